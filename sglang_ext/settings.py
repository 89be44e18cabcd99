"""The plugin's server options, typed: one table, read in one place.

Each option is a flag of ``python -m sglang.launch_server`` / ``sglang serve`` (listed in ``--help``, accepted in a
``--config`` YAML file as its name without dashes) and an environment variable, its alias. Parsing the flag writes
the variable, so the scheduler processes SGLang starts read the same value; the flag wins over a value already in
the environment. SGLang's ``ServerArgs`` keeps only its own fields, so this module reads the environment, nothing
else does (serving/flags.py adds the flags to SGLang's parser; /get_server_info reports the values).

Pure Python: no SGLang, no torch.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from sglang_ext.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Option:
    attr: str  # Settings' field
    flag: str  # the server flag
    env: str  # its environment alias
    help: str
    choices: tuple[str, ...] | None = None  # allowed values (lower case); None: free text, a count or a share
    kind: str = "text"  # without choices: "text", "count" (a whole number >= 0) or "share" (0 <= x <= MAX_SHARE)
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)  # other spellings -> a choice
    metavar: str | None = None

    @property
    def label(self) -> str:
        """How an error names the option: the flag and its variable."""
        return f"{self.flag} ({self.env})"


OPTIONS = (
    Option("aux_layers", "--speculative-eagle3-aux-layers", "SGLANG_EXT_EAGLE3_AUX_LAYERS",
           "The target layers whose outputs feed the Eagle3 head, as 0-based output ids (e.g. 1,29,57; "
           "docs/conventions.md). Default: the draft config's ids, read in its declared convention.",
           metavar="IDS"),
    Option("draft_kv_cache_dtype", "--speculative-draft-kv-cache-dtype", "SGLANG_EXT_DRAFT_KV_CACHE_DTYPE",
           "The draft's own KV cache dtype (an MHA head; an MLA head shares the target's latent cache). auto: the "
           "target's.", choices=("auto", "bf16", "fp16", "fp8_e4m3"),
           aliases={"": "auto", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "fp8": "fp8_e4m3",
                    "float8_e4m3fn": "fp8_e4m3"}),
    Option("adaptive_policy", "--speculative-adaptive-policy", "SGLANG_EXT_ADAPTIVE_POLICY",
           "With --speculative-adaptive: 'cost' chooses the draft depth (0 = no drafting) per batch size from measured "
           "step times and acceptance; 'upstream' keeps SGLang's acceptance thresholds.",
           choices=("upstream", "cost"), aliases={"": "upstream", "off": "upstream", "sglang": "upstream"}),
    Option("adaptive_depth0", "--speculative-adaptive-depth0", "SGLANG_EXT_ADAPTIVE_DEPTH0",
           "With the cost policy, depth 0 runs the target's plain decode step ('decode': decode CUDA graphs, "
           "SGLang's sampler) or upstream's one-token verify ('verify').",
           choices=("decode", "verify"), aliases={"": "decode", "upstream": "verify"}),
    Option("adaptive_depth0_draft_extend", "--speculative-adaptive-depth0-draft-extend",
           "SGLANG_EXT_ADAPTIVE_DEPTH0_DRAFT_EXTEND",
           "With the cost policy, the draft extend at depth 0 (it keeps the draft's KV current) runs only in the "
           "steps before a probe ('warm'), on every step ('keep') or never ('skip').",
           choices=("warm", "keep", "skip"), aliases={"": "warm"}),
    Option("adaptive_shapes", "--speculative-adaptive-shapes", "SGLANG_EXT_ADAPTIVE_SHAPES",
           "With the cost policy: 'chain' chooses among chain depths (topk 1); 'tree', on a server started as a "
           "draft tree (--speculative-eagle-topk > 1), chooses per batch size among that tree, the chain depths "
           "and no drafting (SGLang 0.5.17 and 0.5.23, FA3; experimental).",
           choices=("chain", "tree"), aliases={"": "chain", "chains": "chain"}),
    Option("mla_verify", "--speculative-mla-verify", "SGLANG_EXT_MLA_VERIFY",
           "MLA target, target verify as decode attention. Triton: chains ('auto'), trees too ('decode'), or "
           "upstream's prefill kernel ('extend'). FA3: draft trees as decode rows under "
           "--enable-deterministic-inference ('auto'), always ('decode'), or upstream's cascade ('extend'). "
           "Other backends: no effect.",
           choices=("auto", "decode", "extend"), aliases={"": "auto", "off": "extend", "upstream": "extend"}),
    Option("draft_prefill", "--speculative-draft-prefill", "SGLANG_EXT_DRAFT_PREFILL",
           "The Eagle3 head's prefill over each prompt: its last layer's output projection and MLP at every token as "
           "upstream ('full'), or only at each request's last token, the one row drafting reads ('last', the default: "
           "the draft KV and the outputs are upstream's).", choices=("last", "full"),
           aliases={"": "last", "upstream": "full"}),
    Option("radix_eviction_batch", "--radix-eviction-batch", "SGLANG_EXT_RADIX_EVICTION_BATCH",
           "The least share of the KV pool one radix-cache eviction frees (default 0.01; 0: only the allocation's "
           "shortfall, as upstream). Each eviction sorts every evictable leaf; evicting only the shortfall repeats "
           "that on nearly every step once cached prefixes fill the pool.", kind="share", metavar="SHARE"),
    Option("aux_dump_dir", "--speculative-eagle3-aux-dump-dir", "SGLANG_EXT_AUX_DUMP_DIR",
           "Debug: write the captured aux hidden states of the first prefill batches to this directory.",
           metavar="DIR"),
    Option("aux_dump_max", "--speculative-eagle3-aux-dump-max", "SGLANG_EXT_AUX_DUMP_MAX",
           "Debug: how many prefill batches --speculative-eagle3-aux-dump-dir writes (default 4).", kind="count",
           metavar="N"),
    Option("feature_dir", "--eagle3-feature-dir", "SGLANG_EXT_FEATURE_DIR",
           "A feature server for draft training: a target server (no speculation, --disable-radix-cache) writes "
           "the aux and final hidden states of requests named sglang-ext-features-* here.", metavar="DIR"),
)
BY_ATTR = {o.attr: o for o in OPTIONS}
MAX_SHARE = 0.25  # a "share" option's largest value: evicting a quarter of the pool at once is already a flush


@dataclasses.dataclass(frozen=True)
class Settings:
    aux_layers: str | None = None  # output ids as given ("1,29,57"), parsed by config.aux_layers.parse_override
    draft_kv_cache_dtype: str = "auto"  # auto | bf16 | fp16 | fp8_e4m3
    adaptive_policy: str = "upstream"  # upstream | cost
    adaptive_depth0: str = "decode"  # decode | verify
    adaptive_depth0_draft_extend: str = "warm"  # warm | keep | skip
    adaptive_shapes: str = "chain"  # chain | tree
    mla_verify: str = "auto"  # auto | decode | extend
    draft_prefill: str = "last"  # last | full
    radix_eviction_batch: float = 0.01  # share of the KV pool; 0: upstream's shortfall-only eviction
    aux_dump_dir: str | None = None
    aux_dump_max: int = 4
    feature_dir: str | None = None

    @property
    def draft_kv_dtype(self) -> str | None:
        """The draft's cache dtype, None: follow the target."""
        return None if self.draft_kv_cache_dtype == "auto" else self.draft_kv_cache_dtype

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _parse(option: Option, raw: str | None, strict: bool) -> Any:
    default = getattr(Settings, option.attr)
    if option.choices is None:
        if raw is None or raw.strip() == "":
            return default
        if option.kind == "text":
            return raw.strip()
        try:
            value = int(raw) if option.kind == "count" else float(raw)
        except ValueError:
            value = -1
        limit = MAX_SHARE if option.kind == "share" else float("inf")
        if not 0 <= value <= limit:  # also refuses nan
            if strict:
                raise ConfigError(option.label, raw, "not a count" if option.kind == "count" else
                                  f"not a share between 0 and {MAX_SHARE}",
                                  "give a whole number, e.g. 4" if option.kind == "count" else
                                  f"give a number from 0 to {MAX_SHARE}, e.g. {default}")
            return default
        return value
    key = "" if raw is None else raw.strip().lower()
    value = option.aliases.get(key, key)
    if value not in option.choices:
        if strict:
            raise ConfigError(option.label, raw, "not one of its values",
                              f"use one of {', '.join(option.choices)}")
        return default
    return value


def from_environment(environ: Mapping[str, str] | None = None, strict: bool = True) -> Settings:
    """The settings as the environment holds them (a flag given on the command line has written its variable).
    `strict`: refuse a value that is not one of an option's (else it reads as the default -- the plugin's
    registration must not raise: SGLang's plugin loader would swallow the error; the startup check refuses)."""
    env = os.environ if environ is None else environ
    return Settings(**{o.attr: _parse(o, env.get(o.env), strict) for o in OPTIONS})


_CACHE: dict[tuple, Settings] = {}


def current() -> Settings:
    """This process's settings (re-read when the environment changed), refusing a bad value."""
    key = tuple(os.environ.get(o.env) for o in OPTIONS)
    if key not in _CACHE:
        _CACHE.clear()
        _CACHE[key] = from_environment()
    return _CACHE[key]


def requested() -> Settings:
    """This process's settings, an unreadable value read as its default: for deciding which hooks to register."""
    return from_environment(strict=False)


def export(attr: str, value: str) -> None:
    """A parsed flag's value into its variable, where SGLang's subprocesses read it."""
    os.environ[BY_ATTR[attr].env] = str(value)


def raw_value(attr: str) -> str | None:
    """An option's variable as set, unparsed (inspect-draft checks it as the server would)."""
    return os.environ.get(BY_ATTR[attr].env)
