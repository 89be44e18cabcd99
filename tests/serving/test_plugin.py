"""The SGLang plugin: discovered through its entry point, loaded by SGLang's own `load_plugins()` in
a fresh interpreter (sglang 0.5.17 installed), patching the targets' `set_eagle3_layers_to_capture`."""

import importlib.metadata
import json

import pytest

from conftest import _result, run_py

pytest.importorskip("sglang")


def test_entry_point_is_registered():
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")}
    assert eps.get("sglang_eagle3_mla") == "sglang_ext.plugin:register"


def test_import_is_light():
    p = run_py("""
        import sys, sglang_ext, sglang_ext.config, sglang_ext.settings, sglang_ext.inspect_draft, sglang_ext.plugin
        heavy = [m for m in ("sglang", "torch", "transformers") if m in sys.modules]
        assert not heavy, heavy
        print("ok")""", fresh=True)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr


PATCHED = """
    import functools, json, logging, sys, types
    logging.basicConfig(level=logging.INFO)
    import torch
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
    from sglang.srt.models.kimi_k25 import KimiK25ForConditionalGeneration
    from sglang.srt.models.llama import LlamaForCausalLM
    from transformers import DeepseekV3Config, LlamaConfig
    from sglang_ext.serving import aux_capture

    def standin(cfg):
        # the attributes set_eagle3_layers_to_capture reads and writes on a target model instance
        inner = torch.nn.Module()
        inner.norm = torch.nn.Identity()
        inner.layers_to_capture, inner.start_layer = [], 0
        return types.SimpleNamespace(config=cfg, model=inner, pp_group=types.SimpleNamespace(is_last_rank=True),
                                     capture_aux_hidden_states=False)

    def call(cls, cfg, ids, draft=None):
        aux_capture.server_draft_path = lambda: draft
        m = standin(cfg)
        cls.set_eagle3_layers_to_capture(m, ids)
        return m

    ds = DeepseekV3Config(num_hidden_layers=61, hidden_size=64, vocab_size=100, architectures=["DeepseekV3ForCausalLM"])
    out = {"wrapped": hasattr(DeepseekV3ForCausalLM.set_eagle3_layers_to_capture, "__wrapped__")}
    for name, ids in [("specforge", [1, 29, 57]), ("verbatim", [2, 30, 58]), ("default", None)]:
        m = call(DeepseekV3ForCausalLM, ds, ids)
        out[name] = [m.model.layers_to_capture, m.capture_aux_hidden_states, m._sglang_ext_aux_plan.source]
    m = call(DeepseekV3ForCausalLM, ds, [1, 29, 57], draft=sys.argv[1])  # the draft declares 'output' [1, 29, 60]
    out["declared_last"] = [m.model.layers_to_capture, "forward" in vars(m.model)]
    ll = LlamaConfig(num_hidden_layers=30, hidden_size=64, vocab_size=100, architectures=["LlamaForCausalLM"])
    out["llama"] = call(LlamaForCausalLM, ll, [2, 15, 27]).model.layers_to_capture
    inner = standin(ds)
    kimi = types.SimpleNamespace(language_model=types.SimpleNamespace(
        set_eagle3_layers_to_capture=functools.partial(DeepseekV2ForCausalLM.set_eagle3_layers_to_capture, inner)))
    aux_capture.server_draft_path = lambda: None
    KimiK25ForConditionalGeneration.set_eagle3_layers_to_capture(kimi, [1, 29, 57])
    out["kimi"] = inner.model.layers_to_capture
    try:
        call(DeepseekV3ForCausalLM, ds, [1, 29, 61])
    except Exception as e:
        out["bad"] = [type(e).__name__, str(e)]
    print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def declared_draft(tmp_path_factory):
    from sglang_ext.config import Eagle3DraftConfig
    from sglang_ext.core.heads import Eagle3Head

    d = str(tmp_path_factory.mktemp("draft"))
    cfg = Eagle3DraftConfig(head_format="mha", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     vocab_size=100, target_hidden_size=64, aux_layer_ids=[1, 29, 60], aux_layer_convention="output")
    Eagle3Head(cfg).save_pretrained(d)  # a complete head: the server checks names and shapes at startup
    return d


def test_plugin_patches_targets_in_a_fresh_interpreter(declared_draft):
    p = run_py(PATCHED.replace("sys.argv[1]", repr(declared_draft)), SGLANG_PLUGINS="sglang_eagle3_mla")
    r = _result(p)
    assert r["wrapped"]
    # undeclared ids are read as upstream SGLang 0.5.17 reads them (published drafts keep their layers)
    assert r["specforge"] == [[2, 30, 58], True, "draft config"]
    assert r["verbatim"] == [[2, 30, 58], True, "draft config"]
    assert r["default"] == [[2, 30, 58], True, "default"]
    # a declared convention wins; the last layer's output (capture index 61) is taken by the forward wrapper
    assert r["declared_last"] == [[2, 30], True]
    assert r["llama"] == [3, 16, 28]
    assert r["kimi"] == [2, 30, 58]
    assert r["bad"][0] == "ConfigError" and "eagle_aux_hidden_state_layer_ids" in r["bad"][1]
    assert "[61] out of range" in r["bad"][1]
    assert "[sglang_ext] Eagle3 aux hidden states: outputs of decoder layers" in p.stderr


def test_sglang_plugins_whitelist_excludes_the_plugin():
    p = run_py("""
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM
        print("RESULT", hasattr(DeepseekV2ForCausalLM.set_eagle3_layers_to_capture, "__wrapped__"))
        """, SGLANG_PLUGINS="some_other_plugin")
    assert "RESULT False" in p.stdout, p.stderr[-3000:]


def test_operator_override_env(declared_draft):
    p = run_py(PATCHED.replace("sys.argv[1]", repr(declared_draft)), SGLANG_PLUGINS="sglang_eagle3_mla",
               SGLANG_EXT_EAGLE3_AUX_LAYERS="3,20,28")  # valid for the 61- and the 30-layer target
    r = _result(p)
    assert r["specforge"] == [[4, 21, 29], True, "override"]
    assert r["llama"] == [4, 21, 29]


def test_bad_option_value_stops_the_server_start_not_the_plugin(declared_draft):
    """An unknown SGLANG_EXT_MLA_VERIFY value: the plugin still registers (SGLang's loader would swallow an
    exception there and run without it), and the target's startup hook refuses the value."""
    code = PATCHED.replace("sys.argv[1]", repr(declared_draft)).split("    out = {")[0] + """
    out = {"wrapped": hasattr(DeepseekV3ForCausalLM.set_eagle3_layers_to_capture, "__wrapped__")}
    try:
        call(DeepseekV3ForCausalLM, ds, [1, 29, 57])
    except Exception as e:
        out["bad"] = [type(e).__name__, str(e)]
    print("RESULT" + json.dumps(out))
"""
    r = _result(run_py(code, SGLANG_PLUGINS="sglang_eagle3_mla", SGLANG_EXT_MLA_VERIFY="fast"))
    assert r["wrapped"]
    assert r["bad"][0] == "ConfigError" and "SGLANG_EXT_MLA_VERIFY" in r["bad"][1] and "'fast'" in r["bad"][1]


FP32 = """
import json, torch
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.layers.layernorm import RMSNorm
import sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe as fm
import triton.language as tl

norm = RMSNorm(16)
with torch.no_grad():
    norm.weight.copy_(torch.linspace(0.5, 1.5, 16))
x, res = torch.randn(4, 16), torch.randn(4, 16)
out = norm.forward_cuda(x.clone())  # fp32: upstream's forward_native, not sgl_kernel's rmsnorm
out_res, new_res = norm.forward_cuda(x.clone(), res.clone())
ref = norm.forward_native(x.clone())
ref_res, ref_new = norm.forward_native(x.clone(), res.clone())
seen = []
from sglang_ext.serving import fp32
fp32.invoke_fused_moe_kernel(lambda A, *a, **k: seen.append(k["compute_type"]), torch.zeros(2, dtype=torch.float32),
                             compute_type=tl.float16)
fp32.invoke_fused_moe_kernel(lambda A, *a, **k: seen.append(k["compute_type"]), torch.zeros(2, dtype=torch.bfloat16),
                             compute_type=tl.bfloat16)
calls = []
fp32.rmsnorm_forward_cuda(lambda self, x, r, p: calls.append(x.dtype), norm, x.to(torch.bfloat16))
print(json.dumps({"wrapped": hasattr(RMSNorm.forward_cuda, "__wrapped__"),
                  "moe_wrapped": hasattr(fm.invoke_fused_moe_kernel, "__wrapped__"),
                  "norm": torch.equal(out, ref), "norm_res": torch.equal(out_res, ref_res) and torch.equal(new_res, ref_new),
                  "moe_types": [str(t) for t in seen], "bf16_passes_through": [str(c) for c in calls]}))
"""


def test_fp32_targets_serve_on_upstreams_pure_torch_rmsnorm_and_an_fp32_moe_store():
    """SGLang 0.5.17's sgl_kernel rmsnorm has no fp32 kernel and its fused MoE stores fp32 results as fp16: under the
    plugin an fp32 RMSNorm runs upstream's forward_native (same values), fp32 MoE stores fp32, bf16 is untouched."""
    p = run_py(FP32, SGLANG_PLUGINS="sglang_eagle3_mla")
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["wrapped"] and r["moe_wrapped"] and r["norm"] and r["norm_res"]
    assert r["moe_types"] == ["fp32", "bf16"] and r["bf16_passes_through"] == ["torch.bfloat16"]
