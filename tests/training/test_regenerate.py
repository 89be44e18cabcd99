"""Regeneration of the training data with the target: turn by turn, resumable, reasoning kept."""


import pytest

from sglang_ext.training import data as D
from sglang_ext.training.regenerate import GenerationOptions, LocalRegenerator, load_done

from train_support import tiny_pair  # noqa: F401 -- a fixture
from train_support import CONV, U1, A1, U2, A2


def test_regenerate_turn_by_turn_and_resume(tiny_pair, tmp_path):
    target, tok = tiny_pair
    convs = [D.Conversation("x", [m for m in CONV if m["role"] != "system"]),
             D.Conversation("y", [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "old"}])]
    out = tmp_path / "regen.jsonl"
    regen = LocalRegenerator(target, tok, GenerationOptions(max_new_tokens=6), batch_size=2)
    first = regen.run(convs[1:], str(out))  # an interrupted run wrote "y" only
    assert set(load_done(str(out))) == {"y"}
    done = regen.run(convs, str(out))  # resumes: only "x" is generated now
    assert [c.id for c in done] == ["x", "y"] and done[1].messages == first[0].messages
    x = done[0].messages
    assert [m["role"] for m in x] == ["user", "assistant", "user", "assistant"]
    assert x[1]["content"] != "Hello there" and x[0] == convs[0].messages[0]
    # turn 2 was generated after turn 1's regenerated answer: the target's own continuation
    from sglang_ext.training.chat import prompt_ids
    expected = regen._generate([prompt_ids(tok, x[:3])])[0]
    assert x[3]["content"] == expected
    assert sum(1 for _ in open(out)) == 2


def test_regeneration_resumes_after_a_cut_line_and_writes_as_it_goes(tiny_pair, tmp_path):
    target, tok = tiny_pair
    out = tmp_path / "regen.jsonl"
    regen = LocalRegenerator(target, tok, GenerationOptions(max_new_tokens=4), batch_size=1)
    convs = [D.Conversation(str(i), [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "x"}])
             for i in range(3)]
    regen.run(convs[:1], str(out))
    with open(out, "a") as f:
        f.write('{"id": "1", "messa')  # killed mid-line
    calls = []
    real = regen._generate

    def interrupted(prompts):
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return real(prompts)

    regen._generate = interrupted
    with pytest.raises(KeyboardInterrupt):
        regen.run(convs, str(out))  # the first batch finished before the interruption: it is on disk
    assert sorted(load_done(str(out))) == ["0", "1"] or sorted(load_done(str(out))) == ["0", "2"]
    regen._generate = real
    done = regen.run(convs, str(out))
    assert [c.id for c in done] == ["0", "1", "2"] and sorted(load_done(str(out))) == ["0", "1", "2"]


def test_server_regeneration_keeps_reasoning_content(monkeypatch):
    import sglang_ext.training.regenerate as R

    sent = []

    def reply(url, body, retries, timeout, api_key=None):
        sent.append(body["messages"])
        return {"choices": [{"message": {"role": "assistant", "content": "Four", "reasoning_content": "two and two"}}]}

    monkeypatch.setattr(R, "post_json", reply)
    reg = R.ServerRegenerator("http://x", options=R.GenerationOptions(16))
    out = reg._conversation(D.Conversation("1", [U2, {"role": "assistant", "content": "?"}, U1, A1]))
    assert out.messages[1] == {"role": "assistant", "content": "Four", "reasoning_content": "two and two"}
    assert sent[1][1] == {"role": "assistant", "content": "Four"}  # history carries the answer, as clients send it


def test_resume_refuses_regenerated_data_from_other_prompts(tiny_pair, tmp_path):
    target, tok = tiny_pair
    out = tmp_path / "regen.jsonl"
    regen = LocalRegenerator(target, tok, GenerationOptions(max_new_tokens=4), batch_size=2)
    regen.run([D.Conversation("0", [U1, A1])], str(out))
    with pytest.raises(ValueError, match="other user turns.*new --work"):
        regen.run([D.Conversation("0", [U2, A2])], str(out))
    with pytest.raises(ValueError, match="appears more than once"):
        regen.run([D.Conversation("7", [U1, A1]), D.Conversation("7", [U2, A2])], str(out))

