"""Acceptance accounting: one set of definitions, used by the reference decoder, the trainer's
estimate, the eval reports and the SGLang adapters. See docs/metrics.md.

For one verify step of one request with `a` accepted drafts (0 <= a <= depth, depth =
speculative_num_steps), the step emits a + 1 tokens: the a drafts plus one token the target
supplies itself (the bonus / correction token), which is never counted as accepted.

* accepted drafts per step  = mean a                      ("acceptance length", no bonus)
* tokens per step           = mean (a + 1)                (SGLang's "accept len")
* draft acceptance rate     = sum a / (steps * depth)     (same denominator for chain and tree)
* per-position acceptance   = P(a >= i), i = 1..depth, and P(a >= i | a >= i - 1)
* histogram                 = P(a = j), j = 0..depth

A request that stops inside an accepted run (EOS or max_new_tokens) counts only what it emitted:
that step's a is (tokens emitted in the step) - 1. Then, per finished request,
completion_tokens = sum over steps of (a + 1) + 1, the last 1 being the token prefill produced.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Iterable


def _whole(x) -> bool:
    """A count: >= 0 and integral (Python, numpy or 0-d torch integers alike; not a float or a bool)."""
    try:
        return not isinstance(x, bool) and operator.index(x) >= 0
    except TypeError:
        return False


@dataclasses.dataclass
class AcceptanceStats:
    depth: int
    histogram_counts: list[int] = dataclasses.field(default_factory=list)  # [j] = steps with a == j

    def __post_init__(self):
        if not _whole(self.depth):
            raise ValueError(f"depth={self.depth!r}: a whole number of draft steps >= 0")
        if not all(_whole(c) for c in self.histogram_counts):
            raise ValueError(f"histogram_counts={self.histogram_counts}: counts of verify steps, whole numbers >= 0")
        if not self.histogram_counts:
            self.histogram_counts = [0] * (self.depth + 1)
        if len(self.histogram_counts) != self.depth + 1:
            raise ValueError(f"histogram_counts has {len(self.histogram_counts)} bins, depth {self.depth} needs "
                             f"{self.depth + 1}")

    # ---------------------------------------------------------------------------------- updates
    def add_step(self, accepted_drafts: int) -> None:
        if not 0 <= accepted_drafts <= self.depth:
            raise ValueError(f"accepted_drafts={accepted_drafts} outside 0..depth={self.depth}")
        self.histogram_counts[accepted_drafts] += 1

    def add_steps(self, accepted: Iterable[int]) -> None:
        for a in accepted:
            self.add_step(a)

    def merge(self, other: "AcceptanceStats") -> "AcceptanceStats":
        if other.depth != self.depth:
            raise ValueError(f"cannot merge depth {other.depth} into depth {self.depth}")
        return AcceptanceStats(self.depth, [x + y for x, y in zip(self.histogram_counts, other.histogram_counts)])

    def resized(self, depth: int) -> "AcceptanceStats":
        """The same counts under a larger depth (a server whose depth changes per step, e.g.
        SGLang's --speculative-adaptive, is accounted at the largest depth it ran)."""
        if depth < self.depth and any(self.histogram_counts[depth + 1:]):
            raise ValueError(f"cannot shrink depth {self.depth} to {depth}: steps accepted more")
        counts = (self.histogram_counts + [0] * (depth + 1))[:depth + 1]
        return AcceptanceStats(depth, counts)

    @classmethod
    def from_histogram(cls, counts: Iterable[int], depth: int | None = None) -> "AcceptanceStats":
        """From SGLang's per-request histogram (`spec_correct_drafts_histogram`: [j] = steps with
        j correct drafts, cut after the largest j seen)."""
        counts = [int(c) for c in counts]
        depth = max(depth or 0, len(counts) - 1, 1)
        return cls(depth, (counts + [0] * (depth + 1))[:depth + 1])

    # --------------------------------------------------------------------------------- readouts
    @property
    def verify_steps(self) -> int:
        return sum(self.histogram_counts)

    @property
    def accepted_drafts(self) -> int:
        return sum(j * c for j, c in enumerate(self.histogram_counts))

    @property
    def emitted_tokens(self) -> int:
        """Tokens emitted by verify steps (drafts + bonus), excluding the prefill token."""
        return self.accepted_drafts + self.verify_steps

    @property
    def accepted_drafts_per_step(self) -> float:
        return self.accepted_drafts / self.verify_steps if self.verify_steps else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.emitted_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def draft_acceptance_rate(self) -> float:
        denom = self.verify_steps * self.depth
        return self.accepted_drafts / denom if denom else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """P(a >= i) for i = 1..depth."""
        n = self.verify_steps
        return [sum(self.histogram_counts[i:]) / n if n else 0.0 for i in range(1, self.depth + 1)]

    @property
    def conditional_acceptance(self) -> list[float]:
        """P(a >= i | a >= i - 1) for i = 1..depth (0 where nothing reached position i - 1)."""
        out = []
        for i in range(1, self.depth + 1):
            reached = sum(self.histogram_counts[i - 1:])
            out.append(sum(self.histogram_counts[i:]) / reached if reached else 0.0)
        return out

    @property
    def histogram(self) -> list[float]:
        n = self.verify_steps
        return [c / n if n else 0.0 for c in self.histogram_counts]

    def to_dict(self) -> dict:
        return {"depth": self.depth, "verify_steps": self.verify_steps, "accepted_drafts": self.accepted_drafts,
                "accepted_drafts_per_step": self.accepted_drafts_per_step, "tokens_per_step": self.tokens_per_step,
                "draft_acceptance_rate": self.draft_acceptance_rate,
                "per_position_acceptance": self.per_position_acceptance,
                "conditional_acceptance": self.conditional_acceptance, "histogram": self.histogram,
                "histogram_counts": list(self.histogram_counts)}

    @classmethod
    def from_dict(cls, d: dict) -> "AcceptanceStats":
        return cls(int(d["depth"]), [int(x) for x in d["histogram_counts"]])


def stop_truncation(correct_drafts: int, verify_steps: int, completion_tokens: int, last_step_drafts: int) -> int:
    """Drafts a finished request's last verify step accepted but did not emit because the request
    stopped inside the run (EOS, stop string, max_new_tokens). SGLang 0.5.17 counts the whole run
    per request; our definition counts what was emitted, so that step's a drops by this number.
    0 when nothing was cut, or when the counts cannot be explained by one cut step (a retracted
    and re-prefilled request emits tokens outside verify steps)."""
    cut = correct_drafts + verify_steps - (completion_tokens - 1)
    return cut if 0 < cut <= last_step_drafts else 0


def apply_stop_truncation(histogram_counts: list[int], last_step_drafts: int, cut: int) -> None:
    """Move the last step from bin `last_step_drafts` to `last_step_drafts - cut` (in place)."""
    if cut:
        histogram_counts[last_step_drafts] -= 1
        histogram_counts[last_step_drafts - cut] += 1


def completion_tokens_invariant(stats: AcceptanceStats) -> int:
    """completion_tokens a finished request must report: sum(a + 1) + 1 (the prefill token)."""
    return stats.emitted_tokens + 1


def accepted_drafts_from_sglang_accept_length(accept_length: float) -> float:
    """SGLang's accept length (log line, avg_spec_accept_length) counts the bonus token: subtract it."""
    return accept_length - 1.0


# ---------------------------------------------------------------------------------- noise across prompts
# Accepted drafts per step over a prompt set is a ratio of sums (drafts / steps), and steps within a prompt are
# correlated (a prompt is easy or hard throughout), so its noise is measured across prompts, not steps: the
# linearised (delta-method) standard error of a ratio estimator with the prompt as the sampling unit. Two
# measurements of one head on the same prompts (the server and the reference decoder, whose greedy outputs can
# part under bf16) are compared as a paired difference, which cancels what the prompts share.

def _ratio_residuals(drafts: list[int], steps: list[int]) -> tuple[float, list[float]]:
    for d, s in zip(drafts, steps):  # impossible counts would give a number, not an error
        if not (0 <= s and 0 <= d and (s > 0 or d == 0)) or d != d or s != s:
            raise ValueError(f"a prompt with {d} accepted drafts in {s} verify steps: counts are >= 0, and drafts need "
                             "steps")
    total = sum(steps)
    if len(drafts) != len(steps) or total <= 0:
        raise ValueError(f"need one (drafts, steps) pair per prompt and some steps; got {len(drafts)} drafts, "
                         f"{len(steps)} step counts, {total} steps")
    ratio = sum(drafts) / total
    return ratio, [(d - ratio * s) / total for d, s in zip(drafts, steps)]


def _spread(residuals: list[float]) -> float:
    n = len(residuals)
    return (n / (n - 1) * sum(r * r for r in residuals)) ** 0.5 if n > 1 else float("nan")


def accepted_drafts_per_step_se(drafts: list[int], steps: list[int]) -> float:
    """Standard error of sum(drafts) / sum(steps) with prompts as the unit (nan for one prompt)."""
    return _spread(_ratio_residuals(drafts, steps)[1])


def paired_acceptance_difference(drafts_a: list[int], steps_a: list[int], drafts_b: list[int],
                                 steps_b: list[int]) -> dict:
    """A - B in accepted drafts per step on the same prompts (same order), with the paired standard error."""
    if len(drafts_a) != len(drafts_b):
        raise ValueError(f"paired comparison needs the same prompts: {len(drafts_a)} against {len(drafts_b)}")
    ra, ea = _ratio_residuals(drafts_a, steps_a)
    rb, eb = _ratio_residuals(drafts_b, steps_b)
    return {"a": ra, "b": rb, "difference": ra - rb, "se": _spread([x - y for x, y in zip(ea, eb)]),
            "prompts": len(drafts_a)}


def pair_with_reference(measured: list[dict], reference: list[dict], eos: int | None = None) -> dict:
    """One head measured twice on the same prompts (rows of output_ids, verify_steps, accepted_drafts; same order):
    greedy outputs part under bf16 (another kernel, another batch), and a parted prompt accepts differently from
    there on, so "the same acceptance" means equal within the paired noise (|difference| <= 2 standard errors),
    and, on the prompts whose outputs are identical, close to equal. A trailing `eos` is ignored in the identity
    (a server may or may not return it). One prompt: no spread, so `paired_se` and `within_noise` are None."""
    def ids(r):
        out = list(r["output_ids"])
        return out[:-1] if eos is not None and out and out[-1] == eos else out

    same = [i for i, (m, r) in enumerate(zip(measured, reference)) if ids(m) == ids(r)]
    pair = paired_acceptance_difference([m["accepted_drafts"] for m in measured], [m["verify_steps"] for m in measured],
                                        [r["accepted_drafts"] for r in reference],
                                        [r["verify_steps"] for r in reference])

    def rate(rows):
        steps = sum(rows[i]["verify_steps"] for i in same)
        return sum(rows[i]["accepted_drafts"] for i in same) / steps if steps else None

    se = None if math.isnan(pair["se"]) else pair["se"]
    return {"measured": pair["a"], "reference": pair["b"], "paired_difference": pair["difference"], "paired_se": se,
            "within_noise": None if se is None else abs(pair["difference"]) <= 2 * se,
            "identical_outputs": len(same), "measured_on_identical": rate(measured),
            "reference_on_identical": rate(reference)}
