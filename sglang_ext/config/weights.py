"""One weight map per head format: the tensor names of an Eagle3 head in its checkpoint (what SGLang and vLLM load),
in the core's module (`core.heads.Eagle3Head`) and in SGLang's model, and the shapes a config implies. The export,
the core loader, the pair checks and the serving head all map names here.

Canonical names are the checkpoint's without a ``model.`` prefix, the decoder layer as ``layers.0.``:

    fc.weight, norm.weight, lm_head.weight, embed_tokens.weight, d2t, t2d, fc_norm.{i}.weight, input_norm.weight,
    layers.0.{input_layernorm, hidden_norm, post_attention_layernorm}.weight, layers.0.mlp.{gate,up,down}_proj.weight,
    layers.0.self_attn.* (MHA: q/k/v/o_proj; MLA: q_a_proj, q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa,
    kv_a_layernorm, kv_b_proj, o_proj)

A checkpoint may spell the layer ``midlayer.`` (SGLang's ``LlamaForCausalLMEagle3``, SpecForge, EAGLE) or
``layers.0.`` (``Eagle3DeepseekV2ForCausalLM``, lightseekorg), with or without ``model.``, and the EAGLE-3.1 aux norms
``aux_norm_{low,mid,high}``; all read as the canonical name.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping

from sglang_ext.errors import ConfigError

if TYPE_CHECKING:
    from sglang_ext.config.draft import Eagle3DraftConfig

LAYER = "layers.0."
LEGACY_AUX_NORMS = ("aux_norm_low", "aux_norm_mid", "aux_norm_high")  # EAGLE-3.1's first exports: fc_norm.{0,1,2}


@dataclasses.dataclass(frozen=True)
class WeightMap:
    head_format: str  # "mha" | "mla"
    layer_prefix: str  # how this format's checkpoints name the decoder layer

    # ------------------------------------------------------------------------------------ names
    @staticmethod
    def canonical(name: str) -> str:
        """Any checkpoint spelling -> the canonical name."""
        name = name.removeprefix("model.")
        if name.startswith("midlayer."):
            name = LAYER + name[len("midlayer."):]
        for i, legacy in enumerate(LEGACY_AUX_NORMS):
            name = name.replace(legacy, f"fc_norm.{i}")
        return name

    def checkpoint(self, canonical: str) -> str:
        """The name this format's exports write (what SGLang's class for it loads without remapping)."""
        return self.layer_prefix + canonical[len(LAYER):] if canonical.startswith(LAYER) else canonical

    @staticmethod
    def module(canonical: str) -> str:
        """The parameter's name in core.heads.Eagle3Head (its decoder layer is `layer`)."""
        return "layer." + canonical[len(LAYER):] if canonical.startswith(LAYER) else canonical

    @staticmethod
    def from_module(name: str) -> str:
        return LAYER + name[len("layer."):] if name.startswith("layer.") else name

    @staticmethod
    def sglang_parameter(name: str) -> str:
        """A checkpoint tensor's parameter in SGLang's Eagle3 model (its decoder layer is ``model.midlayer``)."""
        canonical = WeightMap.canonical(name)
        inner = "midlayer." + canonical[len(LAYER):] if canonical.startswith(LAYER) else canonical
        return "model." + inner

    # ------------------------------------------------------------------------------------ shapes
    def expected(self, draft: "Eagle3DraftConfig") -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """(required, optional) {canonical name: shape} of the head's checkpoint."""
        h, th, vocab, dv = draft.hidden_size, draft.target_hidden, draft.vocab_size, draft.draft_vocab
        inter, heads, n_aux = draft.intermediate_size, draft.num_attention_heads, draft.num_aux
        p = LAYER
        req: dict[str, list[int]] = {"fc.weight": [h, th * n_aux], "norm.weight": [h]}
        for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            req[f"{p}{n}.weight"] = [h]
        req.update({f"{p}mlp.gate_proj.weight": [inter, h], f"{p}mlp.up_proj.weight": [inter, h],
                    f"{p}mlp.down_proj.weight": [h, inter]})
        a = f"{p}self_attn."
        if self.head_format == "mha":
            hd, kv = draft.mha_head_dim, draft.kv_heads
            req.update({a + "q_proj.weight": [heads * hd, 2 * h], a + "k_proj.weight": [kv * hd, 2 * h],
                        a + "v_proj.weight": [kv * hd, 2 * h], a + "o_proj.weight": [h, heads * hd]})
            if draft.norm_before_fc:
                req["input_norm.weight"] = [th * n_aux]
            if draft.attention_bias:  # llama_eagle3.py keeps o_proj's bias (its qkv_proj is rebuilt without one)
                req[a + "o_proj.bias"] = [h]
        else:
            nope, rope, vd, kvr = draft.qk_nope_head_dim, draft.qk_rope_head_dim, draft.v_head_dim, draft.kv_lora_rank
            if draft.q_lora_rank is not None:
                qr = draft.q_lora_rank
                req.update({a + "q_a_proj.weight": [qr, 2 * h], a + "q_a_layernorm.weight": [qr],
                            a + "q_b_proj.weight": [heads * (nope + rope), qr]})
            else:
                req[a + "q_proj.weight"] = [heads * (nope + rope), 2 * h]
            req.update({a + "kv_a_proj_with_mqa.weight": [kvr + rope, 2 * h], a + "kv_a_layernorm.weight": [kvr],
                        a + "kv_b_proj.weight": [heads * (nope + vd), kvr], a + "o_proj.weight": [h, heads * vd]})
        if draft.fc_norm:
            for i in range(n_aux):
                req[f"fc_norm.{i}.weight"] = [th]
        opt: dict[str, list[int]] = {"embed_tokens.weight": [vocab, h]}
        lm_head = {"lm_head.weight": [dv, h]}
        # SGLang takes the target's lm_head when the config names no draft vocabulary (or ties it)
        (opt if draft.tie_word_embeddings or draft.draft_vocab_size is None else req).update(lm_head)
        mapping = {"d2t": [dv], "t2d": [vocab]}
        if dv < vocab:
            req["d2t"] = mapping.pop("d2t")
        opt.update(mapping)
        if not draft.use_aux_hidden_state:  # a head of the last hidden state alone has no fc (errors() refuses one)
            opt["fc.weight"] = req.pop("fc.weight")
        return req, opt

    def errors(self, draft: "Eagle3DraftConfig", shapes: Mapping[str, Mapping[str, Any]]) -> list[ConfigError]:
        """The checkpoint's tensors (safetensors headers) against the config: d2t's length, then missing, extra and
        mis-shaped tensors, each list in one error."""
        if not shapes:
            return []
        got = {self.canonical(k): list(v["shape"]) for k, v in shapes.items()}
        if "d2t" in got and got["d2t"] != [draft.draft_vocab]:
            return [ConfigError("draft.weights[d2t]", got["d2t"], f"length != draft_vocab_size {draft.draft_vocab}",
                                "re-export d2t with one entry per draft token, or fix draft_vocab_size")]
        req, opt = self.expected(draft)
        errors = []
        missing = sorted(set(req) - set(got))
        extra = sorted(set(got) - set(req) - set(opt))
        if missing:
            errors.append(ConfigError("draft.weights", missing, f"{len(missing)} tensor(s) missing from the checkpoint",
                                      "export the head again (the names listed are what SGLang's "
                                      f"{draft.architecture} loads)"))
        if extra:
            errors.append(ConfigError("draft.weights", extra, f"{len(extra)} tensor(s) the "
                                      f"{self.head_format.upper()} head does not have (SGLang would skip them "
                                      "silently)", "check head format and config (fc_norm, q_lora_rank, "
                                      "norm_before_fc) or remove the tensors"))
        if draft.hidden_size != draft.target_hidden and "embed_tokens.weight" not in got:
            errors.append(ConfigError("draft.weights", "embed_tokens.weight absent",
                                      f"the head's hidden size {draft.hidden_size} differs from the target's, so "
                                      "SGLang cannot share the target's embedding and would run with an "
                                      "uninitialised one", "ship embed_tokens.weight in the checkpoint"))
        if "fc.weight" in got and not draft.use_aux_hidden_state:
            errors.append(ConfigError("draft.eagle_config.use_aux_hidden_state", False,
                                      f"false, but the checkpoint has fc.weight (in_features {got['fc.weight'][-1]}): "
                                      "the head was trained on the target's aux states, and SGLang would capture "
                                      "none and feed it the last hidden state instead (fc skipped, or a shape "
                                      "error)", "set eagle_config.use_aux_hidden_state to true (the default), or "
                                      "remove fc.weight for a head trained on the last hidden state alone"))
            return errors
        for name, shape in sorted(got.items()):
            want = req.get(name, opt.get(name))
            if want is not None and shape != want:
                errors.append(ConfigError(f"draft.weights[{name}]", shape, f"shape differs from the config's {want}",
                                          "fix hidden_size / heads / ranks / vocab in config.json or re-export"))
        return errors


WEIGHT_MAPS = {"mha": WeightMap("mha", "midlayer."), "mla": WeightMap("mla", LAYER)}


def weight_map(head_format: str) -> WeightMap:
    return WEIGHT_MAPS[head_format]
