"""Which target layers feed an Eagle3 head: the aux-layer id conventions and the one resolver.

An Eagle3 draft reads the hidden state that flows *between* two decoder layers of the target. We name that point by
the 0-based index ``j`` of the decoder layer whose **output** it is (SpecForge's and TRT-LLM's convention):
``j = N - 1`` is the last layer's output (pre final norm). Everything here converts to and from these "output ids".

Engines disagree on what the ids in a draft config mean:

* ``output``  (ours, SpecForge, TRT-LLM): id j = output of layer j.
* ``input``   (vLLM, ATOM): id i = input of layer i = output of layer i - 1.
* ``sglang``  (upstream SGLang 0.5.17, which ignores any declaration): for DeepSeek-family targets, ids whose first
  element is 1 are output ids, any other list is input ids (``DeepseekV2ForCausalLM.set_eagle3_layers_to_capture``);
  for Llama-family targets ids are always output ids (``LlamaForCausalLM.set_eagle3_layers_to_capture`` adds 1).

A draft may declare its convention in ``eagle_config.aux_layer_convention``. A draft that declares none is read the
``sglang`` way, so published drafts capture what they captured before. `resolve` is the only place a convention is
applied: the server's capture hook, inspect-draft, the reference decoder and the trainer all call it, and the plan
it returns is recorded in feature files and exports (``AuxLayerPlan.to_dict``) and checked on read.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from sglang_ext.config.architectures import PLUGIN_HOOKED
from sglang_ext.errors import ConfigError, combined
from sglang_ext.settings import BY_ATTR

if TYPE_CHECKING:
    from sglang_ext.config.draft import Eagle3DraftConfig
    from sglang_ext.config.target import TargetConfig

CONVENTION_FIELD = "aux_layer_convention"  # inside the draft's eagle_config
LAYER_IDS_FIELD = "eagle_aux_hidden_state_layer_ids"  # inside the draft's eagle_config
OVERRIDE_FIELD = BY_ATTR["aux_layers"].label  # the server option that overrides the draft config: output ids

CONVENTIONS = ("output", "input", "sglang")
CONVENTION_ALIASES = {
    "output": "output", "layer_output": "output", "specforge": "output", "trtllm": "output",
    "input": "input", "layer_input": "input", "vllm": "input", "atom": "input",
    "sglang": "sglang", "sglang-0.5.17": "sglang",
}
ENGINES = ("sglang-ext", "sglang", "vllm", "trtllm")  # what inspect-draft compares

def canonical_convention(name: str | None, field: str = f"eagle_config.{CONVENTION_FIELD}") -> str:
    if name is None:
        return "sglang"
    key = str(name).strip().lower()
    if key not in CONVENTION_ALIASES:
        raise ConfigError(field, name, "unknown aux-layer convention",
                          f"use one of {sorted(CONVENTION_ALIASES)} ('output' = 0-based index of the "
                          "decoder layer whose output is captured)")
    return CONVENTION_ALIASES[key]


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


def parse_override(text: str, field: str = OVERRIDE_FIELD) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise ConfigError(field, text, "not a comma-separated list of integers",
                          "write output ids, e.g. 1,29,57") from None
    if not ids:
        raise ConfigError(field, text, "empty", "write output ids, e.g. 1,29,57, or unset it")
    return ids



# ---------------------------------------------------------------------------------------------
# The plan: which physical layers a (target, draft) pair captures, and where that came from
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AuxLayerPlan:
    output_ids: tuple[int, ...]  # physical: outputs of these 0-based decoder layers
    source: str  # "draft config" | "default" | "override"
    convention: str  # how the raw ids were read
    raw_ids: tuple[int, ...] | None

    def to_dict(self) -> dict:
        """What feature files and exports record, so that a reader can check it captured the same layers."""
        return {"output_ids": list(self.output_ids), "source": self.source, "convention": self.convention,
                "raw_ids": None if self.raw_ids is None else list(self.raw_ids)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "AuxLayerPlan":
        raw = d.get("raw_ids")
        return cls(tuple(int(j) for j in d["output_ids"]), str(d.get("source", "?")), str(d.get("convention", "output")),
                   None if raw is None else tuple(int(i) for i in raw))

    def require_same_layers(self, recorded: "AuxLayerPlan | Sequence[int]", where: str, fix: str) -> None:
        """Refuse data captured at other layers than this plan's (`recorded`: another plan or its output ids)."""
        ids = list(recorded.output_ids if isinstance(recorded, AuxLayerPlan) else recorded)
        if ids != list(self.output_ids):
            raise ConfigError(where, ids, f"captured at the outputs of layers {ids}, but this run's aux layers are "
                              f"{list(self.output_ids)} ({self.source})", fix)

    @property
    def capture_indices(self) -> list[int]:
        return capture_indices(self.output_ids)

    def describe(self, num_layers: int) -> str:
        names = ", ".join("last layer" if j == num_layers - 1 else str(j) for j in self.output_ids)
        raw = "" if self.raw_ids is None else f" ids {list(self.raw_ids)} read as '{self.convention}';"
        return (f"Eagle3 aux hidden states: outputs of decoder layers [{names}] of {num_layers} "
                f"(0-based) from {self.source};{raw} SGLang layers_to_capture={self.capture_indices}")


def resolve(target: "TargetConfig", draft: "Eagle3DraftConfig | None" = None, override: str | None = None,
            fc_in_features: int | None = None) -> AuxLayerPlan:
    """What the plugin captures for this pair (`override`: the operator's output ids, "1,29,57"). Raises one
    ConfigError carrying every problem found."""
    plan, errors = resolve_with_errors(target, draft, override, fc_in_features)
    if errors:
        raise combined(errors)
    return plan


def resolve_with_errors(target: "TargetConfig", draft: "Eagle3DraftConfig | None" = None,
                        override: str | None = None,
                        fc_in_features: int | None = None) -> tuple[AuxLayerPlan | None, list[ConfigError]]:
    """The plan and every error found (inspect-draft shows them all). On a target whose capture the plugin does not
    hook (architectures.PLUGIN_HOOKED), upstream SGLang's reading stands: eagle_config's ids its way, no declared
    convention, no override."""
    if draft is not None and target.architecture not in PLUGIN_HOOKED:
        ids = draft.aux_layer_ids if draft.aux_ids_source == "eagle_config" else None
        return plan_for_ids(target, ids, None, None, fc_in_features)
    ids = draft.aux_layer_ids if draft is not None else None
    convention = draft.aux_layer_convention if draft is not None else None
    return plan_for_ids(target, ids, convention, override, fc_in_features)


def plan_for_ids(target: "TargetConfig", ids: Sequence[int] | None, convention: str | None,
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
        errors = validate_output_ids(out, n, OVERRIDE_FIELD, override)
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


def fc_width_errors(plan: AuxLayerPlan, target: "TargetConfig", fc_in_features: int) -> list[ConfigError]:
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


def engine_output_ids(engine: str, target: "TargetConfig", draft: "Eagle3DraftConfig | None") -> list[int]:
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
