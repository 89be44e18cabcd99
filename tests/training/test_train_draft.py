"""The `train_draft` command: options, YAML configs, output checks, torchrun, the CPU time budget."""

import json
import os

import pytest

from sglang_ext.core import tiny

from train_support import tiny_pair  # noqa: F401 -- a fixture

from conftest import REPO as REPO_ROOT  # noqa: E402


def test_yaml_values_are_defaults_checked_like_options(tmp_path):
    from sglang_ext.training.train_draft import parse_args

    from conftest import REPO as here
    example = os.path.join(here, "training", "configs", "gpu-example.yaml")
    args = parse_args(["--config", example, "--epochs", "1", "--out", "out/trial", "--data", "messages:x.jsonl"])
    assert (args.epochs, args.out, args.data, args.lr) == (1, "out/trial", ["messages:x.jsonl"], 0.0003)
    c = tmp_path / "c.yaml"
    c.write_text("lr: 5e-3\n")  # PyYAML: a string
    assert parse_args(["--config", str(c)]).lr == 0.005
    c.write_text("lr: null\n")  # null: the device's default, as when the key is absent
    assert parse_args(["--config", str(c), "--device", "cpu"]).lr == 5e-3
    for text, match in [("draft_format: MLA\n", "draft_format: 'MLA'; choose from"), ("lr: fast\n", "lr: 'fast'"),
                        ("bogus: 1\n", "unknown key 'bogus'"), ("epochs: 2.7\n", ""), ("seed: null\n", ""),
                        ("aux_layers: [1, 2, 3]\n", ""), ("work: 5\n", "")]:
        c.write_text(text)
        with pytest.raises(SystemExit):
            parse_args(["--config", str(c)])


def test_out_is_checked_before_anything_runs_and_replaced_whole(tmp_path, capsys):
    from sglang_ext.training.train_draft import export_dir_problem, main, replace_dir

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


def test_example_config_is_accepted_by_the_cli():
    from sglang_ext.training.train_draft import parse_args

    from conftest import REPO as here
    args = parse_args(["--config", os.path.join(here, "training", "configs", "gpu-example.yaml")])
    assert args.draft_format == "mla" and args.ttt_steps == 7 and args.data[0] == "sharegpt:pkg:20000"


def test_trainer_speed_benchmark_runs_our_side_on_the_cpu(tmp_path):
    """The GPU comparison with SpecForge (training/bench_vs_specforge.py) measures our step on the
    same tensors SpecForge gets; SpecForge itself is not a dependency (it pins another SGLang)."""
    from sglang_ext.training import bench_vs_specforge as b

    out = tmp_path / "r.json"
    assert b.main(["--tiny", "--ours-only", "--seq-len", "64", "--steps", "2", "--ttt", "3", "--json", str(out)]) == 0
    r = json.load(open(out))["rows"]["ours"]
    assert len(r["times"]) == 2 and r["tokens_per_s"] > 0


@pytest.mark.slow  # a fresh interpreter, SmolLM2 or an end-to-end run: `make test`, not `make test-fast`
def test_train_draft_under_torchrun_rank0_prepares_and_exports(tmp_path):
    """`torchrun --nproc_per_node 2 -m sglang_ext.training.train_draft ...` on the CPU: rank 0 regenerates and
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
                        "-m", "sglang_ext.training.train_draft", "--target", str(tmp_path / "target"),
                        "--aux-layers", "0,1,2",
                        "--max-new-tokens", "8", "--draft-vocab-size", "128", "--epochs", "1", "--ttt-steps", "2",
                        "--eval-dataset-path", str(tmp_path / "gsm.jsonl"), "--eval-num-prompts", "2", "--eval-max-new-tokens", "8",
                        "--device", "cpu", "--batch-tokens", "128", "--max-train-minutes", "0",  # ranks stop together
                        "--data", f"messages:{tmp_path / 'sg.jsonl.gz'}", "--regen-samples", "2",
                        "--work", str(tmp_path / "work"), "--out", str(tmp_path / "head")],
                       capture_output=True, text=True, timeout=300,
                       cwd=REPO_ROOT)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stdout.count("[train-draft] regenerated") == 1 and p.stdout.count("[train-draft] exported") == 1
    report = json.load(open(tmp_path / "head" / "training_report.json"))
    assert report["world_size"] == 2 and report["train_conversations"] == 2 * 11  # 12 prompts, 1 held out
    assert report["final_metrics"]["step"] == 1 and report["final_metrics"]["stopped_early"]
    # the options in effect and where each came from; one history point per optimizer step; the curve beside it
    assert report["options"]["lr"] == 5e-3 and report["option_sources"]["lr"] == "cpu default"
    assert report["options"]["epochs"] == 1 and report["option_sources"]["epochs"] == "given"
    assert [h["step"] for h in report["history"]] == [1] and len(report["history"][0]["accuracy_per_step"]) == 2
    assert (tmp_path / "head" / "training_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "options: lr 0.005 (cpu default), epochs 1 (given)" in p.stdout
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


def test_cpu_default_run_keeps_within_its_time_budget():
    """`make train-draft` on the CPU must end within 20 minutes on a slower machine too: training gets what the
    budget leaves after regeneration and features (the schedule is then fitted to it), and an explicit
    --max-train-minutes wins."""
    from sglang_ext.training.train_draft import parse_args, train_seconds_limit

    cpu = parse_args(["--device", "cpu"])
    assert cpu.time_budget_minutes == 19.5 and cpu.max_train_minutes is None
    assert train_seconds_limit(cpu, elapsed_s=430) == 19.5 * 60 - 430 - cpu.post_train_reserve_s
    assert train_seconds_limit(cpu, elapsed_s=1200) == 60.0  # over budget already: one minute, not nothing
    assert train_seconds_limit(parse_args(["--device", "cpu", "--max-train-minutes", "3"]), 430) == 180
    assert train_seconds_limit(parse_args(["--device", "cuda"]), 430) is None


@pytest.mark.parametrize("value", ["-0.1", "1.5"])
def test_a_weight_decay_out_of_range_is_refused_at_parsing(value, capsys):
    from sglang_ext.training.train_draft import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--device", "cpu", "--weight-decay", value])
    assert e.value.code == 2 and f"--weight-decay {float(value)}" in capsys.readouterr().err


def test_fit_attention_steps_only_where_the_attention_was_not_taken(capsys):
    from sglang_ext.training.train_draft import FIT_ATTENTION_AUTO_STEPS, fit_attention_steps, parse_args

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



def test_defaults_follow_the_device_and_say_where_they_came_from():
    """The CPU demo and a GPU run get their own learning rate, epochs and batching; a given option wins; the GPU
    learning rate follows the head's width (SpecForge's 1e-4 for a 7168-wide DeepSeek / Kimi head)."""
    from sglang_ext.training.train_draft import parse_args, resolve_lr, resolved_options_line

    cpu = parse_args(["--device", "cpu"])
    assert (cpu.lr, cpu.epochs, cpu.grad_accum, cpu.batch_tokens, cpu.ttt_steps) == (5e-3, 8, 4, 0, 3)
    assert cpu.option_sources["lr"] == "cpu default"
    gpu = parse_args(["--device", "cuda"])
    assert (gpu.epochs, gpu.grad_accum, gpu.batch_tokens, gpu.ttt_steps, gpu.draft_vocab_size) == (6, 1, 16384, 7, 32000)
    resolve_lr(gpu, 7168)
    assert gpu.lr == 1e-4 and gpu.option_sources["lr"] == "cuda default (head 7168 wide)"
    small = parse_args(["--device", "cuda"])
    resolve_lr(small, 576)
    assert small.lr == 2e-3
    given = parse_args(["--device", "cuda", "--lr", "3e-4", "--epochs", "2"])
    resolve_lr(given, 7168)
    assert given.lr == 3e-4 and given.option_sources["lr"] == "given" and given.option_sources["epochs"] == "given"
    assert "lr 0.0003 (given), epochs 2 (given), grad-accum 1 (cuda default)" in resolved_options_line(given)


def test_history_keeps_its_shape_and_last_step_when_thinned():
    from sglang_ext.training.trainer import HISTORY_POINTS, record_history

    history = []
    for step in range(1, 3 * HISTORY_POINTS + 1):
        record_history(history, {"step": step})
    steps = [h["step"] for h in history]
    assert len(steps) <= HISTORY_POINTS + 1 and steps[0] == 1 and steps[-1] == 3 * HISTORY_POINTS
    assert steps == sorted(steps) and max(b - a for a, b in zip(steps, steps[1:])) <= 4


def test_aux_layers_a_target_cannot_take_are_refused_before_it_loads(tmp_path, capsys):
    """A 4-layer target has no default [1, N//2-1, N-4] of 3 distinct layers: the trainer says so as its own option,
    before loading the target or reading data, instead of a traceback after the load."""
    from sglang_ext.training.train_draft import main

    cfg = tiny.deepseek_v3_config(num_layers=4, hidden=64, heads=2, vocab=512)
    tiny.save_target(tiny.build_target(cfg, seed=0), tiny.train_tokenizer(512), str(tmp_path / "t"))
    assert main(["--target", str(tmp_path / "t"), "--device", "cpu", "--out", str(tmp_path / "o"),
                 "--work", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert "--aux-layers (default)" in err and "[1, 1, 0]" in err and "Traceback" not in err
    assert not (tmp_path / "w" / "regenerated.jsonl").exists()
