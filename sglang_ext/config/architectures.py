"""Architecture names: Eagle3 head classes SGLang serves, and target families by how upstream SGLang reads a draft's
aux-layer ids for them (each target model's ``set_eagle3_layers_to_capture``). Listed from SGLang 0.5.17's
ModelRegistry (``sglang/srt/models/*.py``)."""

from __future__ import annotations

from typing import Any, Mapping

from sglang_ext.errors import ConfigError

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



# ---------------------------------------------------------------------------------------------
# Eagle3 head architectures
# ---------------------------------------------------------------------------------------------

MHA_ARCH = "LlamaForCausalLMEagle3"  # the one MHA Eagle3 class SGLang 0.5.17 registers (vLLM loads it too)
MLA_ARCH = "Eagle3DeepseekV2ForCausalLM"  # upstream's MLA head (kimi_k25_eagle3.py); the plugin serves both names
MHA_ARCHITECTURES = frozenset({MHA_ARCH})
MLA_ARCHITECTURES = frozenset({MLA_ARCH, "Eagle3DeepseekV3ForCausalLM"})
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
