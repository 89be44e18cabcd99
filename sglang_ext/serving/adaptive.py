"""Speculation that never costs more than it saves: SGLang's --speculative-adaptive with a cost model.

Opt-in: ``--speculative-adaptive`` (SGLang's flag: chain drafting, topk 1) plus
``--speculative-adaptive-policy cost`` (or ``SGLANG_EXT_ADAPTIVE_POLICY=cost``). Without it none of these hooks is
registered and SGLang's own acceptance thresholds run unchanged; with it but without ``--speculative-adaptive``
nothing changes (a warning says so).

Extends (hooks registered by sglang_ext.plugin), SGLang 0.5.17:
  * ``sglang.srt.speculative.adaptive_spec_params.AdaptiveStepSlot.update`` (AROUND) -- the per
    batch-size slot's decision becomes sglang_ext.core.adaptive.CostModelPolicy's: measured step
    times and per-position acceptance instead of fixed acceptance thresholds. Upstream's machinery
    stays: prebuilt runtime states per candidate depth, per-batch-size routing, CUDA graphs.
  * ``...adaptive_spec_params._load_adaptive_config`` (AROUND) -- without a config file, every
    batch-size bucket may choose from [0, 1, 3] (upstream's default offers no 0 at batch 1, so a
    draft that never accepts would still be run there).
  * ``SchedulerBatchResultProcessor._resolve_spec_v2_tokens`` (BEFORE) and
    ``process_batch_result_prefill`` / ``process_batch_result_idle`` (AFTER) -- the step clock:
    wall time between consecutive decode results with nothing else processed in between, and the
    depth each result really ran (``speculative_num_draft_tokens - 1``; under the overlap scheduler
    the slot's current depth may already be the next one); a depth-0 step that ran the draft extend only
    because a probe follows is not timed as depth 0 (``decode_depth0.lead_step``).
"""

from __future__ import annotations

import collections
import logging
import os
import time

from sglang_ext import settings
from sglang_ext.core.adaptive import CostModelPolicy, DraftShape, ShapePolicy
from sglang_ext.serving.hooks import Hook

logger = logging.getLogger(__name__)

DEFAULT_CANDIDATES = [0, 1, 3]


def requested(s: settings.Settings) -> bool:
    """Whether the operator asked for the cost policy (the hooks are registered only then, so servers without it
    pay nothing per decode step)."""
    return s.adaptive_policy == "cost"


def enabled() -> bool:
    return requested(settings.current())


class StepClock:
    """Wall time of the last decode step and the depth it ran, or None when the interval also
    processed something else (a prefill, an idle batch) or followed a pause."""

    def __init__(self, max_gap_s: float = 1.0):
        self.last: float | None = None
        self.seconds: float | None = None
        self.draft_tokens: int | None = None  # what the step verified per request (a chain of depth k: k + 1)
        self.max_gap_s = max_gap_s

    @property
    def depth(self) -> int | None:
        return None if self.draft_tokens is None else self.draft_tokens - 1

    def decode_result(self, draft_tokens: int | None) -> None:
        now = time.perf_counter()
        gap = None if self.last is None else now - self.last
        self.seconds = gap if gap is not None and gap < self.max_gap_s else None
        self.draft_tokens = draft_tokens
        self.last = now

    def other_work(self) -> None:
        self.last = None


CLOCK = StepClock()
# one acceptance window for every batch-size slot (acceptance belongs to the draft and the traffic; step times
# stay per slot): a slot first reached after acceptance collapsed stops drafting at its first step. It keeps the
# last 64 drafting steps; estimates read the newest >= 64 request-steps and >= 8 steps of it (CostModelPolicy)
SHARED_WINDOW: collections.deque = collections.deque(maxlen=64)
SHARED_TREE_WINDOW: collections.deque = collections.deque(maxlen=64)  # the same for a tree (serving/draft_shape.py)


def resolve_spec_tokens_before(self, result, batch, *args, **kwargs):
    n = getattr(result, "speculative_num_draft_tokens", None)
    CLOCK.decode_result(None if n is None else int(n))
    return None


def other_batch_after(result, *args, **kwargs):
    CLOCK.other_work()
    return result


def slot_update(original_fn, self, num_correct_drafts_per_req):
    if not enabled():
        return original_fn(self, num_correct_drafts_per_req)
    from sglang_ext.serving import decode_depth0, draft_shape  # both import this module

    tree = draft_shape.startup_tree() if draft_shape.enabled() else None
    policy = getattr(self, "_sglang_ext_policy", None)
    if policy is None:
        policy = self._sglang_ext_policy = _new_policy(self, tree)
    ran = draft_shape.shape_of(CLOCK.draft_tokens, tree) or policy.shape
    before_probe = ran.steps == 0 and decode_depth0.lead_step(policy)
    decision = policy.observe_shape(ran, list(num_correct_drafts_per_req or []), CLOCK.seconds, before_probe)
    summary = _summary(self, policy, ran, len(num_correct_drafts_per_req or []))
    if summary:
        _log(f"[sglang_ext] adaptive speculation summary: {summary}")
    key = draft_shape.key_of(decision.shape)
    if decision.changed and key != self.current_steps:
        self.current_steps = key
        _log(f"[sglang_ext] adaptive speculation: {decision.reason}")
        return True
    return False


def _new_policy(slot, tree: DraftShape | None) -> ShapePolicy:
    """A batch-size slot's policy: its chain depths, and the tree where the server was started as one (the slot
    then starts on it: serving/draft_shape.py)."""
    depths = [k for k in slot.candidate_steps if k >= 0]
    if tree is None:
        return ShapePolicy(depths, slot.current_steps, window=SHARED_WINDOW)
    from sglang_ext.serving.draft_shape import TREE_KEY

    initial = tree.steps if tree.steps in depths else max(depths)
    return ShapePolicy(depths, initial, trees=[tree], initial_tree=tree if slot.current_steps == TREE_KEY else None,
                       window=SHARED_WINDOW, tree_window=SHARED_TREE_WINDOW)


SUMMARY_EVERY_S = 10.0  # a benchmark level lasts seconds: at 30 s most levels went unsummarised


def _summary(slot, policy: CostModelPolicy, ran: DraftShape, batch: int) -> str | None:
    """Every SUMMARY_EVERY_S seconds per batch-size slot: the steps run at each depth since the last summary, the
    measured step time of each depth and the batch sizes seen -- where the time went, which decisions alone
    do not show (a policy that decides well but whose cheap depth is not cheap)."""
    now = time.monotonic()
    acc = getattr(slot, "_sglang_ext_summary", None)
    if acc is None:
        acc = slot._sglang_ext_summary = {"since": now, "steps": {}, "bs": [batch, batch]}
    acc["steps"][ran] = acc["steps"].get(ran, 0) + 1
    acc["bs"] = [min(acc["bs"][0], batch), max(acc["bs"][1], batch)]
    if now - acc["since"] < SUMMARY_EVERY_S:
        return None

    def name(shape: DraftShape) -> str:
        return f"depth {shape.steps}" if shape.is_chain else f"tree {shape.text}"

    order = sorted(acc["steps"], key=lambda sh: (not sh.is_chain, sh.steps, sh.topk))
    steps = ", ".join(f"{name(sh)}: {acc['steps'][sh]}" for sh in order)
    measured = [(DraftShape.chain(k), t) for k, t in sorted(policy.times.items())]
    measured += list(getattr(policy, "tree_times", {}).items())
    times = ", ".join(f"{name(sh)}: {1e3 * t:.2f} ms" for sh, t in measured)
    at_zero = policy.shape.steps == 0
    text = (f"last {now - acc['since']:.0f}s, batch {acc['bs'][0]}-{acc['bs'][1]}: steps [{steps}]; "
            f"measured step time [{times}]; now {name(policy.shape)}"
            + (f", next probe after {policy.probe_interval} steps at depth 0" if at_zero else ""))
    slot._sglang_ext_summary = {"since": now, "steps": {}, "bs": [batch, batch]}
    return text


def _log(text: str) -> None:
    try:
        from sglang.srt.utils import log_info_on_rank0

        log_info_on_rank0(logger, text)
    except Exception:
        logger.info("%s", text)


def load_adaptive_config(original_fn, cfg_path, *args, **kwargs):
    if cfg_path is None and enabled():
        default = {str(bs): {"candidate_steps": list(DEFAULT_CANDIDATES)} for bs in (1, 8, 32, 64)}
        return _validated(default, original_fn)
    return original_fn(cfg_path, *args, **kwargs)


def _validated(cfg: dict, original_fn):
    import json
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(cfg, f)
    try:
        return original_fn(f.name)  # upstream's validation of our default
    finally:
        os.unlink(f.name)


BATCH_RESULTS = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
ON = "--speculative-adaptive-policy cost"  # the option that registers these hooks
HOOKS = (
    Hook("sglang.srt.speculative.adaptive_spec_params.AdaptiveStepSlot.update", "around", slot_update,
         when=requested, option=ON, feature="the cost policy's depth decisions"),
    Hook("sglang.srt.speculative.adaptive_spec_params._load_adaptive_config", "around", load_adaptive_config,
         when=requested, option=ON, feature="the cost policy's depth candidates"),
    Hook(f"{BATCH_RESULTS}._resolve_spec_v2_tokens", "before", resolve_spec_tokens_before, when=requested, option=ON,
         feature="the cost policy's step clock"),
    Hook(f"{BATCH_RESULTS}.process_batch_result_prefill", "after", other_batch_after, when=requested, option=ON,
         feature="the cost policy's step clock"),
    Hook(f"{BATCH_RESULTS}.process_batch_result_idle", "after", other_batch_after, when=requested, option=ON,
         feature="the cost policy's step clock"),
)
