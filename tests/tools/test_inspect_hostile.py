"""inspect-draft (and the schema the server's startup check shares) against configs and checkpoints we
did not write: every bad input is an error naming the field, the value and the fix, never a traceback;
real targets sized by config alone; vLLM's own aux-id field; SGLang's per-architecture id readings."""

import json
import os
import struct

import pytest

from conftest import write_head, write_model_dir
from sglang_ext.inspect_draft import inspect, render

YARN = {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096}
DSV3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "first_k_dense_replace": 3,
        "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512, "moe_intermediate_size": 2048,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_attention_heads": 128, "num_key_value_heads": 128,
        "num_hidden_layers": 61, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "vocab_size": 129280, "rope_scaling": YARN, "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
KIMI_TEXT = {k: v for k, v in DSV3.items() if k != "quantization_config"}
KIMI_TEXT.update(first_k_dense_replace=1, n_routed_experts=384, num_attention_heads=64, num_key_value_heads=64,
                 vocab_size=163840)
KIMI = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": KIMI_TEXT,
        "quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
            "group_0": {"weights": {"num_bits": 4, "group_size": 32, "type": "int"}}}}}
LLAMA8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}


@pytest.fixture
def dsv3(tmp_path):
    return write_model_dir(tmp_path / "dsv3", DSV3)


@pytest.fixture
def head(tmp_path):
    """A valid small MHA head for the DeepSeek-V3 target (its config, then edited per case)."""
    return write_head(tmp_path / "head", "mha", target_hidden=7168, vocab=129280, ids=[1, 29, 57],
                      convention="output", heads=16)


def edit_config(path, **changes):
    cfg = json.load(open(os.path.join(path, "config.json")))
    for k, v in changes.items():
        if v is DROP:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    return path


DROP = object()

BAD_FIELDS = [  # config change -> the field named in the error
    ({"num_attention_heads": "32"}, "draft.num_attention_heads", "not an integer"),
    ({"num_attention_heads": 0}, "draft.num_attention_heads", "at least 1"),
    ({"num_attention_heads": DROP}, "draft.num_attention_heads", "missing"),
    ({"intermediate_size": None}, "draft.intermediate_size", "null"),
    ({"hidden_size": "64"}, "draft.hidden_size", "not an integer"),
    ({"hidden_size": True}, "draft.hidden_size", "not an integer"),
    ({"vocab_size": 129280.5}, "draft.vocab_size", "not an integer"),
    ({"draft_vocab_size": "32"}, "draft.draft_vocab_size", "not an integer"),
    ({"target_hidden_size": None}, "draft.target_hidden_size", "null"),
    ({"target_hidden_size": 0}, "draft.target_hidden_size", "at least 1"),
    ({"num_hidden_layers": "one"}, "draft.num_hidden_layers", "not an integer"),
    ({"num_key_value_heads": 3, "num_attention_heads": 4}, "draft.num_key_value_heads", "does not divide"),
    ({"torch_dtype": "float8"}, "draft.torch_dtype", "not a dtype"),
    ({"hidden_act": "gelu"}, "draft.hidden_act", "only silu"),
    ({"rope_scaling": {"type": "nonsense"}}, "draft.rope_scaling", "not a RoPE scaling"),
    ({"rope_scaling": [1, 2]}, "draft.rope_scaling", "not a RoPE scaling"),
    ({"tie_word_embeddings": True}, "draft.tie_word_embeddings", "ignore the shipped lm_head"),
    ({"architectures": 5}, "draft.architectures", "not a list"),
    ({"architectures": [["X"]]}, "draft.architectures", "not a list"),
    ({"architectures": DROP}, "draft.architectures", "missing"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": ["1", 29, 57]}}, "eagle_aux_hidden_state_layer_ids",
     "not a list of integers"),
    ({"eagle_aux_hidden_state_layer_ids": [1.0, 29, 57]}, "draft.eagle_aux_hidden_state_layer_ids",
     "not a list of integers"),
    # loaded without complaint by transformers 5, then NaN in every RMSNorm / RoPE table of the head
    ({"rms_norm_eps": float("nan")}, "draft.rms_norm_eps", "not a positive finite number"),
    ({"rms_norm_eps": "1e-5"}, "draft.rms_norm_eps", "not a positive finite number"),
    ({"rope_theta": -1}, "draft.rope_theta", "not a positive finite number"),
    ({"rope_theta": 0}, "draft.rope_theta", "not a positive finite number"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": None}}, "draft.rope_parameters.rope_theta",
     "not a positive finite number"),
    ({"eagle_config": {"use_aux_hidden_state": "yes"}}, "draft.eagle_config.use_aux_hidden_state", "not a boolean"),
    ({"attention_bias": "yes"}, "draft.attention_bias", "not a boolean"),
    ({"tie_word_embeddings": "false"}, "draft.tie_word_embeddings", "not a boolean"),
    ({"hidden_act": None}, "draft.hidden_act", "only silu"),  # transformers 5 refuses a null activation
    ({"max_position_embeddings": None}, "draft.max_position_embeddings", "null"),
    ({"num_nextn_predict_layers": "1"}, "draft.num_nextn_predict_layers", "not an integer"),
    ({"model_type": 3}, "draft.model_type", "not a model type name"),
    # a template filled from a model's attributes (ModelOpt's export) writes null where the attribute is absent
    ({"use_cache": None}, "draft.use_cache", "transformers 5 refuses it"),
    ({"mlp_bias": None}, "draft.mlp_bias", "transformers 5 refuses it"),
    ({"mlp_bias": "no"}, "draft.mlp_bias", "not a boolean"),
]


@pytest.mark.parametrize("changes,field,text", BAD_FIELDS)
def test_bad_draft_fields_are_named(dsv3, head, changes, field, text):
    report = inspect(edit_config(head, **changes), dsv3)
    assert any(field in e["field"] and text in e["message"] and e["fix"] for e in report["errors"]), report["errors"]


def test_nulls_the_mla_config_class_refuses_are_named(tmp_path, dsv3):
    head = write_head(tmp_path / "mla", "mla", target_hidden=7168, vocab=129280, ids=[1, 29, 57], convention="output")
    assert not inspect(head, dsv3)["errors"]
    for key in ("n_routed_experts", "routed_scaling_factor", "moe_intermediate_size"):
        report = inspect(edit_config(head, **{key: None}), dsv3)
        assert [e["field"] for e in report["errors"]] == [f"draft.{key}"] and "remove" in report["errors"][0]["fix"]
        edit_config(head, **{key: DROP})
    assert not inspect(head, dsv3)["errors"]  # absent: the class default applies
    assert not inspect(edit_config(head, mlp_bias=None), dsv3)["errors"]  # DeepseekV3Config takes any mlp_bias


def test_an_attention_bias_needs_its_weights(dsv3, head):
    """`attention_bias: true` gives SGLang's Eagle3 layer an o_proj bias; a checkpoint without one would leave it
    uninitialised (nothing checks that a parameter was loaded), so the pair is refused naming the tensor."""
    report = inspect(edit_config(head, attention_bias=True), dsv3)
    (e,) = report["errors"]
    assert e["field"] == "draft.weights" and e["value"] == ["layers.0.self_attn.o_proj.bias"]
    assert not inspect(edit_config(head, attention_bias=False), dsv3)["errors"]


def test_a_head_trained_on_aux_states_is_refused_with_aux_capture_off(tmp_path, dsv3, head):
    """use_aux_hidden_state false: SGLang captures nothing and feeds the head the last hidden state (fc skipped when
    the widths match) -- wrong for a head whose fc reads three aux states; right for a head without an fc."""
    off = {"use_aux_hidden_state": False, "eagle_aux_hidden_state_layer_ids": [1, 29, 57],
           "aux_layer_convention": "output"}
    report = inspect(edit_config(head, eagle_config=off), dsv3)
    (e,) = report["errors"]
    assert e["field"] == "draft.eagle_config.use_aux_hidden_state" and "fc.weight (in_features 21504)" in e["message"]
    assert "remove fc.weight" in e["fix"]
    from safetensors.torch import load_file, save_file

    no_fc = tmp_path / "no-fc"
    no_fc.mkdir()
    weights = load_file(os.path.join(head, "model.safetensors"))
    del weights["fc.weight"]
    save_file(weights, str(no_fc / "model.safetensors"))
    (no_fc / "config.json").write_text(open(os.path.join(head, "config.json")).read())
    report = inspect(str(no_fc), dsv3)
    assert not report["errors"] and any("use_aux_hidden_state is false" in n for n in report["notes"])
    edit_config(str(no_fc), eagle_config={"use_aux_hidden_state": True})  # and with capture on, fc is required
    assert any(e["field"] == "fc.weight" for e in inspect(str(no_fc), dsv3)["errors"])


ODD_VALUES = [None, "abc", -1, 0, 1.5, [], {}, True, float("nan")]


@pytest.mark.parametrize("fmt", ["mha", "mla"])
@pytest.mark.parametrize("which", ["kimi-k2.5", "deepseek-v3"])
def test_no_config_value_gives_a_traceback(tmp_path, fmt, which):
    """Every field of a real target's config (Kimi-K2.5: nested text config, INT4 compressed-tensors; DeepSeek-V3:
    block fp8) and of our exported head's, set in turn to each odd JSON value, the KV pools sized at TP 8:
    inspect-draft answers with errors or notes, never an exception."""
    target_cfg = json.loads(json.dumps({**KIMI, "text_config": KIMI_TEXT} if which == "kimi-k2.5" else DSV3))
    target = write_model_dir(tmp_path / "t", target_cfg)
    vocab = (target_cfg.get("text_config") or target_cfg)["vocab_size"]
    head = write_head(tmp_path / "h", fmt, target_hidden=7168, vocab=vocab, ids=[1, 29, 57], convention="output",
                      heads=16)
    head_cfg = json.load(open(os.path.join(head, "config.json")))

    def paths(cfg, prefix=()):
        for k, v in cfg.items():
            yield prefix + (k,)
            if isinstance(v, dict):
                yield from paths(v, prefix + (k,))

    for where, cfg in ((target, target_cfg), (head, head_cfg)):
        for path in list(paths(cfg)):
            for value in ODD_VALUES:
                edited = json.loads(json.dumps(cfg))
                node = edited
                for k in path[:-1]:
                    node = node[k]
                node[path[-1]] = value
                with open(os.path.join(where, "config.json"), "w") as f:
                    json.dump(edited, f)
                try:
                    render(inspect(head, target, pools={"tp_size": 8}))
                except Exception as e:  # noqa: BLE001 -- the point: nothing may escape
                    pytest.fail(f"{'.'.join(map(str, path))} = {value!r}: {type(e).__name__}: {e}")
        with open(os.path.join(where, "config.json"), "w") as f:
            json.dump(cfg, f)


TARGET_FIELDS = [  # target (text) config changes -> the field named
    ({"kv_lora_rank": 512.5}, "target.kv_lora_rank"),  # the KV pool arithmetic would int() it to 512
    ({"qk_rope_head_dim": "64"}, "target.qk_rope_head_dim"),
    ({"num_attention_heads": 0}, "target.num_attention_heads"),
    ({"q_lora_rank": -1}, "target.q_lora_rank"),
    ({"num_key_value_heads": 1.0}, "target.num_key_value_heads"),
]


@pytest.mark.parametrize("changes,field", TARGET_FIELDS)
def test_bad_target_fields_are_named(tmp_path, head, changes, field):
    target = write_model_dir(tmp_path / "t", {**DSV3, **changes})
    report = inspect(head, target, pools={"tp_size": 8})
    assert any(e["field"] == field and "not an integer >= 1" in e["message"] and e["fix"] for e in report["errors"])
    assert "kv_pools" not in report
    nested = write_model_dir(tmp_path / "k", {**KIMI, "text_config": {**KIMI_TEXT, **changes}})
    assert any(e["field"] == field.replace("target.", "target.text_config.")
               for e in inspect(head, nested)["errors"])
    assert not inspect(head, write_model_dir(tmp_path / "ok", {**DSV3, "q_lora_rank": None}))["errors"]


ARCH_FIXES = [
    (["Eagle3LlamaForCausalLM"], "LlamaForCausalLMEagle3"),  # vLLM's name: SGLang 0.5.17 does not register it
    (["Eagle3Speculator"], "speculators-format"),
    (["LlamaForCausalLMEagle"], "--speculative-algorithm EAGLE"),
    (["LlamaForCausalLM"], "LlamaForCausalLMEagle3"),
]


@pytest.mark.parametrize("archs,fix", ARCH_FIXES)
def test_architecture_refusals_say_what_to_do(dsv3, head, archs, fix):
    report = inspect(edit_config(head, architectures=archs), dsv3)
    (e,) = report["errors"]
    assert e["field"] == "draft.architectures" and fix in e["fix"]


def _raw(path, name, data: bytes):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, name), "wb") as f:
        f.write(data)


def _header_file(path, header: bytes):
    _raw(path, "model.safetensors", struct.pack("<Q", len(header)) + header)


CHECKPOINTS = [  # broken files next to a valid config -> the error's field and text
    (lambda d: _raw(d, "model.safetensors", b""), "safetensors", "shorter than"),
    (lambda d: _header_file(d, b"{not json"), "safetensors", "not JSON"),
    (lambda d: _header_file(d, b"[1, 2]"), "safetensors", "not a JSON object"),
    (lambda d: _header_file(d, b'{"fc.weight": {"shape": [2, 2]}}'), "safetensors", "no valid dtype"),
    (lambda d: _raw(d, "model.safetensors.index.json", b"{}"), "safetensors", "no weight_map"),
    (lambda d: _raw(d, "model.safetensors.index.json", json.dumps(
        {"weight_map": {"fc.weight": "model-00002-of-00002.safetensors"}}).encode()), "safetensors", "not there"),
    (lambda d: _header_file(d, b'{"fc.weight": {"dtype": "BF16", "shape": [64], "data_offsets": [0, 128]}}'),
     "fc.weight", "not a 2-D matrix"),
]


@pytest.mark.parametrize("breaker,field,text", CHECKPOINTS)
def test_broken_checkpoints_are_errors(tmp_path, dsv3, head, breaker, field, text):
    os.remove(os.path.join(head, "model.safetensors"))
    breaker(head)
    report = inspect(head, dsv3)
    assert any(field in e["field"] and text in e["message"] for e in report["errors"]), report["errors"]


RAW_CONFIGS = [(b"[1, 2, 3]", "JSON list"), (b"null", "JSON NoneType"), (b'"s"', "JSON str"),
               (b"{", "not valid JSON"), (b'{"a": "\xe9"}', "not UTF-8")]


@pytest.mark.parametrize("raw,text", RAW_CONFIGS)
def test_unreadable_configs(tmp_path, dsv3, raw, text):
    _raw(tmp_path / "d", "config.json", raw)
    for draft, target in ((str(tmp_path / "d"), dsv3), (dsv3, str(tmp_path / "d"))):
        (e,) = inspect(draft, target)["errors"]
        assert e["field"] == "path" and text in e["message"]
    os.makedirs(tmp_path / "dirconf" / "config.json")
    (e,) = inspect(str(tmp_path / "dirconf" / "config.json"), dsv3)["errors"]
    assert "directory" in e["message"]


def test_cli_never_prints_a_traceback(tmp_path, dsv3, head, run_cli):
    edit_config(head, num_attention_heads="32", architectures=["LlamaForCausalLMEagle3"])
    _raw(tmp_path / "t", "config.json", json.dumps(dict(DSV3, num_hidden_layers=0)).encode())
    for args in ([head, "--target", dsv3], [head, "--target", str(tmp_path / "t")]):
        for extra in ([], ["--json"]):
            rc, out = run_cli("inspect-draft", *args, *extra)
            assert rc == 1 and "Traceback" not in out, out
    for bad in (["--tp-size", "0"], ["--mem-fraction-static", "85"], ["--gpu-memory-gib", "nan"]):
        rc, out = run_cli("inspect-draft", head, "--target", dsv3, *bad)
        assert rc == 2 and bad[0] in out and "Traceback" not in out


def test_a_config_file_path_still_checks_the_weights(dsv3, head):
    edit_config(head, draft_vocab_size=31)  # d2t holds 32
    for path in (head, os.path.join(head, "config.json")):
        report = inspect(path, dsv3)
        assert report["weights_checked"] and any("d2t" in e["field"] for e in report["errors"]), report


def test_pickle_only_weights_are_not_called_checked(dsv3, head, run_cli):
    os.rename(os.path.join(head, "model.safetensors"), os.path.join(head, "pytorch_model.bin"))
    report = inspect(head, dsv3)
    assert report["errors"] == [] and not report["weights_checked"]
    assert any("pytorch_model.bin" in n and "never unpickles" in n for n in report["notes"])
    rc, out = run_cli("inspect-draft", head, "--target", dsv3)
    assert rc == 0 and "weights were not checked" in out and "OK: the server would accept" not in out


def test_tensor_parallel_sizes_the_server_would_assert_on(tmp_path, run_cli):
    target = write_model_dir(tmp_path / "llama", LLAMA8B)
    head = write_head(tmp_path / "h", "mha", target_hidden=4096, vocab=128256, ids=[1, 15, 28], convention="output",
                      heads=16)
    assert inspect(head, target, pools={"tp_size": 8})["errors"] == []  # 8 KV heads, 32 heads
    errors = inspect(head, target, pools={"tp_size": 3})["errors"]
    assert errors and all(e["field"] == "--tp-size" for e in errors)
    assert any("target's 32 attention heads" in e["message"] for e in errors)
    assert inspect(head, target, pools={"tp_size": 16})["errors"] == []  # 8 KV heads replicated twice


def test_kv_cache_dtypes_are_sglangs_choices(dsv3, head):
    for dtype, bytes_per_elem in (("fp8_e5m2", 1), ("fp8_e4m3", 1), ("bfloat16", 2), ("auto", 2)):
        r = inspect(head, dsv3, pools={"kv_cache_dtype": dtype, "tp_size": 8})
        assert r["errors"] == [] and r["kv_pools"]["target_bytes_per_token"] == 576 * 61 * bytes_per_elem
    r = inspect(head, dsv3, pools={"kv_cache_dtype": "nvfp4", "tp_size": 8})
    assert r["errors"] == [] and "kv_pools" not in r and any("nvfp4" in n for n in r["notes"])
    (e,) = inspect(head, dsv3, pools={"kv_cache_dtype": "fp16"})["errors"]  # not an SGLang choice
    assert e["field"] == "--kv-cache-dtype" and "fp8_e5m2" in e["fix"]


@pytest.mark.parametrize("target,tp,low,high", [(DSV3, 8, 70, 85), (KIMI, 8, 62, 76)])
def test_quantized_targets_sized_by_config(tmp_path, target, tp, low, high):
    """DeepSeek-V3 block fp8 (~690 GB on disk) and Kimi-K2.5 INT4 experts (~595 GB) per rank at TP 8: a budget
    left for the KV pools, which a 2-bytes-per-parameter estimate (0 tokens) got wrong."""
    t = write_model_dir(tmp_path / "t", target)
    text = target.get("text_config", target)
    h = write_head(tmp_path / "h", "mha", target_hidden=7168, vocab=text["vocab_size"], ids=[1, 29, 57],
                   convention="output", heads=16)
    k = inspect(h, t, pools={"tp_size": tp})["kv_pools"]
    assert low < k["target_weights_gib_estimate"] < high and k["split"]["tokens"] > 100_000, k
    r = inspect(h, t)  # TP 1: nothing left, and the note says which TP fits
    assert r["kv_pools"]["split"]["tokens"] == 0 and any("--tp-size 8 or more" in n for n in r["notes"]), r["notes"]


def test_target_checkpoint_size_wins_over_the_estimate(tmp_path, dsv3, head):
    with open(os.path.join(dsv3, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 8 * 60 * 2**30}, "weight_map": {}}, f)
    k = inspect(head, dsv3, pools={"tp_size": 8})["kv_pools"]
    assert k["target_weights_source"] == "checkpoint" and k["target_weights_gib_estimate"] == 60


def test_vllm_reads_its_own_top_level_field(tmp_path, dsv3, head):
    """vLLM reads the top-level eagle_aux_hidden_state_layer_ids (input ids), not eagle_config's; our export
    writes both. A config with the top-level field alone: upstream SGLang ignores it (its default)."""
    cfg = json.load(open(os.path.join(head, "config.json")))
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]  # outputs [1, 29, 57] as vLLM's input ids
    r = inspect(head, dsv3)
    assert r["engines"] == {"sglang-ext": [1, 29, 57], "sglang": [1, 29, 57], "vllm": [1, 29, 57],
                            "trtllm": [1, 29, 57]}
    edit_config(head, eagle_config={"use_aux_hidden_state": True}, eagle_aux_hidden_state_layer_ids=[3, 30, 58])
    r = inspect(head, dsv3)
    assert r["engines"]["vllm"] == r["engines"]["sglang-ext"] == [2, 29, 57]
    assert r["engines"]["sglang"] == [1, 29, 57] and r["disagree"] == ["sglang", "trtllm"]


FAMILIES = [  # target architecture, ids (undeclared), what upstream SGLang (and so the server) captures
    ("Qwen3ForCausalLM", [2, 18, 33], [2, 18, 33]),  # qwen3.py adds 1: output ids
    ("Glm4MoeForCausalLM", [2, 18, 33], [2, 18, 33]),
    ("GptOssForCausalLM", [2, 18, 36], [1, 17, 35]),  # gpt_oss.py: verbatim when the largest id is N
    ("Glm4MoeLiteForCausalLM", [2, 18, 33], [1, 17, 32]),  # DeepSeek's reading
]


@pytest.mark.parametrize("arch,ids,captured", FAMILIES)
def test_upstream_reading_per_architecture(tmp_path, arch, ids, captured):
    t = write_model_dir(tmp_path / "t", dict(LLAMA8B, architectures=[arch], num_hidden_layers=36))
    h = write_head(tmp_path / "h", "mha", target_hidden=4096, vocab=128256, ids=ids)
    r = inspect(h, t)
    assert r["errors"] == [] and r["engines"]["sglang"] == r["engines"]["sglang-ext"] == captured
    assert r["plan"]["output_ids"] == captured
    assert any("hook is not on" in n for n in r["notes"])


def test_targets_without_eagle3_capture_are_refused(tmp_path):
    t = write_model_dir(tmp_path / "t", dict(LLAMA8B, architectures=["KimiVLForConditionalGeneration"]))
    h = write_head(tmp_path / "h", "mha", target_hidden=4096, vocab=128256, ids=[1, 15, 28], convention="output")
    (e,) = inspect(h, t)["errors"]
    assert e["field"] == "target.architectures" and "no EAGLE3 aux-state capture" in e["message"]
