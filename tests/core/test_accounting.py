"""Acceptance accounting against hand-worked sequences (docs/metrics.md)."""

import pytest

from sglang_ext.core.accounting import (
    AcceptanceStats,
    accepted_drafts_from_sglang_accept_length,
    completion_tokens_invariant,
)


def test_chain_hand_worked():
    s = AcceptanceStats(depth=3)
    s.add_steps([3, 0, 1, 3, 2])  # 5 verify steps, 9 accepted drafts, 14 tokens
    assert s.verify_steps == 5 and s.accepted_drafts == 9
    assert s.accepted_drafts_per_step == pytest.approx(1.8)
    assert s.tokens_per_step == pytest.approx(2.8)
    assert s.draft_acceptance_rate == pytest.approx(9 / 15)
    assert s.per_position_acceptance == pytest.approx([4 / 5, 3 / 5, 2 / 5])
    assert s.conditional_acceptance == pytest.approx([4 / 5, 3 / 4, 2 / 3])
    assert s.histogram == pytest.approx([0.2, 0.2, 0.2, 0.4])
    assert completion_tokens_invariant(s) == 15  # 14 emitted by verify steps + the prefill token


def test_tree_uses_the_same_denominator_as_chain():
    # a tree of 8 nodes with depth 3 accepting 2 per step has rate 2/3, not 2/7 (SGLang divides by nodes)
    s = AcceptanceStats(depth=3)
    s.add_steps([2, 2])
    assert s.draft_acceptance_rate == pytest.approx(2 / 3)


def test_request_stopping_inside_an_accepted_run():
    # 3 steps accept 3, 3, and then 3 again, but max_new_tokens leaves room for 2 tokens in the last
    # step: it counts a = 1 (2 emitted = 1 draft + 1 more), so completion = 4 + 4 + 2 + 1 = 11
    s = AcceptanceStats(depth=3)
    s.add_steps([3, 3, 1])
    assert completion_tokens_invariant(s) == 11


def test_empty_and_merge_and_bounds():
    s = AcceptanceStats(depth=2)
    assert s.accepted_drafts_per_step == 0.0 and s.per_position_acceptance == [0.0, 0.0]
    assert s.conditional_acceptance == [0.0, 0.0] and s.histogram == [0.0, 0.0, 0.0]
    a, b = AcceptanceStats(2), AcceptanceStats(2)
    a.add_steps([2, 1])
    b.add_steps([0])
    m = a.merge(b)
    assert m.histogram_counts == [1, 1, 1] and m.accepted_drafts == 3
    assert AcceptanceStats.from_dict(m.to_dict()) == m
    with pytest.raises(ValueError):
        s.add_step(3)
    with pytest.raises(ValueError):
        a.merge(AcceptanceStats(3))


def test_sglang_accept_length_counts_the_bonus():
    # "2.746 at 3 steps means 1.746 accepted drafts, ~58%"
    a = accepted_drafts_from_sglang_accept_length(2.746)
    assert a == pytest.approx(1.746) and a / 3 == pytest.approx(0.582, abs=1e-3)


def test_acceptance_standard_error_is_the_spread_across_prompts_a_bootstrap_measures():
    import math
    import random
    import statistics

    from sglang_ext.core.accounting import accepted_drafts_per_step_se

    rng = random.Random(0)
    steps = [rng.randint(20, 60) for _ in range(32)]
    drafts = [int(s * rng.uniform(1.2, 2.4)) for s in steps]
    boot = []
    for _ in range(4000):
        idx = [rng.randrange(32) for _ in range(32)]
        boot.append(sum(drafts[i] for i in idx) / sum(steps[i] for i in idx))
    se = accepted_drafts_per_step_se(drafts, steps)
    assert abs(se - statistics.pstdev(boot)) / se < 0.1
    # equal prompts: no spread; one prompt: no estimate
    assert accepted_drafts_per_step_se([60, 60], [30, 30]) == 0.0
    assert math.isnan(accepted_drafts_per_step_se([60], [30]))


def test_paired_difference_cancels_what_the_prompts_share():
    import pytest

    from sglang_ext.core.accounting import accepted_drafts_per_step_se, paired_acceptance_difference

    steps = [40, 50, 30, 45, 60, 35]
    ref = [40, 100, 15, 80, 130, 50]  # prompts of very different difficulty
    same = paired_acceptance_difference(ref, steps, ref, steps)
    assert same["difference"] == 0.0 and same["se"] == 0.0
    # the server parted on two prompts, one up, one down: the difference is small against its paired spread,
    # which is far below the spread of either measurement across prompts
    srv_d, srv_s = [40, 104, 15, 80, 124, 50], [40, 49, 30, 45, 61, 35]
    p = paired_acceptance_difference(srv_d, srv_s, ref, steps)
    assert p["a"] == sum(srv_d) / sum(srv_s) and p["b"] == sum(ref) / sum(steps)
    assert abs(p["difference"]) < 2 * p["se"] < accepted_drafts_per_step_se(ref, steps)
    with pytest.raises(ValueError, match="same prompts"):
        paired_acceptance_difference(ref[:3], steps[:3], ref, steps)
    with pytest.raises(ValueError, match="some steps"):
        accepted_drafts_per_step_se([0], [0])


def test_impossible_counts_are_refused():
    from sglang_ext.core.accounting import AcceptanceStats, accepted_drafts_per_step_se

    for bad in (lambda: AcceptanceStats(-1), lambda: AcceptanceStats(2, [1, -5, 0]), lambda: AcceptanceStats(1, [1.5, 2]),
                lambda: accepted_drafts_per_step_se([5, 5], [0, 10]), lambda: accepted_drafts_per_step_se([5, -5], [2, 2]),
                lambda: accepted_drafts_per_step_se([float("nan"), 1], [2, 2])):
        with pytest.raises(ValueError):
            bad()
