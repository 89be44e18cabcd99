"""The trainer's pieces: data normalisation, chat loss masks (ChatML, DeepSeek-V3, Kimi templates),
in-process regeneration (turn by turn, resumable), feature shards, exact resume, export."""

import dataclasses
import json
import os

import pytest
import torch

from sglang_ext.core import tiny
from sglang_ext.core.heads import Eagle3Head, head_config_for
from training import data as D
from training.chat import ChatTemplateError, render
from training.features import FeatureExtractor, read_shards, write_shards
from training.regenerate import GenerationOptions, LocalRegenerator, load_done
from training.trainer import TrainConfig, draft_vocabulary, init_head_from_target, train

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


@pytest.fixture(scope="module")
def tiny_pair():
    cfg = tiny.llama_config(num_layers=3, vocab=400, hidden=64)
    return tiny.build_target(cfg), tokenizer(None)


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
    from training.chat import prompt_ids
    expected = regen._generate([prompt_ids(tok, x[:3])])[0]
    assert x[3]["content"] == expected
    assert sum(1 for _ in open(out)) == 2


def _records(tiny_pair, n=6):
    target, tok = tiny_pair
    convs = [D.Conversation(str(i), [{"role": "user", "content": f"number {i} please"},
                                     {"role": "assistant", "content": f"the answer is {i * 7} apples and {i} more"}])
             for i in range(n)]
    return FeatureExtractor(target, tok, [0, 1, 2], dtype=torch.float32), convs


def test_feature_shards_round_trip_and_resume(tiny_pair, tmp_path):
    ext, convs = _records(tiny_pair)
    d = str(tmp_path / "f")
    write_shards(ext, convs[:4], d, shard_size=2)
    m = write_shards(ext, convs, d, shard_size=2)  # resumes: shards 0, 1 kept, shard 2 added
    assert [s["file"] for s in m["shards"]] == ["shard-00000.safetensors", "shard-00001.safetensors",
                                                "shard-00002.safetensors"]
    recs = read_shards(d)
    again = [ext(c) for c in convs]  # one at a time; the shards were captured in padded batches
    assert len(recs) == 6 and len({len(r.input_ids) for r in recs}) > 1
    for a, b in zip(recs, again):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert torch.allclose(a.aux, b.aux, atol=1e-5) and torch.allclose(a.last_hidden, b.last_hidden, atol=1e-5)
        assert a.aux.shape[1] == 3 * 64 and a.loss_mask.sum() > 0
    batched = ext.many(convs, batch_tokens=10 ** 6)  # all six in one padded forward
    assert all(torch.allclose(a.aux, b.aux, atol=1e-5) for a, b in zip(batched, again))
    # a resume in another order (another seed, another version's order) is refused, the shards left as they were
    with pytest.raises(ValueError, match="holds other conversations than chunk 0"):
        write_shards(ext, convs[::-1], d, shard_size=2)
    assert [len(r.input_ids) for r in read_shards(d)] == [len(r.input_ids) for r in recs]


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


def test_resume_gives_the_same_weights(tiny_pair, tmp_path):
    recs, lm = _features_and_lm(tiny_pair, n=6)
    cfg = TrainConfig(ttt_steps=3, lr=1e-2, max_steps=6, grad_accum=2, seed=1)
    torch.manual_seed(0)
    full = _head(tiny_pair, recs)
    train(full, recs, lm, cfg, checkpoint_dir=str(tmp_path / "a"), log=lambda *_: None)
    torch.manual_seed(0)
    part = _head(tiny_pair, recs)
    train(part, recs, lm, cfg, checkpoint_dir=str(tmp_path / "b"), stop_after=3, log=lambda *_: None)
    resumed = _head(tiny_pair, recs)  # a fresh process: state comes from the checkpoint only
    train(resumed, recs, lm, cfg, checkpoint_dir=str(tmp_path / "b"), log=lambda *_: None)
    for (n, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), n
    assert not any(torch.equal(a, b) for (n, a), (_, b) in zip(full.state_dict().items(),
                                                               _head(tiny_pair, recs).state_dict().items())
                   if n == "fc.weight")


def test_batched_conversations_do_not_see_each_other(tiny_pair):
    """Batching (GPU default) is one forward over several right-padded conversations: a batch of a
    conversation with itself scores exactly like the conversation alone, and the accuracy counts of a
    batch of different lengths are the sums of its members' (padding never selected, never attended)."""
    from training.trainer import batches, ttt_loss

    recs, lm = _features_and_lm(tiny_pair, n=3)
    head = _head(tiny_pair, recs)
    rows = lm.float()[head.target_logits_index()]
    cpu = torch.device("cpu")
    with torch.no_grad():
        alone = [ttt_loss(head, r, rows, 3, 0.8, cpu) for r in recs]
        twice, acc2, cnt2 = ttt_loss(head, [recs[0], recs[0]], rows, 3, 0.8, cpu)
        _, acc3, cnt3 = ttt_loss(head, recs, rows, 3, 0.8, cpu)
    lens = [len(r.input_ids) for r in recs]
    assert len(set(lens)) > 1  # the batch really is padded
    assert torch.allclose(twice, alone[0][0], atol=1e-5)
    assert acc2 == [2 * a for a in alone[0][1]] and cnt2 == [2 * c for c in alone[0][2]]
    assert acc3 == [sum(a[1][k] for a in alone) for k in range(3)]
    assert cnt3 == [sum(a[2][k] for a in alone) for k in range(3)] and cnt3[0] > 0
    # the GPU default pads every row to a multiple of 64 lanes: same loss, same counts
    with torch.no_grad():
        padded, acc64, cnt64 = ttt_loss(head, recs, rows, 3, 0.8, cpu, pad_multiple=64)
        unpadded, _, _ = ttt_loss(head, recs, rows, 3, 0.8, cpu)
    assert max(lens) % 64 and torch.allclose(padded, unpadded, atol=1e-5)
    assert (acc64, cnt64) == (acc3, cnt3)
    by_length = sorted([2, 0, 1], key=lambda i: lens[i])  # stable: ties keep the given order
    assert batches(recs, [2, 0, 1], 10 ** 6, 10 ** 6) == [by_length]  # one bucket, sorted by length
    assert batches(recs, [2, 0, 1], 1, 10 ** 6) == [[i] for i in by_length]  # a conversation alone if need be
    assert batches(recs, [0, 1, 2], 2 * max(lens), 10 ** 6, bucket=2) == [sorted([0, 1], key=lambda i: lens[i]), [2]]


def test_batched_training_learns_and_resumes(tiny_pair, tmp_path):
    recs, lm = _features_and_lm(tiny_pair, n=6)
    cfg = TrainConfig(ttt_steps=2, lr=5e-3, max_steps=4, grad_accum=1, batch_tokens=64, seed=1)
    torch.manual_seed(0)
    full = _head(tiny_pair, recs)
    first = train(full, recs, lm, dataclasses.replace(cfg, max_steps=1), log=lambda *_: None)
    torch.manual_seed(0)
    full = _head(tiny_pair, recs)
    last = train(full, recs, lm, cfg, checkpoint_dir=str(tmp_path / "a"), log=lambda *_: None)
    assert last["loss"] < first["loss"]
    torch.manual_seed(0)
    part = _head(tiny_pair, recs)
    train(part, recs, lm, cfg, checkpoint_dir=str(tmp_path / "b"), stop_after=2, log=lambda *_: None)
    resumed = _head(tiny_pair, recs)
    train(resumed, recs, lm, cfg, checkpoint_dir=str(tmp_path / "b"), log=lambda *_: None)
    for (n, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), n


def test_training_time_limit_stops_with_a_checkpoint(tiny_pair, tmp_path):
    recs, lm = _features_and_lm(tiny_pair)
    said = []
    m = train(_head(tiny_pair, recs), recs, lm, TrainConfig(ttt_steps=2, max_steps=50, max_seconds=0.0),
              checkpoint_dir=str(tmp_path), log=said.append)
    assert m["step"] == 1 and m["stopped_early"] and "time limit" in said[-1]
    assert json.load(open(tmp_path / "trainer.json"))["step"] == 1


def test_training_lowers_loss_and_export_loads_back(tiny_pair, tmp_path):
    recs, lm = _features_and_lm(tiny_pair)
    target, _ = tiny_pair
    head = _head(tiny_pair, recs)
    first = train(head, recs, lm, TrainConfig(ttt_steps=2, lr=5e-3, max_steps=1), log=lambda *_: None)
    last = train(head, recs, lm, TrainConfig(ttt_steps=2, lr=5e-3, max_steps=40, grad_accum=4),
                 log=lambda *_: None)
    assert last["loss"] < first["loss"]
    head.save_pretrained(str(tmp_path / "out"))
    cfg = json.load(open(tmp_path / "out" / "config.json"))
    assert cfg["eagle_config"]["aux_layer_convention"] == "output"
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2] and cfg["torch_dtype"] == "bfloat16"
    back = Eagle3Head.from_pretrained(str(tmp_path / "out"), target.get_input_embeddings().weight)
    assert torch.equal(back.draft_to_target(torch.arange(64)), head.draft_to_target(torch.arange(64)))
    assert torch.allclose(back.fc.weight, head.fc.weight.to(torch.bfloat16).float())


@pytest.mark.parametrize("fmt", ["mha", "mla"])
def test_trained_heads_keep_greedy_speculation_exact(tiny_pair, fmt):
    """A trained head (not just a random one) in both formats: chain and tree stay lossless."""
    from sglang_ext.core.decoder import ReferenceDecoder

    target, tok = tiny_pair
    ext, convs = _records(tiny_pair, n=6)
    recs = [ext(c) for c in convs]
    head = Eagle3Head(head_config_for(target.config, fmt, [0, 1, 2]))
    init_head_from_target(head, target)
    train(head, recs, target.get_output_embeddings().weight.detach(),
          TrainConfig(ttt_steps=3, lr=5e-3, max_steps=30, grad_accum=2), log=lambda *_: None)
    prompt = recs[0].input_ids[:12].tolist()
    plain = ReferenceDecoder(target, None).generate(prompt, 24, speculative=False).tokens
    for topk, ndt in [(1, None), (4, 8)]:
        dec = ReferenceDecoder(target, head, num_steps=3, topk=topk, num_draft_tokens=ndt)
        g = dec.generate(prompt, 24)
        dec.close()
        assert g.tokens == plain
        assert len(g.tokens) == sum(a + 1 for a in g.accepted_per_step) + 1


def test_resume_refuses_a_checkpoint_of_another_config(tiny_pair, tmp_path):
    recs, lm = _features_and_lm(tiny_pair)
    train(_head(tiny_pair, recs), recs, lm, TrainConfig(ttt_steps=2, max_steps=2), checkpoint_dir=str(tmp_path),
          log=lambda *_: None)
    with pytest.raises(ValueError, match=r"other options or data \(train_config.ttt_steps: 2 -> 3\)"):
        train(_head(tiny_pair, recs), recs, lm, TrainConfig(ttt_steps=3, max_steps=2), checkpoint_dir=str(tmp_path),
              log=lambda *_: None)
    other = [dataclasses.replace(r, input_ids=r.input_ids.flip(0)) for r in recs]  # other data, same size
    with pytest.raises(ValueError, match="records_fingerprint"):
        train(_head(tiny_pair, other), other, lm, TrainConfig(ttt_steps=2, max_steps=2), checkpoint_dir=str(tmp_path),
              log=lambda *_: None)


def test_a_run_killed_between_the_checkpoint_files_resumes_from_the_weights(tiny_pair, tmp_path):
    """state.safetensors is written whole (temp file, rename) and carries the step: a stale or damaged trainer.json
    beside it (killed between the two writes) cannot make a resume replay a step on already-updated weights."""
    from training.trainer import checkpoint_meta

    recs, lm = _features_and_lm(tiny_pair)
    cfg = TrainConfig(ttt_steps=2, max_steps=4, checkpoint_every=1)
    torch.manual_seed(0)
    straight = _head(tiny_pair, recs)
    train(straight, recs, lm, cfg, log=lambda *_: None)
    torch.manual_seed(0)
    head = _head(tiny_pair, recs)
    train(head, recs, lm, cfg, checkpoint_dir=str(tmp_path), stop_after=3, log=lambda *_: None)
    open(tmp_path / "trainer.json", "w").write('{"step": 2, "tot')  # an older step, cut mid-write
    assert checkpoint_meta(str(tmp_path))["step"] == 3
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "state.safetensors").write_bytes(open(tmp_path / "state.safetensors", "rb").read()[:1000])
    with pytest.raises(ValueError, match="cannot be read.*delete"):
        checkpoint_meta(str(damaged))
    resumed = _head(tiny_pair, recs)
    train(resumed, recs, lm, cfg, checkpoint_dir=str(tmp_path), log=lambda *_: None)
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)


def test_a_time_fitted_schedule_keeps_its_length_on_resume(tiny_pair, tmp_path):
    """A run whose cosine was fitted to a time limit, then run again: it stays finished (no climb back up a longer
    schedule)."""
    recs, lm = _features_and_lm(tiny_pair)
    head = _head(tiny_pair, recs)
    train(head, recs, lm, TrainConfig(ttt_steps=2, max_steps=6), checkpoint_dir=str(tmp_path), stop_after=3,
          log=lambda *_: None)
    import json as _json

    meta = _json.load(open(tmp_path / "trainer.json"))
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    meta["total_steps"] = 3  # as a time-fitted run that ended at its fitted step 3 of 6 planned would have saved
    t = load_file(str(tmp_path / "state.safetensors"))
    save_file(t, str(tmp_path / "state.safetensors"), metadata={"trainer": _json.dumps(meta)})
    before = {k: v.clone() for k, v in head.state_dict().items()}
    again = _head(tiny_pair, recs)
    m = train(again, recs, lm, TrainConfig(ttt_steps=2, max_steps=6), checkpoint_dir=str(tmp_path),
              log=lambda *_: None)
    assert m["resumed_finished"] and m["step"] == 3
    assert all(torch.equal(before[k], v) for k, v in again.state_dict().items())
    with safe_open(str(tmp_path / "state.safetensors"), "pt") as f:
        assert _json.loads(f.metadata()["trainer"])["step"] == 3


def test_yaml_values_are_defaults_checked_like_options(tmp_path):
    from training.train_draft import parse_args

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    example = os.path.join(here, "training", "configs", "gpu-example.yaml")
    args = parse_args(["--config", example, "--epochs", "1", "--out", "out/trial", "--data", "messages:x.jsonl"])
    assert (args.epochs, args.out, args.data, args.lr) == (1, "out/trial", ["messages:x.jsonl"], 0.0003)
    c = tmp_path / "c.yaml"
    c.write_text("lr: 5e-3\n")  # PyYAML: a string
    assert parse_args(["--config", str(c)]).lr == 0.005
    for text, match in [("draft_format: MLA\n", "draft_format: 'MLA'; choose from"), ("lr: fast\n", "lr: 'fast'"),
                        ("bogus: 1\n", "unknown key 'bogus'"), ("epochs: 2.7\n", ""), ("lr: null\n", ""),
                        ("aux_layers: [1, 2, 3]\n", ""), ("work: 5\n", "")]:
        c.write_text(text)
        with pytest.raises(SystemExit):
            parse_args(["--config", str(c)])


def test_out_is_checked_before_anything_runs_and_replaced_whole(tmp_path, capsys):
    from training.train_draft import export_dir_problem, main, replace_dir

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    assert main(["--out", str(theirs), "--work", str(tmp_path / "w"), "--device", "cpu"]) == 2
    assert "not an Eagle3 export" in capsys.readouterr().err and (theirs / "notes.txt").exists()
    assert main(["--out", str(tmp_path / "w" / "draft"), "--work", str(tmp_path / "w"), "--device", "cpu"]) == 2
    assert "--work" in capsys.readouterr().err
    (tmp_path / "afile").write_text("x")
    assert "not a directory" in export_dir_problem(str(tmp_path / "afile"))
    old = tmp_path / "export"  # a previous sharded export: none of its files may survive beside the new one
    old.mkdir()
    (old / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    (old / "model.safetensors.index.json").write_text("{}")
    assert export_dir_problem(str(old)) is None
    new = tmp_path / "export.partial"
    new.mkdir()
    (new / "model.safetensors").write_text("new")
    replace_dir(str(new), str(old))
    assert sorted(os.listdir(old)) == ["model.safetensors"] and not new.exists()
    (old / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    (old / "README.md").write_text("my notes")  # an export with a file of the user's: replacing it would delete it
    assert "README.md" in export_dir_problem(str(old))
    os.remove(old / "README.md")
    link = tmp_path / "link"
    link.symlink_to(old)
    assert export_dir_problem(str(link)) is None  # a link: checked (and later written) where it points


def test_features_of_other_layers_are_refused_not_reused(tiny_pair, tmp_path):
    ext, convs = _records(tiny_pair)
    write_shards(ext, convs, str(tmp_path), shard_size=4, meta={"target": "t", "aux_output_ids": [0, 1, 2]})
    with pytest.raises(ValueError, match=r"aux_output_ids=\[0, 1, 2\], this run asks for aux_output_ids=\[1, 2, 0\]"):
        write_shards(ext, convs, str(tmp_path), shard_size=4, meta={"target": "t", "aux_output_ids": [1, 2, 0]})
    os.remove(tmp_path / "shard-00001.safetensors")
    with pytest.raises(FileNotFoundError, match="shard-00001.safetensors, named in"):
        read_shards(str(tmp_path))


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


def test_example_config_is_accepted_by_the_cli():
    from training.train_draft import parse_args

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = parse_args(["--config", os.path.join(here, "training", "configs", "gpu-example.yaml")])
    assert args.draft_format == "mla" and args.ttt_steps == 7 and args.data[0] == "sharegpt:pkg:20000"


def test_non_finite_loss_stops_training_before_anything_is_saved(tiny_pair, tmp_path):
    recs, lm = _features_and_lm(tiny_pair)
    head = _head(tiny_pair, recs)
    with torch.no_grad():
        head.fc.weight.fill_(float("nan"))  # what a diverged bf16 run looks like
    with pytest.raises(FloatingPointError, match="non-finite TTT loss.*step 0"):
        train(head, recs, lm, TrainConfig(ttt_steps=2, max_steps=3), checkpoint_dir=str(tmp_path / "ck"),
              log=lambda *_: None)
    assert not (tmp_path / "ck" / "trainer.json").exists()


def test_trainer_speed_benchmark_runs_our_side_on_the_cpu(tmp_path):
    """The GPU comparison with SpecForge (training/bench_vs_specforge.py) measures our step on the
    same tensors SpecForge gets; SpecForge itself is not a dependency (it pins another SGLang)."""
    from training import bench_vs_specforge as b

    out = tmp_path / "r.json"
    assert b.main(["--tiny", "--ours-only", "--seq-len", "64", "--steps", "2", "--ttt", "3", "--json", str(out)]) == 0
    r = json.load(open(out))["rows"]["ours"]
    assert len(r["times"]) == 2 and r["tokens_per_s"] > 0


def test_decoder_layer_can_start_from_a_target_layer(tiny_pair):
    from training.trainer import init_layer_from_target

    target, _ = tiny_pair
    head = Eagle3Head(head_config_for(target.config, "mha", [0, 1, 2]))
    assert set(init_layer_from_target(head, target, 2)) == {"self_attn", "mlp", "input_layernorm",
                                                           "post_attention_layernorm", "hidden_norm"}
    src = target.model.layers[2]
    assert torch.equal(head.layer.mlp.down_proj.weight, src.mlp.down_proj.weight)
    assert torch.equal(head.layer.self_attn.o_proj.weight, src.self_attn.o_proj.weight)
    h = target.config.hidden_size
    q = head.layer.self_attn.q_proj.weight
    assert torch.equal(q[:, :h], 0.5 * src.self_attn.q_proj.weight) and torch.equal(q[:, h:], q[:, :h])
    aux = torch.randn(5, 3 * h)
    assert torch.allclose(head.project_aux(aux), aux[:, 2 * h:])  # fc passes the last aux state through
    mla = Eagle3Head(head_config_for(target.config, "mla", [0, 1, 2]))
    before = {k: v.clone() for k, v in mla.state_dict().items()}
    # no MLA source layer in a Llama target: the attention stays as it was, the MLP and norms are the target's
    assert "self_attn" not in init_layer_from_target(mla, target, 2)
    assert all(torch.equal(before[k], v) for k, v in mla.state_dict().items() if "self_attn" in k)
    assert torch.equal(mla.layer.mlp.up_proj.weight, src.mlp.up_proj.weight)
    # an MLA head under a DeepSeek target starts from its (dense) MLA layer the same way
    ds = tiny.build_target(tiny.deepseek_v3_config(num_layers=4, moe_layers=1, hidden=64, heads=4, vocab=400,
                                                   q_lora_rank=32, kv_lora_rank=32, qk_nope=16, qk_rope=8,
                                                   v_head=16))
    mla = Eagle3Head(head_config_for(ds.config, "mla", [0, 1, 2]))
    assert {"self_attn", "mlp"} <= set(init_layer_from_target(mla, ds, 1))
    a, t = mla.layer.self_attn, ds.model.layers[1].self_attn
    assert torch.equal(a.kv_b_proj.weight, t.kv_b_proj.weight) and torch.equal(a.q_b_proj.weight, t.q_b_proj.weight)
    assert torch.equal(a.kv_a_proj_with_mqa.weight[:, 64:], 0.5 * t.kv_a_proj_with_mqa.weight)
    # a MoE source layer: its attention, not its MLP
    assert "mlp" not in init_layer_from_target(Eagle3Head(head_config_for(ds.config, "mla", [0, 1, 2])), ds, 3)
    # an MHA head under the DeepSeek target: the dense layer's MLP and norms, its own attention
    mha = Eagle3Head(head_config_for(ds.config, "mha", [0, 1, 2]))
    attn_before = {k: v.clone() for k, v in mha.layer.self_attn.state_dict().items()}
    parts = init_layer_from_target(mha, ds, 1)
    assert "mlp" in parts and "self_attn" not in parts
    assert torch.equal(mha.layer.mlp.gate_proj.weight, ds.model.layers[1].mlp.gate_proj.weight)
    assert all(torch.equal(attn_before[k], v) for k, v in mha.layer.self_attn.state_dict().items())
    aux = torch.randn(5, 3 * 64)
    assert torch.allclose(mha.project_aux(aux), aux[:, 2 * 64:])  # fc passes the last aux state through


def test_profile_option_logs_where_the_step_time_goes(tiny_pair):
    recs, lm = _features_and_lm(tiny_pair)
    said = []
    train(_head(tiny_pair, recs), recs, lm, TrainConfig(ttt_steps=2, max_steps=4, profile_steps=1, batch_tokens=64),
          log=said.append)
    (table,) = [x for x in said if x.startswith("profile of 1 optimizer steps")]
    assert "aten::" in table and "Self CPU" in table


def test_data_parallel_training_equals_one_process_with_the_same_global_batch(tiny_pair, tmp_path):
    """torchrun, 2 CPU ranks (gloo), grad-accum 1 == one process, grad-accum 2: each step's units are
    split across ranks and gradients summed, so the weights match; a rank that starts from other
    weights is overwritten by rank 0's."""
    import subprocess
    import sys

    from safetensors.torch import load_file, save_file

    ext, convs = _records(tiny_pair, n=6)
    write_shards(ext, convs, str(tmp_path / "features"))
    recs, lm = read_shards(str(tmp_path / "features")), tiny_pair[0].get_output_embeddings().weight.detach()
    torch.manual_seed(0)
    head = _head(tiny_pair, recs)
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(tmp_path / "head.safetensors"))
    save_file({"w": lm.contiguous()}, str(tmp_path / "lm.safetensors"))
    json.dump(head.config.to_dict(), open(tmp_path / "head.json", "w"))
    cfg = dict(ttt_steps=2, lr=5e-3, max_steps=3, grad_accum=1, batch_tokens=40, seed=3)
    json.dump(cfg, open(tmp_path / "train.json", "w"))
    here = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
                        os.path.join(here, "ddp_worker.py"), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    train(head, recs, lm, TrainConfig(**dict(cfg, grad_accum=2)), log=lambda *_: None)
    ddp = load_file(str(tmp_path / "trained.safetensors"))
    for k, v in head.state_dict().items():
        assert torch.allclose(ddp[k], v, atol=1e-6), k
    assert not torch.allclose(ddp["fc.weight"], load_file(str(tmp_path / "head.safetensors"))["fc.weight"])


def test_train_draft_under_torchrun_rank0_prepares_and_exports(tmp_path):
    """`torchrun --nproc_per_node 2 -m training.train_draft ...` on the CPU: rank 0 regenerates and
    captures while rank 1 waits, both train, rank 0 alone exports and reports. With --regen-samples 2
    every training prompt gets a second, sampled response; the held-out prompt keeps one."""
    import gzip
    import subprocess
    import sys

    target = tiny.build_target(tiny.deepseek_v3_config(num_layers=4, hidden=128, heads=4, vocab=512), seed=0)
    tiny.save_target(target, tiny.train_tokenizer(512), str(tmp_path / "target"))
    with gzip.open(tmp_path / "sg.jsonl.gz", "wt") as f:
        for i in range(12):
            f.write(json.dumps({"id": str(i), "messages": [{"role": "user", "content": f"how many apples {i}"},
                                                           {"role": "assistant", "content": "x"}]}) + "\n")
    with open(tmp_path / "gsm.jsonl", "w") as f:
        for i in range(4):
            f.write(json.dumps({"question": f"what is the total {i}", "answer": "#### 3"}) + "\n")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29534",
                        "-m", "training.train_draft", "--target", str(tmp_path / "target"), "--aux-layers", "0,1,2",
                        "--max-new-tokens", "8", "--draft-vocab-size", "128", "--epochs", "1", "--ttt-steps", "2",
                        "--eval-data", str(tmp_path / "gsm.jsonl"), "--eval-prompts", "2", "--eval-max-new-tokens", "8",
                        "--device", "cpu", "--batch-tokens", "128", "--max-train-minutes", "0",  # ranks stop together
                        "--data", f"messages:{tmp_path / 'sg.jsonl.gz'}", "--regen-samples", "2",
                        "--work", str(tmp_path / "work"), "--out", str(tmp_path / "head")],
                       capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stdout.count("[train-draft] regenerated") == 1 and p.stdout.count("[train-draft] exported") == 1
    report = json.load(open(tmp_path / "head" / "training_report.json"))
    assert report["world_size"] == 2 and report["train_conversations"] == 2 * 11  # 12 prompts, 1 held out
    assert report["final_metrics"]["step"] == 1 and report["final_metrics"]["stopped_early"]
    # the estimate keeps, per prompt, what a server re-measuring it on the same prompts is paired against
    est = report["acceptance"]["trained"]
    assert len(est["per_prompt"]) == 2 and "standard_error" in est
    assert sum(r["verify_steps"] for r in est["per_prompt"]) == est["verify_steps"]
    assert sum(r["accepted_drafts"] for r in est["per_prompt"]) == est["accepted_drafts"]
    for r in est["per_prompt"]:  # the prefill token, then a + 1 per verify step
        assert len(r["output_ids"]) == 1 + r["verify_steps"] + r["accepted_drafts"] <= 8
    ids = [json.loads(line)["id"] for line in open(tmp_path / "work" / "regenerated.jsonl")]
    sampled = {i.split("#s")[0] for i in ids if i.endswith("#s1")}
    assert len(ids) == 23 and len(sampled) == 11 and len({str(i) for i in range(12)} - sampled) == 1


def test_fit_total_lays_the_schedule_over_the_time_left():
    from training.trainer import fit_total

    assert fit_total(step=100, planned=500, seconds_left=100.0, seconds_per_step=1.0) == 200  # time binds
    assert fit_total(step=100, planned=150, seconds_left=100.0, seconds_per_step=1.0) == 150  # the plan binds
    assert fit_total(step=100, planned=500, seconds_left=-5.0, seconds_per_step=1.0) == 101  # at least one more
    assert fit_total(step=100, planned=500, seconds_left=10.0, seconds_per_step=0.0) == 500  # no pace yet


def test_time_limited_training_finishes_its_fitted_schedule(tiny_pair, monkeypatch):
    """With a time limit the run measures its pace, shortens the cosine schedule to what fits, and ends
    with the learning rate decayed -- not stopped half-way at a high rate. A fake clock (0.01 s per
    reading, deterministic) stands in for the wall clock."""
    import itertools

    from training import trainer as T

    ticks = itertools.count()
    monkeypatch.setattr(T, "clock", lambda: next(ticks) * 0.01)
    recs, lm = _features_and_lm(tiny_pair)
    cfg = TrainConfig(ttt_steps=2, lr=5e-3, max_steps=400, max_seconds=2.0)
    logged = []
    m = train(_head(tiny_pair, recs), recs, lm, cfg, log=logged.append)
    assert m["planned_steps"] == 400 and m["step"] == m["total_steps"] < 400  # fitted, and finished
    assert not m.get("stopped_early")
    assert m["lr"] < 0.05 * cfg.lr  # the cosine ran to its end
    assert any("schedule fitted to the time limit" in x for x in logged)


def test_held_out_conversations_sample_every_source():
    """The held-out 5% come first after a seeded shuffle: both sources appear in them (in source order they
    were all from the first source), the order is the same for the same seed, and nothing is lost."""
    from training.data import Conversation
    from training.train_draft import extra_samples, held_out_first

    convs = [Conversation(f"sharegpt-{i}", []) for i in range(100)] + [Conversation(f"gsm8k-{i}", []) for i in range(100)]
    order = held_out_first(convs, seed=0)
    held = order[: len(order) // 20]
    assert {c.id.split("-")[0] for c in held} == {"sharegpt", "gsm8k"}
    assert [c.id for c in held_out_first(convs, seed=0)] == [c.id for c in order]
    assert sorted(c.id for c in order) == sorted(c.id for c in convs)
    extra = extra_samples(order[len(held):], 3)  # responses 2 and 3 of the training prompts only
    assert len(extra) == 2 * 190 and {c.id.rsplit("#s", 1)[1] for c in extra} == {"1", "2"}
    assert not {c.id.rsplit("#s", 1)[0] for c in extra} & {c.id for c in held}


def test_cpu_default_run_keeps_within_its_time_budget():
    """`make train-draft` on the CPU must end within 20 minutes on a slower machine too: training gets what the
    budget leaves after regeneration and features (the schedule is then fitted to it), and an explicit
    --max-train-minutes wins."""
    from training.train_draft import parse_args, train_seconds_limit

    cpu = parse_args(["--device", "cpu"])
    assert cpu.time_budget_minutes == 19.5 and cpu.max_train_minutes is None
    assert train_seconds_limit(cpu, elapsed_s=430) == 19.5 * 60 - 430 - cpu.post_train_reserve_s
    assert train_seconds_limit(cpu, elapsed_s=1200) == 60.0  # over budget already: one minute, not nothing
    assert train_seconds_limit(parse_args(["--device", "cpu", "--max-train-minutes", "3"]), 430) == 180
    assert train_seconds_limit(parse_args(["--device", "cuda"]), 430) is None


@pytest.mark.parametrize("spec,text", [("bogus:x", "kind 'bogus' unknown"),
                                       ("messages:/nonexistent/chats.jsonl", "does not exist"),
                                       ("gsm8k:/nonexistent/train.jsonl:10", "does not exist")])
def test_bad_data_sources_are_refused_before_the_target_loads(spec, text, capsys, monkeypatch):
    import training.train_draft as td

    monkeypatch.setattr(td, "load_tokenizer", lambda *a: pytest.fail("the target was loaded"))
    try:
        rc = td.main(["--device", "cpu", "--data", spec])
    except SystemExit as e:  # refused by the option parser
        rc = e.code
    assert rc == 2 and text in capsys.readouterr().err


def test_weight_decay_shrinks_the_matrices_and_leaves_the_norms(tiny_pair):
    """--weight-decay: AdamW's decoupled decay, p <- p (1 - lr wd) - lr u, on the head's matrices; its norms' gains
    take the same step as without decay."""
    recs, lm = _features_and_lm(tiny_pair, n=4)
    cfg = TrainConfig(ttt_steps=2, lr=1e-2, max_steps=1, grad_accum=1, seed=1)
    torch.manual_seed(0)
    plain = _head(tiny_pair, recs)
    start = {n: p.detach().clone() for n, p in plain.named_parameters()}
    train(plain, recs, lm, cfg, log=lambda *_: None)
    torch.manual_seed(0)
    decayed = _head(tiny_pair, recs)
    train(decayed, recs, lm, dataclasses.replace(cfg, weight_decay=0.5), log=lambda *_: None)
    without = dict(plain.named_parameters())
    shrink = []
    for n, p in decayed.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2:
            assert torch.equal(p, without[n]), n
        else:  # the difference is lr * wd * p0, one factor for every matrix
            diff = (without[n] - p).detach()
            factor = float((diff * start[n]).sum() / start[n].pow(2).sum())
            assert torch.allclose(diff, factor * start[n], atol=1e-6), n
            shrink.append(factor)
    assert shrink and min(shrink) > 0 and max(shrink) - min(shrink) < 1e-4


@pytest.mark.parametrize("value", ["-0.1", "1.5"])
def test_a_weight_decay_out_of_range_is_refused_at_parsing(value, capsys):
    from training.train_draft import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--device", "cpu", "--weight-decay", value])
    assert e.value.code == 2 and f"--weight-decay {float(value)}" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_target_attention_is_the_attention_block_of_the_layer(kind, tmp_path):
    """What the head's attention is fitted to: the layer's output is its input plus this block plus the MLP
    of their sum (checked against the target's own forward, for MHA and MLA layers)."""
    from training.trainer import TargetAttention

    cfg = (tiny.llama_config(num_layers=3, hidden=64, heads=4, kv_heads=2, vocab=300) if kind == "llama" else
           tiny.deepseek_v3_config(num_layers=3, moe_layers=1, hidden=64, heads=4, vocab=300, q_lora_rank=32,
                                   kv_lora_rank=32, qk_nope=16, qk_rope=8, v_head=16))
    target = tiny.build_target(cfg, seed=1)
    ids = torch.randint(3, 300, (1, 17))
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
        blk = target.model.layers[1]
        h = hs[1][0]
        a = TargetAttention(target, 1, torch.device("cpu"))(h)
        out = h + a + blk.mlp(blk.post_attention_layernorm(h + a))
    assert torch.allclose(out, hs[2][0], atol=1e-5, rtol=1e-4)
    # causal: a later token does not change earlier outputs
    h2 = h.clone()
    h2[-1] += 1.0
    assert torch.allclose(TargetAttention(target, 1, torch.device("cpu"))(h2)[:-1], a[:-1], atol=1e-6)
    # a target read with --target-weights-only (the layer's weights, the rest on the meta device) gives the same
    from sglang_ext.core.targets import load_target_weights

    target.save_pretrained(tmp_path / "t")
    light = load_target_weights(str(tmp_path / "t"), layer=1)
    assert torch.allclose(TargetAttention(light, 1, torch.device("cpu"))(h), a, atol=1e-6)


def test_an_mha_head_under_an_mla_target_fits_its_attention_to_the_layer():
    """An MHA head cannot take an MLA layer's weights; fit_attention_to_target regresses its attention on the
    layer's attention block over real feature records, and moves nothing else."""
    from training.features import FeatureExtractor
    from training.trainer import fit_attention_to_target, init_layer_from_target

    tok = tiny.train_tokenizer(300)
    cfg = tiny.deepseek_v3_config(num_layers=4, moe_layers=0, hidden=64, heads=4, vocab=len(tok), q_lora_rank=32,
                                  kv_lora_rank=32, qk_nope=16, qk_rope=8, v_head=16)
    target = tiny.build_target(cfg, seed=0)
    aux = [0, 1, 2]
    ex = FeatureExtractor(target, tok, aux, dtype=torch.float32)
    from training import data as D

    convs = [D.Conversation(str(i), [{"role": "user", "content": f"what is {i} and {i * 7} apples"},
                                     {"role": "assistant", "content": f"the total number is {i * 8} apples each"}])
             for i in range(12)]
    records = [ex(c) for c in convs]
    torch.manual_seed(0)
    head = Eagle3Head(head_config_for(target.config, "mha", aux))
    assert "self_attn" not in init_layer_from_target(head, target, 3)
    others = {k: v.clone() for k, v in head.state_dict().items() if "self_attn" not in k}
    fit = fit_attention_to_target(head, target, 3, records, steps=150, lr=3e-3)
    assert fit["relative_error_end"] < 0.5 * fit["relative_error_start"], fit
    assert all(torch.equal(v, head.state_dict()[k]) for k, v in others.items())
    # a target whose layers this cannot run alone: skipped, said why, the head unchanged
    before = {k: v.clone() for k, v in head.state_dict().items()}
    fit = fit_attention_to_target(head, torch.nn.Linear(2, 2), 3, records, steps=5)
    assert "cannot be run alone" in fit["skipped"]
    assert all(torch.equal(v, head.state_dict()[k]) for k, v in before.items())


def test_fit_attention_steps_only_where_the_attention_was_not_taken(capsys):
    from training.train_draft import FIT_ATTENTION_AUTO_STEPS, fit_attention_steps, parse_args

    mlp_only = ["mlp", "input_layernorm", "hidden_norm", "post_attention_layernorm"]
    assert fit_attention_steps("auto", mlp_only, 27, [1, 14, 26], 30) == FIT_ATTENTION_AUTO_STEPS
    assert fit_attention_steps("50", mlp_only, 27, [1, 14, 26], 30) == 50
    assert fit_attention_steps("auto", ["self_attn", *mlp_only], 27, [1, 14, 26], 30) == 0  # copied: nothing to fit
    assert fit_attention_steps("auto", [], 27, [1, 14, 26], 30) == 0  # nothing of the layer taken
    assert fit_attention_steps("auto", mlp_only, 20, [1, 14, 26], 30) == 0  # its input is not an aux state
    assert fit_attention_steps("auto", mlp_only, None, [1, 14, 26], 30) == 0  # --init-layer none
    assert fit_attention_steps("0", mlp_only, 27, [1, 14, 26], 30) == 0
    for bad in ("-3", "many"):
        with pytest.raises(SystemExit):
            parse_args(["--fit-attention-steps", bad])
        assert f"--fit-attention-steps {bad}: a number of steps >= 0 or auto" in capsys.readouterr().err


# ------------------------------------------------------------------ templates and data we did not write
TEMPLATES = os.path.join(os.path.dirname(__file__), "data", "chat_templates")  # copied from the models' repos


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
    from training.train_draft import load_conversations, parse_args

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
    from training.chat import apply_reasoning

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
    from training.chat import end_of_turn

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
    from training.chat import apply_reasoning

    turn = {"role": "assistant", "content": "Four", "reasoning_content": "two and two"}
    assert apply_reasoning([U2, turn], "keep", real_template("qwen3"))[1] == turn  # Qwen3 renders the field
    assert apply_reasoning([U2, turn], "keep", tokenizer(None))[1]["content"] == "<think>two and two</think>Four"


def test_server_regeneration_keeps_reasoning_content(monkeypatch):
    import training.regenerate as R

    sent = []

    def reply(url, body, retries, timeout):
        sent.append(body["messages"])
        return {"choices": [{"message": {"role": "assistant", "content": "Four", "reasoning_content": "two and two"}}]}

    monkeypatch.setattr(R, "post_json", reply)
    reg = R.ServerRegenerator("http://x", options=R.GenerationOptions(16))
    out = reg._conversation(D.Conversation("1", [U2, {"role": "assistant", "content": "?"}, U1, A1]))
    assert out.messages[1] == {"role": "assistant", "content": "Four", "reasoning_content": "two and two"}
    assert sent[1][1] == {"role": "assistant", "content": "Four"}  # history carries the answer, as clients send it


def test_conversations_without_ids_from_two_sources_keep_both(tmp_path, tiny_pair):
    from training.train_draft import load_conversations, parse_args

    _, tok = tiny_pair
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps({"messages": [U1, A1]}) + "\n")
    b.write_text(json.dumps({"messages": [U2, A2]}) + "\n" + json.dumps({"id": None, "messages": [U2, A1]}) + "\n")
    convs = load_conversations(parse_args(["--data", f"messages:{a}", "--data", f"messages:{b}", "--device", "cpu"]),
                               tok)
    assert [c.id for c in convs] == ["0", "0~1", "1"] and [c.messages[0] for c in convs] == [U1, U2, U2]


def test_resume_refuses_regenerated_data_from_other_prompts(tiny_pair, tmp_path):
    target, tok = tiny_pair
    out = tmp_path / "regen.jsonl"
    regen = LocalRegenerator(target, tok, GenerationOptions(max_new_tokens=4), batch_size=2)
    regen.run([D.Conversation("0", [U1, A1])], str(out))
    with pytest.raises(ValueError, match="other user turns.*new --work"):
        regen.run([D.Conversation("0", [U2, A2])], str(out))
    with pytest.raises(ValueError, match="appears more than once"):
        regen.run([D.Conversation("7", [U1, A1]), D.Conversation("7", [U2, A2])], str(out))


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
    from training.regenerate import open_for_append

    p = tmp_path / "regen.jsonl"
    whole = "".join(json.dumps({"id": str(i), "messages": [U1, A1], "pad": "x" * 900}) + "\n" for i in range(200))
    p.write_text(whole + '{"id": "cut", "messages": [' + "y" * 70000)  # a cut line longer than the block read
    with open_for_append(str(p)) as f:
        f.write("next\n")
    assert p.read_text() == whole + "next\n"
