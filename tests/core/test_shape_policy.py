"""The drafting-shape policy (sglang_ext.core.adaptive.ShapePolicy): chain depths, no drafting and a draft tree,
chosen per batch size from measured step times and acceptance, driven by synthetic traces."""

import collections
import random

import pytest

from sglang_ext.core.adaptive import DraftShape, ShapePolicy

TREE = DraftShape(4, 3, 8)


def chain_accepted(rng, k, p):
    a = 0
    while a < k and rng.random() < p:
        a += 1
    return a


def drive(policy, steps, p_chain, p_tree, tree_ms, batch=1, base=10.0, per_draft=1.0, seed=0):
    """Chain depth k: each draft accepted with probability p_chain given the previous, (base + per_draft * k) ms
    per step; the tree: p_tree per position, tree_ms per step. Returns the shapes that ran and the decisions."""
    rng = random.Random(seed)
    trace = []
    for _ in range(steps):
        shape = policy.shape
        if shape.is_chain:
            acc = [chain_accepted(rng, shape.steps, p_chain) for _ in range(batch)]
            t = (base + per_draft * shape.steps) / 1e3
        else:
            acc = [chain_accepted(rng, shape.steps, p_tree) for _ in range(batch)]
            t = tree_ms / 1e3
        trace.append((shape, policy.observe_shape(shape, acc, t)))
    return trace


def share_on_tree(trace, start=0):
    return sum(not s.is_chain for s, _ in trace[start:]) / len(trace[start:])


def test_a_tree_that_pays_is_found_and_kept():
    """Batch 1: the tree accepts 2.4 drafts per step against the chain's 1.7 at 1.15x the chain's step time."""
    pol = ShapePolicy([0, 1, 3], initial=3, trees=[TREE])
    trace = drive(pol, 1500, p_chain=0.7, p_tree=0.9, tree_ms=13.0 * 1.15)
    assert pol.tree == TREE
    entered = next(d for _, d in trace if d.changed and d.tree == TREE)
    assert "depth 3 -> tree 4x3x8" in entered.reason and "measure the tree" in entered.reason
    assert share_on_tree(trace, 200) > 0.97


def test_a_tree_that_does_not_pay_costs_little_and_is_retried_less_often():
    """64 requests: the tree's verify costs twice the chain's step (FA3 measured 0.78x of the chain there)."""
    pol = ShapePolicy([0, 1, 3], initial=3, trees=[TREE], tree_retry_every=256, max_tree_retry_every=2048)
    trace = drive(pol, 6000, p_chain=0.7, p_tree=0.8, tree_ms=26.0, batch=64)
    assert pol.tree is None and pol.depth == 3
    tries = [i for i, (_, d) in enumerate(trace) if d.changed and d.tree == TREE]
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert len(tries) >= 3 and all(b > a for a, b in zip(gaps, gaps[1:3]))  # backs off
    assert share_on_tree(trace) < 0.03
    left = next(d for _, d in trace if d.changed and "-> depth 3" in d.reason)
    assert left.reason.startswith("tree 4x3x8 (topk 4, 3 steps, 8 tokens) -> depth 3: predicted tokens/s")
    assert "next try in 512 steps" in left.reason


def test_started_on_the_tree_measures_the_chain_and_keeps_the_better():
    pol = ShapePolicy([0, 1, 3], initial=3, trees=[TREE], initial_tree=TREE)
    trace = drive(pol, 600, p_chain=0.7, p_tree=0.72, tree_ms=20.0, batch=8)  # the tree accepts no more, costs more
    assert trace[0][0] == TREE and pol.tree is None and pol.depth == 3
    assert any("measure the chain" in d.reason for _, d in trace)
    pol = ShapePolicy([0, 1, 3], initial=3, trees=[TREE], initial_tree=TREE)
    trace = drive(pol, 600, p_chain=0.5, p_tree=0.9, tree_ms=14.0)
    assert pol.tree == TREE and share_on_tree(trace, 300) == 1.0


def test_acceptance_collapse_on_the_tree_stops_drafting_and_the_tree_waits_while_at_depth_0():
    pol = ShapePolicy([0, 1, 3], initial=3, trees=[TREE], initial_tree=TREE, probe_every=200)
    drive(pol, 300, p_chain=0.5, p_tree=0.9, tree_ms=14.0)
    assert pol.tree == TREE
    trace = drive(pol, 2000, p_chain=0.0, p_tree=0.0, tree_ms=14.0, batch=8, seed=1)
    # the tree's goodput falls first, below the chain's last estimate; the chain's own window then finds nothing
    stop = next(i for i, (_, d) in enumerate(trace) if d.changed and d.depth == 0)
    assert stop < 40 and pol.shape == DraftShape.chain(0)
    assert "no draft accepted in the last 64 request-steps" in trace[stop][1].reason
    assert share_on_tree(trace) < 0.01 and not any(d.tree == TREE and d.changed for _, d in trace)


def test_a_step_that_ran_before_the_switch_is_recorded_not_decided():
    """Under the overlap scheduler the step after a switch may still be the old shape's."""
    pol = ShapePolicy([0, 1, 3], initial=3, trees=[TREE], initial_tree=TREE)
    d = pol.observe(3, [2], 0.013)  # a chain step while the tree is chosen
    assert not d.changed and d.tree == TREE and pol.times[3] == 0.013
    pol = ShapePolicy([0, 1, 3], initial=3, trees=[TREE])
    d = pol.observe_shape(TREE, [3], 0.015)  # a tree step while the chain is chosen
    assert not d.changed and d.tree is None and pol.tree_times[TREE] == 0.015


def test_batch_sizes_share_the_tree_window_not_its_step_times():
    window = collections.deque(maxlen=64)
    small = ShapePolicy([0, 1, 3], initial=3, trees=[TREE], initial_tree=TREE, tree_window=window)
    trace = drive(small, 40, p_chain=0.5, p_tree=0.0, tree_ms=14.0, batch=8)
    stop = next(d for _, d in trace if d.changed)
    assert stop.depth == 0 and stop.tree is None and "no draft accepted in the tree's last" in stop.reason
    big = ShapePolicy([0, 1, 3], initial=3, trees=[TREE], initial_tree=TREE, tree_window=window)
    assert big.tree_accepted(TREE) == 0.0 and TREE not in big.tree_times
    first = big.observe_shape(TREE, [0] * 64, 0.02)  # its first step: no warm-up on a tree that never accepts
    assert first.changed and first.depth == 0 and first.tree is None


def test_draft_shapes_name_what_is_wrong():
    assert DraftShape.parse("4x3x8") == TREE and TREE.label == "tree 4x3x8 (topk 4, 3 steps, 8 tokens)"
    assert DraftShape.chain(3) == DraftShape(1, 3, 4) and DraftShape.chain(0).label == "depth 0"
    with pytest.raises(ValueError, match=r"TOPKxSTEPSxTOKENS \(e.g. 4x3x8\), got '4,3,8'"):
        DraftShape.parse("4,3,8")
    with pytest.raises(ValueError, match="verifies 2 to 21 tokens"):
        DraftShape(4, 2, 40)
    with pytest.raises(ValueError, match="a chain .* verifies 4 tokens, got 1x3x8"):
        DraftShape(1, 3, 8)
    with pytest.raises(ValueError, match="trees must have topk > 1"):
        ShapePolicy([0, 1, 3], initial=3, trees=[DraftShape.chain(3)])
