"""Depth 0 of adaptive speculation as a plain decode step (sglang_ext/serving/decode_depth0.py), on the CPU.

SGLang's own ScheduleBatch, SamplingBatchInfo, EAGLEWorkerV2 (built without its __init__, which needs GPUs)
and upstream's draft-extend stub; the target worker is the one stand-in: it records the batch it is asked to
decode and samples a known token (the GPU forward is what the benchmark and the serving checks measure)."""

import dataclasses
import os
import types

import pytest
import torch

from sglang_ext.errors import ConfigError

sglang = pytest.importorskip("sglang.srt.speculative.eagle_worker_v2")

from sglang.srt.layers.logits_processor import LogitsProcessorOutput  # noqa: E402
from sglang.srt.managers.schedule_batch import ScheduleBatch  # noqa: E402
from sglang.srt.managers.utils import GenerationBatchResult  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode  # noqa: E402
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo  # noqa: E402
from sglang.srt.speculative.eagle_info import EagleDraftInput  # noqa: E402
from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2  # noqa: E402

from sglang_ext.serving import decode_depth0  # noqa: E402
from conftest import python_run  # noqa: E402

VOCAB, HIDDEN = 50, 12


class RecordingTarget:
    """Samples token (input + 7) % VOCAB for every request and keeps what it was given."""

    def __init__(self, runner):
        self.model_runner = types.SimpleNamespace(decode_cuda_graph_runner=runner)
        self.seen = None

    def forward_batch_generation(self, batch, capture_hidden_mode=None):
        self.seen = dict(mode=batch.forward_mode, input_ids=batch.input_ids.clone(),
                         out_cache_loc=batch.out_cache_loc.clone(), seq_lens=batch.seq_lens.clone(),
                         seq_lens_cpu=None if batch.seq_lens_cpu is None else batch.seq_lens_cpu.clone(),
                         seq_lens_sum=batch.seq_lens_sum,
                         spec_info=batch.spec_info, capture_hidden_mode=capture_hidden_mode)
        logits = torch.zeros(len(batch.seq_lens), VOCAB)
        return GenerationBatchResult(logits_output=LogitsProcessorOutput(next_token_logits=logits),
                                     next_token_ids=((batch.input_ids + 7) % VOCAB).to(torch.int32),
                                     can_run_cuda_graph=True)


def plain_runner(max_bs=8):
    runner = object.__new__(decode_depth0.plain_decode_runner_class())  # its __init__ captures graphs (GPU)
    runner.max_bs, runner.require_mlp_sync = max_bs, False
    return runner


def make_worker(runner, steps=0):
    worker = object.__new__(EAGLEWorkerV2)
    worker.topk, worker.device, worker.speculative_num_steps = 1, "cpu", steps
    worker.adaptive_controller = None  # the controller's choice is what speculative_num_steps says here
    worker.req_to_token_pool = types.SimpleNamespace(
        req_to_token=torch.arange(4 * 32, dtype=torch.int32).view(4, 32) + 1000)
    worker._target_worker = RecordingTarget(runner)
    draft_runner = types.SimpleNamespace(
        spec_algorithm=types.SimpleNamespace(is_standalone=lambda: False),
        model_config=types.SimpleNamespace(spec_hidden_size=HIDDEN, dtype=torch.bfloat16))
    # the draft's TP placement: SGLang 0.5.17 - 0.5.22 enter it through the worker's draft_tp_context (set by the
    # tests that run the draft extend), 0.5.23 through spec_utils.draft_tp_context(parallel_layout): none here
    worker._draft_worker = types.SimpleNamespace(draft_runner=draft_runner, draft_owns_attention=False,
                                                 parallel_layout=types.SimpleNamespace(tp_group=None, disable_cp=False))
    return worker


def make_batch(bs=3):
    sampling = SamplingBatchInfo(temperatures=torch.ones(bs, 1), top_ps=torch.ones(bs), top_ks=torch.ones(bs),
                                 min_ps=torch.zeros(bs), is_all_greedy=True, is_any_greedy=True,
                                 need_top_p_sampling=False, need_top_k_sampling=False, need_min_p_sampling=False,
                                 vocab_size=VOCAB)
    seq_lens = torch.tensor([5, 9, 17][:bs], dtype=torch.int64)
    return ScheduleBatch(reqs=[], forward_mode=ForwardMode.DECODE, req_pool_indices=torch.tensor([2, 0, 3][:bs]),
                         seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(), seq_lens_sum=int(seq_lens.sum()),
                         spec_info=EagleDraftInput(bonus_tokens=torch.tensor([11, 22, 33][:bs], dtype=torch.int32)),
                         sampling_info=sampling, device="cpu")


def upstream_path(*args, **kwargs):
    raise AssertionError("upstream's one-token verify ran")


DEPTH0_ENV, EXTEND_ENV = "SGLANG_EXT_ADAPTIVE_DEPTH0", "SGLANG_EXT_ADAPTIVE_DEPTH0_DRAFT_EXTEND"


@pytest.fixture
def policy_on(monkeypatch):
    monkeypatch.setenv("SGLANG_EXT_ADAPTIVE_POLICY", "cost")
    monkeypatch.setenv("SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND", "1")
    monkeypatch.delenv(DEPTH0_ENV, raising=False)


def test_depth0_decodes_the_bonus_token_into_its_reserved_slot_and_returns_a_depth0_result(policy_on):
    worker, batch = make_worker(plain_runner()), make_batch()
    published = []
    result = decode_depth0.forward_batch_generation(upstream_path, worker, batch, on_publish=published.append)
    seen = worker.target_worker.seen
    # what the target ran: a plain decode of the bonus tokens at position seq_lens, into the KV slot the
    # scheduler reserved there, with lengths that count the token (spec v2 keeps them before it)
    assert seen["mode"] == ForwardMode.DECODE and seen["spec_info"] is None
    assert seen["input_ids"].tolist() == [11, 22, 33]
    r2t = worker.req_to_token_pool.req_to_token
    assert seen["out_cache_loc"].tolist() == [int(r2t[2, 5]), int(r2t[0, 9]), int(r2t[3, 17])]
    assert seen["out_cache_loc"].dtype == torch.int64
    assert seen["seq_lens"].tolist() == [6, 10, 18] and seen["seq_lens_cpu"].tolist() == [6, 10, 18]
    assert seen["seq_lens_sum"] == 34
    assert seen["capture_hidden_mode"] == CaptureHiddenMode.NULL  # no draft extend reads hidden states
    # what the scheduler reads: one accepted token per request (no draft), the sampled token as next bonus
    assert result.speculative_num_draft_tokens == 1
    assert result.accept_lens.tolist() == [1, 1, 1] and result.accept_lens.dtype == torch.int32
    assert result.next_token_ids.tolist() == [18, 29, 40] and result.next_token_ids.dtype == torch.int32
    assert result.new_seq_lens.tolist() == [6, 10, 18]
    assert result.next_draft_input.bonus_tokens.tolist() == [18, 29, 40]
    assert [t.tolist() for t in published] == [[6, 10, 18]]
    # upstream's draft-extend stub filled what the overlap relay stashes
    assert result.next_draft_input.topk_index.shape == (3, 1)
    assert result.next_draft_input.hidden_states.shape == (3, HIDDEN)
    # the scheduler's batch is back as it was, except what a verify step also leaves (inputs, slots)
    assert batch.seq_lens.tolist() == [5, 9, 17] and batch.seq_lens_cpu.tolist() == [5, 9, 17]
    assert batch.seq_lens_sum == 31 and isinstance(batch.spec_info, EagleDraftInput)


def test_with_the_draft_extend_on_the_step_captures_hidden_states_for_it(policy_on, monkeypatch):
    monkeypatch.delenv("SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND")
    worker, batch = make_worker(plain_runner()), make_batch()
    extended = []
    worker._draft_worker.draft_tp_context = lambda group, **kw: _null()
    worker._draft_worker.draft_runner.tp_group = None
    worker._draft_worker._draft_extend_for_decode = lambda b, r: extended.append((b.out_cache_loc.clone(), r))
    result = decode_depth0.forward_batch_generation(upstream_path, worker, batch)
    assert worker.target_worker.seen["capture_hidden_mode"] == CaptureHiddenMode.FULL
    assert len(extended) == 1 and extended[0][1] is result
    assert extended[0][0].tolist() == worker.target_worker.seen["out_cache_loc"].tolist()


@pytest.mark.parametrize("mode,steps_to_probe,extends", [("", 500, False), ("", 20, True), ("warm", 33, False),
                                                          ("keep", 500, True), ("skip", 20, False)])
def test_the_draft_extend_runs_at_depth0_only_before_a_probe(policy_on, monkeypatch, mode, steps_to_probe, extends):
    """Warm mode (the default): the draft extend at depth 0 only in the 32 steps before the slot's next probe, the
    stub otherwise; 'keep' runs it on every step, 'skip' never. The step captures hidden states unless skipped."""
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

    from sglang_ext.core.adaptive import CostModelPolicy

    monkeypatch.delenv("SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND")
    monkeypatch.setenv(EXTEND_ENV, mode)
    worker, batch = make_worker(plain_runner()), make_batch()
    params = AdaptiveSpeculativeParams(initial_steps=0)  # upstream's routing of batch sizes to slots
    policy = CostModelPolicy([0, 1, 3], initial=0, probe_every=600)
    policy._at_zero = 600 - steps_to_probe
    params._route(3)._sglang_ext_policy = policy
    worker.adaptive_controller = types.SimpleNamespace(params=params,
                                                       activate_step_by_batch=lambda bs: None)
    extended = []
    worker._draft_worker.draft_tp_context = lambda group, **kw: _null()
    worker._draft_worker.draft_runner.tp_group = None
    worker._draft_worker._draft_extend_for_decode = lambda b, r: extended.append(r)
    result = decode_depth0.forward_batch_generation(upstream_path, worker, batch)
    assert len(extended) == int(extends)
    if not extends:  # upstream's stub filled what the overlap relay stashes
        assert result.next_draft_input.hidden_states.shape == (3, HIDDEN)
    want = CaptureHiddenMode.NULL if mode == "skip" else CaptureHiddenMode.FULL
    assert worker.target_worker.seen["capture_hidden_mode"] == want


def test_an_unknown_depth0_draft_extend_mode_is_refused_at_startup(monkeypatch):
    from sglang_ext.serving import startup

    monkeypatch.setenv("SGLANG_EXT_ADAPTIVE_POLICY", "cost")
    monkeypatch.setenv(EXTEND_ENV, "sometimes")
    with pytest.raises(ConfigError, match="--speculative-adaptive-depth0-draft-extend .SGLANG_EXT_ADAPTIVE_DEPTH0_DRAFT_"
                                          "EXTEND.*sometimes.*warm, keep, skip"):
        startup.validate(types.SimpleNamespace(speculative_adaptive=True, speculative_algorithm=None))


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("case", ["grammar", "logprob", "hidden states", "custom logit processor", "beyond graphs",
                                  "depth 3", "depth 0 built upstream's way", "DP attention", "prefill",
                                  "policy off", "verify asked for"])
def test_batches_that_need_the_verify_path_keep_upstreams(policy_on, monkeypatch, case):
    runner = plain_runner(max_bs=2 if case == "beyond graphs" else 8)
    worker, batch = make_worker(runner, steps=3 if case == "depth 3" else 0), make_batch()
    if case == "grammar":
        batch.has_grammar = True
    elif case == "logprob":
        batch.return_logprob = True
    elif case == "hidden states":
        batch.return_hidden_states = True
    elif case == "custom logit processor":
        batch.sampling_info = dataclasses.replace(batch.sampling_info, has_custom_logit_processor=True)
    elif case == "depth 0 built upstream's way":
        from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

        worker._target_worker.model_runner.decode_cuda_graph_runner = object.__new__(DecodeCudaGraphRunner)
    elif case == "DP attention":
        runner.require_mlp_sync = True
    elif case == "prefill":
        batch.forward_mode = ForwardMode.EXTEND
    elif case == "policy off":
        monkeypatch.delenv("SGLANG_EXT_ADAPTIVE_POLICY")
    elif case == "verify asked for":
        monkeypatch.setenv(DEPTH0_ENV, "verify")
    calls = []
    out = decode_depth0.forward_batch_generation(lambda w, b, *a, **k: calls.append(b) or "upstream", worker, batch)
    assert out == "upstream" and calls == [batch] and worker.target_worker.seen is None


def test_depth0_graphs_never_replay_a_verify_batch():
    """Upstream's can_run_graph does not check the mode: a verify batch at depth 0 (one that needs the verify
    path) must run eagerly, not through a decode graph."""
    runner = plain_runner()
    verify = types.SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY)
    assert runner.can_run_graph(verify) is False and runner.get_spec_info(8) is None
    runner.captured_req_width = 2
    with pytest.raises(RuntimeError, match="--speculative-adaptive-depth0 verify"):
        runner.capture()


def test_an_unknown_depth0_mode_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setenv(DEPTH0_ENV, "plain")
    with pytest.raises(ConfigError) as e:
        decode_depth0.mode()
    assert DEPTH0_ENV in str(e.value) and "plain" in str(e.value) and "decode, verify" in str(e.value)


def test_hooks_name_real_sglang_symbols_and_register_only_with_the_policy():
    import importlib

    for hook in decode_depth0.HOOKS:
        module, cls, fn = hook.target.rsplit(".", 2)
        assert callable(getattr(getattr(importlib.import_module(module), cls), fn)), hook.target
    code = ("from sglang.srt.plugins import load_plugins; load_plugins(); "
            "from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2 as W; "
            "print(hasattr(W.forward_batch_generation, '__wrapped__'), "
            "hasattr(W.build_adaptive_runtime_state, '__wrapped__'))")
    for policy, wrapped in (("cost", "True True"), ("", "False False")):
        p = python_run(["-c", code], timeout=300, env=dict(os.environ, SGLANG_EXT_ADAPTIVE_POLICY=policy))
        assert p.returncode == 0, p.stderr[-3000:]
        assert p.stdout.strip().splitlines()[-1] == wrapped, (policy, p.stdout)


def test_depth0_state_is_built_by_upstream_with_decode_graphs_and_only_depth0(policy_on):
    """The runtime state of depth 0 is upstream's own build, with the plain decode runner where upstream names
    its target graph runner; other depths and the name afterwards are upstream's."""
    import sglang.srt.speculative.eagle_worker_v2 as W

    upstream = W.DecodeCudaGraphRunner

    def build(worker, speculative_num_steps, speculative_num_draft_tokens, cuda_graph_bs=None):
        runner = object.__new__(W.DecodeCudaGraphRunner)  # as upstream's build constructs it, through the hook on
        decode_depth0.runner_init(lambda self, *a, **k: None, runner)  # its __init__ (whose capture needs a GPU)
        return types.SimpleNamespace(target_graph_runner=runner)

    depth0 = decode_depth0.build_runtime_state(build, None, speculative_num_steps=0, speculative_num_draft_tokens=1)
    depth3 = decode_depth0.build_runtime_state(build, None, speculative_num_steps=3, speculative_num_draft_tokens=4)
    assert type(depth0.target_graph_runner) is decode_depth0.plain_decode_runner_class()
    assert type(depth3.target_graph_runner) is upstream and W.DecodeCudaGraphRunner is upstream
    outside = object.__new__(W.DecodeCudaGraphRunner)  # a runner built outside a depth-0 build stays upstream's
    decode_depth0.runner_init(lambda self, *a, **k: None, outside)
    assert type(outside) is upstream


def test_without_host_sequence_lengths_the_step_stays_on_the_gpu(policy_on):
    """Spec v2's overlap scheduler may leave the host copies of the lengths unset (no per-step synchronisation);
    the step must not need them."""
    worker, batch = make_worker(plain_runner()), make_batch()
    batch.seq_lens_cpu, batch.seq_lens_sum = None, None
    result = decode_depth0.forward_batch_generation(upstream_path, worker, batch)
    seen = worker.target_worker.seen
    assert seen["seq_lens"].tolist() == [6, 10, 18] and seen["seq_lens_cpu"] is None and seen["seq_lens_sum"] is None
    assert result.new_seq_lens.tolist() == [6, 10, 18] and batch.seq_lens_cpu is None and batch.seq_lens_sum is None


@pytest.mark.parametrize("steps_to_probe,timed", [(20, False), (500, True)])
def test_a_depth0_step_before_a_probe_is_not_timed_as_depth0(policy_on, monkeypatch, steps_to_probe, timed):
    """The step clock's time reaches the slot's cost policy (adaptive.slot_update, on upstream's AdaptiveStepSlot)
    except for a depth-0 step in the lead before a probe, which also ran the draft extend (warm mode): in an H100
    soak those took 18 ms against 9 ms, and timed as depth 0 they made drafting at 0.04 accepted per step look 15%
    better than depth 0 after every probe."""
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

    from sglang_ext.core.adaptive import CostModelPolicy
    from sglang_ext.serving import adaptive

    monkeypatch.delenv("SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND")
    slot = AdaptiveSpeculativeParams(initial_steps=0)._route(128)
    policy = slot._sglang_ext_policy = CostModelPolicy(slot.candidate_steps, 0, probe_every=600)
    policy._at_zero = 600 - steps_to_probe
    monkeypatch.setattr(adaptive.CLOCK, "seconds", 0.018)
    monkeypatch.setattr(adaptive.CLOCK, "draft_tokens", 1)
    adaptive.slot_update(upstream_path, slot, [])
    assert (0 in policy.times) == timed
