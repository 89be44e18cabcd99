"""Training the head: batching, resume, time limits, export, initialisation from the target, weight decay."""

import dataclasses
import json
import os

import pytest
import torch

from sglang_ext.core import tiny
from sglang_ext.core.heads import Eagle3Head, head_config_for
from sglang_ext.training import data as D
from sglang_ext.training.features import FeatureExtractor, read_shards, write_shards
from sglang_ext.training.trainer import TrainConfig, init_head_from_target, train

from train_support import tiny_pair  # noqa: F401 -- a fixture
from train_support import _features_and_lm, _head, _records


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
    from sglang_ext.training.trainer import batches, ttt_loss

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
    from sglang_ext.training.trainer import checkpoint_meta

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


def test_non_finite_loss_stops_training_before_anything_is_saved(tiny_pair, tmp_path):
    recs, lm = _features_and_lm(tiny_pair)
    head = _head(tiny_pair, recs)
    with torch.no_grad():
        head.fc.weight.fill_(float("nan"))  # what a diverged bf16 run looks like
    with pytest.raises(FloatingPointError, match="non-finite TTT loss.*step 0"):
        train(head, recs, lm, TrainConfig(ttt_steps=2, max_steps=3), checkpoint_dir=str(tmp_path / "ck"),
              log=lambda *_: None)
    assert not (tmp_path / "ck" / "trainer.json").exists()


def test_decoder_layer_can_start_from_a_target_layer(tiny_pair):
    from sglang_ext.training.trainer import init_layer_from_target

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


@pytest.mark.slow  # a fresh interpreter, SmolLM2 or an end-to-end run: `make test`, not `make test-fast`
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
    from conftest import WORKERS as here
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
                        os.path.join(here, "ddp_worker.py"), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    train(head, recs, lm, TrainConfig(**dict(cfg, grad_accum=2)), log=lambda *_: None)
    ddp = load_file(str(tmp_path / "trained.safetensors"))
    for k, v in head.state_dict().items():
        assert torch.allclose(ddp[k], v, atol=1e-6), k
    assert not torch.allclose(ddp["fc.weight"], load_file(str(tmp_path / "head.safetensors"))["fc.weight"])


def test_fit_total_lays_the_schedule_over_the_time_left():
    from sglang_ext.training.trainer import fit_total

    assert fit_total(step=100, planned=500, seconds_left=100.0, seconds_per_step=1.0) == 200  # time binds
    assert fit_total(step=100, planned=150, seconds_left=100.0, seconds_per_step=1.0) == 150  # the plan binds
    assert fit_total(step=100, planned=500, seconds_left=-5.0, seconds_per_step=1.0) == 101  # at least one more
    assert fit_total(step=100, planned=500, seconds_left=10.0, seconds_per_step=0.0) == 500  # no pace yet


def test_time_limited_training_finishes_its_fitted_schedule(tiny_pair, monkeypatch):
    """With a time limit the run measures its pace, shortens the cosine schedule to what fits, and ends
    with the learning rate decayed -- not stopped half-way at a high rate. A fake clock (0.01 s per
    reading, deterministic) stands in for the wall clock."""
    import itertools

    from sglang_ext.training import trainer as T

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


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_target_attention_is_the_attention_block_of_the_layer(kind, tmp_path):
    """What the head's attention is fitted to: the layer's output is its input plus this block plus the MLP
    of their sum (checked against the target's own forward, for MHA and MLA layers)."""
    from sglang_ext.training.trainer import TargetAttention

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
    from sglang_ext.training.trainer import fit_attention_to_target, init_layer_from_target

    tok = tiny.train_tokenizer(300)
    cfg = tiny.deepseek_v3_config(num_layers=4, moe_layers=0, hidden=64, heads=4, vocab=len(tok), q_lora_rank=32,
                                  kv_lora_rank=32, qk_nope=16, qk_rope=8, v_head=16)
    target = tiny.build_target(cfg, seed=0)
    aux = [0, 1, 2]
    ex = FeatureExtractor(target, tok, aux, dtype=torch.float32)

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

