"""sglang_ext.training.remeasure: an exported head's reported acceptance, re-measured from its files and paired per
prompt."""

import json

import pytest
import torch

from sglang_ext.core import tiny
from sglang_ext.core.heads import Eagle3Head
from sglang_ext.core.targets import load_target, load_tokenizer
from sglang_ext.training.remeasure import main
from sglang_ext.training.train_draft import acceptance_estimate, gsm8k_prompts, prompt_digest


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny MLA target and an exported MHA head beside a training_report.json written as train_draft writes it
    (the estimate from the exported files, fp32 on the CPU: what a re-measurement here must reproduce exactly)."""
    root = tmp_path_factory.mktemp("remeasure")
    target = tiny.build_target(tiny.deepseek_v3_config(num_layers=4, hidden=128, heads=4, vocab=512), seed=0)
    tiny.save_target(target, tiny.train_tokenizer(512), str(root / "target"), dtype=torch.float32)
    head = tiny.random_head(tiny.head_config_for(target.config, "mha", [0, 1, 2]), target, seed=1, std=0.3)
    head.save_pretrained(str(root / "head"), dtype=torch.float32)
    gsm = root / "gsm.jsonl"
    gsm.write_text("".join(json.dumps({"question": f"what is {i} plus {i}?", "answer": f"#### {2 * i}"}) + "\n"
                           for i in range(5)))
    tok, t = load_tokenizer(str(root / "target")), load_target(str(root / "target"))
    h = Eagle3Head.from_pretrained(str(root / "head"), t.get_input_embeddings().weight)
    est = acceptance_estimate(t, h, gsm8k_prompts(tok, str(gsm), 5), 3, 12, [tok.eos_token_id])
    report = {"acceptance": {"eval_data": str(gsm), "prompts": 5, "chain_steps": 3, "max_new_tokens": 12,
                             "trained": est, "untrained": None}}
    (root / "head" / "training_report.json").write_text(json.dumps(report))
    return root, report


def head_with_report(root, dest, report) -> str:
    """The exported head's files in `dest` beside another training_report.json (the head unchanged)."""
    dest.mkdir(exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        (dest / name).write_bytes((root / "head" / name).read_bytes())
    (dest / "training_report.json").write_text(json.dumps(report))
    return str(dest)


def run(root, *extra):
    return main(["--draft", str(root / "head"), "--target", str(root / "target"), *extra])


def test_a_faithful_report_is_reproduced_prompt_for_prompt(exported, capsys, tmp_path):
    root, report = exported
    assert run(root, "--out", str(tmp_path / "r.json")) == 0
    out = json.load(open(tmp_path / "r.json"))
    assert out["identical_outputs"] == 5 and out["paired_difference"] == 0 and out["within_noise"]
    assert out["remeasured"] == pytest.approx(report["acceptance"]["trained"]["accepted_drafts_per_step"])
    assert "within the noise" in capsys.readouterr().out
    assert run(root, "--num-prompts", "2", "--out", str(tmp_path / "r2.json")) == 0
    assert json.load(open(tmp_path / "r2.json"))["prompts"] == 2


def test_an_inflated_report_is_caught(exported, tmp_path, capsys):
    """A report claiming every draft accepted, on the same outputs' step counts: outside the noise, exit 1."""
    root, report = exported
    inflated = json.loads(json.dumps(report))
    for r in inflated["acceptance"]["trained"]["per_prompt"]:
        r["accepted_drafts"] = 3 * r["verify_steps"]
    fake = head_with_report(root, tmp_path / "fake", inflated)
    assert main(["--draft", fake, "--target", str(root / "target")]) == 1
    assert "OUTSIDE the noise" in capsys.readouterr().out


def test_bad_input_is_named_with_its_fix(exported, tmp_path, capsys):
    root, report = exported
    assert main(["--draft", str(tmp_path), "--target", str(root / "target")]) == 2
    assert "no training_report.json" in capsys.readouterr().err
    totals_only = json.loads(json.dumps(report))
    del totals_only["acceptance"]["trained"]["per_prompt"]
    (tmp_path / "training_report.json").write_text(json.dumps(totals_only))
    assert main(["--draft", str(tmp_path), "--target", str(root / "target")]) == 2
    assert "per_prompt is missing" in capsys.readouterr().err
    moved = json.loads(json.dumps(report))
    moved["acceptance"]["eval_data"] = "/tmp/gpu-data/gsm8k-test.jsonl-not-here"
    (tmp_path / "training_report.json").write_text(json.dumps(moved))
    assert main(["--draft", str(tmp_path), "--target", str(root / "target")]) == 2
    assert "pass the same file with --dataset-path" in capsys.readouterr().err
    assert main(["--draft", str(tmp_path), "--target", str(root / "target"), "--dataset-path", "./nowhere.jsonl"]) == 2
    assert "--dataset-path './nowhere.jsonl': no such file" in capsys.readouterr().err
    (tmp_path / "training_report.json").write_text("[1, 2]")
    assert main(["--draft", str(tmp_path), "--target", str(root / "target")]) == 2
    assert "not a training report" in capsys.readouterr().err
    # the override finds it; other data than the report's (fewer prompts) is refused, not paired
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"question": "one?", "answer": "#### 1"}) + "\n")
    moved_head = head_with_report(root, tmp_path / "moved", moved)
    assert main(["--draft", moved_head, "--target", str(root / "target"), "--dataset-path", str(short)]) == 2
    assert "not the report's source" in capsys.readouterr().err


def test_other_prompts_of_the_same_count_are_refused_not_paired(exported, tmp_path, capsys):
    """Another GSM8K file (or template, or tokenizer) with as many prompts as the report: the per-prompt digests
    tell it apart before anything is paired; a report from before the digests is still re-measured."""
    root, report = exported
    tok = load_tokenizer(str(root / "target"))
    per_prompt = report["acceptance"]["trained"]["per_prompt"]
    assert [r["prompt_sha256"] for r in per_prompt] == [
        prompt_digest(p) for p in gsm8k_prompts(tok, report["acceptance"]["eval_data"], 5)]
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"question": f"what is {i} plus {i}?" if i != 3 else "what is 3 times 3?",
                                         "answer": "#### 0"}) + "\n" for i in range(5)))
    assert run(root, "--dataset-path", str(other)) == 2
    err = capsys.readouterr().err
    assert "prompt 3 (1 of 5 in all)" in err and "is not the report's" in err and "--dataset-path" in err
    old = json.loads(json.dumps(report))
    for r in old["acceptance"]["trained"]["per_prompt"]:
        del r["prompt_sha256"]
    head = head_with_report(root, tmp_path / "head", old)
    assert main(["--draft", head, "--target", str(root / "target"), "--num-prompts", "2"]) == 0
