"""Training data sources: normalisation, offline packages, held-out sampling, malformed and foreign files."""

import json

import pytest

from sglang_ext.training import data as D

from train_support import tiny_pair  # noqa: F401 -- a fixture
from train_support import U1, A1, U2, A2


def test_data_normalisation_counts_malformed_rows(tmp_path):
    p = tmp_path / "sg.json"
    good = {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    rows = [good, {"id": "b", "conversations": [{"from": "gpt", "value": "starts wrong"}]},
            {"id": "c", "conversations": [{"from": "human", "value": "x"}, {"from": "alien", "value": "?"}]},
            {"id": "d", "conversations": "nope"}, dict(good, id="e")]
    text = json.dumps(rows)
    p.write_text(text[: text.rindex("{")])  # a truncated tail, like the packaged ShareGPT file
    rep = D.LoadReport()
    convs = D.load_source(f"sharegpt:{p}", rep)
    assert [c.id for c in convs] == ["a"] and convs[0].messages[1] == {"role": "assistant", "content": "yo"}
    assert rep.malformed == 4 and rep.reasons["truncated JSON array (the file ends inside a row)"] == 1
    m = tmp_path / "m.jsonl"
    m.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
                 + "\n{broken\n")
    rep = D.LoadReport()
    assert len(D.load_source(f"messages:{m}", rep)) == 1 and rep.malformed == 1
    import gzip

    mz = tmp_path / "m.jsonl.gz"
    mz.write_bytes(gzip.compress(m.read_bytes()))
    rep = D.LoadReport()
    assert len(D.load_source(f"messages:{mz}", rep)) == 1 and rep.malformed == 1  # gzip-compressed JSONL
    with pytest.raises(ValueError, match="kind"):
        D.load_source("csv:x")


def test_packaged_sharegpt_reads_offline():
    rep = D.LoadReport()
    convs = D.load_source("sharegpt:pkg:20", rep)
    assert len(convs) == 20 and all(c.messages[-1]["role"] in ("assistant", "user") for c in convs)


def test_held_out_conversations_sample_every_source():
    """The held-out 5% come first after a seeded shuffle: both sources appear in them (in source order they
    were all from the first source), the order is the same for the same seed, and nothing is lost."""
    from sglang_ext.training.data import Conversation
    from sglang_ext.training.train_draft import extra_samples, held_out_first

    convs = [Conversation(f"sharegpt-{i}", []) for i in range(100)] + [Conversation(f"gsm8k-{i}", []) for i in range(100)]
    order = held_out_first(convs, seed=0)
    held = order[: len(order) // 20]
    assert {c.id.split("-")[0] for c in held} == {"sharegpt", "gsm8k"}
    assert [c.id for c in held_out_first(convs, seed=0)] == [c.id for c in order]
    assert sorted(c.id for c in order) == sorted(c.id for c in convs)
    extra = extra_samples(order[len(held):], 3)  # responses 2 and 3 of the training prompts only
    assert len(extra) == 2 * 190 and {c.id.rsplit("#s", 1)[1] for c in extra} == {"1", "2"}
    assert not {c.id.rsplit("#s", 1)[0] for c in extra} & {c.id for c in held}


@pytest.mark.parametrize("spec,text", [("bogus:x", "kind 'bogus' unknown"),
                                       ("messages:/nonexistent/chats.jsonl", "does not exist"),
                                       ("gsm8k:/nonexistent/train.jsonl:10", "does not exist")])
def test_bad_data_sources_are_refused_before_the_target_loads(spec, text, capsys, monkeypatch):
    import sglang_ext.training.train_draft as td

    monkeypatch.setattr(td, "load_tokenizer", lambda *a: pytest.fail("the target was loaded"))
    try:
        rc = td.main(["--device", "cpu", "--data", spec])
    except SystemExit as e:  # refused by the option parser
        rc = e.code
    assert rc == 2 and text in capsys.readouterr().err


def test_conversations_without_ids_from_two_sources_keep_both(tmp_path, tiny_pair):
    from sglang_ext.training.train_draft import load_conversations, parse_args

    _, tok = tiny_pair
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps({"messages": [U1, A1]}) + "\n")
    b.write_text(json.dumps({"messages": [U2, A2]}) + "\n" + json.dumps({"id": None, "messages": [U2, A1]}) + "\n")
    convs = load_conversations(parse_args(["--data", f"messages:{a}", "--data", f"messages:{b}", "--device", "cpu"]),
                               tok)
    assert [c.id for c in convs] == ["0", "0~1", "1"] and [c.messages[0] for c in convs] == [U1, U2, U2]


@pytest.mark.parametrize("blob,kept,reason", [
    (b"\n  " + json.dumps([{"messages": [U1, A1]}]).encode(), 1, None),  # whitespace before the array
    (b"\xef\xbb\xbf" + json.dumps([{"messages": [U1, A1]}]).encode(), 1, None),  # a byte order mark
    (b"\xef\xbb\xbf" + json.dumps({"messages": [U1, A1]}).encode() + b"\n", 1, None),  # BOM + JSONL
    (json.dumps({"messages": [U1, A1]}).encode() + b"\n\xff\xfe\n", 1, "line not UTF-8"),
    (b'[{"messages": ' + json.dumps([U1, A1]).encode() + b'}, {"id": "z", bad}, {"messages": '
     + json.dumps([U2, A2]).encode() + b"}]", 2, "invalid JSON row"),  # a broken row mid-array: the rest is read
    (b'[{"messages": ' + json.dumps([U1, A1]).encode() + b'}, {"id": "z" "messages": ' + json.dumps([U2, A2]).encode()
     + b'}, {"messages": ' + json.dumps([U2, A2]).encode() + b"}]", 2, "invalid JSON row"),  # resync past its turns
])
def test_files_we_did_not_write(tmp_path, blob, kept, reason):
    p = tmp_path / "rows.json"
    p.write_bytes(blob)
    rep = D.LoadReport()
    assert len(D.load_source(f"messages:{p}", rep)) == kept
    assert (reason is None and rep.malformed == 0) or any(r.startswith(reason) for r in rep.reasons)


def test_unreadable_files_and_specs_are_refused_by_name(tmp_path):
    import gzip

    obj = tmp_path / "obj.json"
    obj.write_text(json.dumps({"data": [{"messages": [U1, A1]}]}, indent=1))
    with pytest.raises(D.DataSourceError, match=r"one JSON object \(keys \['data'\]\)"):
        D.load_source(f"messages:{obj}")
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'[{"messages": [{"role": "user", "content": "caf\xe9"}]}]')
    with pytest.raises(D.DataSourceError, match="not UTF-8"):
        D.load_source(f"messages:{latin}")
    gz = tmp_path / "rows.data"  # gzip told by its bytes, not its name
    gz.write_bytes(gzip.compress((json.dumps({"messages": [U1, A1]}) + "\n").encode()))
    assert len(D.load_source(f"messages:{gz}")) == 1
    for spec, match in [("sharegpt:pkg:0", "count 0"), ("hf:", "hf:NAME"), ("hf:NAME:-5", "whole number"),
                        ("hf:NAME:²", "whole number")]:
        with pytest.raises(ValueError, match=match):
            D.parse_spec(spec, check_files=True)
    with pytest.raises(FileNotFoundError, match="is a directory"):
        D.parse_spec(f"messages:{tmp_path}", check_files=True)
    with pytest.raises(FileNotFoundError, match="'-1' is meant as the row count"):
        D.parse_spec("sharegpt:pkg:-1", check_files=True)


def test_openai_rows_normalise():
    rep = D.LoadReport()
    msgs = D.normalise([{"role": " Developer", "content": "Be brief."},
                        {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]},
                        {"role": "assistant", "content": "hi"}], rep)
    assert msgs == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"},
                    {"role": "assistant", "content": "hi"}]
    assert D.normalise([U1, {"role": "tool", "content": "{}"}], rep) is None
    assert D.normalise([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, A1], rep) is None
    assert any("'tool'" in r for r in rep.reasons) and any("image_url" in r for r in rep.reasons)


def test_a_cut_last_line_is_found_from_the_end_of_a_long_file(tmp_path):
    from sglang_ext.training.regenerate import open_for_append

    p = tmp_path / "regen.jsonl"
    whole = "".join(json.dumps({"id": str(i), "messages": [U1, A1], "pad": "x" * 900}) + "\n" for i in range(200))
    p.write_text(whole + '{"id": "cut", "messages": [' + "y" * 70000)  # a cut line longer than the block read
    with open_for_append(str(p)) as f:
        f.write("next\n")
    assert p.read_text() == whole + "next\n"

