"""Verification of a draft tree against the target's logits at [root] + nodes.

* greedy: follow, from the root, the child whose token is the target's argmax; the longest such
  path is accepted and the target's argmax after it is the bonus token.
* sampling: SGLang's target-only tree rejection sampling (drafts are deterministic top-k picks):
  at a node with target distribution p, try its children in order, accepting child c with
  probability p'(c) where p' is p renormalised after removing the children already rejected; if
  all are rejected (or the node is a leaf) the bonus is drawn from p'. Every emitted token is
  therefore an exact sample of the target's (temperature / top-k / top-p processed) distribution.
"""

from __future__ import annotations

import dataclasses

import torch

from sglang_ext.core.drafting import DraftTree


@dataclasses.dataclass
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def target_probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """The distribution the target samples from: temperature, then top-k, then top-p."""
    logits = logits.float() / max(sp.temperature, 1e-6)
    if sp.top_k and sp.top_k < logits.shape[-1]:
        kth = logits.topk(sp.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sp.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > sp.top_p  # keep the smallest set reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


@dataclasses.dataclass
class VerifyResult:
    accepted_nodes: list[int]  # node indices of the accepted path, depth 1 first
    accepted_tokens: list[int]
    bonus_token: int

    @property
    def accepted_drafts(self) -> int:
        return len(self.accepted_nodes)


def verify(tree: DraftTree, target_logits: torch.Tensor, sp: SamplingParams,
           generator: torch.Generator | None = None) -> VerifyResult:
    """target_logits [n+1, vocab]: row 0 at the root, row i+1 at node i."""
    node, path = -1, []
    while True:
        row = target_logits[node + 1]
        children = tree.children(node)
        if sp.greedy:
            best = int(row.argmax())
            nxt = next((c for c in children if int(tree.tokens[c]) == best), None)
            if nxt is None:
                return VerifyResult(path, [int(tree.tokens[i]) for i in path], best)
        else:
            p = target_probs(row, sp).clone()
            nxt = None
            for c in children:
                tok = int(tree.tokens[c])
                mass = float(p.sum())
                if mass > 0 and torch.rand((), generator=generator, device=p.device).item() < float(p[tok]) / mass:
                    nxt = c
                    break
                p[tok] = 0.0
            if nxt is None:
                bonus = int(torch.multinomial(p / p.sum(), 1, generator=generator))
                return VerifyResult(path, [int(tree.tokens[i]) for i in path], bonus)
        path.append(nxt)
        node = nxt
