"""The GPU benchmark's CPU-checkable parts (eval/spec_bench.py): the bound and the measured draft cost,
the Kimi-K2.5-shaped target and heads (checked by the same schema the server enforces), heads written
from the schema loading back into the core, the arms' server arguments, and the report."""

import json
import math
import os

import pytest
import torch

from sglang_ext.eval import spec_bench as sb
from sglang_ext.config import Eagle3DraftConfig, TargetConfig, weight_map
from sglang_ext.config.pair import pair_errors


def test_bound_and_cost_ratio_by_hand():
    assert sb.speedup_bound(2.0, 0.1, steps=3) == pytest.approx(3.0 / 1.3)
    # TPOT at zero acceptance 1.45x plain decoding with 3 draft steps -> c = 0.15
    assert sb.draft_cost_ratio(10.0, 14.5, steps=3) == pytest.approx(0.15)
    assert sb.draft_cost_ratio(10.0, 9.0) == 0.0


@pytest.mark.parametrize("layers,dense", [(2, 2), (3, 1)])
def test_target_step_bytes_are_the_weights_one_token_reads(layers, dense):
    """Against transformers' own DeepseekV3 (on the meta device): every parameter but the embedding, of the routed
    experts only the ones a token selects."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    cfg = dict(sb.target_config(layers), first_k_dense_replace=dense)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(DeepseekV3Config(**{k: v for k, v in cfg.items()
                                                                       if k != "architectures"}))
    active = sum(p.numel() * (cfg["num_experts_per_tok"] / cfg["n_routed_experts"] if ".experts." in n else 1)
                 for n, p in model.named_parameters() if "embed_tokens" not in n)
    assert sb.target_step_bytes(cfg) == 2 * active


def test_an_fp8_target_is_deepseek_v3s_block_format_at_half_the_bytes():
    """`build --target-weights fp8`: the quantization_config DeepSeek-V3 ships, which SGLang's own ModelConfig reads as
    fp8; the bytes a step reads count the layers' matrices at 1 byte plus a float32 scale per 128 x 128 block (against
    transformers' DeepseekV3 on the meta device), the norms and the LM head at 2."""
    from sglang.srt.configs.model_config import ModelConfig
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    cfg = sb.target_config(61, "fp8")
    assert cfg["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                          "weight_block_size": [128, 128]}
    assert "quantization_config" not in sb.target_config(61)
    with pytest.raises(ValueError, match="'int4'.*bf16, fp8"):
        sb.target_config(61, "int4")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(DeepseekV3Config(**{k: v for k, v in sb.target_config(2).items()
                                                                       if k != "architectures"}))
    matrices = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2)
    plain = sum(p.numel() for n, p in model.named_parameters()
                if "embed_tokens" not in n and not (".layers." in n and p.dim() == 2))
    fp8 = sb.target_step_bytes(sb.target_config(2, "fp8"))
    assert matrices + 2 * plain < fp8 < matrices * (1 + 4 / 128 ** 2) + 2 * plain + 64
    assert 0.5 < sb.target_step_bytes(sb.target_config(61, "fp8")) / sb.target_step_bytes(sb.target_config(61)) < 0.53
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
        assert ModelConfig(d).quantization == "fp8"


def test_weight_bytes_bound_of_the_benchmark_pair():
    fmt = "mha"
    d, f = sb.draft_cycle_bytes(sb.head_config(fmt, 16), fmt)
    req, _ = weight_map(fmt).expected(Eagle3DraftConfig.from_dict(sb.head_config(fmt, 16)))
    assert f == 2 * math.prod(req["fc.weight"]) and d + f == 2 * sum(math.prod(v) for k, v in req.items() if k != "d2t")
    b = sb.weight_bytes_bound(sb.target_config(16), sb.head_config(fmt, 16), fmt, accepted=2.0)
    t = sb.target_step_bytes(sb.target_config(16))
    assert b["bound"] == pytest.approx(3 * t / (t + 3 * d + f)) and 2.3 < b["bound"] < 2.35
    assert sb.weight_bytes_bound(sb.target_config(16), sb.head_config(fmt, 16), fmt, 0.0)["bound"] < 1.0
    # an arm against it: TPOT and throughput ratios at concurrency 1, the arm's median acceptance
    runs = lambda tps, tpot, acc: [{"output_tokens_per_s": tps, "tpot_mean_s": tpot, "accepted_drafts_per_step": acc}]
    state = {"build": {"layers": 16}, "arms": {"nospec": {"levels": {"1": runs(180.0, 0.0054, None)}},
                                               "plugin-mha-chain": {"levels": {"1": runs(396.0, 0.0024, 2.0)}}}}
    (row,) = sb.bound_rows(state, ["plugin-mha-chain"])
    assert row["tpot_speedup"] == pytest.approx(2.25) and row["throughput_speedup"] == pytest.approx(2.2)
    assert row["tpot_speedup/bound"] == pytest.approx(2.25 / b["bound"])
    assert "| plugin-mha-chain | 18.27 |" in sb.bound_table([row])
    with pytest.raises(SystemExit, match="'nospec' arm"):
        sb.bound_rows({"build": {"layers": 16}, "arms": {}}, ["plugin-mha-chain"])
    with pytest.raises(SystemExit, match="not a drafting arm"):
        sb.bound_rows(state, ["nospec"])


@pytest.mark.parametrize("fmt", ["mha", "mla"])
def test_kimi_shaped_heads_pass_the_servers_checks_and_are_about_1b(fmt):
    target = TargetConfig.from_dict(sb.target_config(16))
    cfg = sb.head_config(fmt, 16)
    req, _ = weight_map(fmt).expected(Eagle3DraftConfig.from_dict(cfg))
    shapes = {k: {"shape": v, "dtype": "BF16"} for k, v in req.items()}
    assert pair_errors(target, Eagle3DraftConfig.from_dict(cfg), shapes) == []
    params = sum(math.prod(v) for v in req.values())
    assert 0.85e9 < params < 1.4e9, params  # "1B-parameter heads" (MLA 0.90B, MHA larger)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 7, 12]


def test_written_heads_load_in_the_core(tmp_path):
    from sglang_ext.core.heads import Eagle3Head

    for fmt in ("mha", "mla"):
        cfg = sb.head_config(fmt, 8, draft_vocab=64)
        cfg.update(hidden_size=64, target_hidden_size=64, intermediate_size=96, num_attention_heads=4,
                   vocab_size=256)
        if fmt == "mha":
            cfg.update(num_key_value_heads=2, head_dim=16)
        else:
            cfg.update(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
        n = sb.write_head(str(tmp_path / fmt), cfg, fmt, device="cpu")
        head = Eagle3Head.from_pretrained(str(tmp_path / fmt))
        assert n > 0 and head.config.head_format == fmt
        assert torch.equal(head.d2t, torch.zeros(64, dtype=torch.long))


def test_arms_server_arguments():
    args, env = sb.server_args("upstream-chain", 32, 0.8)
    assert env["SGLANG_PLUGINS"] == "none" and env[sb.SIM] == "3.0" and "--load-format" in args
    assert args[args.index("--speculative-draft-model-path") + 1].endswith("head-mha-upstream")
    args, env = sb.server_args("zero-accept-protected", 32, 0.8)
    assert sb.SIM not in env and "--speculative-adaptive" in args and env["SGLANG_EXT_ADAPTIVE_POLICY"] == "cost"
    # the protection as shipped runs depth 0 as a plain decode step; the earlier runs' protected arms keep
    # upstream's one-token verify, so their state files mean what they meant
    args, env = sb.server_args("zero-accept-protected-decode0", 32, 0.8)
    assert "SGLANG_EXT_ADAPTIVE_DEPTH0" not in env and env["SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND"] == "1"
    args, env = sb.server_args("zero-accept-protected-warm", 32, 0.8)  # the shipped default: no extend switch set
    assert sb.SIM not in env and not {"SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND", "SGLANG_EXT_ADAPTIVE_DEPTH0",
                                      "SGLANG_EXT_ADAPTIVE_DEPTH0_DRAFT_EXTEND"} & set(env)
    args, env = sb.server_args("chain-protected-decode0", 32, 0.8)
    assert env[sb.SIM] == "3.0" and "SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND" not in env
    for arm in ("zero-accept-protected", "zero-accept-protected-verify-decode"):
        assert sb.server_args(arm, 32, 0.8)[1]["SGLANG_EXT_ADAPTIVE_DEPTH0"] == "verify"
    args, env = sb.server_args("nospec", 128, 0.8)
    assert "--speculative-algorithm" not in args and args[args.index("--disable-prefill-cuda-graph") - 1] == "128"
    # the running limit above the largest concurrency (at the limit, SGLang 0.5.17 can hold one request of a wave
    # until the others finish): CUDA graphs to 128, 256 requests may run
    assert args[args.index("--max-running-requests") + 1] == "256"


def test_report_from_a_state(tmp_path, monkeypatch):
    monkeypatch.setattr(sb, "WORK", str(tmp_path))

    def runs(tps, tpot, acc=None):
        return [{"output_tokens_per_s": t, "tpot_mean_s": tpot, "accepted_drafts_per_step": acc} for t in tps]

    state = {"build": {"layers": 16}, "arms": {
        "nospec": {"levels": {"1": runs([100, 102], 0.010), "32": runs([3000, 3100], 0.011)}},
        "upstream-chain": {"levels": {"1": runs([200, 204], 0.005, 2.0), "32": runs([3300, 3300], 0.010, 2.0)}},
        "plugin-chain": {"levels": {"1": runs([202, 202], 0.005, 2.0), "32": runs([3300, 3340], 0.010, 2.0)},
                         "pool": {"draft_bytes_per_token": 4096, "draft_pool_tokens": 1000}},
        "zero-accept": {"levels": {"1": runs([70, 70], 0.0145, 0.0)}}}}
    json.dump(state, open(tmp_path / "state.json", "w"))
    out = sb.report(str(tmp_path / "benchmarks.md"))
    row1 = next(r for r in out["rows"] if r["concurrency"] == 1)
    assert row1["plugin/upstream"] == pytest.approx(202 / 202)
    assert out["bound"]["c"] == pytest.approx((0.0145 / 0.010 - 1) / 3)
    assert out["bound"]["bound"] == pytest.approx(3 / (1 + 3 * out["bound"]["c"]))
    assert out["bound"]["achieved"] == pytest.approx(0.010 / 0.005)  # TPOT ratio, what the bound bounds
    text = (tmp_path / "benchmarks.md").read_text()
    assert "| 32 | 1.006" in text and "of the bound" in text and (tmp_path / "benchmarks.png").exists()
    # the bound with verify as decode, and the protection's table (ratios over no speculation, with the band)
    state["arms"].update({
        "zero-accept-verify-decode": {"levels": {"1": runs([75, 75], 0.013, 0.0)}},
        "plugin-chain-verify-decode": {"levels": {"1": runs([210, 212], 0.0048, 2.0)}},
        "zero-accept-protected-decode0": {"levels": {"1": runs([98, 100], 0.0102), "32": runs([2900, 3050], 0.0112)}},
        "chain-protected-decode0": {"levels": {"1": runs([205, 209], 0.0049, 2.0)}}})
    json.dump(state, open(tmp_path / "state.json", "w"))
    out = sb.report(str(tmp_path / "benchmarks.md"))
    assert out["bounds"]["verify as decode"]["c"] == pytest.approx((0.013 / 0.010 - 1) / 3)
    text = (tmp_path / "benchmarks.md").read_text()
    assert "Batch 1, verify as decode: measured draft/target step-cost ratio c = 0.100" in text
    assert (f"| 1 | {99 / 101:.3f} ({98 / 102:.3f}-{100 / 100:.3f}), TPOT {0.010 / 0.0102:.3f} | — | — | "
            f"{207 / 101:.3f} ({205 / 102:.3f}-{209 / 100:.3f}), TPOT {0.010 / 0.0049:.3f} |") in text
    assert f"| 32 | {2975 / 3050:.3f} ({2900 / 3100:.3f}-{3050 / 3000:.3f}), TPOT {0.011 / 0.0112:.3f} |" in text
    # a failed arm is named with its first error line; a profile is summarised
    state["arms"]["plugin-tree"] = {"levels": {}, "error": "OutOfMemoryError() at concurrency 32\nlog tail"}
    prof = {"window_ms": 100.0, "gpu_busy_ms": 40.0, "gpu_busy_fraction": 0.4, "steps": 10,
            "top_kernels_ms_per_step": [["gemm", 2.5]]}
    state["arms"]["plugin-chain"]["profiles"] = {"1": prof, "32": dict(prof, gpu_busy_ms=90.0, gpu_busy_fraction=0.9)}
    json.dump(state, open(tmp_path / "state.json", "w"))
    sb.report(str(tmp_path / "benchmarks.md"))
    text = (tmp_path / "benchmarks.md").read_text()
    assert "`plugin-tree`: OutOfMemoryError() at concurrency 32" in text
    assert "| plugin-chain | 1 | 10.00 | 4.00 | 0.40 | gemm 2.5 |" in text
    assert "| plugin-chain | 32 | 10.00 | 9.00 | 0.90 | gemm 2.5 |" in text
    # a protected arm's policy summaries are in the report
    state["arms"]["zero-accept"]["adaptive"] = {"decisions": 3, "runtime_state_switches": 5, "last_decisions": [],
                                                "summaries": ["last 30s, batch 1-1: steps [depth 0: 3900]"]}
    json.dump(state, open(tmp_path / "state.json", "w"))
    sb.report(str(tmp_path / "benchmarks.md"))
    text = (tmp_path / "benchmarks.md").read_text()
    assert "`zero-accept`: 3 depth decisions, 5 runtime-state switches" in text
    assert "- last 30s, batch 1-1: steps [depth 0: 3900]" in text


def test_trace_summary_counts_overlapping_kernels_once(tmp_path):
    import gzip

    events = [{"ph": "X", "cat": "cpu_op", "name": "step", "ts": 0, "dur": 1000},
              {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 100, "dur": 200},
              {"ph": "X", "cat": "kernel", "name": "attn", "ts": 250, "dur": 100},  # overlaps gemm by 50
              {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 600, "dur": 100}]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    out = sb.trace_summary(str(path), steps=2)
    assert out["window_ms"] == pytest.approx(1.0) and out["gpu_busy_ms"] == pytest.approx(0.35)
    assert out["gpu_busy_fraction"] == pytest.approx(0.35)
    assert out["top_kernels_ms_per_step"] == [("gemm", 0.15), ("attn", 0.05)]


def test_upstream_copy_reads_the_same_layers_under_both_engines(tmp_path):
    from sglang_ext.config.aux_layers import engine_output_ids

    src = tmp_path / "h"
    src.mkdir()
    cfg = sb.head_config("mha", 16)
    json.dump(cfg, open(src / "config.json", "w"))
    sb.upstream_copy(str(src), str(tmp_path / "u"))
    copy = json.load(open(tmp_path / "u" / "config.json"))
    assert "aux_layer_convention" not in copy["eagle_config"]
    target = TargetConfig.from_dict(sb.target_config(16))
    ours = engine_output_ids("sglang-ext", target, Eagle3DraftConfig.from_dict(cfg))
    assert engine_output_ids("sglang", target, Eagle3DraftConfig.from_dict(copy)) == ours == [1, 7, 12]
    assert engine_output_ids("sglang-ext", target, Eagle3DraftConfig.from_dict(copy)) == ours


def test_all_retries_failed_arms_and_redoes_on_request():
    state = {"arms": {"nospec": {"levels": {}}, "upstream-chain": {"error": "server did not start"},
                      "plugin-chain": {"levels": {}}}}
    wanted = ["nospec", "plugin-chain", "upstream-chain", "plugin-chain-verify-decode"]
    assert sb.arms_to_run(state, wanted, []) == ["upstream-chain", "plugin-chain-verify-decode"]
    assert sb.arms_to_run(state, wanted, ["nospec"]) == ["nospec", "upstream-chain", "plugin-chain-verify-decode"]
    assert set(sb.PRIORITY) <= set(sb.ARMS)


def test_adaptive_facts_from_a_server_log():
    """A protected arm's row keeps what its speed is made of: the cost policy's decisions, its periodic
    summaries (steps and measured step time per depth) and SGLang's runtime-state switches."""
    from sglang_ext.eval.spec_bench import adaptive_facts

    log = "\n".join([
        "[2026-11-30 11:30:01] [sglang_ext] adaptive speculation: depth 3 -> 0: predicted tokens/s per request 99.0 "
        "vs 70.1 (+41%)",
        "[2026-11-30 11:30:01] Switch adaptive runtime state: steps 3 -> 0, draft_tokens 4 -> 1",
        "[2026-11-30 11:30:31] [sglang_ext] adaptive speculation summary: last 30s, batch 1-1: steps [depth 0: 3900, "
        "depth 1: 16]; measured step time [depth 0: 5.90 ms, depth 1: 7.10 ms, depth 3: 8.50 ms]; now depth 0",
        "[2026-11-30 11:30:32] Decode batch, #running-req: 1"])
    facts = adaptive_facts(log)
    assert facts["decisions"] == 1 and facts["runtime_state_switches"] == 1
    assert facts["last_decisions"][0].startswith("depth 3 -> 0")
    assert facts["summaries"] == [log.splitlines()[2].split("summary: ")[1]]
    assert adaptive_facts("[2026-11-30] Decode batch, #running-req: 1") is None  # no policy: nothing to keep


def test_profile_levels_for_every_arm_or_some():
    from sglang_ext.eval.spec_bench import profile_levels_of

    assert profile_levels_of(None, "nospec") == set() and profile_levels_of("64", "plugin-chain") == {64}
    spec = "nospec:1,zero-accept-protected-verify-decode:64,nospec:32"
    assert profile_levels_of(spec, "nospec") == {1, 32} and profile_levels_of(spec, "plugin-chain") == set()
    assert profile_levels_of(spec, "zero-accept-protected-verify-decode") == {64}
    with pytest.raises(SystemExit, match="nospek"):
        profile_levels_of("nospek:1", "nospec")


def test_each_repeat_sends_new_prompts_and_every_arm_the_same_ones():
    """A repeat must not find its prompts in the radix cache (runs 1-4 sent one set twice per level), and arms are
    compared on the same prompts."""
    seeds = {(c, r): sb.repeat_seed(c, r) for c in (1, 8, 32, 64, 128) for r in range(3)}
    assert len(set(seeds.values())) == len(seeds)
    assert not {98, 99} & set(seeds.values())  # nor the warm-up's
    # nor a level's own untimed passes (its warm-up, its prefill pass), which differ from each other too
    passes = {sb.level_seed(c, p) for c in (1, 8, 32, 64, 128) for p in ("warmup", "prefill")}
    assert len(passes) == 10 and not passes & set(seeds.values())


def test_low_acceptance_arm_and_the_prefill_table(tmp_path, monkeypatch):
    """The break-even arm runs the protection at 1.5 simulated tokens per step whatever SPEC_BENCH_SIM says, and
    the report sets each arm's prefill pass against no speculation's."""
    monkeypatch.setenv("SPEC_BENCH_SIM", "3.0")
    args, env = sb.server_args("low-accept-protected-decode0", 32, 0.6)
    assert env[sb.SIM] == "1.5" and env["SGLANG_EXT_ADAPTIVE_POLICY"] == "cost" and "--speculative-adaptive" in args
    monkeypatch.setattr(sb, "WORK", str(tmp_path))
    def runs(tps, tpot):
        return [{"output_tokens_per_s": t, "tpot_mean_s": tpot, "accepted_drafts_per_step": None} for t in tps]

    state = {"build": {}, "arms": {
        "nospec": {"levels": {"32": runs([4000, 4000], 0.0074)}, "prefill": {"32": {"wall_s": 0.200}}},
        "low-accept-protected-decode0": {"levels": {"32": runs([4400, 4600], 0.0068)},
                                         "prefill": {"32": {"wall_s": 0.230}, "8": {"wall_s": 0.07}}}}}
    json.dump(state, open(tmp_path / "state.json", "w"))
    sb.report(str(tmp_path / "benchmarks.md"))
    text = (tmp_path / "benchmarks.md").read_text()
    assert f"| 32 | — | — | 1.125 (1.100-1.150), TPOT {0.0074 / 0.0068:.3f} | — | — |" in text
    assert "| nospec | — | 200 |" in text and "| low-accept-protected-decode0 | 70 | 230 (1.15) |" in text


def test_a_run_of_only_the_protections_arms_prints_no_empty_table(tmp_path, monkeypatch):
    monkeypatch.setattr(sb, "WORK", str(tmp_path))
    def runs(tps, tpot):
        return [{"output_tokens_per_s": t, "tpot_mean_s": tpot, "accepted_drafts_per_step": 0.0} for t in tps]

    state = {"build": {}, "arms": {"nospec": {"levels": {"32": runs([4000, 4100], 0.0074)}},
                                   "zero-accept-protected-decode0": {"levels": {"32": runs([3900, 4000], 0.0076)}}}}
    json.dump(state, open(tmp_path / "state.json", "w"))
    sb.report(str(tmp_path / "benchmarks.md"))
    text = (tmp_path / "benchmarks.md").read_text()
    assert "plugin/upstream (min-max)" not in text and "| 32 | 0.975 (0.951-1.000), TPOT 0.974 |" in text


@pytest.mark.parametrize("argv,text", [(["--concurrency", "0,4"], "at least 1"), (["--concurrency", "a"], "integers"),
                                       (["--output-len", "0"], "--output-len 0")])
def test_bench_refuses_bad_levels_before_anything_runs(argv, text, capsys):
    from sglang_ext.eval import bench

    with pytest.raises(SystemExit) as e:
        bench.main(["--base-url", "http://127.0.0.1:9", "--tokenizer", "smollm2", *argv])
    assert e.value.code == 2 and text in capsys.readouterr().err


def test_bench_says_when_the_server_is_not_there(capsys):
    from sglang_ext.eval import bench

    assert bench.main(["--base-url", "http://127.0.0.1:9", "--tokenizer", "smollm2"]) == 2
    assert "cannot reach the server at http://127.0.0.1:9" in capsys.readouterr().err


def test_side_by_side_arms_are_measured_in_rotating_order_on_their_own_servers(monkeypatch):
    """`compare`: the arms' servers start one after another (each on its own port, its KV pool capped), each round
    measures every arm once with the order rotated, an arm whose server dies mid-run (a refused connection, or an exit
    that leaves every request failed) is dropped with its error while the others go on, and no --attention-backend is
    passed unless asked (SGLang's own choice)."""
    import sglang_ext.eval.bench

    started, order, events = [], [], []
    exited = set()  # ports whose server process has exited

    class FakeServer:
        def __init__(self, name, args, env, port_number=None):
            self.url, self.args, self.port = f"http://x:{port_number}", args, str(port_number)
            self.proc = type("P", (), {"poll": lambda _: 1 if self.port in exited else None})()
            started.append((name, port_number, args))
            events.append(("start", port_number))

        def wait_ready(self, timeout):
            events.append(("ready", int(self.port)))
            self.ready_s = 1.0
            return True

        def log(self):
            return "[sglang_ext] draft KV pool allocated: 100 tokens, 0.5 GiB, 4096 B/token (bf16)"

        def last_error(self):
            return "torch.OutOfMemoryError: CUDA out of memory." if self.port in exited else ""

        def stop(self):
            pass

    speed = {"30277": 100.0, "30278": 110.0, "30279": 90.0, "30280": 95.0}

    def fake_measure(url, prompts, concurrency, lengths):
        port = url.rsplit(":", 1)[1]
        if port == "30280" and lengths == [1] * concurrency:  # out of memory in its prefill pass: refuses the rest
            exited.add(port)
        if port in exited:
            return {"output_tokens_per_s": 0.0, "failed_requests": len(prompts), "tpot_mean_s": None,
                    "accepted_drafts_per_step": None, "wall_s": 0.0}
        if lengths[0] == 64:  # a timed pass
            order.append(port)
            if port == "30279" and len(order) > 3:
                raise ConnectionError("server died")
        return {"output_tokens_per_s": speed[port], "failed_requests": 0, "tpot_mean_s": 0.01,
                "accepted_drafts_per_step": 2.0, "wall_s": 0.1}

    monkeypatch.setattr(sb, "prompts", lambda n, input_len, seed=0: ["p"] * n)
    monkeypatch.setattr(sglang_ext.eval.bench, "run_arm", fake_measure)
    monkeypatch.setattr(sb, "serverlib", lambda: type("L", (), {"Server": FakeServer, "tp_args": lambda tp: []}))
    arms = ["upstream-mla-chain", "plugin-mla-chain", "nospec", "zero-accept-protected-warm"]
    rows = sb.compare_arms(arms, [1], repeats=3, input_len=8, output_len=64, max_bs=64, mem_fraction=0.9,
                           port=30277, max_total_tokens=131072)
    assert [p for _, p, _ in started] == [30277, 30278, 30279, 30280]
    # each server starts once the one before it is ready: SGLang sizes a server by the memory free at its start
    assert events == [(e, p) for p in (30277, 30278, 30279, 30280) for e in ("start", "ready")]
    assert all("--attention-backend" not in a and a[a.index("--max-total-tokens") + 1] == "131072"
               for _, _, a in started)
    # rounds A B C, then B C A (C dies on its second run: dropped), then A B; D left in its prefill pass
    assert order == ["30277", "30278", "30279", "30278", "30279", "30277", "30277", "30278"]
    assert [r["output_tokens_per_s"] for r in rows["plugin-mla-chain"]["levels"]["1"]] == [110.0] * 3
    assert len(rows["upstream-mla-chain"]["levels"]["1"]) == 3 and "error" not in rows["upstream-mla-chain"]
    assert "server died" in rows["nospec"]["error"] and len(rows["nospec"]["levels"]["1"]) == 1
    assert rows["zero-accept-protected-warm"]["levels"] == {}  # not a row of 0 tokens/s
    assert rows["zero-accept-protected-warm"]["error"].startswith(
        "server exited in the prefill pass at concurrency 1: torch.OutOfMemoryError")
    assert rows["plugin-mla-chain"]["pool"]["draft_bytes_per_token"] == 4096
    assert rows["nospec"]["side_by_side"] == arms


def test_the_side_by_side_table_gives_medians_their_spread_and_ratios():
    def runs(*tps):
        return [{"output_tokens_per_s": t} for t in tps]

    state = {"arms": {"upstream-mla-chain": {"levels": {"1": runs(400, 410, 420), "16": runs(5000, 5100, 5200)}},
                      "plugin-mla-chain": {"levels": {"1": runs(390, 400, 430), "16": runs(4900, 5100, 5300)}}}}
    table = sb.compare_table(state, ["upstream-mla-chain", "plugin-mla-chain"], "upstream-mla-chain")
    assert "| upstream-mla-chain | 410 (400-420) | 5,100 (5,000-5,200) |" in table
    assert "| plugin-mla-chain | 400 (390-430, 0.976x) | 5,100 (4,900-5,300, 1.000x) |" in table
    with pytest.raises(SystemExit, match="nospec"):
        sb.compare_table(state, ["nospec"], "upstream-mla-chain")


def test_held_requests_found_in_a_recorded_run():
    """The FA3 run of 2026-12-04 (docs/bench): at 64 requests under a running limit of 64, SGLang held the last request
    of a repeat's second wave until the rest had finished in two of the protected arm's repeats and one of the
    policy's; no request was held in any other repeat at 8-64 requests."""
    from sglang_ext.eval import bench

    state = json.load(open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "bench",
                                        "state-2026-12-04-fa3-policy.json")))
    held = {(arm, c): [bench.held_requests(r["per_request_ms"]) for r in row["levels"][c]]
            for arm, row in state["arms"].items() for c in ("8", "32", "64")}
    assert held.pop(("zero-accept-protected-warm", "64")) == [0, 1, 1]
    assert held.pop(("chain-protected-decode0", "64")) == [0, 0, 1]
    assert all(v == [0, 0, 0] for v in held.values()), held
    # sequential requests (concurrency 1) are never held: none runs beside another
    assert bench.held_requests([[0, 30, 600], [600, 630, 1200], [1200, 1230, 1800]]) == 0
    # a request of a wave served only after the others: held; the same request served at once: not
    wave = [[0, 100, 2000], [0, 110, 2000], [5, 120, 2010], [8, 2015, 3000]]
    assert bench.held_requests(wave) == 1
    assert bench.held_requests(wave[:3] + [[8, 130, 2100]]) == 0


def test_wave_phases_split_a_repeat_into_each_waves_prefill_and_decode():
    from sglang_ext.eval import bench

    # two requests arrive together (the first wave at concurrency 2), a third after the first one finished
    spans = [[0.0, 40.0, 1040.0], [2.0, 90.0, 1090.0], [1040.0, 1070.0, 2000.0]]
    assert bench.wave_phases(spans, 2) == [{"prefill_span_ms": 90.0, "decode_span_ms": 1000.0},
                                           {"prefill_span_ms": 30.0, "decode_span_ms": 930.0}]
    assert bench.wave_phases([], 2) == []
    # the FA3 run of 2026-12-05 (docs/bench) at 128 requests: the protected server's first wave finishes its prefill
    # ~90 ms after no speculation's (the draft's extend, ~9.5% of this 16-layer target's prefill) and decodes ~2% slower
    state = json.load(open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "bench",
                                        "state-2026-12-05-fa3-protection-c128.json")))
    table = sb.phases_table(state, ["nospec", "zero-accept-protected-warm"])
    assert "| nospec, wave 1 | 22 / 1,860 | 69 / 1,909 | 224 / 2,088 | 429 / 2,182 | 823 / 2,473 |" in table, table
    assert ("| zero-accept-protected-warm, wave 1 | 24 / 1,876 | 82 / 1,977 | 247 / 2,144 | 470 / 2,216 "
            "| 913 / 2,514 |") in table
    # concurrency 1 runs four waves (at least 4 requests a repeat), the others two
    assert "| nospec, wave 4 | 25 / 1,861 | — | — | — | — |" in table
    # 2026-12-07, 128 requests, the protected server with a 95,446-token pool beside no speculation's 131,072: its
    # second wave decodes 18% longer than its first (3,077 vs 2,536 ms), no speculation's 1% (2,606 vs 2,577)
    state = json.load(open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "bench",
                                        "state-2026-12-07-fa3-draft-prefill-nospec.json")))
    table = sb.phases_table(state, ["nospec", "zero-accept-protected-warm-last-prefill"])
    assert "| nospec, wave 2 | 232 / 2,020 | 873 / 2,606 |" in table, table
    assert "| zero-accept-protected-warm-last-prefill, wave 2 | 256 / 2,017 | 944 / 3,077 |" in table, table
    # 61 layers in fp8 on FA3 (2026-12-06): the protection within 1% of no speculation at 1 / 8 / 32 requests
    state = json.load(open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "bench",
                                        "state-2026-12-06-fa3-61-layers-fp8.json")))
    assert state["build"]["layers"] == 61 and state["build"]["target_weights"] == "fp8"
    table = sb.compare_table(state, ["nospec", "zero-accept-protected-warm"], "nospec")
    assert "| zero-accept-protected-warm | 37 (37-37, 1.007x) | 363 (362-364, 1.000x) | 1,274 (1,267-1,280, 0.998x) |" \
        in table, table


def test_all_refuses_a_work_directory_built_for_another_target(tmp_path, monkeypatch, capsys):
    """`all --layers 61` over a work directory holding the 16-layer build would have measured the 16-layer target."""
    for d in ("target", "head-mha", "head-mla"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "config.json").write_text("{}")
    (tmp_path / "state.json").write_text(json.dumps({"build": {"layers": 16}, "arms": {}}))
    monkeypatch.setattr(sb, "WORK", str(tmp_path))
    with pytest.raises(SystemExit) as e:
        sb.main(["all", "--layers", "61", "nospec"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "holds a 16-layer bf16 target, not --layers 61 --target-weights bf16" in err and "SPEC_BENCH_WORK" in err
    with pytest.raises(SystemExit):
        sb.main(["all", "--layers", "16", "--target-weights", "fp8", "nospec"])
    assert "not --layers 16 --target-weights fp8" in capsys.readouterr().err


class OneServer:
    """What `run` needs of tests/gpu/serverlib.Server (one server at a time, used as a context manager)."""

    def __init__(self, name, args, env, port_number=None):
        self.url, self.ready_s = "http://x:1", 1.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait_ready(self, timeout):
        return True


def test_a_run_stopped_mid_arm_keeps_the_levels_it_measured(tmp_path, monkeypatch):
    """`run` under a time limit: the state file holds every level measured before the stop, the arm marked unfinished
    (so `all` measures it again), and an arm that ends replaces that with its whole row: the server's KV pool cap
    as asked (--max-total-tokens) and the requests SGLang retracted for lack of KV, read from its log."""
    import sglang_ext.eval.bench

    class FakeServer(OneServer):
        def __init__(self, name, args, env, port_number=None):
            super().__init__(name, args, env, port_number)
            started.append(args)

        def log(self):  # SGLang 0.5.17's scheduler warnings, twice
            line = ("[2026-12-07 12:00:0{}] KV cache pool is full. Retract requests. #retracted_reqs: {}, "
                    "#new_tokens_gained: 2048, #new_token_ratio: 0.4000 -> 0.6000")
            return "\n".join(line.format(i, n) for i, n in ((1, 3), (2, 5)))

    started = []

    def measure(url, prompts, concurrency, lengths):
        if lengths[0] == 64 and concurrency == 1 and stop_at_1:
            raise SystemExit(124)  # what a time limit does to the process, past `except Exception`
        return {"output_tokens_per_s": 10.0 * concurrency, "tpot_mean_s": 0.01, "ttft_mean_s": 0.1, "wall_s": 0.1,
                "accepted_drafts_per_step": None}

    monkeypatch.setattr(sb, "WORK", str(tmp_path))
    monkeypatch.setattr(sb, "prompts", lambda n, input_len, seed=0: ["p"] * n)
    monkeypatch.setattr(sglang_ext.eval.bench, "run_arm", measure)
    monkeypatch.setattr(sb, "serverlib", lambda: type("L", (), {"Server": FakeServer, "tp_args": lambda tp: []}))
    argv = ["run", "nospec", "--concurrency", "8,1", "--repeats", "1", "--output-len", "64"]
    stop_at_1 = True
    with pytest.raises(SystemExit):
        sb.main(argv)
    kept = json.load(open(tmp_path / "state.json"))["arms"]["nospec"]
    assert list(kept["levels"]) == ["8"] and kept["levels"]["8"][0]["output_tokens_per_s"] == 80.0
    assert kept["error"] == "unfinished: stopped after concurrency 8"
    assert sb.arms_to_run({"arms": {"nospec": kept}}, ["nospec"], []) == ["nospec"]
    assert "--max-total-tokens" not in started[0]  # SGLang's own sizing unless asked
    stop_at_1 = False
    assert sb.main(argv + ["--max-total-tokens", "131072"]) == 0
    done = json.load(open(tmp_path / "state.json"))["arms"]["nospec"]
    assert list(done["levels"]) == ["8", "1"] and "error" not in done
    assert started[-1][started[-1].index("--max-total-tokens") + 1] == "131072"
    assert done["pool"]["retracted_requests"] == 8


def test_a_run_whose_server_dies_keeps_what_it_measured_and_says_what_it_died_of(tmp_path, monkeypatch):
    """`run`, one server at a time: a server that exits mid-arm (out of memory in a 128-request prefill) answers every
    later request with an error. The arm keeps the levels measured before, and leaves with the log's error line and
    where it died, not with rows of 0 tokens/s for the levels after."""
    import sglang_ext.eval.bench

    dead = []

    class FakeServer(OneServer):
        def __init__(self, name, args, env, port_number=None):
            super().__init__(name, args, env, port_number)
            self.proc = type("P", (), {"poll": lambda _: 1 if dead else None})()

        def log(self):
            return "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB" if dead else ""

        def last_error(self):
            return self.log().splitlines()[-1] if dead else "no error line"

    def measure(url, prompts, concurrency, lengths):
        if concurrency == 128 and lengths == [1] * 128:
            dead.append(True)
        if dead:
            return {"output_tokens_per_s": 0.0, "failed_requests": len(prompts), "tpot_mean_s": None,
                    "ttft_mean_s": 0.0, "wall_s": 0.0, "accepted_drafts_per_step": None}
        return {"output_tokens_per_s": 10.0 * concurrency, "failed_requests": 0, "tpot_mean_s": 0.01,
                "ttft_mean_s": 0.1, "wall_s": 0.1, "accepted_drafts_per_step": None}

    monkeypatch.setattr(sb, "WORK", str(tmp_path))
    monkeypatch.setattr(sb, "prompts", lambda n, input_len, seed=0: ["p"] * n)
    monkeypatch.setattr(sglang_ext.eval.bench, "run_arm", measure)
    monkeypatch.setattr(sb, "serverlib", lambda: type("L", (), {"Server": FakeServer, "tp_args": lambda tp: []}))
    assert sb.main(["run", "nospec", "--concurrency", "8,128,1", "--repeats", "1", "--output-len", "64"]) == 0
    row = json.load(open(tmp_path / "state.json"))["arms"]["nospec"]
    assert list(row["levels"]) == ["8"] and row["levels"]["8"][0]["output_tokens_per_s"] == 80.0
    assert row["error"].startswith("server exited in the prefill pass at concurrency 128: torch.OutOfMemoryError")


def test_each_repeat_is_read_beside_the_probes_the_policy_ran_in_it(monkeypatch):
    """The FA3 runs of 2026-12-07 at 128 requests (docs/bench: the states and the protected servers' policy lines,
    logged to the millisecond): before the probe budget two of three repeats held a probe and ran at 0.931x / 0.910x
    of no speculation, the third at 0.970x; with it one repeat of three held one."""
    import time

    bench_dir = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "bench")
    arm = "zero-accept-protected-warm-last-prefill"
    got = {}
    with monkeypatch.context() as m:  # both machines log UTC, which the log's times are read as
        m.setenv("TZ", "UTC")
        time.tzset()
        for name, log in (("state-2026-12-07-fa3-c128-probes.json", "policy-2026-12-07-fa3-c128-probes.log"),
                          ("state-2026-12-07-fa3-probe-budget.json", "policy-2026-12-07-fa3-probe-budget.log")):
            state = json.load(open(os.path.join(bench_dir, name)))
            sb.mark_probes(state["arms"][arm], open(os.path.join(bench_dir, log)).read())
            got[name] = [r["probes"] for r in state["arms"][arm]["levels"]["128"]]
            table = sb.repeats_table(state, ["nospec", arm])
        # a log without milliseconds still places a probe within its second
        line = "[2026-12-07 12:07:31] [sglang_ext] adaptive speculation: depth 0 -> 1: probe acceptance for 16 steps"
        assert sb.probe_times(line) == [time.mktime(time.strptime("2026-12-07 12:07:31", "%Y-%m-%d %H:%M:%S"))]
    time.tzset()
    assert got == {"state-2026-12-07-fa3-c128-probes.json": [1, 1, 0],
                   "state-2026-12-07-fa3-probe-budget.json": [1, 0, 0]}
    assert "| nospec | 136 / 136 / 136 | 3,498 / 3,633 / 3,632 | 10,974 / 11,034 / 11,027 |" in table
    assert f"| {arm} | 133 (2) / 134 (1) / 135 (0) | 3,553 (1) / 3,556 (1) / 3,591 (0) | 10,463 (1) / 10,326 (0) / " \
           "10,768 (0) |" in table
