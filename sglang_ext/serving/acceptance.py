"""Acceptance reporting without the bonus token: per request, in the decode log, on /metrics and in
/get_server_info -- one set of numbers (sglang_ext.core.accounting, docs/metrics.md).

Extends (hooks registered by sglang_ext.plugin), SGLang 0.5.17:
  * ``sglang.srt.managers.schedule_batch.Req.update_spec_correct_drafts_histogram`` (AROUND) --
    remembers each request's last step, which a stop inside an accepted run may cut.
  * ``sglang.srt.managers.schedule_batch.Req.update_finish_state`` (AROUND) -- when a request
    finishes, its counters are corrected to what it emitted (upstream counts the whole accepted run
    even past EOS / max_new_tokens, so completion_tokens = sum(a + 1) + 1 fails) and added once to
    the process ledger. The ledger therefore equals the sum of the per-request meta_info exactly.
  * ``sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor.
    _resolve_spec_v2_tokens`` (AFTER) -- per-step counts of live rows (not the stale rows of requests
    that already finished, which upstream's "accept len" includes) for the log interval.
  * ``sglang.srt.managers.scheduler.Scheduler.get_internal_state`` (AFTER) -- cumulative totals as
    ``internal_states[0].sglang_ext_acceptance`` of ``/get_server_info``.
  * ``sglang.srt.managers.tokenizer_manager.TokenizerManager._calculate_spec_decoding_metrics``
    (AFTER) -- our fields in each finished request's ``meta_info``.
  * the decode log line (a ``logging.Filter`` on upstream's metrics reporter logger): upstream's
    fields stay; ours are appended with unambiguous names.
Counters are reported by attention-TP rank 0 only (every rank sees every request; a counter summed
over ranks would count TP times).
"""

from __future__ import annotations

import logging
import threading

from sglang_ext.core.accounting import AcceptanceStats, apply_stop_truncation, stop_truncation
from sglang_ext.serving import compat
from sglang_ext.serving.context import server_args as _server_args
from sglang_ext.serving.hooks import Hook

logger = logging.getLogger(__name__)

DECODE_LOGGER = "sglang.srt.managers.scheduler_components.metrics_reporter"
METRIC_PREFIX = "sglang:spec_ext_"


def _configured_depth() -> int:
    args = _server_args()
    return int(compat.spec_num_steps(args) or 1) if args is not None else 1


def is_reporting_rank() -> bool:
    """Attention-TP rank 0 (and CP rank 0): the one rank that counts, logs and writes per-request data."""
    try:
        from sglang.srt.runtime_context import get_parallel

        p = get_parallel()
        return p.attn_tp_rank == 0 and getattr(p, "attn_cp_rank", 0) == 0
    except Exception:
        return True


class Ledger:
    """Process-wide acceptance totals (one per scheduler process)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.finished = AcceptanceStats(_configured_depth())  # finished requests, corrected
        self.requests = 0
        self.aborted = 0  # requests aborted (client gone, AbortReq, errors): no meta_info, none of their steps counted
        self.discarded_drafts = 0  # accepted by the target after the request's stop: not emitted
        self.interval = AcceptanceStats(_configured_depth())  # live rows since the last log line
        self._metrics = None

    def add_live_steps(self, accepted: list[int]) -> None:
        with self.lock:
            if accepted:
                self.interval = self.interval.resized(max(self.interval.depth, max(accepted)))
                self.interval.add_steps(accepted)

    def take_interval(self) -> AcceptanceStats:
        with self.lock:
            out, self.interval = self.interval, AcceptanceStats(self.interval.depth)
            return out

    def add_request(self, histogram: list[int], discarded: int) -> None:
        req = AcceptanceStats.from_histogram(histogram, self.finished.depth)
        with self.lock:
            depth = max(self.finished.depth, req.depth)
            self.finished = self.finished.resized(depth).merge(req.resized(depth))
            self.requests += 1
            self.discarded_drafts += discarded
        if is_reporting_rank():
            self._export(req, discarded)

    def add_aborted(self) -> None:
        with self.lock:
            self.aborted += 1
        if is_reporting_rank():
            args = _server_args()
            if args is not None and getattr(args, "enable_metrics", False):
                m = self._metrics or self._make_metrics(args)
                m["aborted"].labels(model_name=args.served_model_name or args.model_path).inc()

    def to_dict(self) -> dict:
        with self.lock:
            d = self.finished.to_dict()
            d.update(finished_requests=self.requests, aborted_requests=self.aborted,
                     discarded_drafts=self.discarded_drafts,
                     definition="a = drafts accepted and emitted per verify step, bonus token excluded; "
                                "completion_tokens = sum(a + 1) + 1 per request (docs/metrics.md)")
            return d

    # ---------------------------------------------------------------------------- /metrics
    def _export(self, req: AcceptanceStats, discarded: int) -> None:
        args = _server_args()
        if args is None or not getattr(args, "enable_metrics", False):
            return
        m = self._metrics or self._make_metrics(args)
        labels = {"model_name": args.served_model_name or args.model_path}
        m["requests"].labels(**labels).inc()
        m["verify_steps"].labels(**labels).inc(req.verify_steps)
        m["accepted_drafts"].labels(**labels).inc(req.accepted_drafts)
        m["discarded_drafts"].labels(**labels).inc(discarded)
        for j, c in enumerate(req.histogram_counts):
            if c:
                m["histogram"].labels(**labels, accepted=str(j)).inc(c)
        for i in range(1, req.depth + 1):
            reached = sum(req.histogram_counts[i:])
            if reached:
                m["position"].labels(**labels, position=str(i)).inc(reached)
        with self.lock:
            m["per_step"].labels(**labels).set(self.finished.accepted_drafts_per_step)

    def _make_metrics(self, args) -> dict:
        from prometheus_client import Counter, Gauge

        base = ["model_name"]
        self._metrics = {
            "requests": Counter(METRIC_PREFIX + "requests", "Finished requests counted", base),
            "aborted": Counter(METRIC_PREFIX + "aborted_requests", "Aborted requests (not in the other counters)", base),
            "verify_steps": Counter(METRIC_PREFIX + "verify_steps", "Verify steps of finished requests", base),
            "accepted_drafts": Counter(METRIC_PREFIX + "accepted_drafts",
                                       "Draft tokens accepted and emitted (bonus token excluded)", base),
            "discarded_drafts": Counter(METRIC_PREFIX + "discarded_drafts",
                                        "Drafts accepted after a request's stop, not emitted", base),
            "histogram": Counter(METRIC_PREFIX + "accepted_drafts_histogram",
                                 "Verify steps by accepted drafts j", base + ["accepted"]),
            "position": Counter(METRIC_PREFIX + "position_accepted",
                                "Verify steps whose draft at position i was accepted (a >= i)", base + ["position"]),
            "per_step": Gauge(METRIC_PREFIX + "accepted_drafts_per_step",
                              "Accepted drafts per verify step since start (no bonus)", base,
                              multiprocess_mode="mostrecent"),
        }
        return self._metrics


_LEDGER: Ledger | None = None


def ledger() -> Ledger:
    global _LEDGER
    if _LEDGER is None:
        _LEDGER = Ledger()
    return _LEDGER


# ------------------------------------------------------------------------------- scheduler hooks
def update_histogram(original_fn, self, num_correct_drafts, *args, **kwargs):
    self._sglang_ext_last_drafts = int(num_correct_drafts)
    return original_fn(self, num_correct_drafts, *args, **kwargs)


def _aborted(req) -> bool:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return isinstance(getattr(req, "finished_reason", None), FINISH_ABORT)


def update_finish_state(original_fn, self, *args, **kwargs):
    was_finished = self.finished()
    out = original_fn(self, *args, **kwargs)
    if was_finished or not self.finished() or getattr(self, "_sglang_ext_counted", False):
        return out
    self._sglang_ext_counted = True
    if _aborted(self):
        ledger().add_aborted()
        return out
    if getattr(self.sampling_params, "max_new_tokens", None) == 0:
        # SGLang's own prefix-caching request before an n > 1 request's samples: no client receives it, so no
        # view counts it (the samples are the requests)
        return out
    if self.spec_verify_ct <= 0:  # finished in prefill (or speculation off): no verify step
        if getattr(_server_args(), "speculative_algorithm", None):
            ledger().add_request([], 0)
        return out
    last = getattr(self, "_sglang_ext_last_drafts", 0)
    cut = stop_truncation(self.spec_num_correct_drafts, self.spec_verify_ct, len(self.output_ids_through_stop), last)
    if cut:
        self.spec_num_correct_drafts -= cut
        apply_stop_truncation(self.spec_correct_drafts_histogram, last, cut)
    ledger().add_request(list(self.spec_correct_drafts_histogram), cut)
    return out


def resolve_spec_tokens_after(result_tokens, self, result, batch, *args, **kwargs):
    per_req = getattr(result, "num_correct_drafts_per_req_cpu", None)
    if per_req:
        live = [a for a, req in zip(per_req, batch.reqs) if not (req.is_retracted or req.finished())]
        ledger().add_live_steps(live)
    return result_tokens


def internal_state_after(result, self, *args, **kwargs):
    state = getattr(result, "internal_state", None)
    if isinstance(state, dict) and getattr(self, "spec_algorithm", None) is not None \
            and not self.spec_algorithm.is_none():
        state["sglang_ext_acceptance"] = ledger().to_dict()
    return result


class DecodeLogFields(logging.Filter):
    """Appends our fields to upstream's decode log line (which keeps its own "accept len")."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg
        if isinstance(msg, str) and msg.startswith("Decode batch") and "accept len:" in msg:
            led = ledger()
            live = led.take_interval()
            total = led.to_dict()
            pos = ", ".join(f"{p:.2f}" for p in live.per_position_acceptance)
            record.msg = (f"{msg}, accepted drafts/step: {live.accepted_drafts_per_step:.2f} "
                          f"(no bonus; {live.verify_steps} req-steps), per-position P(a>=i): [{pos}], "
                          f"finished reqs: {total['finished_requests']} (accepted drafts "
                          f"{total['accepted_drafts']} over {total['verify_steps']} verify steps)")
        return True


def install_log_filter() -> None:
    log = logging.getLogger(DECODE_LOGGER)
    if not any(isinstance(f, DecodeLogFields) for f in log.filters):
        log.addFilter(DecodeLogFields())


# ------------------------------------------------------------------------------- tokenizer hook
def request_fields(completion_tokens: int, verify_steps: int, histogram: list[int] | None, depth: int) -> dict:
    """Our per-request fields from upstream's (already truncation-corrected) counters."""
    accepted = completion_tokens - 1 - verify_steps  # the invariant, with the prefill token
    stats = AcceptanceStats.from_histogram(histogram or [], depth)
    out = {"spec_verify_steps": verify_steps, "spec_depth": stats.depth,
           "spec_accepted_drafts_per_step": accepted / verify_steps,
           "spec_tokens_per_step": (accepted + verify_steps) / verify_steps,
           "spec_draft_acceptance_rate": accepted / (verify_steps * stats.depth)}
    if histogram:
        out["spec_position_accepted"] = [sum(stats.histogram_counts[i:]) for i in range(1, stats.depth + 1)]
    return out


def spec_metrics_after(result, self, meta_info, recv_obj, i, *args, **kwargs):
    try:
        verify = recv_obj.spec_verify_ct[i]
        completion = recv_obj.completion_tokens[i]
    except (AttributeError, IndexError, TypeError):
        return result
    if not verify:
        return result
    hist = None
    hists = getattr(recv_obj, "spec_correct_drafts_histogram", None)
    if hists and len(hists) > i:
        hist = hists[i]
    depth = int(compat.spec_num_steps(self.server_args) or 1)  # 0.5.21+: the resolved depth, not the raw input
    meta_info.update(request_fields(completion, verify, hist, depth))
    return result


HOOKS = (
    Hook("sglang.srt.managers.schedule_batch.Req.update_spec_correct_drafts_histogram", "around", update_histogram,
         feature="acceptance counters (a stop inside an accepted run)"),
    Hook("sglang.srt.managers.schedule_batch.Req.update_finish_state", "around", update_finish_state,
         feature="acceptance counters without the bonus token"),
    Hook("sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor."
         "_resolve_spec_v2_tokens", "after", resolve_spec_tokens_after, feature="the decode log line's acceptance"),
    Hook("sglang.srt.managers.scheduler.Scheduler.get_internal_state", "after", internal_state_after,
         feature="the acceptance totals in /get_server_info"),
    Hook("sglang.srt.managers.tokenizer_manager.TokenizerManager._calculate_spec_decoding_metrics", "after",
         spec_metrics_after, feature="the acceptance fields of meta_info"),
)
