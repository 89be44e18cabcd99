"""Render conversations with the target tokenizer's own chat template and mark the assistant tokens.

The loss mask is found from rendering boundaries, not from a regex on one template: for the i-th
assistant turn, the template rendered over messages[:i] with the generation prompt ends where the
assistant's text starts, and rendered over messages[:i+1] ends where it stops. Tokens whose text
starts inside [start, stop) are assistant tokens (the end-of-turn token included, the whitespace
the template puts after it excluded: the model never generates it). ChatML, DeepSeek-V3's and
Kimi's templates all work the same way.
"""

from __future__ import annotations

import dataclasses
import re

THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


class ChatTemplateError(ValueError):
    pass


@dataclasses.dataclass
class Rendered:
    text: str
    input_ids: list[int]
    loss_mask: list[int]  # 1 on assistant tokens
    spans: list[tuple[int, int]]  # character spans of the assistant turns


def require_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat_template: drafts must be trained on "
            "chat-formatted text (raw prompts change acceptance); use the target's own tokenizer or set "
            "tokenizer.chat_template")


def apply_reasoning(messages: list[dict], reasoning: str) -> list[dict]:
    """reasoning='drop' removes <think>...</think> blocks and `reasoning_content` from assistant turns;
    'keep' leaves them (a `reasoning_content` field is then prepended as a <think> block)."""
    if reasoning not in ("drop", "keep"):
        raise ValueError(f"reasoning={reasoning!r}: use 'drop' or 'keep'")
    out = []
    for m in messages:
        m = dict(m)
        if m["role"] == "assistant":
            rc = m.pop("reasoning_content", None)
            if reasoning == "drop":
                m["content"] = THINK.sub("", m["content"])
            elif rc:
                m["content"] = f"<think>{rc}</think>{m['content']}"
        out.append(m)
    return out


def render(tokenizer, messages: list[dict], reasoning: str = "drop", max_tokens: int | None = None) -> Rendered:
    require_chat_template(tokenizer)
    messages = apply_reasoning(messages, reasoning)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        pre = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (full.startswith(pre) and full.startswith(upto) and len(upto) >= len(pre)):
            raise ChatTemplateError("the chat template does not render conversations prefix-consistently "
                                    f"(assistant turn {i}); cannot locate assistant tokens")
        spans.append((len(pre), len(upto)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [0] * len(ids)
    for start, stop in spans:
        inside = [j for j, (a, b) in enumerate(offsets) if start <= a < stop]
        while inside and not full[offsets[inside[-1]][0]:offsets[inside[-1]][1]].strip():
            inside.pop()  # the template's whitespace after the end-of-turn token
        for j in inside:
            mask[j] = 1
    if max_tokens is not None:
        ids, mask = ids[:max_tokens], mask[:max_tokens]
    return Rendered(full, ids, mask, spans)


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat prompt (generation prompt appended), as a server would build them."""
    require_chat_template(tokenizer)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
