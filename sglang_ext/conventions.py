"""The project's conventions, in one place: aux-layer ids and the draft config schema.

Pure Python (no torch, no SGLang) so that `inspect-draft`, the core, the trainer and the
SGLang adapters all read a draft the same way. Documented in docs/conventions.md.

Physical capture points
-----------------------
An Eagle3 draft reads the hidden state that flows *between* two decoder layers of the target.
We name that point by the 0-based index ``j`` of the decoder layer whose **output** it is
(SpecForge's and TRT-LLM's convention): ``j = N - 1`` is the last layer's output (pre final
norm). Everything in this module converts to and from these "output ids".

Engines disagree on what the ids in a draft config mean:

* ``output``  (ours, SpecForge, TRT-LLM): id j = output of layer j.
* ``input``   (vLLM, ATOM): id i = input of layer i = output of layer i - 1.
* ``sglang``  (upstream SGLang 0.5.17, which ignores any declaration): for DeepSeek-family
  targets, ids whose first element is 1 are output ids, any other list is input ids
  (``DeepseekV2ForCausalLM.set_eagle3_layers_to_capture``); for Llama-family targets ids are
  always output ids (``LlamaForCausalLM.set_eagle3_layers_to_capture`` adds 1).

A draft may declare its convention in ``eagle_config.aux_layer_convention``. A draft that
declares none is read the ``sglang`` way, so published drafts capture what they captured before.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, Sequence

# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


class ConfigError(ValueError):
    """Bad draft/target input. Names the field, the value and the fix."""

    def __init__(self, field: str, value: Any, problem: str, fix: str):
        self.field, self.value, self.problem, self.fix = field, value, problem, fix
        super().__init__(f"{field}={value!r}: {problem}. Fix: {fix}")


# ---------------------------------------------------------------------------------------------
# Aux-layer ids
# ---------------------------------------------------------------------------------------------

CONVENTION_FIELD = "aux_layer_convention"  # inside the draft's eagle_config
LAYER_IDS_FIELD = "eagle_aux_hidden_state_layer_ids"  # inside the draft's eagle_config
OVERRIDE_ENV = "SGLANG_EXT_EAGLE3_AUX_LAYERS"  # "1,29,57": output ids, wins over the config

CONVENTIONS = ("output", "input", "sglang")
CONVENTION_ALIASES = {
    "output": "output", "layer_output": "output", "specforge": "output", "trtllm": "output",
    "input": "input", "layer_input": "input", "vllm": "input", "atom": "input",
    "sglang": "sglang", "sglang-0.5.17": "sglang",
}
ENGINES = ("sglang-ext", "sglang", "vllm", "trtllm")  # what inspect-draft compares

DEEPSEEK_FAMILY = frozenset({
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
    "KimiK25ForConditionalGeneration", "KimiVLForConditionalGeneration",
})
LLAMA_FAMILY = frozenset({"LlamaForCausalLM", "MistralForCausalLM"})


def canonical_convention(name: str | None, field: str = f"eagle_config.{CONVENTION_FIELD}") -> str:
    if name is None:
        return "sglang"
    key = str(name).strip().lower()
    if key not in CONVENTION_ALIASES:
        raise ConfigError(field, name, "unknown aux-layer convention",
                          f"use one of {sorted(CONVENTION_ALIASES)} ('output' = 0-based index of the "
                          "decoder layer whose output is captured)")
    return CONVENTION_ALIASES[key]


MODEL_TYPE_ARCHITECTURES = {  # configs that name no architecture (GGUF-converted, some exports)
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM", "kimi_k25": "KimiK25ForConditionalGeneration",
}


def architecture_of(config: Mapping[str, Any]) -> str:
    archs = config.get("architectures") or []
    if archs:
        return archs[0]
    return MODEL_TYPE_ARCHITECTURES.get(config.get("model_type"), "?")


def target_family(architecture: str) -> str:
    """'deepseek', 'llama' or 'other' -- decides how upstream SGLang reads undeclared ids."""
    if architecture in DEEPSEEK_FAMILY:
        return "deepseek"
    if architecture in LLAMA_FAMILY:
        return "llama"
    return "other"


def default_output_ids(num_layers: int) -> list[int]:
    """[1, N//2 - 1, N - 4]: what SGLang, vLLM and TRT-LLM all capture when a draft names none."""
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    if num_layers < 7:  # the formula collides or goes negative below 7 layers
        raise ConfigError(f"eagle_config.{LAYER_IDS_FIELD}", None,
                          f"the target has {num_layers} layers and the default [1, N//2-1, N-4] = {ids} "
                          "is not 3 distinct layers",
                          f"set eagle_config.{LAYER_IDS_FIELD} explicitly (output ids in 0..{num_layers - 1})")
    return ids


def to_output_ids(ids: Sequence[int], convention: str, family: str = "deepseek") -> list[int]:
    """Raw ids of a draft config, read in `convention`, as physical output ids (may be out of range:
    `validate_output_ids` says so)."""
    ids = [int(i) for i in ids]
    conv = canonical_convention(convention)
    if conv == "output":
        return ids
    if conv == "input":
        return [i - 1 for i in ids]
    # upstream SGLang 0.5.17
    if family == "llama":
        return ids  # llama.py adds 1 to reach the next layer's input: output ids
    if ids and ids[0] == 1:
        return ids  # deepseek_v2.py adds 1 only in this case
    return [i - 1 for i in ids]  # otherwise verbatim as layer inputs


def from_output_ids(output_ids: Sequence[int], convention: str, family: str = "deepseek") -> list[int]:
    """Inverse of `to_output_ids`: the ids to write in a draft config of `convention`."""
    out = [int(j) for j in output_ids]
    conv = canonical_convention(convention)
    if conv == "output":
        return out
    if conv == "input":
        return [j + 1 for j in out]
    if family == "llama" or (out and out[0] == 1):
        return out
    if out and out[0] == 0:  # verbatim input ids would start with 1, which SGLang shifts again
        raise ConfigError(f"eagle_config.{LAYER_IDS_FIELD}", out,
                          "upstream SGLang cannot express capturing layer 0's output on a "
                          "DeepSeek-family target (its ids would start with 1 and be shifted)",
                          f"declare eagle_config.{CONVENTION_FIELD}='output' and store output ids")
    return [j + 1 for j in out]


def capture_indices(output_ids: Sequence[int]) -> list[int]:
    """SGLang's `layers_to_capture`: a model captures the *input* of layer k, so k = j + 1.
    k == N (the last layer's output) is not reached by SGLang's layer loop; our patch captures it."""
    return [int(j) + 1 for j in output_ids]


def validate_output_ids(output_ids: Sequence[int], num_layers: int, field: str,
                        raw: Any = None) -> list[ConfigError]:
    """Range, duplicates and order. `raw` is what the user wrote (shown in the error)."""
    raw = list(output_ids) if raw is None else raw
    errors = []
    bad = [j for j in output_ids if not 0 <= j < num_layers]
    if bad:
        hint = " (-1 is the embedding output, not a decoder layer's)" if -1 in bad else ""
        errors.append(ConfigError(field, raw,
                                  f"physical layer(s) {bad} out of range for a {num_layers}-layer target{hint}",
                                  f"use output ids in 0..{num_layers - 1} (0-based decoder layer whose "
                                  "output is captured)"))
    dup = sorted({j for j in output_ids if list(output_ids).count(j) > 1})
    if dup:
        errors.append(ConfigError(field, raw, f"layer(s) {dup} captured twice",
                                  "list each layer once"))
    if not dup and list(output_ids) != sorted(output_ids):
        errors.append(ConfigError(field, raw, "ids are not in ascending order; every engine "
                                  "concatenates aux states in layer order, so the fc weight's column "
                                  "blocks would not match", "sort the ids ascending (and the fc columns "
                                  "with them, if the draft was trained in another order)"))
    if not output_ids:
        errors.append(ConfigError(field, raw, "no layers", "list at least one layer"))
    return errors


def parse_override(text: str, field: str = OVERRIDE_ENV) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise ConfigError(field, text, "not a comma-separated list of integers",
                          "write output ids, e.g. 1,29,57") from None
    if not ids:
        raise ConfigError(field, text, "empty", "write output ids, e.g. 1,29,57, or unset it")
    return ids


def env_option_set(name: str, off_values: Sequence[str]) -> bool:
    """Whether an environment option is set to anything but an off value (case-insensitive). Never raises:
    the plugin registers an option's hooks by this, and SGLang's plugin loader swallows an exception from
    registration (the server would run without the plugin); `env_choice` refuses."""
    return os.environ.get(name, "").strip().lower() not in off_values


def env_choice(name: str, choices: Mapping[str, Any], what: str, fix: str) -> Any:
    """What an environment option's value (case-insensitive; unset is "") means, from `choices`; any other
    value is refused with field, value and fix."""
    value = os.environ.get(name, "").strip().lower()
    if value not in choices:
        raise ConfigError(name, value, what, fix)
    return choices[value]


# ---------------------------------------------------------------------------------------------
# Draft and target configs
# ---------------------------------------------------------------------------------------------

MHA_ARCHITECTURES = frozenset({"LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"})
MLA_ARCHITECTURES = frozenset({"Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM"})
MLA_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclasses.dataclass(frozen=True)
class TargetSpec:
    architecture: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    text_config: Mapping[str, Any]  # the decoder's config (nested for VL wrappers)
    nested_text_config: bool

    @property
    def family(self) -> str:
        return target_family(self.architecture)

    @property
    def is_mla(self) -> bool:
        return self.text_config.get("kv_lora_rank") is not None


@dataclasses.dataclass(frozen=True)
class DraftSpec:
    architecture: str
    head_format: str  # "mha" | "mla"
    hidden_size: int
    target_hidden_size: int | None
    vocab_size: int
    draft_vocab_size: int | None
    num_hidden_layers: int
    aux_layer_ids: tuple[int, ...] | None  # raw, as written
    aux_layer_convention: str | None  # as declared (canonical), None if undeclared
    config: Mapping[str, Any]


def load_json(path: str) -> dict:
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError("path", path, "no config.json there",
                          "pass a model directory containing config.json, or the config.json itself") from None
    except json.JSONDecodeError as e:
        raise ConfigError("path", path, f"config.json is not valid JSON ({e})", "fix the file") from None


def _require(cfg: Mapping, key: str, prefix: str, kind=int):
    if key not in cfg or cfg[key] is None:
        raise ConfigError(prefix + key, None, "missing", f"set {key} in config.json")
    try:
        return kind(cfg[key])
    except (TypeError, ValueError):
        raise ConfigError(prefix + key, cfg[key], f"not a {kind.__name__}", f"set {key} to a number") from None


def parse_target(cfg: Mapping[str, Any]) -> TargetSpec:
    arch = architecture_of(cfg)
    nested = isinstance(cfg.get("text_config"), Mapping)
    text = cfg["text_config"] if nested else cfg
    prefix = "target.text_config." if nested else "target."
    return TargetSpec(architecture=arch,
                      num_hidden_layers=_require(text, "num_hidden_layers", prefix),
                      hidden_size=_require(text, "hidden_size", prefix),
                      vocab_size=_require(text, "vocab_size", prefix),
                      text_config=text, nested_text_config=nested)


def parse_draft(cfg: Mapping[str, Any]) -> DraftSpec:
    arch = (cfg.get("architectures") or [None])[0]
    if arch in MHA_ARCHITECTURES:
        fmt = "mha"
    elif arch in MLA_ARCHITECTURES:
        fmt = "mla"
    else:
        raise ConfigError("draft.architectures", cfg.get("architectures"), "not an Eagle3 head architecture",
                          f"use {sorted(MHA_ARCHITECTURES)[0]!r} (MHA, Llama-style) or "
                          f"{sorted(MLA_ARCHITECTURES)[0]!r} (MLA, DeepSeek-style)")
    eagle = cfg.get("eagle_config") or {}
    if not isinstance(eagle, Mapping):
        raise ConfigError("draft.eagle_config", eagle, "not an object", "write eagle_config as a JSON object")
    ids = eagle.get(LAYER_IDS_FIELD, cfg.get(LAYER_IDS_FIELD))
    if ids is not None:
        if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                         for i in ids):
            raise ConfigError(f"draft.eagle_config.{LAYER_IDS_FIELD}", ids, "not a list of integers",
                              "write a list such as [1, 29, 57]")
        ids = tuple(ids)
    declared = eagle.get(CONVENTION_FIELD)
    conv = canonical_convention(declared, f"draft.eagle_config.{CONVENTION_FIELD}") if declared is not None else None
    return DraftSpec(architecture=arch, head_format=fmt,
                     hidden_size=_require(cfg, "hidden_size", "draft."),
                     target_hidden_size=cfg.get("target_hidden_size"),
                     vocab_size=_require(cfg, "vocab_size", "draft."),
                     draft_vocab_size=cfg.get("draft_vocab_size"),
                     num_hidden_layers=int(cfg.get("num_hidden_layers", 1)),
                     aux_layer_ids=ids, aux_layer_convention=conv, config=cfg)


# ---------------------------------------------------------------------------------------------
# Resolution: which physical layers a (target, draft) pair captures, and where that came from
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AuxLayerPlan:
    output_ids: tuple[int, ...]  # physical: outputs of these 0-based decoder layers
    source: str  # "draft config" | "default" | "override"
    convention: str  # how the raw ids were read
    raw_ids: tuple[int, ...] | None

    @property
    def capture_indices(self) -> list[int]:
        return capture_indices(self.output_ids)

    def describe(self, num_layers: int) -> str:
        names = ", ".join("last layer" if j == num_layers - 1 else str(j) for j in self.output_ids)
        raw = "" if self.raw_ids is None else f" ids {list(self.raw_ids)} read as '{self.convention}';"
        return (f"Eagle3 aux hidden states: outputs of decoder layers [{names}] of {num_layers} "
                f"(0-based) from {self.source};{raw} SGLang layers_to_capture={self.capture_indices}")


def engine_output_ids(engine: str, target: TargetSpec, draft: DraftSpec | None) -> list[int]:
    """The physical layers each engine would capture for this pair (no override)."""
    ids = draft.aux_layer_ids if draft else None
    n = target.num_hidden_layers
    if ids is None:
        return default_output_ids(n)
    if engine == "sglang-ext":
        return to_output_ids(ids, draft.aux_layer_convention or "sglang", target.family)
    if engine == "sglang":
        return to_output_ids(ids, "sglang", target.family)
    if engine == "vllm":
        return to_output_ids(ids, "input")
    if engine == "trtllm":
        return to_output_ids(ids, "output")
    raise ValueError(f"unknown engine {engine!r}; one of {ENGINES}")


def resolve_aux_layers(target: TargetSpec, draft: DraftSpec | None,
                       override: str | None = None) -> AuxLayerPlan:
    """What our plugin captures. Raises the first ConfigError (use `aux_layer_errors` for all)."""
    plan, errors = aux_layer_errors(target, draft, override)
    if errors:
        raise errors[0]
    return plan


def aux_layer_errors(target: TargetSpec, draft: DraftSpec | None, override: str | None = None,
                     fc_in_features: int | None = None) -> tuple[AuxLayerPlan | None, list[ConfigError]]:
    """The plan and every error found (inspect-draft shows them all)."""
    ids = draft.aux_layer_ids if draft else None
    convention = draft.aux_layer_convention if draft else None
    return plan_for_ids(target, ids, convention, override, fc_in_features)


def plan_for_ids(target: TargetSpec, ids: Sequence[int] | None, convention: str | None,
                 override: str | None = None,
                 fc_in_features: int | None = None) -> tuple[AuxLayerPlan | None, list[ConfigError]]:
    """`ids` as written in a draft config (None: none written), `convention` as declared (None:
    undeclared, read upstream SGLang's way); `override` is the operator's env value."""
    n = target.num_hidden_layers
    field = f"draft.eagle_config.{LAYER_IDS_FIELD}"
    if override:
        try:
            out = parse_override(override)
        except ConfigError as e:
            return None, [e]
        plan = AuxLayerPlan(tuple(out), "override", "output", tuple(out))
        errors = validate_output_ids(out, n, OVERRIDE_ENV, override)
    elif ids is None:
        try:
            out = default_output_ids(n)
        except ConfigError as e:
            return None, [e]
        plan, errors = AuxLayerPlan(tuple(out), "default", "output", None), []
    else:
        conv = convention or "sglang"
        out = to_output_ids(ids, conv, target.family)
        plan = AuxLayerPlan(tuple(out), "draft config", conv, tuple(ids))
        errors = validate_output_ids(out, n, field, list(ids))
    if fc_in_features is not None and not errors:
        errors += fc_width_errors(plan, target, fc_in_features)
    return plan, errors


def fc_width_errors(plan: AuxLayerPlan, target: TargetSpec, fc_in_features: int) -> list[ConfigError]:
    expected = len(plan.output_ids) * target.hidden_size
    if fc_in_features == expected:
        return []
    per = fc_in_features / target.hidden_size
    fix = (f"capture {int(per)} layers, the number the draft was trained on" if per == int(per)
           else "use a draft trained for this target (its hidden size differs)")
    return [ConfigError("fc.weight.in_features", fc_in_features,
                        f"the draft's fc expects {fc_in_features} = {per:g} x target hidden size "
                        f"{target.hidden_size}, but {len(plan.output_ids)} layers {list(plan.output_ids)} "
                        f"({plan.source}) give {expected}", fix)]
