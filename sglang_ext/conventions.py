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
import math
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

# How upstream SGLang 0.5.17 reads undeclared ids, by target architecture: each model's
# `set_eagle3_layers_to_capture` (listed from SGLang 0.5.17's ModelRegistry, `sglang/srt/models/*.py`).
# "deepseek": ids starting with 1 are output ids, any other list input ids (deepseek_v2.py, glm4_moe_lite.py);
# "llama": every id + 1 (output ids: llama.py, qwen2/3(_moe), glm4_moe, gemma3/4, minimax, ... 40 models);
# "gpt_oss": verbatim when the largest id equals the layer count, else + 1 (gpt_oss.py).
# An architecture of the registry with no such method cannot serve EAGLE3 in SGLang 0.5.17 at all
# ("unsupported"); one outside the registry is "unknown" (read the majority's way, "llama").
DEEPSEEK_FAMILY = frozenset({
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "KimiK25ForConditionalGeneration",
    "GlmMoeDsaForCausalLM", "MistralLarge3ForCausalLM", "Glm4MoeLiteForCausalLM",
})
LLAMA_FAMILY = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", "InternLM3ForCausalLM", "Llama4ForCausalLM",
    "Llama4ForConditionalGeneration", "Ministral3ForCausalLM", "IQuestCoderForCausalLM", "TeleFLMForCausalLM",
    "ApertusForCausalLM", "BailingMoEForCausalLM", "BailingMoeForCausalLM", "BailingMoeV2ForCausalLM",
    "SarvamMoEForCausalLM", "ExaoneMoEForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration",
    "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration",
    "Glm4MoeForCausalLM", "LongcatFlashForCausalLM", "MiniMaxM2ForCausalLM", "MiniMaxM3SparseForCausalLM",
    "MellumForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen2_5_VLForConditionalGeneration",
    "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
    "InternS1ProForConditionalGeneration", "InternS2PreviewForConditionalGeneration",
})
GPT_OSS_FAMILY = frozenset({"GptOssForCausalLM"})
# registered by SGLang 0.5.17 but without set_eagle3_layers_to_capture: the EAGLE3 server fails at start
# (a selection of the causal LMs users ask about; "unknown" covers the rest)
NO_EAGLE3_CAPTURE = frozenset({
    "KimiVLForConditionalGeneration", "KimiLinearForCausalLM", "DeepseekForCausalLM", "DeepseekV4ForCausalLM",
    "DeepseekVL2ForCausalLM", "MixtralForCausalLM", "Gemma2ForCausalLM", "GemmaForCausalLM", "Glm4ForCausalLM",
    "Qwen2VLForConditionalGeneration", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "MiniCPM3ForCausalLM",
    "Ernie4_5_ForCausalLM", "Ernie4_5_MoeForCausalLM", "Grok1ForCausalLM", "OlmoeForCausalLM", "Olmo2ForCausalLM",
    "Step3p5ForCausalLM", "MiMoV2FlashForCausalLM", "HunYuanMoEV1ForCausalLM", "SarvamMLAForCausalLM",
})
# our plugin's capture hook is on these targets' path (serving/aux_capture.HOOK_TARGETS: the methods of
# deepseek_v2.DeepseekV2ForCausalLM and llama.LlamaForCausalLM, and the classes that inherit or delegate to
# them); elsewhere upstream SGLang's own reading stands, and a declared convention is not applied
PLUGIN_HOOKED = frozenset({
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "KimiK25ForConditionalGeneration",
    "GlmMoeDsaForCausalLM", "MistralLarge3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM",
    "Phi3ForCausalLM", "InternLM3ForCausalLM", "Llama4ForCausalLM", "Ministral3ForCausalLM",
    "IQuestCoderForCausalLM", "TeleFLMForCausalLM",
})


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
    """A target's architecture: architectures[0], else the one its model_type implies."""
    archs = config.get("architectures")
    if archs:
        if not isinstance(archs, (list, tuple)) or not isinstance(archs[0], str):
            raise ConfigError("target.architectures", archs, "not a list of class names",
                              'write a list such as ["DeepseekV3ForCausalLM"]')
        return archs[0]
    return MODEL_TYPE_ARCHITECTURES.get(config.get("model_type"), "?")


def target_family(architecture: str) -> str:
    """How upstream SGLang 0.5.17 reads undeclared ids for this target: 'deepseek', 'llama' (+1),
    'gpt_oss', 'unsupported' (no EAGLE3 capture in SGLang 0.5.17) or 'unknown' (read as 'llama')."""
    if architecture in DEEPSEEK_FAMILY:
        return "deepseek"
    if architecture in LLAMA_FAMILY:
        return "llama"
    if architecture in GPT_OSS_FAMILY:
        return "gpt_oss"
    if architecture in NO_EAGLE3_CAPTURE:
        return "unsupported"
    return "unknown"


def default_output_ids(num_layers: int) -> list[int]:
    """[1, N//2 - 1, N - 4]: what SGLang, vLLM and TRT-LLM all capture when a draft names none."""
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    if num_layers < 7:  # the formula collides or goes negative below 7 layers
        raise ConfigError(f"eagle_config.{LAYER_IDS_FIELD}", None,
                          f"the target has {num_layers} layers and the default [1, N//2-1, N-4] = {ids} "
                          "is not 3 distinct layers",
                          f"set eagle_config.{LAYER_IDS_FIELD} explicitly (output ids in 0..{num_layers - 1})")
    return ids


def to_output_ids(ids: Sequence[int], convention: str, family: str = "deepseek",
                  num_layers: int | None = None) -> list[int]:
    """Raw ids of a draft config, read in `convention`, as physical output ids (may be out of range:
    `validate_output_ids` says so). `num_layers` matters only to the gpt_oss reading."""
    ids = [int(i) for i in ids]
    conv = canonical_convention(convention)
    if conv == "output":
        return ids
    if conv == "input":
        return [i - 1 for i in ids]
    # upstream SGLang 0.5.17
    if family == "gpt_oss":
        return [i - 1 for i in ids] if ids and max(ids) == num_layers else ids
    if family != "deepseek":
        return ids  # llama.py (and most others) add 1 to reach the next layer's input: output ids
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
    if family != "deepseek" or (out and out[0] == 1):
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

MHA_ARCHITECTURES = frozenset({"LlamaForCausalLMEagle3"})  # the one MHA Eagle3 class SGLang 0.5.17 registers
MLA_ARCHITECTURES = frozenset({"Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM"})
MLA_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# names a draft may carry that are not an Eagle3 head SGLang 0.5.17 serves, and what to do instead
OTHER_DRAFT_ARCHITECTURES = {
    "Eagle3LlamaForCausalLM": "vLLM's name for the same Llama-style head, which SGLang 0.5.17 does not register: "
                              "set architectures to [\"LlamaForCausalLMEagle3\"] (vLLM loads that name too)",
    "Eagle3Speculator": "a vLLM speculators-format config (speculators_config + transformer_layer_config): write "
                        "an SGLang config with the transformer_layer_config fields at the top level, "
                        "architectures [\"LlamaForCausalLMEagle3\"], draft_vocab_size, target_hidden_size and "
                        "eagle_config.eagle_aux_hidden_state_layer_ids",
    "LlamaForCausalLMEagle": "an EAGLE-1/2 head: serve it with --speculative-algorithm EAGLE (this plugin's checks "
                             "are for EAGLE3)",
    "Qwen2ForCausalLMEagle": "an EAGLE-1/2 head: serve it with --speculative-algorithm EAGLE",
    "MistralForCausalLMEagle": "an EAGLE-1/2 head: serve it with --speculative-algorithm EAGLE",
}


@dataclasses.dataclass(frozen=True)
class TargetSpec:
    architecture: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    text_config: Mapping[str, Any]  # the decoder's config (nested for VL wrappers)
    nested_text_config: bool
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # the whole config (quantization)

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
    aux_layer_ids: tuple[int, ...] | None  # raw, as written (eagle_config's, else the top-level field)
    aux_layer_convention: str | None  # as declared (canonical), None if undeclared
    config: Mapping[str, Any]
    # vLLM's field: the top-level eagle_aux_hidden_state_layer_ids (else eagle_config.layer_ids), input ids
    vllm_layer_ids: tuple[int, ...] | None = None
    aux_ids_source: str = "eagle_config"  # where aux_layer_ids came from: "eagle_config" | "top-level"


def load_json(path: str) -> dict:
    """A config.json (or a directory holding one) as a JSON object; anything else is a ConfigError."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8-sig") as f:  # -sig: a byte-order mark is not an error
            cfg = json.load(f)
    except FileNotFoundError:
        raise ConfigError("path", path, "no config.json there",
                          "pass a model directory containing config.json, or the config.json itself") from None
    except IsADirectoryError:
        raise ConfigError("path", path, "is a directory, not a config file", "pass the model directory") from None
    except UnicodeDecodeError as e:
        raise ConfigError("path", path, f"config.json is not UTF-8 ({e.reason} at byte {e.start})",
                          "save it as UTF-8 JSON") from None
    except json.JSONDecodeError as e:
        raise ConfigError("path", path, f"config.json is not valid JSON ({e})", "fix the file") from None
    except OSError as e:
        raise ConfigError("path", path, f"cannot read it ({e.strerror})", "check the path and its permissions") from None
    if not isinstance(cfg, dict):
        raise ConfigError("path", path, f"config.json holds a JSON {type(cfg).__name__}, not an object",
                          "write the config as a JSON object {...}")
    return cfg


def is_int(value: Any) -> bool:
    """A JSON integer (not a bool, not a float, not a numeric string: transformers refuses those)."""
    return isinstance(value, int) and not isinstance(value, bool)


def positive_number(value: Any) -> bool:
    """A JSON number > 0 and finite (not a bool, not a string)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _require(cfg: Mapping, key: str, prefix: str, minimum: int = 1) -> int:
    """A required integer field, at least `minimum`."""
    if key not in cfg or cfg[key] is None:
        raise ConfigError(prefix + key, None, "missing", f"set {key} in config.json")
    return check_int(cfg[key], prefix + key, minimum)


def check_int(value: Any, field: str, minimum: int = 1) -> int:
    if not is_int(value):
        raise ConfigError(field, value, "not an integer", f"write it as a JSON integer (e.g. {max(minimum, 1)})")
    if value < minimum:
        raise ConfigError(field, value, f"must be at least {minimum}", f"set a value >= {minimum}")
    return value


def parse_target(cfg: Mapping[str, Any]) -> TargetSpec:
    arch = architecture_of(cfg)
    nested = isinstance(cfg.get("text_config"), Mapping)
    text = cfg["text_config"] if nested else cfg
    prefix = "target.text_config." if nested else "target."
    return TargetSpec(architecture=arch,
                      num_hidden_layers=_require(text, "num_hidden_layers", prefix),
                      hidden_size=_require(text, "hidden_size", prefix),
                      vocab_size=_require(text, "vocab_size", prefix),
                      text_config=text, nested_text_config=nested, config=cfg)


def _layer_ids(value: Any, field: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(is_int(i) for i in value):
        raise ConfigError(field, value, "not a list of integers", "write a list such as [1, 29, 57]")
    return tuple(value)


def parse_draft(cfg: Mapping[str, Any]) -> DraftSpec:
    archs = cfg.get("architectures")
    if archs is not None and (not isinstance(archs, (list, tuple)) or not all(isinstance(a, str) for a in archs)):
        raise ConfigError("draft.architectures", archs, "not a list of class names",
                          'write a list such as ["LlamaForCausalLMEagle3"]')
    arch = (archs or [None])[0]
    if arch in MHA_ARCHITECTURES:
        fmt = "mha"
    elif arch in MLA_ARCHITECTURES:
        fmt = "mla"
    else:
        known = OTHER_DRAFT_ARCHITECTURES.get(arch)
        if known is None and "speculators_config" in cfg:
            known = OTHER_DRAFT_ARCHITECTURES["Eagle3Speculator"]
        generic = ('set architectures to ["LlamaForCausalLMEagle3"] (an MHA, Llama-style head) or '
                   '["Eagle3DeepseekV2ForCausalLM"] (an MLA, DeepSeek-style head)')
        raise ConfigError("draft.architectures", archs,
                          "missing" if arch is None else "not an Eagle3 head architecture SGLang 0.5.17 serves",
                          known or generic)
    eagle = cfg.get("eagle_config") or {}
    if not isinstance(eagle, Mapping):
        raise ConfigError("draft.eagle_config", eagle, "not an object", "write eagle_config as a JSON object")
    ids = _layer_ids(eagle.get(LAYER_IDS_FIELD), f"draft.eagle_config.{LAYER_IDS_FIELD}")
    top = _layer_ids(cfg.get(LAYER_IDS_FIELD), f"draft.{LAYER_IDS_FIELD}")
    vllm_ids = top if top is not None else _layer_ids(eagle.get("layer_ids"), "draft.eagle_config.layer_ids")
    declared = eagle.get(CONVENTION_FIELD)
    conv = canonical_convention(declared, f"draft.eagle_config.{CONVENTION_FIELD}") if declared is not None else None
    source = "eagle_config"
    if ids is None and top is not None:  # only vLLM's field: its ids are vLLM's (input ids) unless declared
        ids, source = top, "top-level"
        conv = conv or "input"
    layers = cfg.get("num_hidden_layers", 1)
    return DraftSpec(architecture=arch, head_format=fmt,
                     hidden_size=_require(cfg, "hidden_size", "draft."),
                     target_hidden_size=cfg.get("target_hidden_size"),
                     vocab_size=_require(cfg, "vocab_size", "draft."),
                     draft_vocab_size=cfg.get("draft_vocab_size"),
                     num_hidden_layers=check_int(layers, "draft.num_hidden_layers", 1),
                     aux_layer_ids=ids, aux_layer_convention=conv, config=cfg, vllm_layer_ids=vllm_ids,
                     aux_ids_source=source)


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
    """The physical layers each engine would capture for this pair (no override). Upstream SGLang reads
    eagle_config's ids only; vLLM the top-level field (else eagle_config.layer_ids), as input ids."""
    n = target.num_hidden_layers
    if draft is None:
        return default_output_ids(n)
    if engine == "sglang-ext":
        if draft.aux_layer_ids is None:
            return default_output_ids(n)
        if target.architecture not in PLUGIN_HOOKED:
            return engine_output_ids("sglang", target, draft)  # our hook is not on this target's path
        return to_output_ids(draft.aux_layer_ids, draft.aux_layer_convention or "sglang", target.family, n)
    if engine == "sglang":
        if draft.aux_layer_ids is None or draft.aux_ids_source != "eagle_config":
            return default_output_ids(n)
        return to_output_ids(draft.aux_layer_ids, "sglang", target.family, n)
    if engine == "vllm":
        return default_output_ids(n) if draft.vllm_layer_ids is None else to_output_ids(draft.vllm_layer_ids, "input")
    if engine == "trtllm":
        return default_output_ids(n) if draft.aux_layer_ids is None else to_output_ids(draft.aux_layer_ids, "output")
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
        out = to_output_ids(ids, conv, target.family, n)
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
