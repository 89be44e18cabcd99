"""What the trainer tests share: a tiny Llama target with a ChatML tokenizer, chat templates, feature records."""

import os

import pytest
import torch

from sglang_ext.core import tiny
from sglang_ext.core.heads import Eagle3Head, head_config_for
from sglang_ext.training import data as D
from sglang_ext.training.features import FeatureExtractor
from sglang_ext.training.trainer import draft_vocabulary, init_head_from_target


DEEPSEEK = ("<｜begin▁of▁sentence｜>{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
            "{% elif m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}{% elif m['role'] == 'assistant' %}"
            "{{ '<｜Assistant｜>' + m['content'] + '<｜end▁of▁sentence｜>' }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}")


KIMI = ("{% for m in messages %}{% if m['role'] == 'user' %}<|im_user|>user<|im_middle|>{{ m['content'] }}<|im_end|>"
        "{% elif m['role'] == 'assistant' %}<|im_assistant|>assistant<|im_middle|>{{ m['content'] }}<|im_end|>"
        "{% else %}<|im_system|>system<|im_middle|>{{ m['content'] }}<|im_end|>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}")


CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"},
        {"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "Two plus two?"},
        {"role": "assistant", "content": "<think>easy</think>Four"}]


def tokenizer(template: str | None):
    tok = tiny.train_tokenizer(400)
    tok.add_special_tokens({"additional_special_tokens": [
        "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>",
        "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"]})
    if template is not None:
        tok.chat_template = template
    return tok


def masked_runs(tok, r):
    runs, cur = [], []
    for i, m in zip(r.input_ids, r.loss_mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


@pytest.fixture(scope="module")
def tiny_pair():
    cfg = tiny.llama_config(num_layers=3, vocab=400, hidden=64)
    return tiny.build_target(cfg), tokenizer(None)


def _records(tiny_pair, n=6):
    target, tok = tiny_pair
    convs = [D.Conversation(str(i), [{"role": "user", "content": f"number {i} please"},
                                     {"role": "assistant", "content": f"the answer is {i * 7} apples and {i} more"}])
             for i in range(n)]
    return FeatureExtractor(target, tok, [0, 1, 2], dtype=torch.float32), convs


def _features_and_lm(tiny_pair, n=4):
    """Feature records of n conversations and the target's lm_head, the trainer's inputs."""
    ext, convs = _records(tiny_pair, n=n)
    target, _ = tiny_pair
    return [ext(c) for c in convs], target.get_output_embeddings().weight.detach()


def _head(tiny_pair, records):
    target, _ = tiny_pair
    hot = draft_vocabulary(records, 64, 400)
    head = Eagle3Head(head_config_for(target.config, "mha", [0, 1, 2], draft_vocab_size=64))
    head.set_vocab_mapping(hot)
    init_head_from_target(head, target)
    return head


TEMPLATES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "chat_templates")  # copied from the models' repos


def real_template(name: str, bos: str | None = None, eos: str | None = None):
    tok = tokenizer(open(os.path.join(TEMPLATES, f"{name}.jinja")).read())
    tok.add_tokens(["<think>", "</think>", "[INST]", "[/INST]"])
    if bos:
        tok.bos_token = bos
    if eos:
        tok.eos_token = eos
    return tok


U1, A1 = {"role": "user", "content": "Say hello"}, {"role": "assistant", "content": "Hello there"}


U2, A2 = {"role": "user", "content": "Two plus two?"}, {"role": "assistant", "content": "Four"}

