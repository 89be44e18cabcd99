"""A draft tree among the cost policy's shapes (sglang_ext/serving/draft_shape.py), on the CPU.

SGLang's own ServerArgs (resolved with the plugin's hooks), runtime context, AdaptiveController, adaptive parameters
and EAGLEWorkerV2's state build and switch (built without the workers' __init__, which needs GPUs). The stand-ins are
the GPU parts of a state build: the attention backends and graphs, which record the topk each store held when they
were built."""

import json
import types

import pytest
import torch

from conftest import _result, run_py, write_head, write_model_dir

pytest.importorskip("sglang.srt.speculative.eagle_worker_v2")

TREE_ENV = {"SGLANG_EXT_ADAPTIVE_POLICY": "cost", "SGLANG_EXT_ADAPTIVE_SHAPES": "tree"}


def _built_for_this_release():
    from sglang_ext.serving import compat, draft_shape

    return compat.version() in draft_shape.RELEASES


# the hooks are registered on the releases they are built against only (elsewhere the startup check refuses)
built_against = pytest.mark.skipif(not _built_for_this_release(),
                                   reason="the tree shape's hooks are for another release")

CONTROLLER = """
    import inspect, json, types
    import torch
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.runtime_context import get_spec, publish
    from sglang.srt.speculative.adaptive_runtime_state import AdaptiveController, SpecRuntimeState
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2, EagleDraftWorker
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang_ext.serving import adaptive, compat

    case = json.loads(CASE)
    args = ServerArgs(model_path=case["target"], speculative_algorithm="EAGLE3", device="cpu",
                      speculative_draft_model_path=case["draft"], attention_backend="fa3", disable_cuda_graph=True,
                      speculative_adaptive=True, speculative_eagle_topk=4, speculative_num_steps=3,
                      speculative_num_draft_tokens=8)
    publish(args, role="test")
    built = []
    view = compat.resolved(args)

    def fa3_topk():  # where FA3's backend and the graph runners read topk when built: ServerArgs; 0.5.21+ get_spec()
        return get_spec().speculative_eagle_topk if compat.at_least("0.5.21") else args.speculative_eagle_topk

    def max_draft_tokens():  # what the verify graphs and the KV reserve are sized for
        if compat.at_least("0.5.21"):
            from sglang.srt.runtime_context import max_speculative_num_draft_tokens

            return max_speculative_num_draft_tokens()
        return args.max_speculative_num_draft_tokens

    class Backend:  # an attention backend reads its topk when built (FA3)
        def __init__(self, topk):
            self.topk = topk

    dw = EagleDraftWorker.__new__(EagleDraftWorker)
    dw.server_args, dw.device, dw.topk, dw.speculative_num_steps, dw.speculative_num_draft_tokens = args, "cpu", 4, 3, 8
    dw.draft_runner = types.SimpleNamespace(server_args=args, draft_attn_backend=None, attn_backend=None,
                                            spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE3"),
                                            model_config=types.SimpleNamespace(spec_hidden_size=12,
                                                                               dtype=torch.float32))
    dw.cuda_graph_runner = dw.cuda_graph_runner_for_draft_extend = None
    dw.draft_attn_backend = dw.draft_extend_attn_backend = Backend(4)

    def init_attention_backend():
        built.append({"steps": dw.speculative_num_steps, "draft_worker": dw.topk,
                      "server_args": fa3_topk(), "context": get_spec().speculative_eagle_topk,
                      "tokens": get_spec().speculative_num_draft_tokens})
        dw.draft_attn_backend = dw.draft_extend_attn_backend = Backend(fa3_topk())

    dw.init_attention_backend, dw._capture_cuda_graphs = init_attention_backend, lambda: None
    runner = types.SimpleNamespace(server_args=args, init_new_workspace=False, decode_cuda_graph_runner=None,
                                   attn_backend=Backend(4))
    runner._get_attention_backend = lambda init_new_workspace: Backend(fa3_topk())
    w = EAGLEWorkerV2.__new__(EAGLEWorkerV2)
    w.server_args, w.device, w.gpu_id, w.topk, w.speculative_num_steps, w.speculative_num_draft_tokens = \\
        args, "cpu", 0, 4, 3, 8
    w._draft_worker, w._target_worker = dw, types.SimpleNamespace(model_runner=runner)
    w._additional_graph_memory_usage, w._additional_graph_time_usage = {}, {}
    # what EAGLEWorkerV2.init_cuda_graphs does with adaptive speculation on
    if "policy" in inspect.signature(AdaptiveController.__init__).parameters:  # 0.5.23: the worker passes its policy
        from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

        ctl = AdaptiveController(w, AdaptiveSpeculativeParams(initial_steps=3, cfg_path=None))
    else:
        ctl = AdaptiveController(w, config_path=None)
    ctl.register(SpecRuntimeState(3, 8, dw.draft_attn_backend, None, runner.attn_backend, None,
                                  dw.draft_extend_attn_backend, None))
    ctl.init_states(cuda_graph_bs=None)

    def now():
        return {"shape": [w.topk, w.speculative_num_steps, w.speculative_num_draft_tokens],
                "draft_worker": [dw.topk, dw.speculative_num_steps, dw._sglang_ext_draft_topk],
                "backends": [runner.attn_backend.topk, dw.draft_attn_backend.topk],
                "chain_buffers": list(dw._topk1_score_indices_prealloc.shape)}

    out = {"built": built, "after_init": now(), "tokens": view.speculative_num_draft_tokens,
           "stores": [fa3_topk(), get_spec().speculative_eagle_topk],
           "max_draft_tokens": max_draft_tokens()}
    ran, alloc_lens = [], set()  # the KV one request may allocate per decode step, under each state that ran
    from sglang.srt.mem_cache import allocation_sizing
    for step in range(400):  # 8 requests per step; accepted drafts and step ms per verified-token count
        ctl.activate_step_by_batch(8)
        n = w.speculative_num_draft_tokens
        adaptive.CLOCK.draft_tokens, adaptive.CLOCK.seconds = n, case["ms"][str(n)] / 1e3
        ran.append(n)
        alloc_lens.add(allocation_sizing.get_alloc_len_per_decode())
        ctl.on_verify_complete([case["accepted"][str(n)]] * 8, batch_size=8)
    out["ran"], out["last"], out["alloc_lens"] = sorted(set(ran)), now(), sorted(alloc_lens)
    result = types.SimpleNamespace(next_draft_input=types.SimpleNamespace())
    batch = types.SimpleNamespace(seq_lens=torch.zeros(3, dtype=torch.int64))
    w._stub_skipped_draft_extend(batch, result)  # depth 0's stub for a skipped draft extend
    out["stub_width"] = [result.next_draft_input.topk_p.shape[-1], w.topk]
    out["tree_share_last_100"] = sum(n == 8 for n in ran[-100:]) / 100
    print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pair")
    target = write_model_dir(tmp / "t", {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 8,
        "hidden_size": 64, "vocab_size": 100, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
        "v_head_dim": 16, "num_attention_heads": 4, "intermediate_size": 128})
    draft = write_head(tmp / "d", "mha", hidden=64, target_hidden=64, vocab=100, draft_vocab=None, ids=[1, 3, 5],
                       convention="output")
    return str(target), str(draft)


def _controller(pair, accepted, ms):
    case = {"target": pair[0], "draft": pair[1], "accepted": accepted, "ms": ms}
    return _result(run_py(CONTROLLER.replace("CASE", repr(json.dumps(case))), **TREE_ENV))


@built_against
def test_a_tree_server_builds_its_chains_at_topk_1_and_keeps_the_tree_where_it_pays(pair):
    """The tree verifies 8 tokens and accepts 3 drafts in 14 ms; chain depth 3 accepts 1 in 13 ms."""
    r = _controller(pair, accepted={"8": 3, "4": 1, "2": 1, "1": 0}, ms={"8": 14, "4": 13, "2": 11, "1": 10})
    # every candidate depth built as a chain: topk 1 in each store its backends and graphs read, its own tokens
    assert [b["steps"] for b in r["built"]] == [0, 1, 3]
    for b in r["built"]:
        assert (b["draft_worker"], b["server_args"], b["context"], b["tokens"]) == (1, 1, 1, b["steps"] + 1), b
    # the server runs as it started: the tree, its backends, and the stores back at its topk; sized for 8 tokens
    assert r["after_init"] == {"shape": [4, 3, 8], "draft_worker": [4, 3, 4], "backends": [4, 4],
                               "chain_buffers": [48, 3]}
    assert r["stores"] == [4, 4] and r["max_draft_tokens"] == 8 and r["tokens"] == 8
    assert r["ran"] == [1, 2, 4, 8] and r["tree_share_last_100"] == 1.0  # each depth measured, then the tree
    # the KV reserve per decode step stays the tree's under every state: a reserve taken under one state is spent by
    # the next (0.5.23 reads it per batch from the context, where depth 0 and 1 would reserve 8, not 12)
    assert r["alloc_lens"] == [12]


@built_against
def test_where_the_tree_does_not_pay_the_chain_runs_at_topk_1(pair):
    """The same accepted drafts on the tree and the chain; the tree's step costs twice the chain's."""
    r = _controller(pair, accepted={"8": 2, "4": 2, "2": 1, "1": 0}, ms={"8": 26, "4": 13, "2": 11, "1": 10})
    assert r["last"] == {"shape": [1, 3, 4], "draft_worker": [4, 3, 1], "backends": [1, 1], "chain_buffers": [48, 3]}
    assert r["tree_share_last_100"] == 0.0
    assert r["stub_width"] == [4, 1]  # the draft input keeps the tree's width on a chain state


def test_a_chain_state_drafts_at_topk_1_from_the_first_column():
    """The draft input keeps the tree's width (every draft extend emits it: the overlap scheduler's buffers hold one
    width); a chain state's draft reads the top-1 column at topk 1, and the worker is as it was afterwards."""
    from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker

    from sglang_ext.serving import draft_shape

    dw = EagleDraftWorker.__new__(EagleDraftWorker)
    dw.topk, dw._sglang_ext_draft_topk = 4, 1
    p = torch.tensor([[0.5, 0.25, 0.125, 0.0625], [0.75, 0.125, 0.0625, 0.03125]])
    index = torch.tensor([[7, 3, 9, 1], [4, 8, 2, 6]])
    batch = types.SimpleNamespace(spec_info=types.SimpleNamespace(topk_p=p, topk_index=index))
    seen = []
    draft_shape.draft(lambda self, b: seen.append((self.topk, b.spec_info.topk_p.tolist(),
                                                   b.spec_info.topk_index.tolist())), dw, batch)
    assert seen == [(1, [[0.5], [0.75]], [[7], [4]])]
    assert dw.topk == 4 and batch.spec_info.topk_p is p and batch.spec_info.topk_index is index
    dw._sglang_ext_draft_topk = 4  # the tree's state: upstream's draft untouched
    draft_shape.draft(lambda self, b: seen.append(b.spec_info.topk_p.shape[-1]), dw, batch)
    assert seen[-1] == 4


STARTUP = """
    import json
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import ServerArgs
    from sglang_ext.serving import compat
    case, out = json.loads(CASE), {}
    for name, extra in case["servers"].items():
        try:
            a = ServerArgs(model_path=case["target"], speculative_algorithm="EAGLE3", device="cpu",
                           speculative_draft_model_path=case["draft"], **extra)
            if compat.at_least("0.5.21"):  # construction no longer resolves: what launchers call next
                from sglang.srt.arg_groups.overrides import max_speculative_num_draft_tokens

                a.resolve_once()
                top = max_speculative_num_draft_tokens(a)
            else:
                top = a.max_speculative_num_draft_tokens
            v = compat.resolved(a)
            out[name] = [v.speculative_adaptive, v.speculative_eagle_topk, v.speculative_num_draft_tokens, top]
        except Exception as e:
            out[name] = [type(e).__name__, getattr(e, "field", None), str(e)]
    print("RESULT" + json.dumps(out))
"""


@built_against
def test_the_startup_check_refuses_what_the_tree_shape_cannot_serve(pair):
    tree = {"speculative_adaptive": True, "speculative_eagle_topk": 4, "speculative_num_steps": 3,
            "speculative_num_draft_tokens": 8, "attention_backend": "fa3"}
    servers = {"tree on fa3": tree, "chain": {**tree, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4},
               "triton": {**tree, "attention_backend": "triton"},
               "no --speculative-adaptive": {**tree, "speculative_adaptive": False},
               "same tokens as depth 3": {**tree, "speculative_num_draft_tokens": 4}}
    case = {"target": pair[0], "draft": pair[1], "servers": servers}
    r = _result(run_py(STARTUP.replace("CASE", repr(json.dumps(case))), **TREE_ENV))
    assert r["tree on fa3"] == [True, 4, 8, 8]  # adaptive stays on, the tree's 8 tokens kept and sized for
    kind, field, text = r["chain"]
    assert (kind, field) == ("ConfigError", "--speculative-eagle-topk") and "started as the tree" in text
    kind, field, text = r["triton"]
    assert field == "--attention-backend" and "'triton'" in text and "--attention-backend fa3" in text
    assert "--speculative-draft-attention-backend" not in text  # the draft's backend is the target's: named once
    kind, field, text = r["no --speculative-adaptive"]
    assert field == "--speculative-adaptive-shapes (SGLANG_EXT_ADAPTIVE_SHAPES)" and "--speculative-adaptive" in text
    kind, field, text = r["same tokens as depth 3"]
    assert field == "--speculative-adaptive-config" and "offers depth 3" in text and "4x3x4" in text
    # without the option the tree under the cost policy is refused as before, now naming the option as a way out
    r = _result(run_py(STARTUP.replace("CASE", repr(json.dumps({**case, "servers": {"tree": tree}}))),
                       SGLANG_EXT_ADAPTIVE_POLICY="cost"))
    kind, field, text = r["tree"]
    assert field == "--speculative-adaptive-policy (SGLANG_EXT_ADAPTIVE_POLICY)"
    assert "--speculative-adaptive-shapes tree" in text


def test_a_release_other_than_the_one_it_is_built_against_is_refused():
    from types import SimpleNamespace

    from sglang_ext import settings
    from sglang_ext.serving import draft_shape

    s = settings.Settings(adaptive_policy="cost", adaptive_shapes="tree")
    args = SimpleNamespace(speculative_adaptive=True, speculative_eagle_topk=4, speculative_num_steps=3,
                           speculative_num_draft_tokens=8, attention_backend="fa3", page_size=1)
    assert draft_shape.server_problems(args, s, "0.5.17") == []
    assert draft_shape.server_problems(args, s, "0.5.23") == []
    (warning,) = draft_shape.server_warnings(args, s, "0.5.23")  # served, saying what was checked where
    assert "0.5.23" in warning and "checked on 0.5.17 only" in warning
    assert "--speculative-adaptive-shapes chain" in warning
    assert draft_shape.server_warnings(args, s, "0.5.17") == []
    (error,) = draft_shape.server_problems(args, s, "0.5.20")  # a release whose adaptive states were not read
    assert error.field == "--speculative-adaptive-shapes (SGLANG_EXT_ADAPTIVE_SHAPES)" and "0.5.20" in error.problem
    assert "0.5.17, 0.5.23" in error.problem
    assert "--speculative-adaptive-shapes chain" in error.fix
    (error,) = draft_shape.server_problems(SimpleNamespace(**{**vars(args), "pp_size": 2}), s, "0.5.17")
    assert error.field == "--pp-size" and "last pipeline stage" in error.problem and "--pp-size 1" in error.fix
    (error,) = draft_shape.server_problems(SimpleNamespace(**{**vars(args), "enable_dp_attention": True}), s, "0.5.17")
    assert error.field == "--enable-dp-attention" and "DP ranks" in error.problem
    (error,) = draft_shape.server_problems(SimpleNamespace(**{**vars(args), "speculative_num_steps": 2,
                                                              "speculative_num_draft_tokens": 6}), s, "0.5.17")
    assert error.field == "--speculative-num-steps" and "[0, 1, 3]" in error.problem
    assert draft_shape.server_problems(args, settings.Settings(), "0.5.23") == []  # not asked for: nothing
