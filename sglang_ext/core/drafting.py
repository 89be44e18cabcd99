"""Draft proposal: chain (top-1) and tree (top-k per step), built the way SGLang 0.5.17 builds
them (``select_top_k_tokens`` + ``organize_draft_results``):

  depth 1: the k best tokens of the draft's distribution after the last verified token;
  depth i: each of the k nodes expanded at depth i-1 proposes its k best children, scored by
           cumulative probability (parent score x child probability); the k best of those k*k
           candidates are expanded at depth i+1;
  finally the num_draft_tokens - 1 best candidates over all depths form the tree (a node's
  score never exceeds its parent's, so the parents of kept nodes are kept).

Chain drafting is the topk == 1 case. A tree is verified by one target forward over
[root] + nodes with `tree_attention_mask`, each node at position root_position + depth.
"""

from __future__ import annotations

import dataclasses

import torch

from sglang_ext.core.heads import Eagle3Head
from sglang_ext.core.layers import KVCache


@dataclasses.dataclass
class DraftTree:
    tokens: torch.Tensor  # [n] target token ids of the draft nodes (root excluded)
    parents: torch.Tensor  # [n] parent node index, -1 = the root (the last verified token)
    depths: torch.Tensor  # [n] 1..num_steps
    scores: torch.Tensor  # [n] cumulative draft probability

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1 = root), in tree order (the order SGLang verifies them)."""
        return [i for i in range(len(self)) if int(self.parents[i]) == node]

    def path(self, node: int) -> list[int]:
        """Nodes from depth 1 down to `node`."""
        out = []
        while node != -1:
            out.append(node)
            node = int(self.parents[node])
        return out[::-1]

    def attention_mask(self) -> torch.Tensor:
        """[n+1, n+1] bool over [root] + nodes: each attends to itself, the root and its ancestors."""
        n = len(self)
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        mask[:, 0] = True
        for i in range(n):
            for j in self.path(i):
                mask[i + 1, j + 1] = True
        return mask

    def position_offsets(self) -> torch.Tensor:
        """[n+1]: 0 for the root, the depth for each node."""
        return torch.cat([torch.zeros(1, dtype=torch.long, device=self.depths.device), self.depths.long()])


def tree_attention_mask(tree: DraftTree, prefix_len: int) -> torch.Tensor:
    """[n+1, prefix_len + n+1] bool: the prefix is visible to every tree token."""
    return torch.cat([torch.ones(len(tree) + 1, prefix_len, dtype=torch.bool), tree.attention_mask()], dim=1)


@torch.no_grad()
def propose(head: Eagle3Head, cache: KVCache, first_logits: torch.Tensor, first_hidden: torch.Tensor,
            root_position: int, num_steps: int, topk: int, num_draft_tokens: int) -> DraftTree:
    """Build a draft tree.

    cache: the draft's KV cache over the verified context (length = context entries); entries
           appended here are the drafted nodes' and must be dropped by the caller afterwards.
    first_logits [draft_vocab], first_hidden [hidden]: the draft's output at the last verified
           position (its distribution for the token after the root).
    root_position: the sequence position of the root (the last verified token). EAGLE feeds the
           draft a token at the position of the token before it, so depth-i nodes are fed at
           root_position + i - 1, and the target verifies them at root_position + i.
    """
    if topk == 1:
        num_draft_tokens = num_steps + 1
    if not 1 <= num_draft_tokens - 1 <= topk + (num_steps - 1) * topk * topk:
        raise ValueError(f"num_draft_tokens={num_draft_tokens} must be in 2..{1 + topk + (num_steps - 1) * topk ** 2}"
                         f" for topk={topk}, num_steps={num_steps}")
    device = first_logits.device
    context_len = len(cache)
    probs = torch.softmax(first_logits.float(), dim=-1)
    p, idx = probs.topk(topk)
    # candidate pool (SGLang's score_list / token_list / parents), in creation order
    cand_scores, cand_tokens, cand_parent, cand_depth = [p], [idx], [torch.full((topk,), -1, device=device)], \
        [torch.ones(topk, dtype=torch.long, device=device)]
    frontier = torch.arange(topk, device=device)  # candidate ids expanded at the next step
    frontier_scores, frontier_tokens = p, idx
    frontier_hidden = first_hidden.expand(topk, -1)
    frontier_cache_rows = [[] for _ in range(topk)]  # cache entries on each frontier node's path
    n_cand = topk
    for depth in range(2, num_steps + 1):
        # feed the frontier (draft ids -> target ids for the embedding); each node attends to the
        # context, the entries of its own path, and itself
        positions = torch.full((1, topk), root_position + depth - 2, device=device)
        base = len(cache)
        mask = torch.zeros(topk, base + topk, dtype=torch.bool, device=device)
        mask[:, :context_len] = True
        for r, rows in enumerate(frontier_cache_rows):
            mask[r, rows] = True
            mask[r, base + r] = True
        out = head(head.draft_to_target(frontier_tokens)[None], frontier_hidden[None], positions, cache, mask[None])
        child_p, child_idx = torch.softmax(out.logits[0].float(), dim=-1).topk(topk)  # [k, k]
        expand = frontier_scores[:, None] * child_p
        cand_scores.append(expand.flatten())
        cand_tokens.append(child_idx.flatten())
        cand_parent.append(frontier.repeat_interleave(topk))
        cand_depth.append(torch.full((topk * topk,), depth, dtype=torch.long, device=device))
        best_p, best = expand.flatten().topk(topk)
        rows = [frontier_cache_rows[int(b) // topk] + [base + int(b) // topk] for b in best]
        frontier = n_cand + best
        frontier_scores, frontier_tokens = best_p, child_idx.flatten()[best]
        frontier_hidden = out.hidden[0][best // topk]
        frontier_cache_rows = rows
        n_cand += topk * topk
    scores = torch.cat(cand_scores)
    tokens = torch.cat(cand_tokens)
    parents = torch.cat(cand_parent).long()
    depths = torch.cat(cand_depth)
    keep = scores.topk(num_draft_tokens - 1).indices.sort().values
    remap = {int(c): i for i, c in enumerate(keep)}
    kept_parents = []
    for c in keep:
        par = int(parents[c])
        if par != -1 and par not in remap:  # only on exact ties; SGLang would keep an orphan
            raise RuntimeError("draft tree selection kept a node without its parent (score tie)")
        kept_parents.append(-1 if par == -1 else remap[par])
    return DraftTree(tokens=head.draft_to_target(tokens[keep]), parents=torch.tensor(kept_parents, device=device),
                     depths=depths[keep], scores=scores[keep])
