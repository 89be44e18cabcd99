"""Chat-formatted training data: loss masks over the assistant tokens (ChatML, DeepSeek, Kimi and real templates), reasoning, templates that rewrite history."""

import json

import pytest

from sglang_ext.training.chat import ChatTemplateError, render

from train_support import tiny_pair  # noqa: F401 -- a fixture
from train_support import CONV, DEEPSEEK, KIMI, U1, A1, U2, A2, masked_runs, real_template, tokenizer


@pytest.mark.parametrize("template,end", [(None, "<|im_end|>"), (DEEPSEEK, "<｜end▁of▁sentence｜>"),
                                          (KIMI, "<|im_end|>")])
def test_loss_mask_covers_exactly_the_assistant_tokens(template, end):
    tok = tokenizer(template)  # None: the tiny tokenizer's ChatML template
    r = render(tok, CONV, reasoning="drop")
    assert masked_runs(tok, r) == ["Hello there" + end, "Four" + end]
    r = render(tok, CONV, reasoning="keep")
    assert masked_runs(tok, r) == ["Hello there" + end, "<think>easy</think>Four" + end]


def test_tokenizer_without_chat_template_is_refused():
    tok = tokenizer(None)
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        render(tok, CONV)


def test_deepseek_r1_is_trained_as_served():
    """R1's generation prompt opens <think>, which its rendering of a finished turn drops: every conversation used to
    fail. Now the last turn is rendered as the server saw it: prompt (with <think>), the answer, end of turn."""
    tok = real_template("deepseek_r1", bos="<｜begin▁of▁sentence｜>")
    answer = {"role": "assistant", "content": "two and two\n</think>\n\nFour"}  # a server's reply: the opener was in the prompt
    r = render(tok, [U2, answer], reasoning="keep")
    assert r.as_served and r.text.endswith("<｜Assistant｜><think>\ntwo and two\n</think>\n\nFour<｜end▁of▁sentence｜>")
    assert masked_runs(tok, r) == [tok.decode(tok("two and two\n</think>\n\nFour", add_special_tokens=False)
                                              .input_ids) + "<｜end▁of▁sentence｜>"]
    r = render(tok, [U2, answer], reasoning="drop")  # the reasoning goes, the answer stays
    assert masked_runs(tok, r) == ["Four<｜end▁of▁sentence｜>"]


@pytest.mark.parametrize("name,msgs,expected", [
    # history loses its think blocks: the last turn, as served, with what the template writes before an answer
    ("qwen3", [U1, A1, U2, A2], ["<think>\n\n</think>\n\nFour<|im_end|>"]),
    ("mistral_v03", [{"role": "system", "content": "Be brief."}, U1, A1, U2, A2], ["Four</s>"]),  # system moves
    ("qwen3", [U1, A1], ["<think>\n\n</think>\n\nHello there<|im_end|>"]),  # consistent: as before
])
def test_templates_that_rewrite_history_train_the_last_turn(name, msgs, expected):
    tok = real_template(name, bos="<s>" if name == "mistral_v03" else None, eos="</s>" if name == "mistral_v03" else None)
    r = render(tok, msgs)
    assert [s.strip() for s in masked_runs(tok, r)] == expected
    assert r.as_served == (len(msgs) > 2)


def test_a_template_that_refuses_a_row_skips_it_not_the_run(tmp_path):
    """Mixtral's template raises on a system turn: that conversation is skipped and counted, before regeneration."""
    from sglang_ext.training.train_draft import load_conversations, parse_args

    tok = real_template("mixtral", bos="<s>", eos="</s>")
    p = tmp_path / "m.jsonl"
    p.write_text("\n".join(json.dumps({"messages": m}) for m in
                           [[U1, A1], [{"role": "system", "content": "x"}, U2, A2]]) + "\n")
    args = parse_args(["--data", f"messages:{p}", "--device", "cpu"])
    convs = load_conversations(args, tok)
    assert [c.messages for c in convs] == [[U1, A1]]
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render(tok, [{"role": "system", "content": "x"}, U2, A2])
    p.write_text(json.dumps({"messages": [{"role": "system", "content": "x"}, U2, A2]}) + "\n")
    with pytest.raises(SystemExit, match="no conversation to train on.*refused by the chat template"):
        load_conversations(parse_args(["--data", f"messages:{p}", "--device", "cpu"]), tok)


@pytest.mark.parametrize("content,expected", [
    ("<think>a</think>\n\nFour", "Four"),
    ("reasoning opened by the prompt\n</think>\n\nFour", "Four"),
    ("Four <think>cut by the token lim", "Four"),
    ("Four", "Four"),
])
def test_reasoning_drop_removes_every_shape_of_reasoning(content, expected):
    from sglang_ext.training.chat import apply_reasoning

    out = apply_reasoning([U2, {"role": "assistant", "content": content, "reasoning_content": "r"}], "drop")
    assert out[1] == {"role": "assistant", "content": expected}


def test_an_answer_that_was_all_reasoning_is_skipped_under_drop():
    """Cut by the token limit while reasoning: nothing of an answer is left, and training the end-of-turn token
    alone after the prompt would teach the draft to stop at once. With a prompt that opens <think> (R1), a reply
    without `</think>` is such an answer."""
    for tok, content in [(tokenizer(None), "<think>only reasoning, cut"),
                         (real_template("deepseek_r1", bos="<｜begin▁of▁sentence｜>"), "still reasoning when cut")]:
        with pytest.raises(ChatTemplateError, match="nothing is left"):
            render(tok, [U2, {"role": "assistant", "content": content}], reasoning="drop")
        assert render(tok, [U2, {"role": "assistant", "content": content}], reasoning="keep").loss_mask


def test_template_probes_render_once_per_template_and_follow_a_changed_template():
    """end_of_turn / turn_prefix / prompt_opens_think render probe conversations: once per template, not on each of the
    conversations feature capture renders; another template (or other special tokens) is probed afresh."""
    from sglang_ext.training.chat import end_of_turn

    tok = real_template("deepseek_r1", bos="<｜begin▁of▁sentence｜>")
    calls = []
    apply = tok.apply_chat_template
    tok.apply_chat_template = lambda messages, **kw: calls.append(messages) or apply(messages, **kw)
    answer = {"role": "assistant", "content": "two and two\n</think>\n\nFour"}
    first = render(tok, [U2, answer], reasoning="drop")  # probes the template (unless a test before did)
    calls.clear()
    again = render(tok, [U2, answer], reasoning="drop")
    probes = [m for m in calls if any("sglang-ext-probe" in x["content"] or x["content"] == "Hi" for x in m)]
    assert again == first and probes == [] and calls
    assert end_of_turn(tok) == "<｜end▁of▁sentence｜>"
    tok.chat_template = tok.chat_template.replace("<｜end▁of▁sentence｜>", "<|im_end|>")
    assert end_of_turn(tok) == "<|im_end|>"  # the changed template, not the cached answer
    chatml = tokenizer(None)
    assert end_of_turn(chatml) == "<|im_end|>"
    chatml.chat_template = chatml.chat_template.replace("'<|im_end|>'", "eos_token")
    chatml.eos_token = "<｜end▁of▁sentence｜>"
    assert end_of_turn(chatml) == "<｜end▁of▁sentence｜>"
    chatml.eos_token = "<|im_user|>"  # only a special token changed: probed afresh
    assert end_of_turn(chatml) == "<|im_user|>"


def test_reasoning_keep_passes_the_field_to_a_template_that_renders_it():
    from sglang_ext.training.chat import apply_reasoning

    turn = {"role": "assistant", "content": "Four", "reasoning_content": "two and two"}
    assert apply_reasoning([U2, turn], "keep", real_template("qwen3"))[1] == turn  # Qwen3 renders the field
    assert apply_reasoning([U2, turn], "keep", tokenizer(None))[1]["content"] == "<think>two and two</think>Four"

