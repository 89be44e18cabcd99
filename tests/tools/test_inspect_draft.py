"""`python -m sglang_ext inspect-draft`: the layers each engine reads, and every refusal."""

import json

import pytest

from conftest import deepseek_v3_config, kimi_k25_config, write_model_dir


@pytest.fixture
def targets(tmp_path):
    tiny = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 8, "hidden_size": 64,
            "vocab_size": 512, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "num_attention_heads": 4}
    return {"kimi": write_model_dir(tmp_path / "kimi", kimi_k25_config()),
            "dsv3": write_model_dir(tmp_path / "dsv3", deepseek_v3_config()),
            "tiny": write_model_dir(tmp_path / "tiny", tiny) + "/config.json"}


VOCAB = {"kimi": 163840, "dsv3": 129280, "tiny": 512}
CASES = [
    # target, ids, convention, ours, {engine: layers that differ from ours}
    ("kimi", None, None, [1, 29, 57], {}),  # lightseekorg/kimi-k2.5-eagle3: no eagle ids at all
    # a SpecForge export: vLLM reads only the top-level field (none here), so its default, the same layers
    ("kimi", [1, 29, 57], None, [1, 29, 57], {}),
    ("dsv3", [1, 29, 57], "output", [1, 29, 57], {}),  # ours: the top-level field for vLLM is [2, 30, 58]
    ("dsv3", [2, 30, 58], "input", [1, 29, 57], {"trtllm": [2, 30, 58]}),
    ("dsv3", [2, 30, 58], None, [1, 29, 57], {"trtllm": [2, 30, 58]}),  # upstream reads these verbatim
    ("tiny", [0, 3, 7], "output", [0, 3, 7], {"sglang": [-1, 2, 6]}),
    ("tiny", [1, 4, 7], "vllm", [0, 3, 6], {"sglang": [1, 4, 7], "trtllm": [1, 4, 7]}),
]


@pytest.mark.parametrize("tgt,ids,conv,ours,differ", CASES)
def test_layers_per_engine(targets, make_draft, run_cli, tgt, ids, conv, ours, differ):
    hidden = {"kimi": 7168, "dsv3": 7168, "tiny": 64}[tgt]
    arch = "Eagle3DeepseekV2ForCausalLM" if tgt == "kimi" else "LlamaForCausalLMEagle3"
    d = make_draft(f"d-{tgt}", target_hidden=hidden, arch=arch, ids=ids, convention=conv, vocab=VOCAB[tgt])
    rc, out = run_cli("inspect-draft", d, "--target", targets[tgt], "--json")
    report = json.loads(out)
    assert rc == 0, out
    assert report["engines"]["sglang-ext"] == ours
    assert report["plan"]["output_ids"] == ours
    assert sorted(report["disagree"]) == sorted(differ)
    for engine, layers in differ.items():
        assert report["engines"][engine] == layers
    rc, text = run_cli("inspect-draft", d, "--target", targets[tgt])
    assert rc == 0 and f"sglang_ext will capture outputs of {ours}" in text
    assert ("DIFFERS" in text) == bool(differ)


def test_vl_wrapper_is_reported(targets, make_draft, run_cli):
    d = make_draft("k", arch="Eagle3DeepseekV2ForCausalLM")
    rc, text = run_cli("inspect-draft", d, "--target", targets["kimi"])
    assert rc == 0 and "KimiK25ForConditionalGeneration (text_config of a VL wrapper): 61 layers" in text
    assert "MLA head" in text


BAD = [
    ({"ids": [1, 29, 61], "convention": "output"}, 3, "eagle_aux_hidden_state_layer_ids", "out of range"),
    ({"ids": [1, 29, 29], "convention": "output"}, 3, "eagle_aux_hidden_state_layer_ids", "captured twice"),
    ({"ids": [1, 29, 57], "convention": "outputs"}, 3, "aux_layer_convention", "unknown aux-layer convention"),
    ({"ids": [1, 29, 57], "convention": "output"}, 4, "fc.weight.in_features", "fc expects 28672"),
    ({"ids": [1, 29], "convention": "output"}, 3, "fc.weight.in_features", "capture 3 layers"),
    ({"arch": "LlamaForCausalLM"}, 3, "draft.architectures", "not an Eagle3 head"),
]


@pytest.mark.parametrize("kw,n_aux,field,text", BAD)
def test_bad_input_exits_nonzero_naming_the_field(targets, make_draft, run_cli, kw, n_aux, field, text):
    d = make_draft("bad", n_aux=n_aux, vocab=129280, **kw)
    rc, out = run_cli("inspect-draft", d, "--target", targets["dsv3"], "--json")
    assert rc == 1
    errors = json.loads(out)["errors"]
    assert any(field in e["field"] and text in e["message"] and e["fix"] for e in errors), errors
    rc, out = run_cli("inspect-draft", d, "--target", targets["dsv3"])
    assert rc == 1 and "REFUSED" in out and field in out


def test_override_is_shown_and_checked(targets, make_draft, run_cli):
    d = make_draft("o", ids=[1, 29, 57], convention="output", vocab=129280)
    rc, out = run_cli("inspect-draft", d, "--target", targets["dsv3"], "--override", "3,30,60", "--json")
    r = json.loads(out)
    assert rc == 0 and r["plan"] == {"output_ids": [3, 30, 60], "source": "override", "convention": "output",
                                     "sglang_layers_to_capture": [4, 31, 61]}
    rc, out = run_cli("inspect-draft", d, "--target", targets["dsv3"], "--override", "3,30,61")
    assert rc == 1 and "SGLANG_EXT_EAGLE3_AUX_LAYERS" in out


def test_missing_paths_and_usage(tmp_path, run_cli, targets):
    rc, out = run_cli("inspect-draft", str(tmp_path / "nope"), "--target", targets["dsv3"])
    assert rc == 1 and "no config.json" in out
    rc, _ = run_cli("inspect-draft")
    assert rc == 2
    rc, _ = run_cli("no-such-command")
    assert rc == 2


def test_the_command_line_lists_its_commands_and_version(run_cli):
    rc, out = run_cli("--help")
    assert rc == 0 and "inspect-draft" in out
    rc, out = run_cli("--version")
    assert rc == 0 and out.startswith("sglang-eagle3-mla ")
    rc, _ = run_cli("no-such-command")
    assert rc == 2
