"""Tiny models built in code (tests, CPU runs, GPU smoke checks): DeepseekV3 (MLA) and Llama
targets from transformers configs, a small BPE tokenizer with a ChatML template, and Eagle3 heads
sized for a target. Seeded: the same arguments give the same weights."""

from __future__ import annotations

import json
import os
import random

import torch

from sglang_ext.config.draft import Eagle3DraftConfig
from sglang_ext.core.heads import Eagle3Head, head_config_for  # noqa: F401 (re-export)

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")


def deepseek_v3_config(num_layers=4, hidden=256, heads=4, vocab=512, moe_layers=1, q_lora_rank=96,
                       kv_lora_rank=64, qk_nope=32, qk_rope=16, v_head=32, init_std=0.02, context=2048, **kw):
    from transformers import DeepseekV3Config

    dense = num_layers - moe_layers
    # the DeepSeek-V3 checkpoint fields SGLang's DeepseekV2 model reads (transformers' config lacks some)
    kw = dict(dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_layer_freq=1, ep_size=1,
                   num_nextn_predict_layers=0, topk_method="noaux_tc", scoring_func="sigmoid",
                   routed_scaling_factor=2.5, norm_topk_prob=True), **kw)
    return DeepseekV3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=heads,
        n_group=1, topk_group=1, first_k_dense_replace=dense, q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=qk_nope, qk_rope_head_dim=qk_rope, v_head_dim=v_head, max_position_embeddings=context,
        initializer_range=init_std, tie_word_embeddings=False, architectures=["DeepseekV3ForCausalLM"],
        bos_token_id=0, eos_token_id=2, pad_token_id=0, **kw)


def llama_config(num_layers=4, hidden=128, heads=4, kv_heads=2, vocab=512, init_std=0.02, **kw):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=2048, initializer_range=init_std, tie_word_embeddings=False,
                       architectures=["LlamaForCausalLM"], bos_token_id=0, eos_token_id=2, pad_token_id=0, **kw)


def build_target(config, seed: int = 0, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    # eager experts: transformers' grouped_mm MoE path has no float64 kernel (tests use float64)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation="eager")
    return model.eval()


def train_tokenizer(vocab_size: int = 512, seed: int = 0):
    """A byte-level BPE on generated text with ChatML specials <|endoftext|>=0, <|im_start|>=1,
    <|im_end|>=2 (eos); returns a transformers PreTrainedTokenizerFast with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    words = ["the", "a", "of", "and", "to", "is", "in", "number", "answer", "apples", "cost", "dollars",
             "user", "assistant", "what", "how", "many", "total", "each", "has"] + \
            ["".join(rng.choice("bcdfghklmnprstvz") + rng.choice("aeiou") for _ in range(rng.randint(1, 3)))
             for _ in range(400)]
    text = [" ".join(rng.choice(words) for _ in range(20)) + f" {rng.randint(0, 999)}." for _ in range(2000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHATML
    return fast


def save_target(model, tokenizer, out_dir: str, dtype=torch.bfloat16) -> str:
    os.makedirs(out_dir, exist_ok=True)
    model.to(dtype).save_pretrained(out_dir, safe_serialization=True)
    model.float()
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
        with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": tokenizer.eos_token_id, "do_sample": False}, f)
    return out_dir


def random_head(cfg: Eagle3DraftConfig, target=None, seed: int = 0, std: float = 0.02) -> Eagle3Head:
    """A random head; embedding (and, without a draft vocab, lm_head rows) taken from `target`."""
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight") or ".norm" in name or name.startswith("norm"):
                continue
            if p.dim() >= 2 and not name.startswith("embed_tokens"):
                p.normal_(0, std)
        if target is not None:
            head.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    return head.eval()
