"""Eagle3 draft heads in the two serving formats, with weight loading and saving beside them.

* MHA (Llama-style), SGLang ``LlamaForCausalLMEagle3`` / vLLM ``Eagle3LlamaForCausalLM`` layout:
  ``fc``, ``midlayer.{self_attn.{q,k,v,o}_proj, mlp, input_layernorm, hidden_norm,
  post_attention_layernorm}``, ``norm``, ``lm_head``, ``d2t``, ``t2d``.
* MLA (DeepSeek-style), SGLang ``Eagle3DeepseekV2ForCausalLM`` layout: ``fc``,
  ``layers.0.self_attn.{q_a_proj, q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa,
  kv_a_layernorm, kv_b_proj, o_proj}``, the same norms and MLP under ``layers.0``, ``norm``,
  ``lm_head``; EAGLE-3.1 ``fc_norm.{i}`` and ``norm_output``.

One draft step (identical in both formats, as in SGLang):
    h   = fc(concat(aux states))            (or the previous step's hidden state)
    x   = concat(input_layernorm(embed(token)), hidden_norm(h))          [2 * hidden]
    r   = attention(x) + h
    out = mlp(post_attention_layernorm(r)) + r
    logits = lm_head(norm(out));  next hidden = out (or norm(out) with norm_output)
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Mapping

import torch
from torch import nn

from sglang_ext.config.draft import Eagle3DraftConfig
from sglang_ext.config.weights import weight_map
from sglang_ext.core.layers import MLP, KVCache, RMSNorm, RotaryEmbedding, attention
from sglang_ext.core.ttt_attention import TTTCache
from sglang_ext.errors import ConfigError


def head_config_for(target_config, head_format: str, aux_layer_ids, draft_vocab_size=None,
                    **overrides) -> Eagle3DraftConfig:
    """A head config sized like the target: MHA with the target's width and head layout, MLA with
    its MLA dimensions (DeepSeek-like small ones under an MHA target); `overrides` win."""
    t = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    hidden = t.hidden_size
    cfg = dict(head_format=head_format, hidden_size=hidden, intermediate_size=t.intermediate_size,
               num_attention_heads=t.num_attention_heads, vocab_size=t.vocab_size, target_hidden_size=hidden,
               num_aux=len(aux_layer_ids), aux_layer_ids=tuple(aux_layer_ids), draft_vocab_size=draft_vocab_size,
               rms_norm_eps=t.rms_norm_eps, max_position_embeddings=t.max_position_embeddings)
    rope = getattr(t, "rope_parameters", None) or {}
    cfg["rope_theta"] = float(rope.get("rope_theta", getattr(t, "rope_theta", 10000.0)))
    if head_format == "mha":
        kv = getattr(t, "num_key_value_heads", None) or t.num_attention_heads
        cfg.update(num_key_value_heads=kv if t.num_attention_heads % kv == 0 else t.num_attention_heads,
                   head_dim=getattr(t, "head_dim", None) or hidden // t.num_attention_heads)
        if getattr(t, "qk_nope_head_dim", None):  # MHA head under an MLA target: a plain head size
            cfg["head_dim"] = 64 if hidden >= 256 else 32
    else:
        for f in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            cfg[f] = getattr(t, f, None)
        if cfg["kv_lora_rank"] is None:  # MLA head under an MHA target: DeepSeek-like small dims
            cfg.update(q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
    cfg.update(overrides)
    if cfg.get("aux_layer_ids") is not None:
        cfg["aux_layer_ids"] = tuple(cfg["aux_layer_ids"])
    return Eagle3DraftConfig(**cfg)


class MHAAttention(nn.Module):
    """Llama attention over the 2*hidden input, grouped-query, NeoX RoPE."""

    def __init__(self, cfg: Eagle3DraftConfig):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
        if self.n_heads % self.n_kv:
            raise ConfigError("num_key_value_heads", self.n_kv,
                              f"does not divide num_attention_heads={self.n_heads}", "use a divisor of it")
        d_in = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(d_in, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_in, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_in, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.rope = RotaryEmbedding(self.head_dim, cfg.rope_theta, cfg.rope_scaling, interleaved=False)
        self.scale = self.head_dim ** -0.5 * self.rope.softmax_scale_factor

    def forward(self, x, positions, cache: KVCache | TTTCache | None, mask):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = self.rope(q, positions), self.rope(k, positions)
        out = attention(q, k, v, mask, self.scale) if cache is None else cache.attend(q, k, v, mask, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLAAttention(nn.Module):
    """DeepSeek multi-latent attention over the 2*hidden input: low-rank q (or plain q_proj),
    compressed kv latent + decoupled RoPE key shared by all heads (interleaved RoPE).
    Computed naively (keys/values expanded per head); SGLang's absorbed kernels compute the same."""

    def __init__(self, cfg: Eagle3DraftConfig):
        super().__init__()
        for f in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(cfg, f) is None:
                raise ConfigError(f, None, "missing for an MLA head", f"set {f} (e.g. the target's value)")
        self.n_heads = cfg.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        qk = self.nope + self.rope_dim
        d_in = 2 * cfg.hidden_size
        self.q_lora_rank = cfg.q_lora_rank
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(d_in, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.n_heads * qk, bias=False)
        else:
            self.q_proj = nn.Linear(d_in, self.n_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d_in, cfg.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, cfg.hidden_size, bias=False)
        self.rope = RotaryEmbedding(self.rope_dim, cfg.rope_theta, cfg.rope_scaling, interleaved=True)
        self.scale = qk ** -0.5 * self.rope.softmax_scale_factor

    def forward(self, x, positions, cache: KVCache | TTTCache | None, mask):
        b, t, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        q = q.view(b, t, self.n_heads, -1).transpose(1, 2)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_c)).view(b, t, self.n_heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_pe = self.rope(q_pe, positions)
        k_pe = self.rope(k_pe.view(b, 1, t, self.rope_dim), positions).expand(b, self.n_heads, t, self.rope_dim)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe], dim=-1)
        out = attention(q, k, v, mask, self.scale) if cache is None else cache.attend(q, k, v, mask, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, cfg: Eagle3DraftConfig):
        super().__init__()
        self.self_attn = MHAAttention(cfg) if cfg.head_format == "mha" else MLAAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def attention_input(self, embeds, hidden):
        """What the attention reads: [input_layernorm(embeds), hidden_norm(hidden)], 2 * hidden wide."""
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def forward(self, embeds, hidden, positions, cache, mask):
        x = self.attention_input(embeds, hidden)
        residual = self.self_attn(x, positions, cache, mask) + hidden
        return self.mlp(self.post_attention_layernorm(residual)) + residual


@dataclasses.dataclass
class HeadOutput:
    logits: torch.Tensor  # [B, T, draft_vocab]
    hidden: torch.Tensor  # [B, T, hidden]: what the next draft step reads


class Eagle3Head(nn.Module):
    """An Eagle3 draft head. `embed_tokens` is the target's embedding (shared, frozen);
    `lm_head` projects to the draft vocabulary, mapped back to target ids by `d2t`."""

    def __init__(self, cfg: Eagle3DraftConfig):
        super().__init__()
        if cfg.num_aux * cfg.target_hidden == cfg.hidden_size:
            raise ConfigError("target_hidden_size", cfg.target_hidden,
                              f"{cfg.num_aux} aux states of this width equal the head's hidden size, so SGLang "
                              "cannot tell aux states from a draft step's hidden state", "change either size")
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        aux_width = cfg.target_hidden * cfg.num_aux
        self.input_norm = RMSNorm(aux_width, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = (nn.ModuleList(RMSNorm(cfg.target_hidden, cfg.rms_norm_eps) for _ in range(cfg.num_aux))
                        if cfg.fc_norm else None)
        self.fc = nn.Linear(aux_width, cfg.hidden_size, bias=False)
        self.layer = Eagle3DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab, bias=False)
        # draft id -> target id offsets; identity when the draft vocabulary is the full one
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))

    # ---------------------------------------------------------------------------------- forward
    def project_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """Concatenated target aux states [.., num_aux * target_hidden] -> [.., hidden]."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            aux = torch.cat([n(c) for n, c in zip(self.fc_norm, aux.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return self.fc(aux)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | None = None, mask: torch.Tensor | None = None) -> HeadOutput:
        """input_ids [B,T]: the token at each position's *next* slot (EAGLE's shifted input);
        hidden [B,T,num_aux*target_hidden] (aux states) or [B,T,hidden] (previous step);
        positions [B,T]; mask [T,S] / [B,T,S] over cache entries (None: causal)."""
        if hidden.shape[-1] != self.config.hidden_size:  # SGLang's rule: aux states are wider
            hidden = self.project_aux(hidden)
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        out = self.layer(embeds, hidden, positions, cache, mask)
        normed = self.norm(out)
        return HeadOutput(logits=self.lm_head(normed), hidden=normed if self.config.norm_output else out)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_logits_index(self) -> torch.Tensor:
        """Target ids of the draft vocabulary, in draft order."""
        return torch.arange(self.config.draft_vocab, device=self.d2t.device) + self.d2t

    def set_vocab_mapping(self, draft_to_target_ids: torch.Tensor) -> None:
        """Use a draft vocabulary: `draft_to_target_ids[i]` is the target id of draft id i (sorted)."""
        ids = draft_to_target_ids.to(torch.long)
        if ids.numel() != self.config.draft_vocab:
            raise ConfigError("d2t", ids.numel(), f"length != draft_vocab_size {self.config.draft_vocab}",
                              "pass one target id per draft id")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_().index_fill_(0, ids, True)

    # ------------------------------------------------------------------------------ checkpoint
    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """Weights under the serving format's names (config.weights). No embed_tokens when the head is as wide as
        the target (SGLang shares the target's); a narrower or wider head ships its own."""
        names = weight_map(self.config.head_format)
        own_embedding = self.config.hidden_size != self.config.target_hidden
        out = {}
        for name, t in self.state_dict().items():
            if name.startswith("embed_tokens.") and not own_embedding:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if name in ("d2t", "t2d") and not self.config.has_vocab_mapping:
                continue
            out[names.checkpoint(names.from_module(name))] = t
        return out

    def load_checkpoint_state(self, tensors: Mapping[str, torch.Tensor], strict: bool = True) -> list[str]:
        """Load a checkpoint's tensors, any layout config.weights reads (``midlayer.`` or ``layers.0.``, with or
        without ``model.``). Returns names it did not use; raises ConfigError listing missing/unexpected names when
        strict."""
        names = weight_map(self.config.head_format)
        mapped = {names.module(names.canonical(name)): t for name, t in tensors.items()}
        own = self.state_dict()
        # t2d is redundant with d2t (SGLang and vLLM ignore it): rebuilt below when absent
        optional = {"embed_tokens.weight", "t2d"} | ({"lm_head.weight"} if self.config.tie_word_embeddings
                                                     or self.config.draft_vocab_size is None else set())
        if not self.config.has_vocab_mapping:
            optional |= {"d2t"}
        missing = sorted(k for k in own if k not in mapped and k not in optional)
        unexpected = sorted(k for k in mapped if k not in own)
        if strict and (missing or unexpected):
            raise ConfigError("weights", {"missing": missing, "unexpected": unexpected},
                              "checkpoint names do not match the head config",
                              "export the head with the matching format/config (names are listed)")
        with torch.no_grad():
            for k, t in mapped.items():
                if k in own:
                    if own[k].shape != t.shape:
                        raise ConfigError(k, list(t.shape), f"shape differs from the config's {list(own[k].shape)}",
                                          "check hidden sizes, heads and ranks in config.json")
                    own[k].copy_(t)
            if "d2t" in mapped and "t2d" not in mapped and self.config.has_vocab_mapping:
                self.t2d.zero_().index_fill_(0, self.d2t + torch.arange(self.d2t.numel()), True)
        return unexpected

    def save_pretrained(self, out_dir: str, dtype: torch.dtype = torch.bfloat16) -> None:
        from safetensors.torch import save_file

        os.makedirs(out_dir, exist_ok=True)
        state = {k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous()
                 for k, v in self.checkpoint_state().items()}
        save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        # safetensors writes through a private temp file (mode 0600): a server under another user could not read it
        os.chmod(os.path.join(out_dir, "model.safetensors"), 0o644)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(self.config.to_dict(), f, indent=2)

    @classmethod
    def from_pretrained(cls, path: str, target_embedding: torch.Tensor | None = None,
                        target_lm_head: torch.Tensor | None = None, dtype=torch.float32) -> "Eagle3Head":
        """Load a head directory (ours, SpecForge's, SGLang's or lightseekorg's layout)."""
        from safetensors.torch import load_file

        from sglang_ext import checkpoint

        cfg = Eagle3DraftConfig.load(path)
        head = cls(cfg)
        tensors = {}
        for file in checkpoint.safetensors_files(path):
            tensors.update(load_file(file))
        head.load_checkpoint_state(tensors)
        if "embed_tokens.weight" not in tensors and target_embedding is not None:
            head.embed_tokens.weight.data.copy_(target_embedding)
        if "lm_head.weight" not in tensors and target_lm_head is not None:
            head.lm_head.weight.data.copy_(target_lm_head)
        if cfg.tie_word_embeddings:
            head.lm_head.weight = head.embed_tokens.weight
        return head.to(dtype)
