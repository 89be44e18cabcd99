"""The aux-layer convention: conversions, defaults and every refusal (sglang_ext.config.aux_layers)."""

import pytest

from sglang_ext.config import aux_layers as C
from sglang_ext.config import Eagle3DraftConfig, TargetConfig
from sglang_ext.errors import ConfigError


def target(n, arch="DeepseekV3ForCausalLM", hidden=7168):
    return TargetConfig.from_dict({"architectures": [arch], "num_hidden_layers": n, "hidden_size": hidden,
                           "vocab_size": 1000})


@pytest.mark.parametrize("n", [61, 27, 2])
@pytest.mark.parametrize("convention", ["output", "input", "sglang"])
@pytest.mark.parametrize("family", ["deepseek", "llama"])
def test_round_trip(n, convention, family):
    candidates = [[0, n - 1], [1, n // 2, n - 1], [1], list(range(n))]
    for out in candidates:
        out = sorted(set(j for j in out if 0 <= j < n))
        if convention == "sglang" and family == "deepseek" and out[0] == 0:
            with pytest.raises(ConfigError):  # upstream cannot express it: documented
                C.from_output_ids(out, convention, family)
            continue
        raw = C.from_output_ids(out, convention, family)
        assert C.to_output_ids(raw, convention, family) == out


def test_engine_readings_of_specforge_ids_for_deepseek_v3():
    # SpecForge writes output ids [1, 29, 57] for a 61-layer DeepSeek-V3
    assert C.to_output_ids([1, 29, 57], "output") == [1, 29, 57]
    assert C.to_output_ids([1, 29, 57], "sglang", "deepseek") == [1, 29, 57]  # first id 1: shifted
    assert C.to_output_ids([2, 30, 58], "sglang", "deepseek") == [1, 29, 57]  # verbatim layer inputs
    assert C.to_output_ids([1, 29, 57], "input") == [0, 28, 56]  # vLLM reads inputs
    assert C.to_output_ids([2, 30, 58], "sglang", "llama") == [2, 30, 58]  # llama.py always adds 1
    assert C.capture_indices([1, 29, 57]) == [2, 30, 58]


@pytest.mark.parametrize("n,expected", [(61, [1, 29, 57]), (27, [1, 12, 23]), (7, [1, 2, 3])])
def test_default_matches_sglang_vllm_trtllm(n, expected):
    assert C.default_output_ids(n) == expected
    # SGLang's default layers_to_capture [2, N//2, N-3] are inputs = the same physical layers
    assert C.capture_indices(expected) == [2, n // 2, n - 3]


def test_default_refused_for_tiny_targets():
    with pytest.raises(ConfigError, match="eagle_aux_hidden_state_layer_ids"):
        C.default_output_ids(5)


def test_aliases_and_unknown_convention():
    assert C.canonical_convention("SpecForge") == "output"
    assert C.canonical_convention("vllm") == "input"
    assert C.canonical_convention(None) == "sglang"
    with pytest.raises(ConfigError) as e:
        C.canonical_convention("outputs")
    assert e.value.field.endswith("aux_layer_convention") and e.value.value == "outputs"
    assert "output" in e.value.fix


def plan(n, ids, conv=None, override=None, fc=None):
    return C.plan_for_ids(target(n, hidden=16), ids, conv, override, fc)


def test_out_of_range_duplicate_unsorted_are_refused():
    _, errs = plan(61, [1, 29, 61], "output")
    assert [e.field for e in errs] == ["draft.eagle_config.eagle_aux_hidden_state_layer_ids"]
    assert "[61] out of range" in errs[0].problem and "0..60" in errs[0].fix
    _, errs = plan(61, [1, 29, 29], "output")
    assert "[29] captured twice" in errs[0].problem
    _, errs = plan(61, [29, 1, 57], "output")
    assert "ascending" in errs[0].problem
    _, errs = plan(61, [0, 29, 57], "input")  # input id 0 = the embedding output
    assert "embedding output" in errs[0].problem


def test_fc_width_must_match_layer_count():
    p, errs = plan(61, [1, 29, 57], "output", fc=48)
    assert not errs and p.output_ids == (1, 29, 57)
    _, errs = plan(61, [1, 29], "output", fc=48)
    assert errs[0].field == "fc.weight.in_features" and errs[0].value == 48
    assert "capture 3 layers" in errs[0].fix
    _, errs = plan(61, [1, 29, 57], "output", fc=50)
    assert "hidden size differs" in errs[0].fix


def test_override_wins_and_is_validated():
    p, errs = plan(61, [1, 29, 57], "output", override="2, 30, 60")
    assert not errs and p.output_ids == (2, 30, 60) and p.source == "override"
    _, errs = plan(61, [1, 29, 57], None, override="1,x")
    assert errs[0].field == C.OVERRIDE_FIELD
    _, errs = plan(61, None, None, override="1,61")
    assert errs[0].field == C.OVERRIDE_FIELD and "out of range" in errs[0].problem


def test_last_layer_output_is_capturable():
    p, errs = plan(61, [1, 29, 60], "output")
    assert not errs and p.capture_indices == [2, 30, 61]  # 61 = after the loop: our patch captures it
    assert "last layer" in p.describe(61)


def test_vl_wrapper_uses_text_config():
    t = TargetConfig.from_dict({"architectures": ["KimiK25ForConditionalGeneration"],
                        "text_config": {"num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840,
                                        "kv_lora_rank": 512}})
    assert t.num_hidden_layers == 61 and t.nested_text_config and t.family == "deepseek" and t.is_mla


def test_missing_target_field_is_named():
    with pytest.raises(ConfigError) as e:
        TargetConfig.from_dict({"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 8, "vocab_size": 8})
    assert e.value.field == "target.num_hidden_layers"


def test_draft_ids_must_be_integers():
    with pytest.raises(ConfigError) as e:
        Eagle3DraftConfig.from_dict({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 8, "vocab_size": 8,
                       "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, "2", 3]}})
    assert e.value.field == "draft.eagle_config.eagle_aux_hidden_state_layer_ids"
