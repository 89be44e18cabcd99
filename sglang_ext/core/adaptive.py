"""Draft fewer steps (or none) when speculation stops paying, from measured step times.

One batch-size bucket runs verify steps at a depth k chosen from `candidates` (0 = no drafting).
Throughput per request at depth k is

    goodput(k) = (1 + E[min(a, k)]) / t(k)

with a the accepted drafts of a step (bonus excluded) and t(k) the measured wall time of a step
at depth k. E[min(a, k)] = sum_{i<=k} P(a >= i) comes from the per-position acceptance of a recent
window of steps (at least 64 request-steps and 8 steps; each position's rate pooled over every step that
drafted it); positions deeper than the window measured take the conditional rates last measured at
a deeper depth, and past those are extrapolated with the last conditional rate. t(k) is the median of the
last `time_samples` step times where k ran (one slow step -- a request arriving, a state switch -- does
not move it; an EMA did, and on an H200 a zero-acceptance run then left depth 0 for depth 1 or 3 on 37%
of its steps); other depths are read off a line t(k) = t0 + k * d fitted to the measured depths (until two depths were measured, a draft step is
assumed to cost `prior_draft_cost` of a step at k = 0: the only constant, and only until measured).
Step times are non-decreasing in k (a step at depth k does a depth-0 step's verify and k draft
forwards), and a depth's time is only refreshed while it runs: where two measured depths disagree with
that order, the newer measurement wins (a stale low depth is lowered to a deeper depth measured since, a
stale deep depth raised to a shallower one measured since). Bounding only from above let a depth-3 time
taken at 86 requests hold the depth-1 time measured at 128 below depth 0's: the policy kept drafting at
depth 1 for the whole of an H200 soak at 0.04 accepted drafts per step. For the same reason a full window
in which nothing was accepted sends the policy to depth 0 whatever the times say.
At k = 0 no acceptance can be measured, so the policy probes the smallest positive depth after
`probe_every` steps there; each probe that finds speculation still not paying doubles that interval, up to
`max_probe_every` (a draft that never pays then costs probe_len / max_probe_every of the steps, 0.4% by
default, instead of 6%), and a probe that pays resets it. What a probe costs is measured, not assumed: the time its
steps and the steps just before it (which bring the draft's state up to date) took beyond depth 0's, and the next
probe waits at least until that cost is `probe_budget` (1%) of the time spent at depth 0 in between. On an H100 at
128 requests (8.4 ms depth-0 steps) a probe's 16 depth-1 steps predicted 0.04 s, this clock measured 0.16 s, and the
6-second benchmark repeats that held a probe ran 4-6% slower than the one that did not: doubling from 256 steps
alone put three probes in a benchmark level, the budget one. Policies of several batch sizes may share one
acceptance window (`window=` a deque): a batch size seen for the first time then stops drafting at its first step
when nothing was accepted in the shared window, without its own warm-up at full depth. A depth below the current
one whose step time was never measured at this batch size is run for `explore_len` steps before the policy relies
on a modelled time for it: on an H200 a draft accepting 2 of 3 at 128 requests took 54 ms per step at depth 3, where
the model (with only depth 3 measured) put depth 0 at 37 ms against its real 14.5 ms, and the policy kept drafting
at 0.83x of no speculation. A
switch needs a predicted gain above `min_gain`; every switch states why.
Pure Python: the SGLang adapter feeds it, the CPU tests drive it with synthetic traces.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics


@dataclasses.dataclass(frozen=True)
class DraftShape:
    """What one speculative step drafts and verifies: `steps` draft forwards keeping `topk` branches each, of which
    `draft_tokens` are verified (the root -- the last verified token -- included; SGLang's
    --speculative-eagle-topk, --speculative-num-steps and --speculative-num-draft-tokens). A chain is topk 1 with
    steps + 1 draft tokens (steps 0: no drafting); anything else is a tree."""

    topk: int
    steps: int
    draft_tokens: int

    def __post_init__(self):
        if self.topk < 1 or self.steps < 0:
            raise ValueError(f"a drafting shape needs topk >= 1 and steps >= 0, got {self.text}")
        if self.topk == 1 and self.draft_tokens != self.steps + 1:
            raise ValueError(f"a chain (topk 1) of {self.steps} steps verifies {self.steps + 1} tokens, "
                             f"got {self.text}")
        widest = 1 + self.topk + max(self.steps - 1, 0) * self.topk * self.topk  # SGLang's candidate nodes
        if self.topk > 1 and not (self.steps >= 1 and 2 <= self.draft_tokens <= widest):
            raise ValueError(f"a tree of topk {self.topk} and {self.steps} steps verifies 2 to {widest} tokens "
                             f"(root included) and drafts at least one step, got {self.text}")

    @classmethod
    def chain(cls, depth: int) -> "DraftShape":
        return cls(1, depth, depth + 1)

    @classmethod
    def parse(cls, text: str) -> "DraftShape":
        """'TOPKxSTEPSxTOKENS', e.g. '4x3x8' (topk 4, 3 steps, 8 draft tokens)."""
        parts = str(text).lower().replace(" ", "").split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"a drafting shape is TOPKxSTEPSxTOKENS (e.g. 4x3x8), got {text!r}")
        return cls(*(int(p) for p in parts))

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @property
    def text(self) -> str:
        return f"{self.topk}x{self.steps}x{self.draft_tokens}"

    @property
    def label(self) -> str:
        if self.is_chain:
            return f"depth {self.steps}"
        return f"tree {self.text} (topk {self.topk}, {self.steps} steps, {self.draft_tokens} tokens)"


@dataclasses.dataclass
class Decision:
    depth: int
    changed: bool
    reason: str
    tree: DraftShape | None = None  # the tree to draft with; None: the chain of `depth`

    @property
    def shape(self) -> DraftShape:
        return self.tree or DraftShape.chain(self.depth)


class CostModelPolicy:
    def __init__(self, candidates, initial: int, window: int | collections.deque = 64, time_samples: int = 15,
                 warmup: int = 8, decide_every: int = 8, probe_every: int = 256, probe_len: int = 16,
                 min_gain: float = 0.03, prior_draft_cost: float = 0.15, max_probe_every: int = 4096,
                 explore_len: int = 8, window_steps: int = 8, probe_budget: float = 0.01):
        self.candidates = sorted(set(int(c) for c in candidates))
        if not self.candidates:
            raise ValueError("candidates must not be empty")
        self.depth = initial if initial in self.candidates else self.candidates[len(self.candidates) // 2]
        # (depth, accepted drafts per request) per step; a deque passed in is shared with other policies (acceptance
        # is a property of the draft and the traffic, not of the batch size; step times stay per policy). Estimates
        # read the newest steps that hold `window_requests` request-steps *and* `window_steps` steps: at 128
        # requests 64 request-steps are half a step, and where acceptance is correlated across a batch (SGLang's
        # SGLANG_SIMULATE_ACC_LEN draws one length per step; a batch of similar prompts) one step is one sample
        self.window: collections.deque = window if isinstance(window, collections.deque) else \
            collections.deque(maxlen=window)
        self.window_requests = self.window.maxlen or 64
        self.window_steps = min(window_steps, self.window_requests)
        self.times: dict[int, float] = {}  # depth -> median of its recent step times
        self._measured_at: dict[int, int] = {}  # depth -> the step its newest time sample came from
        self.by_depth: dict[int, collections.deque] = {}  # depth -> its last steps' accepted drafts (this policy)
        self._samples: dict[int, collections.deque] = {}
        self.time_samples = time_samples
        self.warmup, self.decide_every = warmup, decide_every
        self.probe_every, self.probe_len, self.min_gain = probe_every, probe_len, min_gain
        self.max_probe_every = max(max_probe_every, probe_every)
        self.probe_interval = probe_every  # steps at depth 0 before the next probe (backs off, see above)
        self.probe_budget = probe_budget  # the share of depth-0 time a probe that finds nothing may cost
        self._probe_cost_s, self._probe_cost_steps = 0.0, 0  # this probe's time beyond depth 0's, and its steps
        self.prior_draft_cost = prior_draft_cost
        self._steps = 0
        self._since_decision = 0
        self._at_zero = 0
        self._probing = 0
        self.explore_len = explore_len
        self._exploring = 0
        self.last_reason = "initial"

    @property
    def shape(self) -> DraftShape:
        """What this policy drafts with now."""
        return DraftShape.chain(self.depth)

    def observe_shape(self, shape: DraftShape, accepted: list[int], step_seconds: float | None,
                      before_probe: bool = False) -> Decision:
        """`observe` for what ran, given as a drafting shape (ShapePolicy also takes trees)."""
        if not shape.is_chain:
            raise ValueError(f"{shape.label}: this policy chooses chain depths only (ShapePolicy chooses trees too)")
        return self.observe(shape.steps, accepted, step_seconds, before_probe)

    # --------------------------------------------------------------------------------- inputs
    def observe(self, depth: int, accepted: list[int], step_seconds: float | None,
                before_probe: bool = False) -> Decision:
        """One verify step of a batch at `depth` (what ran; under SGLang's overlap scheduler it may
        lag the current choice by a step), its per-request accepted drafts and its wall time.
        `before_probe`: a depth-0 step that also ran the work a probe needs first (the draft extend, in the
        `needs_draft_state` lead): its time is not what a depth-0 step costs and is not recorded as depth 0's. In
        an H100 soak those steps took 18 ms against depth 0's 9 ms, filled depth 0's median just before each probe
        was judged, and the policy drafted at a loss for whole minutes after probes."""
        self._record(depth, accepted, step_seconds, before_probe)
        if self._exploring:
            self._exploring -= 1
            return Decision(self.depth, False, "exploring") if self._exploring else self._decide(force=True)
        if self._probing:
            self._probing -= 1
            if self._probing:
                return Decision(self.depth, False, "probing")
            decision = self._decide(force=True)
            if self.depth == 0:  # the probe found speculation still not paying: probe less often
                note = self._back_off()
                self.last_reason += note
                decision = Decision(decision.depth, decision.changed, decision.reason + note)
            else:
                self.probe_interval = self.probe_every
            self._probe_cost_s, self._probe_cost_steps = 0.0, 0
            return decision
        if self.depth == 0:
            self._at_zero += 1
            if self._at_zero >= self.probe_interval:
                return self._probe()
        if self.depth > 0 and self._steps <= self.warmup and self._never_accepts():
            return self._decide()  # a shared window already says no draft is accepted: no need to wait
        if self._steps <= self.warmup or self._since_decision < self.decide_every:
            return Decision(self.depth, False, "waiting")
        return self._decide()

    def _record(self, depth: int, accepted: list[int], step_seconds: float | None, before_probe: bool) -> None:
        """A chain step's time and acceptance, kept whatever is decided next."""
        timed, lead = step_seconds is not None and step_seconds > 0, before_probe and depth == 0
        if timed and (self._probing or lead) and 0 in self.times:  # what this probe costs beyond depth 0
            self._probe_cost_s += step_seconds - self.times[0]
            self._probe_cost_steps += 1
        if timed and not lead:
            samples = self._samples.setdefault(depth, collections.deque(maxlen=self.time_samples))
            samples.append(step_seconds)
            self.times[depth] = statistics.median(samples)
            self._measured_at[depth] = self._steps
        if depth > 0 and accepted:
            step = tuple(min(int(a), depth) for a in accepted)
            self.window.append((depth, step))
            self.by_depth.setdefault(depth, collections.deque(maxlen=self.window_requests)).append((depth, step))
        self._steps += 1
        self._since_decision += 1

    def _back_off(self) -> str:
        """After a probe that found nothing: twice the interval, and at least as many depth-0 steps as make the
        probe's measured cost `probe_budget` of their time; never past `max_probe_every`."""
        t0, cost = self.times.get(0), max(0.0, self._probe_cost_s)
        budgeted = int(cost / (self.probe_budget * t0)) + 1 if t0 and self.probe_budget > 0 and cost > 0 else 0
        self.probe_interval = min(max(2 * self.probe_interval, budgeted), self.max_probe_every)
        steps = self._probe_cost_steps
        spent = f"; probe cost {1e3 * cost:.0f} ms over {steps} steps" if steps else ""
        return f"{spent}; next probe in {self.probe_interval} steps"

    def needs_draft_state(self, lead: int) -> bool:
        """Whether the draft must keep its state (its KV of the decoded tokens, its last hidden state) current at
        this step. While drafting, always. At depth 0 only in the `lead` steps before a probe, so that the probe
        drafts from a warm recent context: keeping it current on every depth-0 step (the draft extend) made
        depth 0 cost 1.2x a plain decode step at 64-128 requests on an H200, which held a draft accepting 0.5
        per step at 0.81-0.87x of no speculation. Not while exploring depth 0: that measures depth 0's own time."""
        if self.depth > 0 or self._probing:
            return True
        if self._exploring:
            return False
        return self.probe_interval - self._at_zero <= lead

    def recent(self, steps=None) -> list[tuple[int, tuple[int, ...]]]:
        """The newest steps holding at least `window_requests` request-steps and `window_steps` steps (all there
        are, if fewer), newest first."""
        out, requests = [], 0
        for entry in reversed(self.window if steps is None else steps):
            if requests >= self.window_requests and len(out) >= self.window_steps:
                break
            out.append(entry)
            requests += len(entry[1])
        return out

    def _full(self, recent) -> bool:
        return sum(len(a) for _, a in recent) >= self.window_requests and len(recent) >= self.window_steps

    def _never_accepts(self) -> bool:
        """A full window in which no draft was accepted at any depth."""
        recent = self.recent()
        return self._full(recent) and not any(any(a) for _, a in recent)

    def _window_text(self) -> str:
        recent = self.recent()
        return f"{sum(len(a) for _, a in recent)} request-steps ({len(recent)} steps)"

    # ------------------------------------------------------------------------------- estimates
    @staticmethod
    def _rates(recent) -> list[float]:
        """P(a >= i | a >= i - 1) for i = 1..(deepest depth drafted), pooled over every step that drafted position
        i: a chain's first i drafts do not depend on how many follow them, so a probe at depth 1 and older steps
        at depth 3 measure position 1 alike (before, only the deepest depth's steps counted, and a few stale deep
        steps could outvote a fresh probe)."""
        deepest = max((d for d, _ in recent), default=0)
        rates = []
        for i in range(1, deepest + 1):
            reached = [a for d, step in recent if d >= i for a in step if a >= i - 1]
            if not reached:
                break
            rates.append(sum(a >= i for a in reached) / len(reached))
        return rates

    def acceptance_at_depth(self) -> tuple[int, list[float]]:
        """(K, [P(a >= i) for i = 1..K]) over the window, K its deepest depth measured."""
        recent = self.recent()
        p, prob = [], 1.0
        for r in self._rates(recent):
            prob *= r
            p.append(prob)
        deepest = max((d for d, _ in recent), default=0)
        return deepest, p + [0.0] * (deepest - len(p))  # past where no step got: none accepted there

    def per_position(self) -> list[float]:
        """[P(a >= i) for i = 1..]: the window's, continued past its deepest depth with the conditional rates
        P(a >= i | a >= i - 1) last measured at a deeper depth. At 128 requests one step refills the window, so
        after a step at depth 1 it knows nothing past position 1; extrapolating its rate 1.0 there (a draft
        accepting exactly 2 of 3, H200) predicted 3 accepted at depth 3, and the policy went 1 -> 3 -> 1 on
        every decision."""
        depth, p = self.acceptance_at_depth()
        deeper = [d for d, q in self.by_depth.items() if d > depth and q]
        if p and deeper:
            # no rate past the positions its steps reached (e.g. measured before acceptance recovered)
            rates = self._rates(self.recent(self.by_depth[max(deeper)]))
            for rate in rates[depth:]:
                p.append(p[-1] * rate)
        return p

    def expected_accepted(self, k: int) -> float | None:
        p = self.per_position()
        if not p:
            return None
        total = sum(p[:k])
        if k > len(p):
            prev = p[-2] if len(p) >= 2 else 1.0
            rate = min(1.0, p[-1] / prev) if prev > 0 else 0.0
            last = p[-1]
            for _ in range(k - len(p)):
                last *= rate
                total += last
        return total

    def ordered_times(self) -> dict[int, float]:
        """The measured step times made non-decreasing in depth, newest first: each depth's median is held
        between the depths measured after it (the shallower ones below, the deeper ones above)."""
        out: dict[int, float] = {}
        for k in sorted(self.times, key=lambda d: -self._measured_at.get(d, 0)):
            lo = max((t for d, t in out.items() if d < k), default=0.0)
            hi = min((t for d, t in out.items() if d > k), default=float("inf"))
            out[k] = min(max(self.times[k], lo), hi)
        return out

    def step_time(self, k: int) -> float | None:
        times = self.ordered_times()
        if k in times:
            return times[k]
        t = self._line_time(k, times)
        deeper = [v for d, v in times.items() if d > k]
        shallower = [v for d, v in times.items() if d < k]
        if t is not None and deeper:
            t = min(t, min(deeper))  # never above a deeper depth's time
        if t is not None and shallower:
            t = max(t, max(shallower))  # nor below a shallower one's
        return t

    def _line_time(self, k: int, times: dict[int, float]) -> float | None:
        known = sorted(times.items())
        if len(known) >= 2:  # least-squares line through the measured depths
            n = len(known)
            mx = sum(x for x, _ in known) / n
            my = sum(y for _, y in known) / n
            var = sum((x - mx) ** 2 for x, _ in known)
            slope = sum((x - mx) * (y - my) for x, y in known) / var if var else 0.0
            return max(my + slope * (k - mx), 1e-9)
        if len(known) == 1:
            k0, t0 = known[0]
            return t0 * (1 + self.prior_draft_cost * k) / (1 + self.prior_draft_cost * k0)
        return None

    def goodput(self, k: int) -> float | None:
        t = self.step_time(k)
        if t is None:
            return None
        e = 0.0 if k == 0 else self.expected_accepted(k)
        return None if e is None else (1 + e) / t

    # ------------------------------------------------------------------------------- decisions
    def _decide(self, force: bool = False) -> Decision:
        self._since_decision = 0
        if 0 in self.candidates and self.depth != 0 and self._never_accepts():
            # no step time is needed (and a stale one must not decide): with nothing accepted, every positive
            # depth costs more than depth 0 and yields the same one token per step
            old = self.depth
            self.depth, self._at_zero = 0, 0
            self.last_reason = (f"depth {old} -> 0: no draft accepted in the last {self._window_text()} "
                                "(acceptance window shared across batch sizes)" + self._times_text("; "))
            return Decision(0, True, self.last_reason)
        unmeasured = [k for k in self.candidates if k < self.depth and k not in self.times]
        if unmeasured and self.depth in self.times:
            return self._explore(unmeasured[0])
        scores = {k: self.goodput(k) for k in self.candidates}
        scores = {k: g for k, g in scores.items() if g is not None}
        current = scores.get(self.depth)
        if not scores or current is None:
            return Decision(self.depth, False, "no estimate yet")
        best = max(scores, key=lambda k: scores[k])
        gain = scores[best] / current - 1 if current > 0 else float("inf")
        if best == self.depth or (gain < self.min_gain and not force):  # after a probe: no hysteresis
            return Decision(self.depth, False, "keep")
        old = self.depth
        k_depth, p = self.acceptance_at_depth()
        self.last_reason = (
            f"depth {old} -> {best}: predicted tokens/s per request {scores[best]:.1f} vs {current:.1f} "
            f"({gain:+.0%}); accepted drafts per step at depth {k_depth}: {sum(p):.2f}, per position "
            f"[{', '.join(f'{x:.2f}' for x in p)}]" + self._times_text("; "))
        self.depth = best
        if best == 0:
            self._at_zero = 0
        return Decision(best, True, self.last_reason)

    def _times_text(self, prefix: str) -> str:
        """The step times a decision used: measured (a median) or read off the model."""
        parts = [f"k={k}: {1e3 * t:.2f}{self._time_origin(k, t)}"
                 for k, t in ((k, self.step_time(k)) for k in self.candidates) if t is not None]
        return f"{prefix}step ms {', '.join(parts)}" if parts else ""

    def _time_origin(self, k: int, t: float) -> str:
        if k not in self.times:
            return " (model)"
        return "" if t == self.times[k] else f" (measured {1e3 * self.times[k]:.2f}, bounded by newer depths)"

    def _explore(self, depth: int) -> Decision:
        """Measure a cheaper depth's step time (never measured at this batch size) instead of modelling it."""
        old, self.depth, self._exploring = self.depth, depth, self.explore_len
        if depth == 0:
            self._at_zero = 0
        self.last_reason = (f"depth {old} -> {depth}: measure depth {depth}'s step time for {self.explore_len} steps "
                            f"(not yet measured at this batch size; modelled {1e3 * self.step_time(depth):.2f} ms)")
        return Decision(depth, True, self.last_reason)

    def _probe(self) -> Decision:
        positive = [c for c in self.candidates if c > 0]
        self._at_zero = 0
        if not positive:
            return Decision(0, False, "no positive depth to probe")
        self._probing = self.probe_len
        self.depth = positive[0]
        self.last_reason = f"depth 0 -> {self.depth}: probe acceptance for {self.probe_len} steps"
        return Decision(self.depth, True, self.last_reason)


class ShapePolicy(CostModelPolicy):
    """CostModelPolicy's chain depths (0 = no drafting) plus draft trees.

    A tree's acceptance cannot be read off a chain's per-position rates (it verifies several branches per
    position) nor its step time off the chain's line (topk-wide draft steps, a tree-masked verify), so both are
    measured, never modelled: goodput(tree) = (1 + mean accepted drafts per request) / (median step time), over the
    tree's own window (shared across batch sizes, as the chain's is) and this batch size's step times.
    - **A tree is entered only right after it was measured.** When the chain policy settles on a positive depth
      and the tree was never measured at this batch size, or `tree_retry_every` chain steps passed since it last
      ran, the tree runs for `tree_explore_len` steps; it stays when its goodput beats the best chain depth's by
      `min_gain`, else the chain resumes and the next try waits twice as long (up to `max_tree_retry_every`).
      Upstream's FA3 figures say why a tree must be tried per batch size: with one head, a tree won at 1 request
      and lost 22% at 64.
    - **On the tree**, every `decide_every` steps its fresh goodput is compared with the chain's last estimates; a
      chain depth better by `min_gain` resumes the chain (whose own window then corrects a stale estimate within
      a decision), and a full tree window with nothing accepted goes straight to depth 0.
    - Started on a tree (`initial_tree`), the chain is measured at its first decision and the two compared at the
      chain's first settled decision.
    """

    def __init__(self, candidates, initial: int, trees=(), initial_tree: DraftShape | None = None,
                 tree_window: int | collections.deque | None = None, tree_explore_len: int = 16,
                 tree_retry_every: int = 512, max_tree_retry_every: int = 8192, **kwargs):
        super().__init__(candidates, initial, **kwargs)
        self.trees = list(dict.fromkeys(trees))
        if any(t.is_chain for t in self.trees):
            raise ValueError(f"trees must have topk > 1, got {[t.text for t in self.trees]}")
        self.tree = initial_tree if initial_tree in self.trees else None  # drafting now; None: the chain
        # (tree, accepted drafts per request) per tree step
        self.tree_window: collections.deque = tree_window if isinstance(tree_window, collections.deque) else \
            collections.deque(maxlen=tree_window or self.window.maxlen or 64)
        self.tree_times: dict[DraftShape, float] = {}
        self._tree_samples: dict[DraftShape, collections.deque] = {}
        self.tree_explore_len = tree_explore_len
        self.tree_retry_every = tree_retry_every
        self.max_tree_retry_every = max(max_tree_retry_every, tree_retry_every)
        self.tree_retry_interval = tree_retry_every
        self._tree_exploring = 0
        self._since_tree = 0  # chain steps since a tree last ran
        self._pending: DraftShape | None = None  # a tree measured before the chain was, compared at its next decision

    @property
    def shape(self) -> DraftShape:
        return self.tree or DraftShape.chain(self.depth)

    def observe_shape(self, shape: DraftShape, accepted: list[int], step_seconds: float | None,
                      before_probe: bool = False) -> Decision:
        """One verify step of what ran (a chain depth or a tree), as CostModelPolicy.observe."""
        if shape.is_chain:
            return self.observe(shape.steps, accepted, step_seconds, before_probe)
        return self._observe_tree(shape, accepted, step_seconds)

    def needs_draft_state(self, lead: int) -> bool:
        return self.tree is not None or super().needs_draft_state(lead)

    # ------------------------------------------------------------------------------- chain steps
    def observe(self, depth: int, accepted: list[int], step_seconds: float | None,
                before_probe: bool = False) -> Decision:
        if self.tree is not None:  # ran before the switch to the tree took effect (the overlap scheduler's lag)
            self._record(depth, accepted, step_seconds, before_probe)
            return self._tree_decision(False, "drafting a tree")
        decision = super().observe(depth, accepted, step_seconds, before_probe)
        self._since_tree += 1
        decided = self._since_decision == 0 and not self._exploring and not self._probing
        if not self.trees or not decided or decision.changed:
            return decision
        if self._pending is not None:
            return self._compare_pending()
        if self.depth == 0:
            return decision  # drafting does not pay as a chain: the tree is tried again once it does
        due = [t for t in self.trees if t not in self.tree_times]
        if not due and self._since_tree >= self.tree_retry_interval:
            due = self.trees
        return self._explore_tree(due[0]) if due else decision

    def _explore_tree(self, tree: DraftShape) -> Decision:
        old = self.shape.label
        self.tree, self._tree_exploring, self._since_decision = tree, self.tree_explore_len, 0
        self.last_reason = (f"{old} -> {tree.label}: measure the tree's accepted drafts and step time for "
                            f"{self.tree_explore_len} steps")
        return self._tree_decision(True, self.last_reason)

    def _compare_pending(self) -> Decision:
        tree, self._pending = self._pending, None
        if self._never_accepts():  # newer than the tree's measurements: nothing would be accepted there either
            return self._tree_lost(tree, "no draft accepted in the chain's window since")
        g_tree, (k, g_chain) = self.tree_goodput(tree), self._best_chain()
        if g_tree is not None and g_chain is not None and g_tree > g_chain * (1 + self.min_gain):
            self.tree, self._since_decision = tree, 0
            self.last_reason = f"depth {self.depth} -> {tree.label}: " + self._versus(tree, g_tree, k, g_chain)
            return self._tree_decision(True, self.last_reason)
        return self._tree_lost(tree, self._versus(tree, g_tree, k, g_chain))

    def _tree_lost(self, tree: DraftShape, why: str) -> Decision:
        self.tree_retry_interval = min(2 * self.tree_retry_interval, self.max_tree_retry_every)
        self._since_tree = 0
        self.last_reason = (f"keep depth {self.depth} over {tree.label}: {why}; next try in "
                            f"{self.tree_retry_interval} steps")
        return Decision(self.depth, False, self.last_reason)

    # -------------------------------------------------------------------------------- tree steps
    def _observe_tree(self, tree: DraftShape, accepted: list[int], step_seconds: float | None) -> Decision:
        if step_seconds is not None and step_seconds > 0:
            samples = self._tree_samples.setdefault(tree, collections.deque(maxlen=self.time_samples))
            samples.append(step_seconds)
            self.tree_times[tree] = statistics.median(samples)
        if accepted:
            self.tree_window.append((tree, tuple(min(int(a), tree.steps) for a in accepted)))
        self._steps += 1
        self._since_decision += 1
        if self.tree != tree:  # ran before the switch away took effect
            return self._tree_decision(False, "keep") if self.tree else Decision(self.depth, False, "keep")
        if self._tree_exploring:
            self._tree_exploring -= 1
            if self._tree_exploring:
                return self._tree_decision(False, "exploring the tree")
            return self._judge_tree(explored=True)
        if self._steps <= self.warmup and self._tree_never_accepts(tree):
            return self._judge_tree(explored=False)  # the shared window already says so: no need to wait
        if self._steps <= self.warmup or self._since_decision < self.decide_every:
            return self._tree_decision(False, "waiting")
        return self._judge_tree(explored=False)

    def _tree_recent(self, tree: DraftShape) -> list:
        """The tree's newest steps, as `recent` reads the chain's."""
        return self.recent([e for e in self.tree_window if e[0] == tree])

    def _tree_never_accepts(self, tree: DraftShape) -> bool:
        recent = self._tree_recent(tree)
        return self._full(recent) and not any(any(a) for _, a in recent)

    def _judge_tree(self, explored: bool) -> Decision:
        tree, self._since_decision = self.tree, 0
        recent = self._tree_recent(tree)
        if 0 in self.candidates and self._tree_never_accepts(tree):
            self.tree, self.depth, self._at_zero = None, 0, 0
            self.last_reason = (f"{tree.label} -> depth 0: no draft accepted in the tree's last "
                                f"{sum(len(a) for _, a in recent)} request-steps ({len(recent)} steps)")
            return Decision(0, True, self.last_reason)
        g_tree, (k, g_chain) = self.tree_goodput(tree), self._best_chain()
        if g_chain is None:  # started on the tree: measure the chain, compare at its first settled decision
            k = max(self.depth, max(self.candidates))
            self.tree, self.depth, self._exploring, self._pending = None, k, self.explore_len, tree
            self.last_reason = f"{tree.label} -> depth {k}: measure the chain for {self.explore_len} steps"
            return Decision(k, True, self.last_reason)
        if g_tree is None:
            return self._tree_decision(False, "no estimate yet")
        versus = self._versus(tree, g_tree, k, g_chain)
        if explored and not g_tree > g_chain * (1 + self.min_gain):
            self.tree, self.depth = None, k
            self._tree_lost(tree, versus)
            self.last_reason = f"{tree.label} -> depth {k}: {versus}; next try in {self.tree_retry_interval} steps"
            return Decision(k, True, self.last_reason)
        if not explored and g_chain > g_tree * (1 + self.min_gain):
            self.tree, self.depth, self._since_tree = None, k, 0
            self.tree_retry_interval = self.tree_retry_every
            self.last_reason = f"{tree.label} -> depth {k}: {versus}"
            return Decision(k, True, self.last_reason)
        if explored:
            self.tree_retry_interval = self.tree_retry_every
            self.last_reason = f"keep {tree.label}: {versus}"
        return self._tree_decision(False, "keep")

    # ------------------------------------------------------------------------------- estimates
    def tree_accepted(self, tree: DraftShape) -> float | None:
        """Mean accepted drafts per request over the tree's window (bonus token excluded)."""
        recent = self._tree_recent(tree)
        requests = sum(len(a) for _, a in recent)
        return sum(sum(a) for _, a in recent) / requests if requests else None

    def tree_goodput(self, tree: DraftShape) -> float | None:
        e, t = self.tree_accepted(tree), self.tree_times.get(tree)
        return None if e is None or not t else (1 + e) / t

    def _best_chain(self) -> tuple[int, float | None]:
        scores = {k: self.goodput(k) for k in self.candidates}
        scores = {k: g for k, g in scores.items() if g is not None}
        if not scores:
            return self.depth, None
        best = max(scores, key=lambda k: scores[k])
        return best, scores[best]

    def _versus(self, tree: DraftShape, g_tree: float | None, k: int, g_chain: float | None) -> str:
        def rate(g):
            return "n/a" if g is None else f"{g:.1f}"
        e, t = self.tree_accepted(tree), self.tree_times.get(tree)
        measured = "" if e is None or not t else f" ({e:.2f} accepted drafts per step, {1e3 * t:.2f} ms)"
        return (f"predicted tokens/s per request {rate(g_tree)} on the tree{measured} vs {rate(g_chain)} at depth "
                f"{k}" + self._times_text("; chain "))

    def _tree_decision(self, changed: bool, reason: str) -> Decision:
        return Decision(self.tree.steps if self.tree else self.depth, changed, reason, self.tree)
