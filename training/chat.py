"""Render conversations with the target tokenizer's own chat template and mark the assistant tokens.

The loss mask is found from rendering boundaries, not from a regex on one template: for the i-th
assistant turn, the template rendered over messages[:i] with the generation prompt ends where the
assistant's text starts, and rendered over messages[:i+1] ends where it stops. Tokens whose text
starts inside [start, stop) are assistant tokens (the end-of-turn token included, the whitespace
the template puts after it excluded: the model never generates it). ChatML, DeepSeek-V3's and
Kimi's templates all work the same way.

Some templates render a turn differently once it is history: DeepSeek-R1's generation prompt opens
`<think>` that the rendered turn does not hold, Qwen3's drops earlier turns' think blocks, Mistral's
moves the system prompt to the last user turn. For those the conversation is rendered as the server
saw its last assistant turn: the generation prompt over everything before it, then the turn's text and
the template's end-of-turn marker (`Rendered.as_served`; earlier turns are context, not trained on).
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
    as_served: bool = False  # the template rewrites history: only the last assistant turn, as the server saw it


def require_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat_template: drafts must be trained on "
            "chat-formatted text (raw prompts change acceptance); use the target's own tokenizer or set "
            "tokenizer.chat_template")


def strip_reasoning(text: str, prompt_opens_think: bool = False) -> str:
    """The answer without its reasoning: closed <think> blocks; everything up to a `</think>` whose opener was in
    the prompt (DeepSeek-R1, Qwen3-Thinking and Kimi-K2.5 generation prompts open `<think>` themselves; with such a
    prompt, a reply with no `</think>` was cut while still reasoning and has no answer); and an unterminated
    `<think>` tail (an answer cut by the token limit while still reasoning)."""
    if prompt_opens_think and "</think>" not in text and not text.lstrip().startswith("<think>"):
        return ""
    text = THINK.sub("", text)
    if "</think>" in text:
        text = text[text.rindex("</think>") + len("</think>"):].lstrip()
    if "<think>" in text:
        text = text[: text.index("<think>")].rstrip()
    return text


def renders_reasoning_field(tokenizer) -> bool:
    """Whether the template renders an assistant turn's `reasoning_content` itself (Qwen3, Kimi-K2-Thinking)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "reasoning_content" in template


# What a template does around an answer (end-of-turn marker, text before an answer, a generation prompt that opens
# <think>) is found by rendering probe conversations; a template renders them the same every time, so each is
# rendered once per template, not once per conversation (the feature capture renders every conversation).
_PROBES: dict[tuple, object] = {}


def _template_key(tokenizer) -> tuple:
    """What a probe's rendering depends on: the template and the special tokens apply_chat_template passes it."""
    tokens = getattr(tokenizer, "special_tokens_map", None) or {}
    return (type(tokenizer).__name__, repr(getattr(tokenizer, "chat_template", None)),
            repr(sorted((k, str(v)) for k, v in tokens.items())))


def _probed(name: str, tokenizer, compute):
    key = (name, _template_key(tokenizer))
    if key not in _PROBES:
        _PROBES[key] = compute(tokenizer)  # a template that refuses the probe raises each time: nothing cached
    return _PROBES[key]


def prompt_opens_think(tokenizer) -> bool:
    """Whether the template's generation prompt opens a <think> block itself (DeepSeek-R1, Qwen3-Thinking)."""
    return _probed("prompt_opens_think", tokenizer, _prompt_opens_think)


def _prompt_opens_think(tokenizer) -> bool:
    try:
        gp = apply_template(tokenizer, [{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    except ChatTemplateError:
        return False
    return gp.count("<think>") > gp.count("</think>")


def apply_reasoning(messages: list[dict], reasoning: str, tokenizer=None, native: bool | None = None) -> list[dict]:
    """reasoning='drop' removes the reasoning (`strip_reasoning`, and `reasoning_content`) from assistant turns
    (an answer with nothing left is refused: ChatTemplateError, the conversation is skipped); 'keep' leaves it: a
    `reasoning_content` field goes to a template that renders it (`native`), else it is prepended to the content
    as a <think> block."""
    if reasoning not in ("drop", "keep"):
        raise ValueError(f"reasoning={reasoning!r}: use 'drop' or 'keep'")
    if native is None:
        native = tokenizer is not None and renders_reasoning_field(tokenizer)
    opens = reasoning == "drop" and tokenizer is not None and prompt_opens_think(tokenizer)
    out = []
    for m in messages:
        m = dict(m)
        if m["role"] == "assistant":
            rc = m.pop("reasoning_content", None)
            if reasoning == "drop":
                answer = strip_reasoning(m["content"], opens)
                if not answer.strip() and m["content"].strip():
                    raise ChatTemplateError("nothing is left of an answer once its reasoning is dropped (cut by the "
                                            "token limit while reasoning); --reasoning keep trains on it")
                m["content"] = answer
            elif rc and native:
                m["reasoning_content"] = rc
            elif rc:
                m["content"] = f"<think>{rc}</think>{m['content']}"
        out.append(m)
    return out


def apply_template(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The template's text; a template that refuses the conversation (Gemma on a system turn, Mixtral on roles
    that do not alternate) raises ChatTemplateError with its own message, which callers count per row."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except ChatTemplateError:
        raise
    except Exception as e:  # jinja2's TemplateError (raise_exception), or a template indexing a missing field
        raise ChatTemplateError(f"the chat template refused the conversation: {type(e).__name__}: {e}") from e


def end_of_turn(tokenizer) -> str:
    """What the template writes after an assistant turn's text, less trailing whitespace (ChatML's <|im_end|>,
    DeepSeek's <｜end▁of▁sentence｜>, Llama-3's <|eot_id|>); the EOS token when it writes nothing."""
    return _probed("end_of_turn", tokenizer, _end_of_turn)


def _end_of_turn(tokenizer) -> str:
    probe = "sglang-ext-probe-7f3a"
    text = apply_template(tokenizer, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": probe}])
    tail = text[text.rindex(probe) + len(probe):].rstrip() if probe in text else ""
    return tail or (getattr(tokenizer, "eos_token", None) or "")


def _consistent_spans(tokenizer, messages: list[dict], full: str) -> list[tuple[int, int]] | None:
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        pre = apply_template(tokenizer, messages[:i], add_generation_prompt=True)
        upto = apply_template(tokenizer, messages[: i + 1])
        if not (full.startswith(pre) and full.startswith(upto) and len(upto) >= len(pre)):
            return None
        spans.append((len(pre), len(upto)))
    return spans


def turn_prefix(tokenizer) -> str:
    """What the template writes between its generation prompt and an answer's text (Mistral's " "; none for ChatML,
    and none where the generation prompt holds more than a finished turn's header, as DeepSeek-R1's `<think>`)."""
    return _probed("turn_prefix", tokenizer, _turn_prefix)


def _turn_prefix(tokenizer) -> str:
    probe = "sglang-ext-probe-7f3a"
    gp = apply_template(tokenizer, [{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    text = apply_template(tokenizer, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": probe}])
    return text[len(gp): text.index(probe)] if text.startswith(gp) and probe in text[len(gp):] else ""


def render(tokenizer, messages: list[dict], reasoning: str = "drop", max_tokens: int | None = None) -> Rendered:
    require_chat_template(tokenizer)
    given = messages
    messages = apply_reasoning(given, reasoning, tokenizer)
    full = apply_template(tokenizer, messages)
    if reasoning == "keep" and any(m.get("reasoning_content") and m["reasoning_content"] not in full for m in messages):
        # the template renders the field only for some turns (Kimi-K2.5: after the last plain answer): kept as text
        messages = apply_reasoning(given, reasoning, tokenizer, native=False)
        full = apply_template(tokenizer, messages)
    spans, as_served = _consistent_spans(tokenizer, messages, full), False
    if spans is None:  # the template rewrites history (module docstring): the last turn as the server saw it
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is None:
            raise ChatTemplateError("the conversation has no assistant turn")
        pre = apply_template(tokenizer, messages[:last], add_generation_prompt=True)
        turn = messages[last]
        text = turn["content"]
        if turn.get("reasoning_content"):  # kept, for a template that renders the field: as the model wrote it
            text = f"<think>\n{turn['reasoning_content']}\n</think>\n\n{text}"
        full = pre + turn_prefix(tokenizer) + text + end_of_turn(tokenizer)
        spans, as_served = [(len(pre), len(full))], True
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [0] * len(ids)
    for start, stop in spans:
        # a token straddling the start (a prompt ending in a space, "Assistant: " + "Hello" -> " Hello") carries
        # the answer's first characters: trained on, not lost
        inside = [j for j, (a, b) in enumerate(offsets) if start <= a < stop or (a < start < b)]
        while inside and not full[offsets[inside[-1]][0]:offsets[inside[-1]][1]].strip():
            inside.pop()  # the template's whitespace after the end-of-turn token
        for j in inside:
            mask[j] = 1
    if max_tokens is not None:
        ids, mask = ids[:max_tokens], mask[:max_tokens]
    return Rendered(full, ids, mask, spans, as_served)


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat prompt (generation prompt appended), as a server would build them."""
    require_chat_template(tokenizer)
    text = apply_template(tokenizer, messages, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
