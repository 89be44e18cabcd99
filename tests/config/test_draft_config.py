"""`Eagle3DraftConfig`, the one reader of a draft's config.json: the configs others publish and export load by config
alone; a field no Eagle3 config has, or a contradiction, is refused with field, value and fix."""

import pytest

from sglang_ext.config import Eagle3DraftConfig

# the field sets of real templates and exports (values shortened to a small head); which tool writes them
SPECFORGE_LLAMA3_8B = {  # SpecForge configs/llama3-8B-eagle3.json
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
    "rms_norm_eps": 1e-5, "vocab_size": 1000, "draft_vocab_size": 320, "max_position_embeddings": 2048,
    "initializer_range": 0.02, "tie_word_embeddings": False, "use_cache": True, "torch_dtype": "float16",
    "transformers_version": "4.28.1", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
TORCHSPEC_KIMI_MHA = {  # TorchSpec configs/draft_models/kimi_k25_eagle3.json (+ the draft_vocab_size its export adds)
    "architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
    "intermediate_size": 128, "max_position_embeddings": 4096, "max_window_layers": 1, "model_type": "llama",
    "num_attention_heads": 4, "num_hidden_layers": 1, "num_key_value_heads": 4, "rms_norm_eps": 1e-5,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 50000.0, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 1000,
    "draft_vocab_size": 1000, "_torchspec_version": "0.1"}
TORCHSPEC_KIMI_MLA = {  # TorchSpec kimi_k25_eagle3_mla.json: ModelOpt-style eagle_config switches
    "architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "kimi_k2", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "vocab_size": 1000, "draft_vocab_size": 320,
    "torch_dtype": "bfloat16", "rope_theta": 50000.0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57], "use_aux_hidden_state": True,
                     "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
                     "use_mtp_layernorm": False}}
EAGLE_3_1 = dict(SPECFORGE_LLAMA3_8B, fc_norm=True, norm_output=True, num_aux_hidden_states=3)  # qwen3-30B-A3B-eagle3.1
MODELOPT = dict(SPECFORGE_LLAMA3_8B, mlp_bias=False, pretraining_tp=1, rope_scaling=None, attention_dropout=0.0,
                eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 14, 26], "use_aux_hidden_state": True,
                              "next_layer_regular": True, "parallel_draft_step": 1,
                              "parallel_draft_heads_num_layers": 1, "use_last_layernorm": False})


@pytest.mark.parametrize("cfg", [SPECFORGE_LLAMA3_8B, TORCHSPEC_KIMI_MHA, TORCHSPEC_KIMI_MLA, EAGLE_3_1, MODELOPT],
                         ids=["specforge", "torchspec-mha", "torchspec-mla", "eagle-3.1", "modelopt"])
def test_published_and_exported_configs_load_by_config_alone(cfg):
    c = Eagle3DraftConfig.from_dict(cfg)
    assert c.errors() == []
    assert c.head_format == ("mla" if "kv_lora_rank" in cfg else "mha")


def test_typed_fields_read_as_the_loaders_read_them():
    c = Eagle3DraftConfig.from_dict(EAGLE_3_1)
    assert (c.fc_norm, c.norm_output, c.num_aux, c.draft_vocab, c.target_hidden) == (True, True, 3, 320, 64)
    mla = Eagle3DraftConfig.from_dict(TORCHSPEC_KIMI_MLA)
    assert mla.aux_layer_ids == (1, 29, 57) and mla.aux_layer_convention is None  # undeclared: SGLang's reading
    assert Eagle3DraftConfig.from_dict(TORCHSPEC_KIMI_MHA).rope_scaling["type"] == "yarn"


def test_a_misspelled_field_is_refused_with_the_field_it_meant():
    (e,) = Eagle3DraftConfig.from_dict(dict(SPECFORGE_LLAMA3_8B, draft_vocab_sise=320)).errors()
    assert e.field == "draft.draft_vocab_sise" and e.value == 320 and "'draft_vocab_size'" in e.fix
    cfg = dict(SPECFORGE_LLAMA3_8B, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 3],
                                                  "aux_layer_convension": "output"})
    (e,) = Eagle3DraftConfig.from_dict(cfg).errors()
    assert e.field == "draft.eagle_config.aux_layer_convension" and "'aux_layer_convention'" in e.fix
    (e,) = Eagle3DraftConfig.from_dict(dict(SPECFORGE_LLAMA3_8B, my_notes="v2")).errors()
    assert e.field == "draft.my_notes" and e.fix == "remove it"


def test_what_sglang_would_drop_or_fail_on_is_refused():
    # LlamaForCausalLMEagle3 reads config.draft_vocab_size with no default
    no_vocab = {k: v for k, v in TORCHSPEC_KIMI_MHA.items() if k != "draft_vocab_size"}
    (e,) = Eagle3DraftConfig.from_dict(no_vocab).errors()
    assert e.field == "draft.draft_vocab_size" and e.value is None and "null" in e.fix
    assert Eagle3DraftConfig.from_dict(dict(no_vocab, tie_word_embeddings=True)).errors() == []  # tied: not read
    # norm biases no engine loads (an exporter's norm_bias)
    (e,) = Eagle3DraftConfig.from_dict(dict(SPECFORGE_LLAMA3_8B, norm_bias=True)).errors()
    assert e.field == "draft.norm_bias" and "dropped" in e.problem
    # num_aux_hidden_states contradicting the ids: fc would be sized for one count, capture for the other
    cfg = dict(SPECFORGE_LLAMA3_8B, num_aux_hidden_states=4,
               eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 14, 26]})
    (e,) = Eagle3DraftConfig.from_dict(cfg).errors()
    assert e.field == "draft.num_aux_hidden_states" and e.value == 4


@pytest.mark.parametrize("cfg", [SPECFORGE_LLAMA3_8B, TORCHSPEC_KIMI_MLA, EAGLE_3_1], ids=["mha", "mla", "eagle-3.1"])
def test_what_we_write_reads_back_as_the_same_config(cfg):
    c = Eagle3DraftConfig.from_dict(cfg)
    again = Eagle3DraftConfig.from_dict(c.to_dict())
    assert again.to_dict() == c.to_dict() and again.errors() == []
    for field in ("head_format", "target_hidden", "num_aux", "draft_vocab", "aux_layer_ids", "fc_norm", "norm_output",
                  "q_lora_rank", "kv_lora_rank", "rope_theta", "rope_scaling", "kv_heads"):
        assert getattr(again, field) == getattr(c, field), field


def test_load_refuses_a_config_with_errors_naming_all_of_them(tmp_path):
    import json

    from sglang_ext.errors import ConfigError

    (tmp_path / "config.json").write_text(json.dumps(dict(SPECFORGE_LLAMA3_8B, hidden_act="gelu", extra_field=1)))
    with pytest.raises(ConfigError) as e:
        Eagle3DraftConfig.load(str(tmp_path))
    assert e.value.field == "draft.hidden_act" and "extra_field" in str(e.value)
    assert Eagle3DraftConfig.load(str(tmp_path), strict=False).hidden_act == "gelu"
