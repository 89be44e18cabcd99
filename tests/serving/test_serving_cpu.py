"""The SGLang adapters on the CPU, as far as SGLang 0.5.17 runs there: acceptance accounting on real
`Req` objects with the plugin's hooks applied by SGLang's own `load_plugins()`, the decode log
fields, per-request meta_info fields, MLA head architecture resolution, and startup refusals."""

import json
import re
import logging

import pytest

from conftest import write_head
from sglang_ext.errors import ConfigError
from sglang_ext.core.accounting import AcceptanceStats, apply_stop_truncation, stop_truncation
from sglang_ext.serving import acceptance

sglang = pytest.importorskip("sglang")
from conftest import _result, run_py  # noqa: E402


def test_stop_truncation_by_hand():
    # steps accepted 3, 0, 2, 3 drafts; max_new_tokens 10: prefill 1 + 4 + 1 + 3 = 9 emitted, the last step
    # emits only 1 of its 4 tokens, so its a is 0 and 3 accepted drafts were discarded
    assert stop_truncation(correct_drafts=8, verify_steps=4, completion_tokens=10, last_step_drafts=3) == 3
    hist = [1, 0, 1, 2]
    apply_stop_truncation(hist, 3, 3)
    assert hist == [2, 0, 1, 1]
    assert stop_truncation(8, 4, 13, 3) == 0  # nothing cut
    assert stop_truncation(8, 4, 15, 3) == 0  # more tokens than steps explain (a re-prefilled request): left alone
    s = AcceptanceStats.from_histogram([2, 0, 1, 1])
    assert (s.depth, s.accepted_drafts, s.verify_steps, s.emitted_tokens + 1) == (3, 5, 4, 10)
    assert AcceptanceStats.from_histogram([5, 1], depth=3).histogram_counts == [5, 1, 0, 0]
    assert s.resized(5).histogram_counts == [2, 0, 1, 1, 0, 0]
    with pytest.raises(ValueError):
        s.resized(2)


def test_request_fields_follow_the_invariant():
    # 10 completion tokens over 4 verify steps: 10 - 1 (prefill token) - 4 (one non-draft token per step) = 5
    f = acceptance.request_fields(completion_tokens=10, verify_steps=4, histogram=[2, 0, 1, 1], depth=3)
    assert f["spec_accepted_drafts_per_step"] == 1.25 and f["spec_tokens_per_step"] == 2.25
    assert f["spec_draft_acceptance_rate"] == 5 / 12
    assert f["spec_position_accepted"] == [2, 2, 1]  # steps with a >= 1, 2, 3
    tree = acceptance.request_fields(10, 4, [2, 0, 1, 1], depth=3)
    assert tree["spec_draft_acceptance_rate"] == f["spec_draft_acceptance_rate"]  # same denominator for trees


def test_decode_log_line_keeps_upstream_fields_and_adds_ours():
    led = acceptance.ledger()
    led.take_interval()
    led.add_live_steps([1, 2, 0, 3])
    rec = logging.LogRecord("x", logging.INFO, "f", 1, "Decode batch, #running-req: 4, accept len: 2.50, "
                            "accept rate: 0.50, #queue-req: 0", None, None)
    acceptance.DecodeLogFields().filter(rec)
    assert rec.msg.startswith("Decode batch, #running-req: 4, accept len: 2.50")
    assert "accepted drafts/step: 1.50 (no bonus; 4 req-steps)" in rec.msg
    assert "per-position P(a>=i): [0.75, 0.50, 0.25]" in rec.msg
    assert led.take_interval().verify_steps == 0  # the interval restarts after each line
    other = logging.LogRecord("x", logging.INFO, "f", 1, "Prefill batch, #new-seq: 1", None, None)
    acceptance.DecodeLogFields().filter(other)
    assert other.msg == "Prefill batch, #new-seq: 1"


REQ = """
    import json
    from array import array
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang_ext.serving import acceptance

    def run(steps, max_new, stop=None, tokens=None, abort_at=None):
        sp = SamplingParams(max_new_tokens=max_new, temperature=0, stop_token_ids=stop)
        sp.normalize(None)
        r = Req("r", "", array("i", [5, 6, 7]), sp, vocab_size=100)
        r.output_ids.extend([11]); r.update_finish_state(1)  # the prefill token
        for k, a in enumerate(steps):
            if r.finished():
                break
            r.spec_verify_ct += 1; r.spec_num_correct_drafts += a; r.update_spec_correct_drafts_histogram(a)
            run_tokens = (tokens or {}).get(k, [20] * (a + 1))
            if k == abort_at:  # the client went away (AbortReq): the scheduler finishes it as aborted
                r.to_finish = FINISH_ABORT()
            r.output_ids.extend(run_tokens); r.update_finish_state(a + 1)
        return [r.finished(), len(r.output_ids_through_stop), r.spec_num_correct_drafts, r.spec_verify_ct,
                list(r.spec_correct_drafts_histogram)]

    out = {"length": run([3, 0, 2, 3], 10),
           "eos": run([3, 3], 50, stop=[99], tokens={1: [20, 99, 20, 20]}),
           "exact": run([3, 3], 9), "aborted": run([3, 3, 3], 50, abort_at=1)}
    # as in an EAGLE3 server's scheduler: a request finished at prefill counts (it answered a client), SGLang's own
    # prefix-caching request ahead of an n > 1 request's samples (max_new_tokens 0) does not
    from types import SimpleNamespace
    acceptance._server_args = lambda: SimpleNamespace(speculative_algorithm="EAGLE3")
    out["at_prefill"] = run([], 1)
    out["prefix_for_n"] = run([], 0)
    out["ledger"] = acceptance.ledger().to_dict()
    print("RESULT" + json.dumps(out))
"""


def test_real_requests_that_stop_inside_an_accepted_run():
    r = _result(run_py(REQ, SGLANG_PLUGINS="sglang_eagle3_mla"))
    # max_new_tokens cuts the 4th step after 1 of its 4 tokens: its a is 0 (was 3)
    assert r["length"] == [True, 10, 5, 4, [2, 0, 1, 1]]
    # EOS (stop id 99) is the 2nd token of the 2nd step's run: that step emitted 2 tokens, a = 1
    assert r["eos"] == [True, 7, 4, 2, [0, 1, 0, 1]]
    # a run that ends exactly at max_new_tokens is not cut
    assert r["exact"] == [True, 9, 6, 2, [0, 0, 0, 2]]
    for _, completion, accepted, steps, _ in (r["length"], r["eos"], r["exact"]):
        assert completion == accepted + steps + 1  # the invariant, per request
    led = r["ledger"]
    # an aborted request gets no meta_info: it is counted as aborted, and none of its steps in the totals, so that
    # /metrics and /get_server_info still equal the sum of what the clients received
    assert r["aborted"][0] is True and led["aborted_requests"] == 1
    assert r["at_prefill"][0] is True and r["prefix_for_n"][0] is True
    assert led["finished_requests"] == 3 + 1 and led["accepted_drafts"] == 5 + 4 + 6 and led["verify_steps"] == 8
    assert led["discarded_drafts"] == 3 + 2
    assert led["histogram_counts"] == [2, 1, 1, 4]


ARCH = """
    import json, sys
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig
    from sglang.srt.model_loader.utils import get_model_architecture
    out = {}
    for name, path in json.loads(sys.argv[1]).items():
        mc = ModelConfig(path, is_draft_model=True)
        cls, arch = get_model_architecture(mc)
        out[name] = [mc.attention_arch == AttentionArch.MLA, getattr(mc, "kv_lora_rank", None), cls.__name__,
                     mc.hf_config.architectures[0]]
    print("RESULT" + json.dumps(out))
"""


def test_mla_head_architectures_resolve_to_our_class_and_mla_shapes(tmp_path):
    heads = {
        "v2-name": write_head(tmp_path / "a", "mla", hidden=64, target_hidden=64, vocab=100, draft_vocab=None),
        "v3-name": write_head(tmp_path / "b", "mla", hidden=64, target_hidden=64, vocab=100, draft_vocab=None,
                              arch="Eagle3DeepseekV3ForCausalLM"),
        "mha": write_head(tmp_path / "c", "mha", hidden=64, target_hidden=64, vocab=100, draft_vocab=None),
    }
    code = ARCH.replace("json.loads(sys.argv[1])", f"json.loads({json.dumps(json.dumps(heads))})")
    r = _result(run_py(code, SGLANG_PLUGINS="sglang_eagle3_mla"))
    assert r["v2-name"] == [True, 32, "Eagle3MLAHeadForCausalLM", "Eagle3DeepseekV2ForCausalLM"]
    # a name upstream does not list is still MLA (latent KV pool): SGLang reads it under upstream's name
    assert r["v3-name"] == [True, 32, "Eagle3MLAHeadForCausalLM", "Eagle3DeepseekV2ForCausalLM"]
    assert r["mha"][0] is False and r["mha"][2] == "LlamaForCausalLMEagle3"


def test_startup_refuses_a_bad_pair_before_loading(tmp_path, monkeypatch):
    """The startup check (after ServerArgs resolution, before any model is built) refuses the pair, the option values
    and the backend combinations a server would fail on later -- each with field, value and fix."""
    from types import SimpleNamespace

    from conftest import write_model_dir
    from sglang_ext.serving import startup

    monkeypatch.setattr(startup.hooks, "missing_symbols", lambda s: [])  # no SGLang patched in this process
    target = write_model_dir(tmp_path / "t", {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 8,
                                              "hidden_size": 64, "vocab_size": 100, "kv_lora_rank": 32,
                                              "qk_rope_head_dim": 8, "num_attention_heads": 4})
    good = write_head(tmp_path / "good", "mha", hidden=64, target_hidden=64, vocab=100, draft_vocab=None,
                      ids=[1, 3, 5], convention="output")

    def args(draft, **kw):
        return SimpleNamespace(**{"speculative_algorithm": "EAGLE3", "model_path": target, "tp_size": 1,
                                  "speculative_draft_model_path": draft, "attention_backend": None,
                                  "speculative_eagle_topk": 1, **kw})

    def refusal(a):
        with pytest.raises(ConfigError) as e:
            startup.validate(a)
        return e.value

    startup.validate(args(good))
    bad = write_head(tmp_path / "bad", "mha", hidden=64, target_hidden=64, vocab=128, draft_vocab=None,
                     ids=[1, 3, 5], convention="output")
    e = refusal(args(bad))
    assert e.field == "draft.vocab_size" and "100" in e.problem
    monkeypatch.setenv("SGLANG_EXT_DRAFT_KV_CACHE_DTYPE", "fp4")
    e = refusal(args(good))
    assert e.field == "--speculative-draft-kv-cache-dtype (SGLANG_EXT_DRAFT_KV_CACHE_DTYPE)" and "fp8_e4m3" in e.fix
    monkeypatch.delenv("SGLANG_EXT_DRAFT_KV_CACHE_DTYPE")
    # out-of-range aux layers from the operator's option
    monkeypatch.setenv("SGLANG_EXT_EAGLE3_AUX_LAYERS", "1,3,8")
    assert "out of range" in refusal(args(good)).problem
    monkeypatch.delenv("SGLANG_EXT_EAGLE3_AUX_LAYERS")
    # on the Triton backend, a latent its MLA decode kernel cannot tile is refused here, not in graph capture
    e = refusal(args(good, attention_backend="triton"))
    assert e.field == "target.kv_lora_rank" and "Triton" in e.problem
    startup.validate(args(good, attention_backend="flashinfer"))
    # draft trees on FlashInfer under an MLA target: refused (wrong answers measured on an H200), with the way out
    e = refusal(args(good, attention_backend="flashinfer", speculative_eagle_topk=4))
    assert e.field == "--speculative-eagle-topk" and "flashinfer" in e.problem and "fa3" in e.fix
    startup.validate(args(good, attention_backend="fa3", speculative_eagle_topk=4))
    # FlashMLA: an MHA head does not start there, nor adaptive drafting (both measured on an H200): refused with the
    # way out; an MLA head's chain is accepted
    e = refusal(args(good, attention_backend="flashmla"))
    assert e.field == "--attention-backend" and "MHA-format" in e.problem and "MLA-format head" in e.fix
    e = refusal(args(good, attention_backend="fa3", speculative_draft_attention_backend="flashmla"))
    assert e.field == "--speculative-draft-attention-backend"
    mla = write_head(tmp_path / "mla", "mla", hidden=64, target_hidden=64, vocab=100, draft_vocab=None,
                     ids=[1, 3, 5], convention="output")
    startup.validate(args(mla, attention_backend="flashmla"))
    e = refusal(args(mla, attention_backend="flashmla", speculative_adaptive=True))
    assert e.field == "--speculative-adaptive" and "fa3" in e.fix
    startup.validate(args(mla, attention_backend="fa3", speculative_adaptive=True))
    # a TP size the head counts cannot split (target 4 heads, draft 2): named at startup, not a bare assert
    e = refusal(args(good, tp_size=4))
    assert e.field == "--tp-size" and "draft's 2 attention heads" in e.problem
    # with DP attention the attention splits over tp / dp = 2 ranks: accepted
    startup.validate(args(good, tp_size=4, enable_dp_attention=True, dp_size=2))
    # ... but the cost policy there: SGLang turns adaptive speculation off under attention DP (no protection would run)
    monkeypatch.setenv("SGLANG_EXT_ADAPTIVE_POLICY", "cost")
    dp = dict(tp_size=4, enable_dp_attention=True, dp_size=2, speculative_adaptive=True)
    e = refusal(args(good, **dp))
    assert e.field.startswith("--speculative-adaptive-policy") and "attention DP" in e.fix, e
    startup.validate(args(good, **{**dp, "enable_dp_attention": False, "tp_size": 1}))
    monkeypatch.delenv("SGLANG_EXT_ADAPTIVE_POLICY")
    # a draft not readable yet (a hub id not in the cache): the capture hook checks it at target load
    startup.validate(args("no-such-org/no-such-draft"))


def test_startup_names_a_hook_sglang_could_not_apply(monkeypatch):
    """SGLang logs and skips a hook target it cannot resolve; the plugin refuses to start instead, naming the SGLang
    release, the symbol and the feature that would silently be off."""
    from sglang_ext import settings
    from sglang_ext.serving import hooks

    gone = "sglang.srt.managers.schedule_batch.Req.update_finish_state"
    errors = hooks.missing_symbols(settings.Settings(), is_applied=lambda target: target != gone)
    assert len(errors) == 1 and errors[0].field == "sglang" and gone in errors[0].problem
    assert "acceptance counters" in errors[0].problem and "0.5.17" in errors[0].fix
    # opt-in hooks count only where their option asks for them
    assert not hooks.missing_symbols(settings.Settings(), is_applied=lambda t: "adaptive" not in t)
    assert hooks.missing_symbols(settings.Settings(adaptive_policy="cost"), is_applied=lambda t: "adaptive" not in t)


ADAPTIVE = """
    import json
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams
    from sglang_ext.serving import adaptive
    params = AdaptiveSpeculativeParams(initial_steps=3, cfg_path=None)
    out = {"candidates": params.candidate_steps, "start": params.get_steps_for_batch(1)}
    for step in range(60):  # a draft that never accepts, 8 requests per step, k=3 steps take 13 ms, k=0 10 ms
        k = params.get_steps_for_batch(8)
        adaptive.CLOCK.draft_tokens, adaptive.CLOCK.seconds = k + 1, (10 + k) / 1e3
        params.on_verify_complete([0] * 8, batch_size=8)
    out["after_zero_acceptance"] = [params.get_steps_for_batch(8), params.get_steps_for_batch(1)]
    logged = []
    adaptive._log = logged.append
    adaptive.SUMMARY_EVERY_S = 0.0  # the periodic summary line, now
    params.on_verify_complete([0] * 8, batch_size=8)
    out["summary"] = [x for x in logged if "summary" in x]
    adaptive.CLOCK.draft_tokens, adaptive.CLOCK.seconds = 4, None  # batch 1's first verify step, at depth 3
    params.on_verify_complete([0], batch_size=1)
    out["batch_1_after_one_step"] = params.get_steps_for_batch(1)
    out["switch_lines"] = [x for x in logged if "request-steps" in x]
    print("RESULT" + json.dumps(out))
"""


def test_adaptive_cost_policy_inside_sglangs_adaptive_controller():
    r = _result(run_py(ADAPTIVE, SGLANG_PLUGINS="sglang_eagle3_mla", SGLANG_EXT_ADAPTIVE_POLICY="cost"))
    assert r["candidates"] == [0, 1, 3] and r["start"] == 3  # our default offers 0 at every batch size
    assert r["after_zero_acceptance"] == [0, 3]  # batch 8 stopped drafting; batch 1 saw no steps yet
    # where the steps went and what each depth cost, as measured (10 ms at depth 0, 13 ms at depth 3)
    (line,) = r["summary"]
    assert "batch 8-8" in line and "depth 0: 10.00 ms" in line and "depth 3: 13.00 ms" in line
    steps = dict(re.findall(r"depth (\d): (\d+)", line.split("steps [")[1].split("]")[0]))
    assert int(steps["0"]) > int(steps["3"]) > 0 and "now depth 0, next probe after 256 steps at depth 0" in line
    # batch 1, reached after acceptance collapsed at batch 8, stops at its first step (shared acceptance window)
    assert r["batch_1_after_one_step"] == 0 and "no draft accepted in the last 65 request-steps (9 steps)" in r["switch_lines"][0]
    r = _result(run_py(ADAPTIVE, SGLANG_PLUGINS="sglang_eagle3_mla"))  # without the variable: upstream's policy
    from sglang_ext.serving import compat

    assert r["candidates"] == ([0, 1, 3, 5, 7] if compat.at_least("0.5.21") else [0, 1, 3, 7])  # upstream's defaults


STARTUP = """
    import json, sys
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import ServerArgs
    import logging
    from sglang_ext.serving import compat
    warned = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("sglang_ext.serving.startup").addHandler(handler)
    out = {}
    for name, (draft, extra) in json.loads(sys.argv[1])["drafts"].items():
        warned.clear()
        try:
            args = ServerArgs(model_path=json.loads(sys.argv[1])["target"], speculative_algorithm="EAGLE3",
                              speculative_draft_model_path=draft, device="cpu", **extra)
            if compat.at_least("0.5.21"):  # construction no longer resolves: what launchers call next
                args.resolve_once()
            out[name] = None
        except Exception as e:
            out[name] = [type(e).__name__, getattr(e, "field", None), getattr(e, "problem", str(e))]
        out[name + " warnings"] = list(warned)
    print("RESULT" + json.dumps(out))
"""


def test_sglangs_own_server_args_run_the_startup_check(tmp_path):
    """With the plugin loaded, building SGLang's ServerArgs (what launch_server and Engine do first; from SGLang 0.5.21
    building and resolving it) refuses a bad pair before any model exists -- and accepts a good one: every hook
    applied in that process."""
    from conftest import write_model_dir

    target = write_model_dir(tmp_path / "t", {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 8,
        "hidden_size": 64, "vocab_size": 100, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
        "v_head_dim": 16, "num_attention_heads": 4, "intermediate_size": 128})
    good = write_head(tmp_path / "good", "mha", hidden=64, target_hidden=64, vocab=100, draft_vocab=None,
                      ids=[1, 3, 5], convention="output")
    bad = write_head(tmp_path / "bad", "mha", hidden=64, target_hidden=64, vocab=128, draft_vocab=None,
                     ids=[1, 3, 5], convention="output")
    r = _result(run_py(_startup_program(target, {"good": (good, {}), "bad": (bad, {})})))
    assert r["good"] is None and r["bad"][:2] == ["ConfigError", "draft.vocab_size"]
    # the cost policy where SGLang turns adaptive speculation off (it would log a warning and serve the tree
    # unprotected): refused at the same point, with SGLang's reason; a chain is accepted
    chain = {"speculative_adaptive": True, "speculative_num_steps": 3, "speculative_eagle_topk": 1,
             "speculative_num_draft_tokens": 4}
    tree = {**chain, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8}
    cases = {"chain": (good, chain), "tree": (good, tree),
             "tree, no --speculative-adaptive": (good, {**tree, "speculative_adaptive": False})}
    r = _result(run_py(_startup_program(target, cases), SGLANG_EXT_ADAPTIVE_POLICY="cost"))
    assert r["chain"] is None
    for case in ("tree", "tree, no --speculative-adaptive"):
        kind, field, problem = r[case]
        assert (kind, field) == ("ConfigError", "--speculative-adaptive-policy (SGLANG_EXT_ADAPTIVE_POLICY)")
        assert "speculative_eagle_topk=4" in problem and "no protection" in problem, problem
    # a running limit above the largest decode graph: a warning naming both and the fix (graphs to 64 with 128
    # running ran 94% of an H200 soak's decode batches eagerly); none where the graphs reach the limit
    graphs = {"cuda_graph_bs_decode": [1, 2, 4, 8, 16, 32, 64]}
    cases = {"tree": (good, tree), "short graphs": (good, {**graphs, "max_running_requests": 128}),
             "graphs to the limit": (good, {**graphs, "max_running_requests": 64})}
    r = _result(run_py(_startup_program(target, cases)))
    assert r["tree"] is None  # without the policy: upstream's fallback to the fixed tree
    assert r["short graphs"] is None and r["graphs to the limit"] is None
    (line,) = [w for w in r["short graphs warnings"] if "CUDA graph" in w]
    assert "--max-running-requests 128" in line and "(64 requests)" in line and "65-128" in line
    assert "--cuda-graph-bs-decode" in line
    assert not any("CUDA graph" in w for w in r["graphs to the limit warnings"])


def _startup_program(target: str, drafts: dict) -> str:
    """STARTUP for `drafts` ({case: (draft dir, extra ServerArgs fields)}) against `target`."""
    payload = json.dumps(json.dumps({"target": target, "drafts": drafts}))
    return STARTUP.replace("json.loads(sys.argv[1])", f"json.loads({payload})")


def test_an_mla_head_without_q_lora_rank_gets_the_plain_q_layer_and_others_upstreams(monkeypatch):
    """The hook on upstream's Eagle3MLADecoderLayer.__init__ builds the plain-q layer only for q_lora_rank null; a
    head with a query low-rank goes to upstream's own constructor untouched."""
    from types import SimpleNamespace

    from sglang_ext.serving import mla_head, registry

    built = []
    monkeypatch.setattr(mla_head, "init_plain_q", lambda self, config, *a, **k: built.append(("plain", k)))
    upstream = lambda self, config, *a, **k: built.append(("upstream", k))  # noqa: E731
    registry.layer_init(upstream, object(), SimpleNamespace(q_lora_rank=None), layer_id=0, prefix="model.midlayer")
    registry.layer_init(upstream, object(), SimpleNamespace(q_lora_rank=1536), layer_id=0, prefix="model.midlayer")
    assert built == [("plain", {"layer_id": 0, "prefix": "model.midlayer"}),
                     ("upstream", {"layer_id": 0, "prefix": "model.midlayer"})]
