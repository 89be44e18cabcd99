import contextlib
import http.server
import json
import os
import sys
import subprocess
import textwrap
import threading

import pytest
from safetensors.torch import save_file

from forkserver import run as python_run  # a fresh interpreter's program, forked from one with SGLang imported

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K_TEST = os.path.join(REPO, "sglang_ext", "data", "gsm8k", "test.jsonl")  # the packaged copy
WORKERS = os.path.join(REPO, "tests", "workers")  # scripts the tests run in processes of their own


@contextlib.contextmanager
def stub_server(handler: type[http.server.BaseHTTPRequestHandler]):
    """A local HTTP server answering with `handler` (a stand-in for what a client talks to: a refusing server, an
    SGLang feature endpoint); yields its base URL, shut down on exit."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_port}"
    finally:
        srv.shutdown()
        srv.server_close()


def write_model_dir(path, config: dict, tensors: dict | None = None):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    if tensors:
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    return str(path)


def kimi_k25_config():
    """Kimi-K2.5's shape: a VL wrapper around a 61-layer DeepseekV3 text model (no weights)."""
    return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "text_config": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
                            "num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840,
                            "num_attention_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
                            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}}


def deepseek_v3_config():
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 61,
            "hidden_size": 7168, "vocab_size": 129280, "num_attention_heads": 128, "q_lora_rank": 1536,
            "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}


def draft_config(arch="LlamaForCausalLMEagle3", hidden=64, vocab=163840, ids=None, convention=None):
    eagle = {"use_aux_hidden_state": True}
    if ids is not None:
        eagle["eagle_aux_hidden_state_layer_ids"] = ids
    if convention is not None:
        eagle["aux_layer_convention"] = convention
    cfg = {"architectures": [arch], "hidden_size": hidden, "vocab_size": vocab, "draft_vocab_size": 32,
           "num_hidden_layers": 1, "num_attention_heads": 2, "eagle_config": eagle}
    return cfg


def write_head(path, fmt="mha", hidden=64, target_hidden=7168, vocab=163840, n_aux=3, draft_vocab=32,
               arch=None, ids=None, convention=None, heads=2, **config_overrides):
    """A complete Eagle3 head (config.json + safetensors in the serving layout, written by the core),
    small (hidden 64) whatever the target's size; eagle_config ids/convention as given."""
    from sglang_ext.config import Eagle3DraftConfig
    from sglang_ext.core.heads import Eagle3Head

    mla = dict(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    cfg = Eagle3DraftConfig(head_format=fmt, hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=heads,
                     vocab_size=vocab, target_hidden_size=target_hidden, num_aux=n_aux, draft_vocab_size=draft_vocab,
                     **(dict(num_key_value_heads=2, head_dim=32) if fmt == "mha" else mla))
    head = Eagle3Head(cfg)
    head.save_pretrained(str(path))
    import dataclasses

    # the config our exporter writes for these ids (eagle_config's, and vLLM's top-level field for a declared
    # convention); an undeclared one is a third-party config with eagle_config's ids alone
    d = dict(dataclasses.replace(cfg, aux_layer_ids=ids, aux_layer_convention=convention).to_dict(),
             **config_overrides)
    if arch:
        d["architectures"] = [arch]
    eagle = {"use_aux_hidden_state": True}
    if ids is not None:
        eagle["eagle_aux_hidden_state_layer_ids"] = ids
    if convention is not None:
        eagle["aux_layer_convention"] = convention
    d["eagle_config"] = eagle
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(d, f)
    return str(path)


@pytest.fixture
def make_draft(tmp_path):
    """make_draft(name, target_hidden, n_aux, arch=..., ids=..., convention=..., vocab=...) -> a head dir."""
    from sglang_ext.config.architectures import MLA_ARCHITECTURES

    def make(name, target_hidden=7168, n_aux=3, arch="LlamaForCausalLMEagle3", vocab=163840, **kw):
        fmt = "mla" if arch in MLA_ARCHITECTURES else "mha"
        return write_head(tmp_path / name, fmt, target_hidden=target_hidden, vocab=vocab, n_aux=n_aux, arch=arch,
                          **kw)
    return make


@pytest.fixture
def run_cli():
    import subprocess

    def run(*args):
        p = subprocess.run([sys.executable, "-m", "sglang_ext", *args], capture_output=True, text=True, cwd=REPO,
                           env=dict(os.environ, SGLANG_EXT_EAGLE3_AUX_LAYERS=""))
        return p.returncode, p.stdout + p.stderr
    return run


def run_py(code: str, fresh: bool = False, **env) -> subprocess.CompletedProcess:
    """`code` as `python -c`: in a fork of an interpreter with SGLang imported (tests/forkserver.py), or with
    `fresh` in a new interpreter (a test of what importing a module imports)."""
    argv, e = ["-c", textwrap.dedent(code)], dict(os.environ, **env)
    if fresh:
        return subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=REPO, env=e, timeout=300)
    return python_run(argv, env=e, cwd=REPO, timeout=300)


def _result(p):
    line = next((l for l in p.stdout.splitlines() if l.startswith("RESULT")), None)
    assert line, p.stdout[-2000:] + p.stderr[-4000:]
    return json.loads(line[len("RESULT"):])


# The serving tests that start a fresh interpreter (SGLang's plugin loader, launch_server's argument parsing) or run
# SGLang's own kernels and controllers on the CPU, 5-25 s each on 2 cores: `make test` runs them, `make test-fast`
# (`-m "not slow"`) leaves them out. Elsewhere such tests carry @pytest.mark.slow themselves.
SLOW_SERVING_MODULES = {"test_plugin.py"}  # every test a fresh interpreter
SLOW_SERVING_TESTS = {
    "test_hooks_name_real_sglang_symbols_and_register_only_with_the_policy",
    "test_adaptive_cost_policy_inside_sglangs_adaptive_controller",
    "test_mla_head_architectures_resolve_to_our_class_and_mla_shapes",
    "test_real_requests_that_stop_inside_an_accepted_run",
    "test_sglangs_own_server_args_run_the_startup_check",
    "test_plugin_applies_the_hooks_unless_upstreams_kernel_is_asked_for",
    "test_hooks_on_sglangs_triton_backend_equal_its_own_verify",
    "test_deterministic_mode_verify_rows_equal_plain_decode_bit_for_bit",
    "test_verify_as_decode_equals_upstreams_extend_kernel",
    "test_flags_in_help_and_config_yaml_reach_the_environment",
    "test_a_tree_server_builds_its_chains_at_topk_1_and_keeps_the_tree_where_it_pays",
    "test_where_the_tree_does_not_pay_the_chain_runs_at_topk_1",
    "test_the_startup_check_refuses_what_the_tree_shape_cannot_serve",
}


# Of those, the ones that read what an SGLang release itself does (its plugin loader, ServerArgs resolution, model
# registry, flag parser, scheduler hooks, the accounting on its request objects): `make test-newest` runs them
# with the fast tests against the newest supported release (`-m "not slow or release"`).
RELEASE_TESTS = {
    "test_plugin_patches_targets_in_a_fresh_interpreter",
    "test_sglangs_own_server_args_run_the_startup_check",
    "test_mla_head_architectures_resolve_to_our_class_and_mla_shapes",
    "test_hooks_name_real_sglang_symbols_and_register_only_with_the_policy",
    "test_real_requests_that_stop_inside_an_accepted_run",
    "test_flags_in_help_and_config_yaml_reach_the_environment",
    "test_a_tree_server_builds_its_chains_at_topk_1_and_keeps_the_tree_where_it_pays",
    "test_where_the_tree_does_not_pay_the_chain_runs_at_topk_1",
    "test_the_startup_check_refuses_what_the_tree_shape_cannot_serve",
}


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        if item.path.parent.name != "serving":
            continue
        name = getattr(item, "originalname", item.name)
        if name in RELEASE_TESTS:
            item.add_marker(pytest.mark.release)
        if item.path.name in SLOW_SERVING_MODULES or name in SLOW_SERVING_TESTS:
            item.add_marker(pytest.mark.slow)
