"""`make bench` / `python -m sglang_ext.eval.bench`: a serving benchmark against SGLang servers, spec vs no spec.

Prompts come from ShareGPT (offline package) or GSM8K and are rendered through the target's chat
template (raw prompts only with `--raw-prompts`, which the report flags). For each concurrency of
the sweep it streams `/generate` requests with fixed (or sampled) output lengths and measures TTFT,
TPOT, output tokens/s and, from each request's meta_info, accepted drafts per step (no bonus).
Writes report.json, report.md and throughput.png to --out.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import random
import statistics
import sys
import time
import urllib.request

from tqdm import tqdm

from sglang_ext.commands import VERSION, prog
from sglang_ext.eval.gsm8k import load_gsm8k, spec_from_meta
from sglang_ext.http_client import add_api_key_argument, get_json, headers, redacted
from sglang_ext.plotting import pyplot


def sse_events(lines):
    """Decoded JSON payloads of an SGLang `/generate` stream (`data: {...}` lines, `data: [DONE]`)."""
    for raw in lines:
        line = raw.decode() if isinstance(raw, bytes) else raw
        line = line.strip()
        if not line.startswith("data:"):
            continue
        body = line[len("data:"):].strip()
        if body == "[DONE]":
            return
        yield json.loads(body)


def one_request(url: str, text: str, max_new_tokens: int, timeout: float = 600, api_key: str | None = None) -> dict:
    """One streamed request's timings and counters; a request that fails is recorded with its error, not raised
    (one bad request does not end a sweep)."""
    try:
        return _one_request(url, text, max_new_tokens, timeout, api_key)
    except Exception as e:  # HTTP errors, a dropped connection, a timeout
        detail = e.read().decode(errors="replace")[:300] if hasattr(e, "read") else ""
        return {"error": f"{type(e).__name__}: {e} {detail}".strip()}


def _one_request(url: str, text: str, max_new_tokens: int, timeout: float, api_key: str | None) -> dict:
    payload = {"text": text, "stream": True, "sampling_params": {"max_new_tokens": max_new_tokens,
                                                                 "temperature": 0, "ignore_eos": True}}
    req = urllib.request.Request(url.rstrip("/") + "/generate", data=json.dumps(payload).encode(),
                                 headers=headers(api_key))
    t0 = time.perf_counter()
    first, last_meta, arrivals = None, {}, []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for ev in sse_events(r):
            now = time.perf_counter()
            if first is None:
                first = now
            arrivals.append(now)
            last_meta = ev.get("meta_info", last_meta)
    end = time.perf_counter()
    n = int(last_meta.get("completion_tokens", 0))
    return {"start": t0, "ttft": (first or end) - t0, "latency": end - t0, "completion_tokens": n,
            "tpot": (end - (first or end)) / (n - 1) if n > 1 else None,  # one token: no time per output token
            "spec": spec_from_meta(last_meta)}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile: the smallest value with at least q of the values at or below it (p99 of 4
    values is their maximum; the index int(0.99 * (n - 1)) used before gave the 3rd of 4)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def held_requests(spans: list[list[float]], factor: float = 3.0) -> int:
    """Requests a server held back while it served others: the first token came more than `factor` times the median
    time to first token after the start, and only once at least half of the requests already running at its start
    had finished. SGLang 0.5.17 did this to one request per slow repeat at a concurrency equal to its running limit
    (docs/benchmarks.md, 2026-12-04): one such request adds a whole wave's time to a repeat. `spans`: each request's
    [start, first token, end] (`per_request_ms`)."""
    if len(spans) < 3:
        return 0
    median_ttft = statistics.median(f - s for s, f, _ in spans)
    held = 0
    for i, (start, first, _) in enumerate(spans):
        running = [e for j, (s, _, e) in enumerate(spans) if j != i and s <= start < e]
        if running and first - start > factor * median_ttft and sum(e <= first for e in running) >= len(running) / 2:
            held += 1
    return held


def wave_phases(spans: list[list[float]], concurrency: int) -> list[dict]:
    """Where a repeat's time goes, wave by wave, from its requests' [start, first token, end] (`per_request_ms`).
    Each client sends its next request when its last one ends, so in start order every `concurrency` requests form a
    wave: the first arrives together, the next one request at a time as the first one's requests finish. A wave's
    `prefill_span_ms` runs from its first start to its last first token (every prefill chunk and whatever the server
    ran between them); its `decode_span_ms` is the mean from each request's first token to its end."""
    ordered = sorted(spans, key=lambda r: r[0])
    waves = [ordered[i:i + concurrency] for i in range(0, len(ordered), concurrency)] if concurrency > 0 else []
    return [{"prefill_span_ms": round(max(f for _, f, _ in wave) - wave[0][0], 1),
             "decode_span_ms": round(statistics.mean(e - f for _, f, e in wave), 1)} for wave in waves]


def summarize(results: list[dict], wall: float) -> dict:
    failed = [r["error"] for r in results if "error" in r]
    results = [r for r in results if "error" not in r]
    tokens = sum(r["completion_tokens"] for r in results)
    # a request whose counters lack its accepted drafts is left out of acceptance, not read as zero drafts
    specs = [r["spec"] for r in results if r["spec"] and r["spec"]["accepted_drafts"] is not None]
    steps = sum(s["verify_steps"] for s in specs)
    acc = sum(s["accepted_drafts"] for s in specs)
    tpots = [r["tpot"] for r in results if r["tpot"] is not None]
    t0 = min((r["start"] for r in results if "start" in r), default=0.0)
    spans = [[round(1e3 * (r["start"] - t0), 1), round(1e3 * (r["start"] - t0 + r["ttft"]), 1),
              round(1e3 * (r["start"] - t0 + r["latency"]), 1)] for r in results if "start" in r]
    return {"requests": len(results), "failed_requests": len(failed), "errors": sorted(set(failed))[:5],
            # the first start on the wall clock: `per_request_ms` against a server log's timestamps (SGLANG_LOG_MS=1)
            "start_unix": round(t0 + time.time() - time.perf_counter(), 3) if spans else None,
            "output_tokens": tokens, "wall_s": wall,
            "output_tokens_per_s": tokens / wall if wall else 0.0,
            "ttft_mean_s": statistics.mean(r["ttft"] for r in results) if results else 0.0,
            "ttft_p99_s": percentile([r["ttft"] for r in results], 0.99) if results else 0.0,
            "tpot_mean_s": statistics.mean(tpots) if tpots else None,
            "accepted_drafts_per_step": acc / steps if steps else None,
            # each request's [start, first token, end] in ms from the first start: which wave a slow first
            # token belongs to, and what the requests around it were doing
            "per_request_ms": spans,
            "held_requests": held_requests(spans)}


def load_prompts(source: str, n: int, tokenizer, raw: bool, seed: int) -> list[str]:
    """n chat-rendered prompts; main takes a separate slice for each concurrency level, so no level finds its
    prompts already in the server's radix cache from the one before (warm prefixes: TTFT 3-5x faster and
    tokens/s 10-54% higher, eval/spec_bench.py's repeat_seed)."""
    if source == "gsm8k":
        rows, _ = load_gsm8k(None, "test", n)
        messages = [[{"role": "user", "content": r["question"]}] for r in rows]
    else:
        from sglang_ext.training.data import LoadReport, load_source

        convs = load_source(f"sharegpt:pkg:{n * 2}", LoadReport())
        random.Random(seed).shuffle(convs)
        messages = [[m for m in c.messages if m["role"] != "assistant"][:1] for c in convs[:n]]
    if raw:
        return [m[-1]["content"] for m in messages]
    return [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]


def run_arm(url: str, prompts: list[str], concurrency: int, lengths: list[int], api_key: str | None = None) -> dict:
    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(tqdm(pool.map(lambda pl: one_request(url, *pl, api_key=api_key), zip(prompts, lengths)),
                            total=len(prompts),
                            desc=f"{url} c={concurrency}", unit="req"))
    return summarize(results, time.perf_counter() - t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=prog("bench"), description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=VERSION)
    ap.add_argument("--base-url", required=True, help="server with speculation")
    ap.add_argument("--nospec-base-url", help="server without speculation (same target)")
    ap.add_argument("--tokenizer", required=True, help="the target's tokenizer (chat template)")
    add_api_key_argument(ap)
    ap.add_argument("--dataset-name", choices=["sharegpt", "gsm8k"], default="sharegpt")
    ap.add_argument("--raw-prompts", action="store_true", help="skip the chat template (flagged in the report)")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--sample-output-len", action="store_true", help="uniform in [output_len/2, output_len]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/bench")
    args = ap.parse_args(argv)
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        ap.error(f"--concurrency {args.concurrency}: comma-separated integers, e.g. 1,4,16,64")
    if not levels or min(levels) < 1:
        ap.error(f"--concurrency {args.concurrency}: every level at least 1")
    for name in ("num_prompts", "output_len"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)}: at least 1")

    for url in filter(None, (args.base_url, args.nospec_base_url)):  # before any prompt is prepared
        try:
            get_json(url.rstrip("/") + "/get_model_info", timeout=10, api_key=args.api_key)
        except Exception as e:
            print(f"error: cannot reach the server at {url} ({e}); start it first, or fix the URL", file=sys.stderr)
            return 2
    from sglang_ext.core.targets import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    rng = random.Random(args.seed)
    report = {"config": redacted(vars(args)), "chat_template": not args.raw_prompts, "levels": {}}
    if args.raw_prompts:
        report["warning"] = "raw prompts (no chat template): acceptance is not what chat users would see"
        print("WARNING: " + report["warning"], file=sys.stderr)
    counts = [max(args.num_prompts, c) for c in levels]
    pool = load_prompts(args.dataset_name, sum(counts), tok, args.raw_prompts, args.seed)
    if len(pool) < sum(counts):
        print(f"error: --dataset-name {args.dataset_name} gave {len(pool)} prompts; the sweep needs {sum(counts)} "
              "distinct ones "
              f"(each level its own, so none is served from the cache the last one warmed): lower "
              "--num-prompts or the levels", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    for c, n, start in zip(levels, counts, [sum(counts[:i]) for i in range(len(counts))]):
        prompts = pool[start: start + n]
        lengths = [rng.randint(max(1, args.output_len // 2), args.output_len) if args.sample_output_len
                   else args.output_len for _ in prompts]
        level = {"spec": run_arm(args.base_url, prompts, c, lengths, args.api_key)}
        if args.nospec_base_url:
            level["no-spec"] = run_arm(args.nospec_base_url, prompts, c, lengths, args.api_key)
            level["speedup"] = (level["spec"]["output_tokens_per_s"] / level["no-spec"]["output_tokens_per_s"]
                                if level["no-spec"]["output_tokens_per_s"] else None)
        report["levels"][c] = level
        for arm in ("spec", "no-spec"):
            if level.get(arm, {}).get("failed_requests"):
                print(f"WARNING: c={c} {arm}: {level[arm]['failed_requests']} requests failed: {level[arm]['errors']}",
                      file=sys.stderr)
        with open(os.path.join(args.out, "report.json"), "w") as f:  # after every level: a later failure keeps it
            json.dump(report, f, indent=1)
    rows = ["| concurrency | arm | output tok/s | TTFT mean (s) | TPOT mean (ms) | accepted drafts / step |",
            "|---|---|---|---|---|---|"]
    for c, level in report["levels"].items():
        for arm in ("spec", "no-spec"):
            if arm in level:
                s = level[arm]
                acc = "—" if s["accepted_drafts_per_step"] is None else f"{s['accepted_drafts_per_step']:.3f}"
                tpot = "—" if s["tpot_mean_s"] is None else f"{1000 * s['tpot_mean_s']:.2f}"
                failed = f" ({s['failed_requests']} failed)" if s.get("failed_requests") else ""
                rows.append(f"| {c} | {arm}{failed} | {s['output_tokens_per_s']:.1f} | {s['ttft_mean_s']:.3f} | "
                            f"{tpot} | {acc} |")
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write("# Serving benchmark\n\n" + (f"**{report['warning']}**\n\n" if "warning" in report else "")
                + "\n".join(rows) + "\n")
    plt = pyplot("eval", os.path.join(args.out, "throughput.png"))
    if plt is None:
        return 0
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm in ("spec", "no-spec"):
        xs = [c for c in report["levels"] if arm in report["levels"][c]]
        ax.plot(xs, [report["levels"][c][arm]["output_tokens_per_s"] for c in xs], marker="o", label=arm)
    ax.set(xscale="log", xlabel="concurrency", ylabel="output tokens/s", title="throughput vs concurrency")
    ax.legend()
    fig.savefig(os.path.join(args.out, "throughput.png"), dpi=100)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
