"""Chain and tree drafting: SGLang's tree construction, the tree mask and positions."""

import torch

from sglang_ext.core import tiny
from sglang_ext.core.drafting import DraftTree, propose, tree_attention_mask
from sglang_ext.core.layers import KVCache


def test_tree_mask_and_positions():
    tree = DraftTree(tokens=torch.tensor([7, 8, 9, 4]), parents=torch.tensor([-1, -1, 0, 2]),
                     depths=torch.tensor([1, 1, 2, 3]), scores=torch.tensor([.5, .4, .3, .2]))
    m = tree.attention_mask().int().tolist()
    assert m == [[1, 0, 0, 0, 0],
                 [1, 1, 0, 0, 0],
                 [1, 0, 1, 0, 0],
                 [1, 1, 0, 1, 0],
                 [1, 1, 0, 1, 1]]
    assert tree.position_offsets().tolist() == [0, 1, 1, 2, 3]
    assert tree.children(-1) == [0, 1] and tree.path(3) == [0, 2, 3]
    full = tree_attention_mask(tree, prefix_len=3)
    assert full.shape == (5, 8) and full[:, :3].all()


def _head(vocab=64, seed=0):
    cfg = tiny.llama_config(num_layers=2, vocab=vocab, hidden=32)
    t = tiny.build_target(cfg)
    return tiny.random_head(tiny.head_config_for(cfg, "mha", [0, 1]), t, seed=seed, std=0.3), t


@torch.no_grad()
def _context(head, n=6):
    cache = KVCache()
    ids = torch.arange(1, n + 1)[None]
    aux = torch.randn(1, n, head.config.num_aux * head.config.target_hidden_size,
                      generator=torch.Generator().manual_seed(0))
    out = head(ids, aux, torch.arange(n)[None], cache)
    return cache, out.logits[0, -1], out.hidden[0, -1]


def test_chain_is_topk1_greedy_rollout():
    head, _ = _head()
    cache, logits, hidden = _context(head)
    tree = propose(head, cache, logits, hidden, root_position=6, num_steps=3, topk=1, num_draft_tokens=4)
    assert tree.parents.tolist() == [-1, 0, 1] and tree.depths.tolist() == [1, 2, 3]
    # roll out by hand: each step feeds the previous argmax at the next position
    cache2, l2, h2 = _context(head)
    toks = []
    tok, h, pos = int(l2.argmax()), h2, 6
    for _ in range(3):
        toks.append(tok)
        o = head(torch.tensor([[tok]]), h[None, None], torch.tensor([[pos]]), cache2)
        tok, h, pos = int(o.logits[0, -1].argmax()), o.hidden[0, -1], pos + 1
    assert tree.tokens.tolist() == toks


def test_tree_keeps_best_nodes_by_cumulative_probability():
    head, _ = _head()
    cache, logits, hidden = _context(head)
    n_ctx = len(cache)
    tree = propose(head, cache, logits, hidden, root_position=6, num_steps=3, topk=4, num_draft_tokens=8)
    assert len(tree) == 7
    p1 = torch.softmax(logits, -1)
    top = p1.topk(4)
    # depth-1 candidates are the 4 best tokens with their probabilities as scores
    d1 = [i for i in range(7) if tree.depths[i] == 1]
    for i in d1:
        assert float(tree.scores[i]) == float(p1[tree.tokens[i]])
        assert int(tree.tokens[i]) in top.indices.tolist()
    # scores never exceed the parent's; kept nodes are the best 7 of all candidates (sorted by creation)
    for i in range(7):
        par = int(tree.parents[i])
        if par >= 0:
            assert tree.scores[i] <= tree.scores[par] and tree.depths[i] == tree.depths[par] + 1
    assert len(cache) > n_ctx  # drafted entries were appended; the caller truncates
    cache.truncate(n_ctx)
    assert len(cache) == n_ctx


def test_draft_vocab_mapping_is_applied():
    head, t = _head(vocab=64)
    cfg2 = tiny.head_config_for(t.config, "mha", [0, 1], draft_vocab_size=16)
    h2 = tiny.random_head(cfg2, t, std=0.3)
    hot = torch.arange(16) * 4 + 1
    h2.set_vocab_mapping(hot)
    cache, logits, hidden = _context(h2)
    tree = propose(h2, cache, logits, hidden, root_position=6, num_steps=2, topk=2, num_draft_tokens=4)
    assert all(int(x) in hot.tolist() for x in tree.tokens)
