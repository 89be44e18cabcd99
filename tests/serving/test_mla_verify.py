"""Chain target-verify of an MLA target as grouped decode attention (sglang_ext.serving.mla_verify):
SGLang's own Triton kernels, run on the CPU by Triton's interpreter, compute the same verify attention
both ways; the option's parsing and the plugin's registration."""

import json
import os

import pytest

from conftest import WORKERS as HERE, python_run  # noqa: E402


def test_verify_as_decode_equals_upstreams_extend_kernel():
    p = python_run([os.path.join(HERE, "mla_verify_worker.py")], env=dict(os.environ, TRITON_INTERPRET="1"),
                   timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    # query (b, i) reads the prefix and draft tokens 0..i: prefixes 9, 3, 14 with 4 verify tokens each
    assert r["lens"] == [10, 11, 12, 13, 4, 5, 6, 7, 15, 16, 17, 18]
    assert r["first_query_slots"] == r["expected_first_query_slots"]
    assert r["extend_vs_ref"] < 1e-4 and r["decode_vs_ref"] < 1e-4 and r["decode_vs_extend"] < 1e-4


@pytest.mark.parametrize("drafting", ["chain", "tree"])
def test_hooks_on_sglangs_triton_backend_equal_its_own_verify(drafting):
    """SGLang's TritonAttnBackend (its real methods, pools, layer and kernels) computes a verify batch of an
    MLA layer -- a chain, or a tree read from EAGLE's verify mask -- the same with the plugin's hooks as
    without them, eager and through the CUDA-graph metadata path; replay refills the captured buffers (also
    after an eager batch replaced the backend's metadata: the server's first tree verify failed so); a
    prefill batch after it is left to upstream."""
    mode = "decode" if drafting == "tree" else ""  # trees only when asked for; chains by default
    p = python_run([os.path.join(HERE, "mla_verify_backend_worker.py"), drafting], timeout=900,
                   env=dict(os.environ, TRITON_INTERPRET="1", SGLANG_EXT_MLA_VERIFY=mode))
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["upstream_norm"] > 0.1  # a real output, not zeros
    assert r["eager_max_diff"] < 1e-4 and r["graph_max_diff"] < 1e-4 and r["replay_max_diff"] < 1e-4
    assert r["replay_same_buffers"] and r["flag_after_verify"]
    assert not r["flag_after_prefill"] and r["prefill_goes_upstream"]


def test_deterministic_mode_verify_rows_equal_plain_decode_bit_for_bit():
    """Under SGLang's --enable-deterministic-inference (KV split by a fixed tile per query), a chain verify
    run as decode queries gives every token exactly the output its plain decode step would: greedy
    speculation then reproduces the target alone token for token, not merely up to bf16 near-ties."""
    p = python_run([os.path.join(HERE, "mla_verify_backend_worker.py"), "deterministic"],
                   env=dict(os.environ, TRITON_INTERPRET="1"), timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["upstream_norm"] > 0.1
    assert max(r["kv_splits"]) > 1  # the tile really splits these prefixes (9, 3, 14 + 1..4 tokens, tile 4)
    assert r["verify_vs_plain_decode_max_diff"] == 0.0


ENV = "SGLANG_EXT_MLA_VERIFY"


def test_option_parsing(monkeypatch):
    from sglang_ext.errors import ConfigError
    from sglang_ext.serving import mla_verify

    from sglang_ext import settings
    from sglang_ext.serving import hooks

    def registered():
        return any(h.target.endswith("TritonAttnBackend.forward_extend") for h in
                   hooks.active_hooks(settings.requested()))

    for value, want, chosen in (("", True, "auto"), ("auto", True, "auto"), ("off", False, "extend"),
                                ("extend", False, "extend"), ("decode", True, "decode"), ("DECODE", True, "decode")):
        monkeypatch.setenv(ENV, value)
        assert registered() is want and mla_verify.mode() == chosen
    # a typo must not turn the plugin off at registration (SGLang's loader swallows exceptions there):
    # the hooks are registered and the server start refuses the value
    monkeypatch.setenv(ENV, "fast")
    assert registered()
    with pytest.raises(ConfigError, match="SGLANG_EXT_MLA_VERIFY.*'fast'.*auto, decode, extend"):
        mla_verify.mode()


@pytest.mark.parametrize("value,topk,use_mla,applied", [
    ("", 1, True, True), ("", 4, True, False), ("decode", 4, True, True), ("extend", 1, True, False),
    ("", 1, False, False)])
def test_which_backends_verify_as_decode(monkeypatch, value, topk, use_mla, applied):
    """By default chains of MLA targets; draft trees only with =decode; never a non-MLA target or =extend."""
    import types

    from sglang_ext.serving import mla_verify

    monkeypatch.setenv(ENV, value)
    backend = types.SimpleNamespace(use_mla=use_mla, topk=topk, dcp_size=1, sliding_window_size=None,
                                    _translate_kv_loc=None, page_size=1)
    assert mla_verify.applies(backend) is applied


def test_hooks_name_real_sglang_symbols():
    import importlib

    from sglang_ext.serving import mla_verify

    for hook in mla_verify.HOOKS:
        module, cls, fn = hook.target.rsplit(".", 2)
        assert callable(getattr(getattr(importlib.import_module(module), cls), fn)), hook.target


@pytest.mark.parametrize("value,wrapped", [("decode", True), ("", True), ("extend", False)])
def test_plugin_applies_the_hooks_unless_upstreams_kernel_is_asked_for(value, wrapped):
    code = ("from sglang.srt.plugins import load_plugins; load_plugins(); "
            "from sglang.srt.layers.attention.triton_backend import TritonAttnBackend as B; "
            "print(hasattr(B.forward_extend, '__wrapped__'), hasattr(B.init_forward_metadata_out_graph, '__wrapped__'))")
    p = python_run(["-c", code], timeout=300, env=dict(os.environ, SGLANG_EXT_MLA_VERIFY=value))
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split()[-2:] == [str(wrapped), str(wrapped)]
