"""The reference speculative decoder: a transformers target + an Eagle3 head, decoding one request
the way SGLang's Eagle3 worker does, in plain torch (CPU or GPU). It is the eval's CPU engine, the
trainer's acceptance estimate and the oracle that server results are compared with.

Per request:
  prefill   target(prompt) -> aux states A_0..A_{L-1}, first token x_L (the "prefill token")
  extend    draft((A_t, x_{t+1}) at position t, t < L) -> the draft's distribution after x_L
  loop      propose a chain/tree from it; target verifies [x_L] + tree in one forward (tree mask,
            position = L + depth); accept a drafts + 1 bonus token; keep the accepted path in the
            target cache; draft-extend over the newly verified positions; repeat.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from sglang_ext.config import TargetConfig, resolve
from sglang_ext.core.accounting import AcceptanceStats
from sglang_ext.core.capture import AuxCapture
from sglang_ext.core.drafting import propose, tree_attention_mask
from sglang_ext.core.heads import Eagle3Head
from sglang_ext.core.layers import KVCache
from sglang_ext.core.verify import SamplingParams, target_probs, verify


@dataclasses.dataclass
class Generation:
    tokens: list[int]  # generated tokens (prompt excluded)
    stats: AcceptanceStats | None  # None without speculation
    accepted_per_step: list[int]
    finish_reason: str  # "stop" (EOS) | "length"


def head_aux_output_ids(head: Eagle3Head, target) -> list[int]:
    """The physical target layers a head reads: what the server captures for this pair (config.aux_layers.resolve,
    the one resolver), refused with field, value and fix when it cannot serve them."""
    return list(resolve(TargetConfig.from_dict(target.config.to_dict()), head.config).output_ids)


class ReferenceDecoder:
    def __init__(self, target, head: Eagle3Head | None = None, num_steps: int = 3, topk: int = 1,
                 num_draft_tokens: int | None = None, aux_output_ids: Sequence[int] | None = None):
        self.target, self.head = target.eval(), head.eval() if head is not None else None
        self.num_steps, self.topk = num_steps, topk
        self.num_draft_tokens = num_steps + 1 if topk == 1 else (num_draft_tokens or 2 * num_steps + 2)
        self.capture = None
        if head is not None:
            ids = list(aux_output_ids) if aux_output_ids is not None else head_aux_output_ids(head, target)
            self.capture = AuxCapture(target, ids)
        self.device = next(target.parameters()).device
        self.dtype = next(target.parameters()).dtype

    def close(self):
        if self.capture is not None:
            self.capture.remove()

    # ---------------------------------------------------------------------------- target calls
    def _new_cache(self):
        from transformers import DynamicCache

        try:
            return DynamicCache(config=self.target.config)
        except TypeError:
            return DynamicCache()

    def _target(self, ids: Sequence[int], positions: torch.Tensor, cache, mask: torch.Tensor | None = None):
        kw = dict(input_ids=torch.tensor([list(ids)], device=self.device), position_ids=positions[None].to(self.device),
                  past_key_values=cache, use_cache=True)
        if mask is not None:  # custom 4D additive mask (tree attention)
            add = torch.zeros(mask.shape, dtype=self.dtype, device=self.device)
            add.masked_fill_(~mask.to(self.device), torch.finfo(self.dtype).min)
            kw["attention_mask"] = add[None, None]
        logits = self.target(**kw).logits[0].float()
        aux = self.capture.concat()[0] if self.capture is not None else None
        return logits, aux

    @staticmethod
    def _keep_cache(cache, prefix_len: int, keep: torch.Tensor) -> None:
        """Keep cache entries [0, prefix_len) and prefix_len + keep (a verified tree path)."""
        for layer in cache.layers:
            idx = torch.cat([torch.arange(prefix_len, device=layer.keys.device), prefix_len + keep.to(layer.keys.device)])
            layer.keys = layer.keys.index_select(-2, idx)
            layer.values = layer.values.index_select(-2, idx)

    def _sample(self, logits: torch.Tensor, sp: SamplingParams, gen) -> int:
        if sp.greedy:
            return int(logits.argmax())
        return int(torch.multinomial(target_probs(logits, sp), 1, generator=gen))

    # -------------------------------------------------------------------------------- generate
    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int = 128,
                 sampling: SamplingParams | None = None, eos_token_ids: Sequence[int] = (),
                 seed: int = 0, speculative: bool = True) -> Generation:
        sp = sampling or SamplingParams()
        gen = torch.Generator(device=self.device).manual_seed(seed)
        eos = set(int(e) for e in eos_token_ids)
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids is empty")
        cache = self._new_cache()
        logits, aux = self._target(prompt, torch.arange(len(prompt)), cache)
        out = [self._sample(logits[-1], sp, gen)]
        if out[-1] in eos or max_new_tokens <= 1:
            return Generation(out, AcceptanceStats(self.num_steps) if speculative else None, [],
                              "stop" if out[-1] in eos else "length")
        if not speculative or self.head is None:
            return self._plain(prompt, out, cache, max_new_tokens, sp, gen, eos)
        head = self.head
        stats, per_step = AcceptanceStats(self.num_steps), []
        draft_cache = KVCache()
        d = head(torch.tensor([prompt[1:] + out], device=self.device), aux[None].to(self._head_dtype()),
                 torch.arange(len(prompt), device=self.device)[None], draft_cache)
        first_logits, first_hidden = d.logits[0, -1], d.hidden[0, -1]
        while True:
            root_pos = len(prompt) + len(out) - 1  # the last generated token is the root
            tree = propose(head, draft_cache, first_logits, first_hidden, root_pos, self.num_steps, self.topk,
                           self.num_draft_tokens)
            draft_cache.truncate(root_pos)
            ids = [out[-1]] + tree.tokens.tolist()
            positions = root_pos + tree.position_offsets()
            logits, aux = self._target(ids, positions, cache, tree_attention_mask(tree, root_pos))
            res = verify(tree, logits, sp, gen)
            keep = torch.tensor([0] + [i + 1 for i in res.accepted_nodes])
            self._keep_cache(cache, root_pos, keep)
            new = res.accepted_tokens + [res.bonus_token]
            emitted, finish = [], None
            for t in new:
                emitted.append(t)
                if t in eos:
                    finish = "stop"
                    break
                if len(out) + len(emitted) >= max_new_tokens:
                    finish = "length"
                    break
            out += emitted
            stats.add_step(len(emitted) - 1)  # a request stopping mid-run counts what it emitted
            per_step.append(len(emitted) - 1)
            if finish:
                return Generation(out, stats, per_step, finish)
            # draft extend over the verified positions root_pos .. root_pos + a
            d = head(torch.tensor([new], device=self.device), aux[keep.to(self.device)][None].to(self._head_dtype()),
                     (root_pos + torch.arange(len(new), device=self.device))[None], draft_cache)
            first_logits, first_hidden = d.logits[0, -1], d.hidden[0, -1]

    def _head_dtype(self):
        return next(self.head.parameters()).dtype

    def _plain(self, prompt, out, cache, max_new_tokens, sp, gen, eos) -> Generation:
        while True:
            logits, _ = self._target([out[-1]], torch.tensor([len(prompt) + len(out) - 1]), cache)
            out.append(self._sample(logits[-1], sp, gen))
            if out[-1] in eos:
                return Generation(out, None, [], "stop")
            if len(out) >= max_new_tokens:
                return Generation(out, None, [], "length")
