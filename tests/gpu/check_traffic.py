"""GPU check: speculation under the traffic users send -- every request option, aborts and disconnects, and a soak.

Uses check_serving's tiny DeepseekV3 target and its two trained heads (built and trained on first use, in
GPU_CHECK_WORK). For each arm (head x drafting shape, and upstream SGLang's EAGLE3 without the plugin, whose
served and refused options the plugin's must match; the backend is SGLang's choice unless
GPU_CHECK_ATTENTION_BACKEND names one) one server is started with `--enable-metrics`, the arms' servers side by
side (GPU_CHECK_MAX_TOTAL_TOKENS caps each one's pool), and three parts run:

1. `options`: each request option of `/generate` and `/v1/chat/completions` on 16 prompts, 16 in flight: stop
   strings, stop token ids, `n` = 2, logprobs (top 2), JSON schema and regex constrained output (xgrammar),
   `ignore_eos`, streaming. Per option: works / refused (SGLang's reason) / failed (the error), the invariant
   completion_tokens = accepted drafts + verify steps + 1 on every response, what the output must satisfy (stops
   where asked, parses against the schema, matches the regex, the streamed text equals the unstreamed one), and the
   server's ledger moving by exactly the responses' sums; in deterministic mode (GPU_TRAFFIC_DETERMINISTIC, default 1)
   the logprobs against the target alone's, token by token.
2. `aborts`: at 1 and at 64 in flight, streams closed by the client after a few chunks and requests aborted by
   `/abort_request`; afterwards the server must still answer, the ledger must count each finished request once and
   each aborted one as aborted (never in the acceptance counters), and the KV pool must be back at its idle usage
   (`sglang:num_used_tokens` read from /metrics before and after; SGLang's own idle leak check would also stop
   the server).
3. `soak` (GPU_TRAFFIC_SOAK_S seconds, default 600, after one request of each kind timed alone on the fresh server
   and GPU_TRAFFIC_SOAK_WARMUP_S seconds of the same traffic just before, default 60, whose first response time and
   count are reported apart): 256 clients against `--max-running-requests 128`, client k sending request k of a block
   of 256 again and again (`soak_block`: prompt lengths up to GPU_TRAFFIC_MAX_PROMPT tokens, default 32768, capped
   below the target's context, one of that length per block, through chunked prefill; 30% sharing a cached prefix,
   every other prompt its own; greedy and sampled), so the same mix is in flight every minute, the cost protection on
   a chain: per minute output tokens/s of the requests that
   finished and of what the scheduler decoded (its token counter), prompt, cached and prefill-computed tokens,
   accepted drafts per verify step, GPU memory and the allocator's counters, compiled kernels and pool usage; at the
   end every response's invariant, and the ledger and /metrics each equal to the sum of meta_info.

Writes $OUT/traffic.json and prints a table per part.

    PYTHONPATH=/tmp/site:. python -P tests/gpu/check_traffic.py [PART ...] [--arms ARM,...]   (default: options aborts,
    every arm; a soak: the MLA chain alone)
"""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import os
import random
import re
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import check_serving as CS  # noqa: E402
from serverlib import Server, port  # noqa: E402

from sglang_ext.eval.bench import sse_events  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
ARMS = {  # name: (head, drafting args, extra server args, env)
    "mha-chain": ("mha", CS.CHAIN, [], {}),
    "mla-chain": ("mla", CS.CHAIN, [], {}),
    "mha-tree": ("mha", CS.TREE, [], {}),
    "mla-tree": ("mla", CS.TREE, [], {}),
    "mha-chain-protected": ("mha", CS.CHAIN + ["--speculative-adaptive"], [], {"SGLANG_EXT_ADAPTIVE_POLICY": "cost"}),
    # upstream SGLang's EAGLE3 without the plugin (its ids in upstream's reading): what it serves or refuses is what
    # the plugin's arms must serve or refuse alike; it has no ledger, and its counters are its own
    "upstream-mha-chain": ("mha-upstream", CS.CHAIN, [], {"SGLANG_PLUGINS": "none"}),
    # the soak's arm with upstream's radix eviction (only the shortfall): beside mla-chain, what the eviction batch
    # does once the cache fills the pool
    "mla-chain-evict-shortfall": ("mla", CS.CHAIN, [], {"SGLANG_EXT_RADIX_EVICTION_BATCH": "0"}),
}
# the soak serves a chain with the protection on (the cost policy may drop drafting at large batches); a tree as it is
# (SGLang's adaptive mode, and so the protection, runs chains only: the startup check refuses the policy on a tree).
# CUDA graphs to the running limit: with check_serving's graphs to 64, every decode batch of 65-128 requests ran
# eagerly (host-bound, 17-18 ms a depth-0 step, 7-13% GPU busy; 94% of the 2026-12-04 soak's decode batches)
SOAK_ARGS = ["--max-running-requests", "128", "--cuda-graph-bs-decode", "1", "2", "4", "8", "16", "32", "64", "96",
             "128", "--chunked-prefill-size", "4096"]
SOAK_PROTECTION_ARGS = ["--speculative-adaptive"]
SOAK_ENV = {"SGLANG_EXT_ADAPTIVE_POLICY": "cost"}


def is_chain(name: str) -> bool:
    drafting = ARMS[name][1]
    return drafting[drafting.index("--speculative-eagle-topk") + 1] == "1"


def soak_env(name: str) -> dict:
    return dict(SOAK_ENV) if is_chain(name) else {}
SOAK_ARM = "mla-chain"  # the soak's arm unless --arms names others: the MLA head, the product's own format
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}, "unit": {"type": "string"}},
          "required": ["answer", "unit"]}
REGEX = r"(yes|no), because [a-z]+"


# ------------------------------------------------------------------------------------------------- per response
def invariant_holds(meta: dict) -> bool:
    """completion_tokens = accepted drafts + verify steps + 1 (a response without verify steps has nothing to hold)."""
    steps = meta.get("spec_verify_ct") or 0
    return steps == 0 or meta["completion_tokens"] == CS.accepted_drafts(meta) + steps + 1


def sums(metas: list[dict]) -> dict:
    return {"requests": len(metas), "verify_steps": sum(m.get("spec_verify_ct") or 0 for m in metas),
            "accepted_drafts": sum(CS.accepted_drafts(m) for m in metas)}


def ledger(srv: Server) -> dict | None:
    """The plugin's per-process ledger (None: a server without the plugin)."""
    d = CS.plugin_state(srv, "sglang_ext_acceptance")
    if d is None:
        return None
    return {"requests": d.get("finished_requests", 0), "verify_steps": d.get("verify_steps", 0),
            "accepted_drafts": d.get("accepted_drafts", 0), "aborted": d.get("aborted_requests", 0)}


def cuda_memory(srv: Server) -> dict | None:
    """The scheduler's CUDA allocator counters (the plugin's `sglang_ext_cuda_memory` in /get_server_info; None from
    a server without it): bytes allocated and reserved, segments."""
    return CS.plugin_state(srv, "sglang_ext_cuda_memory")


def prefix_cache(srv: Server) -> dict | None:
    """The radix cache's eviction counters (the plugin's `sglang_ext_prefix_cache`; None from a server without it):
    evictions and their host time since start, the evictable leaves now."""
    return CS.plugin_state(srv, "sglang_ext_prefix_cache")


def gauge(metrics_text: str, name: str) -> float | None:
    """An SGLang gauge from /metrics text (its first series)."""
    m = re.search(rf"^sglang:{name}\{{[^}}]*\}} ([-\d.e+]+)", metrics_text, re.MULTILINE)
    return float(m.group(1)) if m else None


def realtime_tokens(metrics_text: str) -> dict[str, float]:
    """SGLang's scheduler-side token counter, `sglang:realtime_tokens_total`, per mode (decode, prefill_compute,
    prefill_cache; 0.5.17 - 0.5.23), summed over its series: counted as each batch runs (a decode step adds its batch
    size plus its accepted drafts), where the responses' counts land when a request finishes."""
    out: dict[str, float] = {}
    for mode, value in re.findall(r'^sglang:realtime_tokens_total\{[^}]*mode="([a-z_]+)"[^}]*\} ([-\d.e+]+)',
                                  metrics_text, re.MULTILINE):
        out[mode] = out.get(mode, 0.0) + float(value)
    return out


def counter_per_minute(samples: list[tuple[float, dict]], minutes: list[int], key: str) -> list[float | None]:
    """A counter's increase in each of `minutes` (whole minutes from the soak's start), from (seconds, {key: value})
    samples taken every ~20 s, read linearly between the samples around each minute's two ends (None where a minute
    reaches past the samples, or the counter is missing)."""
    points = [(s, c[key]) for s, c in samples if key in c]

    def at(x: float) -> float | None:
        for (s0, v0), (s1, v1) in zip(points, points[1:]):
            if s0 <= x <= s1:
                return v0 if s1 == s0 else v0 + (v1 - v0) * (x - s0) / (s1 - s0)
        return None

    out = []
    for m in minutes:
        lo, hi = at(60 * m), at(60 * (m + 1))
        out.append(None if lo is None or hi is None else hi - lo)
    return out


def used_tokens(srv: Server) -> float | None:
    return gauge(srv.get("/metrics"), "num_used_tokens")


def moved(before: dict | None, after: dict | None) -> dict | None:
    return None if before is None or after is None else {k: after[k] - before[k] for k in after}


def parse_sse(lines) -> list[dict]:
    """The JSON events of a `text/event-stream` body (eval/bench.py's reader)."""
    return list(sse_events(lines))


def constrained_ok(kind: str, text: str, finish: dict | None) -> bool:
    """A constrained output is right when it satisfies its grammar, or stopped at the length limit on the way."""
    if finish and finish.get("type") == "length":
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and isinstance(value.get("answer"), int) and isinstance(value.get("unit"), str)


def status_of(results: list[dict]) -> str:
    """works | refused (SGLang answered 4xx with a reason) | failed (an error or a wrong output)."""
    if any(r.get("refused") for r in results):
        return "refused: " + next(r["refused"] for r in results if r.get("refused"))[:120]
    if any(r.get("error") for r in results):
        return "failed: " + next(r["error"] for r in results if r.get("error"))[:120]
    if not all(r.get("output_ok", True) for r in results):
        return "failed: output does not satisfy the option"
    return "works"


# ------------------------------------------------------------------------------------------------- requests
def post(srv: Server, path: str, payload: dict, timeout: float = 300) -> tuple[int, object]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=timeout)
    conn.request("POST", path, json.dumps(payload), {"Content-Type": "application/json"})
    r = conn.getresponse()
    body = r.read()
    conn.close()
    try:
        return r.status, json.loads(body)
    except ValueError:
        return r.status, body.decode(errors="replace")


def generate(srv: Server, ids: list[int], sp: dict, **extra) -> dict:
    code, body = post(srv, "/generate", {"input_ids": ids, "sampling_params": sp, **extra})
    if code >= 400:
        return {"refused": f"HTTP {code}: {body}"}
    outs = body if isinstance(body, list) else [body]
    return {"outs": outs, "metas": [o["meta_info"] for o in outs]}


def option_requests(tokenizer) -> dict:
    """name -> (function(srv, prompt ids) -> result dict). Each result: metas (the responses' meta_info), and
    output_ok where the option states what the output must be."""
    frequent = tokenizer.encode(" the", add_special_tokens=False)[-1]

    def stop_string(srv, ids):
        r = generate(srv, ids, {"temperature": 0, "max_new_tokens": 64, "stop": [" the"]})
        if "outs" in r:
            r["output_ok"] = all(" the" not in o["text"] for o in r["outs"])
        return r

    def stop_token_ids(srv, ids):
        r = generate(srv, ids, {"temperature": 0, "max_new_tokens": 64, "stop_token_ids": [frequent]})
        if "outs" in r:
            r["output_ok"] = all(frequent not in (o.get("output_ids") or [])[:-1] for o in r["outs"])
        return r

    def n2(srv, ids):
        r = generate(srv, ids, {"temperature": 0.8, "max_new_tokens": 48, "n": 2})
        if "outs" in r:
            r["output_ok"] = len(r["outs"]) == 2
        return r

    def logprobs(srv, ids):
        r = generate(srv, ids, {"temperature": 0, "max_new_tokens": 32}, return_logprob=True, top_logprobs_num=2)
        if "outs" in r:
            m = r["metas"][0]
            r["output_ok"] = len(m.get("output_token_logprobs") or []) == m["completion_tokens"]
            r["logprobs"] = [t[0] for t in m.get("output_token_logprobs") or []]
        return r

    def constrained(kind):
        def run(srv, ids):
            key = {"json": "json_schema", "regex": "regex"}[kind]
            value = json.dumps(SCHEMA) if kind == "json" else REGEX
            r = generate(srv, ids, {"temperature": 0, "max_new_tokens": 48, key: value})
            if "outs" in r:
                r["output_ok"] = all(constrained_ok(kind, o["text"], o["meta_info"].get("finish_reason"))
                                     for o in r["outs"])
            return r
        return run

    def ignore_eos(srv, ids):
        r = generate(srv, ids, {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True})
        if "outs" in r:
            r["output_ok"] = all(m["completion_tokens"] == 64 for m in r["metas"])
        return r

    def stream(srv, ids):
        sp = {"temperature": 0, "max_new_tokens": 48}
        plain = generate(srv, ids, sp)
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=300)
        conn.request("POST", "/generate", json.dumps({"input_ids": ids, "sampling_params": sp, "stream": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status >= 400:
            return {"refused": f"HTTP {resp.status}: {resp.read()[:200]!r}"}
        events = parse_sse(resp)
        conn.close()
        last = events[-1]
        # both requests move the ledger: the unstreamed one's meta_info is summed too
        return {"metas": plain.get("metas", []) + [last["meta_info"]],
                "output_ok": "outs" in plain and last["text"] == plain["outs"][0]["text"]}

    def chat(srv, ids):
        text = tokenizer.decode(ids, skip_special_tokens=True)[-400:]
        code, body = post(srv, "/v1/chat/completions", {
            "model": "default", "messages": [{"role": "user", "content": text}], "max_tokens": 32,
            "temperature": 0, "n": 2, "logprobs": True, "top_logprobs": 2, "stop": ["\n\n"]})
        if code >= 400:
            return {"refused": f"HTTP {code}: {body}"}
        choices = body.get("choices", [])
        return {"metas": [], "output_ok": len(choices) == 2 and all(c["message"]["content"] is not None for c in choices)}

    return {"stop-string": stop_string, "stop-token-ids": stop_token_ids, "n-2": n2, "logprobs": logprobs,
            "json-schema": constrained("json"), "regex": constrained("regex"), "ignore-eos": ignore_eos,
            "stream": stream, "chat-n2-logprobs-stop": chat}


# ------------------------------------------------------------------------------------------------- the parts
def part_options(srv: Server, prompts: list[list[int]], tokenizer, reference: list[dict] | None = None) -> dict:
    """`reference`: the target alone's results of the logprobs option (deterministic mode), compared per token."""
    table = {}
    for name, fn in option_requests(tokenizer).items():
        before = ledger(srv)
        with cf.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda ids, fn=fn: _safe(fn, srv, ids), prompts[:16]))
        time.sleep(1)
        metas = [m for r in results for m in r.get("metas", [])]
        d = moved(before, ledger(srv))
        table[name] = {"status": status_of(results), "responses": len(metas),
                       "invariant_failures": sum(not invariant_holds(m) for m in metas),
                       # the chat route's responses carry no meta_info: the ledger's move is all there is
                       "ledger_equals_responses": (None if name.startswith("chat") or d is None else
                                                   {k: d[k] for k in ("requests", "verify_steps", "accepted_drafts")}
                                                   == sums(metas)),
                       "ledger_moved": d, "responses_sum": sums(metas)}
        if name == "logprobs" and reference is not None:
            table[name]["versus_target"] = logprob_agreement(results, reference)
    return table


def logprob_agreement(results: list[dict], reference: list[dict]) -> dict:
    """Per prompt: the same tokens, and the largest |logprob difference| over them (0.0 when bit-equal)."""
    same, gaps = 0, []
    for got, ref in zip(results, reference):
        a, b = got.get("outs"), ref.get("outs")
        if not a or not b:
            continue
        if a[0].get("output_ids") == b[0].get("output_ids"):
            same += 1
            gaps.append(max((abs(x - y) for x, y in zip(got["logprobs"], ref["logprobs"])), default=0.0))
    return {"same_tokens": same, "of": len(reference), "max_logprob_difference": max(gaps, default=None)}


def _safe(fn, srv, ids):
    try:
        return fn(srv, ids)
    except Exception as e:  # noqa: BLE001 -- a failure is a row of the table
        return {"error": f"{type(e).__name__}: {e}"}


def settled_used_tokens(srv: Server, seconds: float) -> float | None:
    """`sglang:num_used_tokens` once it reads 0 (a pool holding no request: the radix cache's evictable tokens are
    not counted), or its last value after `seconds`. The gauge is published with each batch and again when the
    scheduler goes idle (at most 30 s later), so a reading right after traffic may be the last batch's."""
    deadline = time.time() + seconds
    value = used_tokens(srv)
    while value not in (0, None) and time.time() < deadline:
        time.sleep(1)
        value = used_tokens(srv)
    return value


def part_aborts(srv: Server, prompts: list[list[int]]) -> dict:
    out = {}
    for in_flight in (1, 64):
        idle = settled_used_tokens(srv, 40)
        before = ledger(srv)
        batch = [prompts[i % len(prompts)] for i in range(in_flight)]
        rids = [f"abort-{in_flight}-{i}" for i in range(in_flight)]

        def disconnect(i, batch=batch, rids=rids):
            """Half the streams are closed by the client after 3 chunks; the rest aborted by rid."""
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=300)
            sp = {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}
            conn.request("POST", "/generate", json.dumps({"input_ids": batch[i], "sampling_params": sp,
                                                          "stream": True, "rid": rids[i]}),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            for _ in range(3):
                resp.readline()
            if i % 2:
                post(srv, "/abort_request", {"rid": rids[i]})
                events = parse_sse(resp)
                conn.close()
                return events[-1]["meta_info"] if events else None
            conn.close()  # the client goes away mid-stream
            return None

        with cf.ThreadPoolExecutor(in_flight) as pool:
            finished = [m for m in pool.map(disconnect, range(in_flight)) if m is not None
                        and (m.get("finish_reason") or {}).get("type") != "abort"]
        after = settled_used_tokens(srv, 75)
        d = moved(before, ledger(srv))
        alive = generate(srv, prompts[0], {"temperature": 0, "max_new_tokens": 8})
        out[f"in_flight_{in_flight}"] = {
            "requests": in_flight, "finished_anyway": len(finished), "ledger_moved": d,
            "counted_once": None if d is None else (d["requests"] == len(finished)
                                                    and d["requests"] + d["aborted"] == in_flight),
            "used_tokens_before_after": [idle, after],
            "pool_back_to_idle": None if after is None else after == 0,
            "serves_after": "outs" in alive and invariant_holds(alive["metas"][0])}
    return out


SOAK_BLOCK = 256  # requests per block of the soak's mix: every block holds the same lengths, sharing and sampling


def soak_block(max_prompt: int, n_prompts: int, block: int = SOAK_BLOCK) -> list[dict]:
    """One block of the soak's requests. Prompt lengths at the block's quantiles of 64 x Pareto(1.2), capped at
    max_prompt, the longest at max_prompt (chunked prefill in every block); 30% sharing the cached prefix; half
    greedy, half sampled (T 0.8, top-p 0.95); 16 / 64 / 256 new tokens in equal parts. The traffic repeats the block,
    shuffled anew each pass, so any 256 consecutive requests hold the same mix and a minute's throughput measures the
    server, not which lengths that minute drew (independent Pareto draws put one 32k prompt in some minutes and none
    in others)."""
    r = random.Random(1)
    lengths = sorted(min(max_prompt, int(64 * (1 - (i + 0.5) / block) ** (-1 / 1.2))) for i in range(block))
    lengths[-1] = max_prompt
    shared = [i < round(0.3 * block) for i in range(block)]
    greedy = [i % 2 == 0 for i in range(block)]
    new_tokens = [(16, 64, 256)[i % 3] for i in range(block)]
    for column in (shared, greedy, new_tokens):
        r.shuffle(column)
    return [{"length": n, "shared": sh, "prompt": r.randrange(n_prompts),
             "sampling": {**({"temperature": 0} if g else {"temperature": 0.8, "top_p": 0.95}),
                          "max_new_tokens": m}}
            for n, sh, g, m in zip(lengths, shared, greedy, new_tokens)]


MARKER_TOKENS = 4  # a request's own tokens before its prompt: no two requests share more than the shared prefix


def request_marker(serial: int) -> list[int]:
    """Token ids 1-399 (the shared prefix's range) spelling `serial`, 25 billion distinct: repeating the block must not
    repeat its prompts, or the radix cache holds every prompt after the first pass (the soak of 2026-12-04 found 99% of
    its prompt tokens cached)."""
    return [1 + (serial // 399 ** i) % 399 for i in range(MARKER_TOKENS)]


def soak_input_ids(req: dict, prompts: list[list[int]], shared_prefix: list[int], serial: int = 0) -> list[int]:
    """`req["length"]` tokens (at least the marker and the prompt whole): as much of the cached prefix as the length
    leaves room for if the request shares it, then the request's own marker, then its prompt repeated -- so only the
    sharing 30% find anything in the radix cache, and a short request shares a short prefix."""
    base = prompts[req["prompt"]]
    room = max(req["length"] - MARKER_TOKENS - len(base), 0)
    head = (shared_prefix[:room] if req["shared"] else []) + request_marker(serial)
    n = max(req["length"] - len(head), len(base))
    return head + (base * (n // len(base) + 1))[:n]


def jit_cache_dirs() -> dict[str, str]:
    home = os.path.expanduser("~")
    return {"triton": os.environ.get("TRITON_CACHE_DIR", f"{home}/.triton/cache"),
            "flashinfer": os.path.join(os.environ.get("FLASHINFER_WORKSPACE_BASE", home), ".cache", "flashinfer")}


def jit_cache_counts() -> dict[str, int]:
    """{cache: entries} of the kernel caches present (Triton's, FlashInfer's)."""
    return {name: sum(len(files) for _, _, files in os.walk(d))
            for name, d in jit_cache_dirs().items() if os.path.isdir(d)}


def jit_cache_entries() -> int | None:
    """Kernels compiled on this machine so far (Triton's and FlashInfer's caches): each one loaded adds its code to the
    GPU's memory, which a soak must tell apart from a leak."""
    counts = jit_cache_counts()
    return sum(counts.values()) if counts else None


def progress(text: str) -> None:
    """A line per phase and per soak minute, as it happens: a run cut short by a time limit still tells where it was
    (the report itself is printed and written at the end)."""
    print(f"[traffic] {time.strftime('%H:%M:%S')} {text}", flush=True)


def first_requests(srv: Server, prompts: list[list[int]], max_prompt: int) -> dict:
    """Seconds to serve each kind of request the soak sends, one at a time on the fresh server, before any traffic, and
    the entries each added to Triton's and FlashInfer's kernel caches: a first sampled request or a first long prompt
    that compiles a kernel shows here, not as a stalled first minute (a soak's first sampled request took 97 s alone,
    a greedy one 8 s; the server's own warm-up request is greedy and short). Temperature alone and with top-p apart:
    SGLang 0.5.17's sampler draws a temperature-only batch with torch.multinomial, one with top-k or top-p through
    flashinfer.sampling.top_k_top_p_sampling_from_probs, whose module FlashInfer compiles on its first call where no
    prebuilt copy is installed (flashinfer-jit-cache) -- the suspect, confirmed where only the top-p request adds
    FlashInfer cache entries."""
    kinds = {"greedy, 64 tokens": (64, {"temperature": 0}),
             "sampled (T 0.8), 64 tokens": (64, {"temperature": 0.8}),
             "sampled (T 0.8, top-p 0.95), 64 tokens": (64, {"temperature": 0.8, "top_p": 0.95}),
             f"greedy, {max_prompt} tokens": (max_prompt, {"temperature": 0})}
    out = {}
    for i, (name, (length, sp)) in enumerate(kinds.items()):
        ids = soak_input_ids({"length": length, "shared": False, "prompt": 0}, prompts, [], serial=10 ** 6 + i)
        before, t = jit_cache_counts(), time.time()
        res = _safe(lambda s, x, sp=sp: generate(s, x, {**sp, "max_new_tokens": 16}), srv, ids)
        after = jit_cache_counts()
        out[name] = {"seconds": round(time.time() - t, 2),
                     "cache_entries_added": {k: after[k] - before.get(k, 0) for k in after},
                     **({"error": res["error"]} if "error" in res else {})}
        progress(f"first request alone, {name}: {out[name]}")
    return out


def part_soak(srv: Server, prompts: list[list[int]], seconds: float, max_prompt: int, warmup: float = 0) -> dict:
    """One stretch of the soak's traffic: `warmup` seconds (rounded up to whole minutes; its responses reported apart:
    a fresh server's first minutes hold its one-time costs -- kernels compiled on first use of a shape or a sampler,
    the first visit to each batch size), then `seconds` measured, with no pause between them, so the measured minutes
    start in the steady state rather than from a drained server. Client k of 256 sends request k of `soak_block`
    again and again (`client_request`), each time with its own marker: the mix in flight is the same in every minute.
    The ledger and /metrics are compared with every response of the stretch, warm-up included."""
    rng = random.Random(0)
    shared = [rng.randrange(1, 400) for _ in range(min(2048, max_prompt // 2))]
    block = soak_block(max_prompt, len(prompts))

    def traffic(duration: float, seed: int) -> dict:
        stop_at = time.time() + duration
        minutes: dict[int, dict] = {}
        metas: list[dict] = []
        counters: list[tuple[float, dict]] = []  # (seconds from the start, the scheduler's token counters)
        first_response: list[float] = []  # the first finished request's time, set once
        told: set[int] = set()  # the minutes whose progress line was printed
        t0 = time.time()
        serial, lock = [seed], threading.Lock()

        def next_serial() -> int:
            with lock:
                serial[0] += 1
                return serial[0]

        def client(k):
            req = client_request(block, k)
            while time.time() < stop_at:
                ids = soak_input_ids(req, prompts, shared, serial=next_serial())
                res = _safe(lambda s, i, sp=req["sampling"]: generate(s, i, dict(sp)), srv, ids)
                if not first_response:
                    first_response.append(time.time() - t0)
                minute = int((time.time() - t0) // 60)
                row = minutes.setdefault(minute, {"tokens": 0, "errors": 0})
                if "metas" in res:
                    metas.extend(res["metas"])
                    row["invariant_failures"] = row.get("invariant_failures", 0) + sum(
                        not invariant_holds(m) for m in res["metas"])
                    row["tokens"] += sum(m["completion_tokens"] for m in res["metas"])
                    row["prompt_tokens"] = row.get("prompt_tokens", 0) + sum(m.get("prompt_tokens", 0)
                                                                             for m in res["metas"])
                    row["cached_tokens"] = row.get("cached_tokens", 0) + sum(m.get("cached_tokens", 0)
                                                                             for m in res["metas"])
                    # what the protection did that minute: verify steps and accepted drafts of its finished requests
                    for key, value in sums(res["metas"]).items():
                        row[key] = row.get(key, 0) + value
                else:
                    row["errors"] += 1

        def sample():
            while True:
                now = time.time()
                text = srv.get("/metrics")
                counters.append((round(now - t0, 2), realtime_tokens(text)))
                if now >= stop_at:  # a last sample at the stop, so the last whole minute's end is inside the samples
                    break
                minute = int((now - t0) // 60)
                if minute - 1 in minutes and minute - 1 not in told:  # the minute before is whole: what it did
                    told.add(minute - 1)
                    done = minutes[minute - 1]
                    label = "warm-up minute" if minute <= first_minute else f"minute {minute - first_minute}"
                    progress(f"soak {label}: {done['tokens'] / 60:,.0f} "
                             f"output tok/s, {done['errors']} errors, {done.get('used_tokens')} pool tokens used, "
                             f"GPU {done.get('gpu_mib')} MiB")
                row = minutes.setdefault(minute, {"tokens": 0, "errors": 0})
                row["gpu_mib"] = gpu_memory_mib()
                row["jit_cache_entries"] = jit_cache_entries()
                row["cuda_memory"] = cuda_memory(srv)
                row["prefix_cache"] = prefix_cache(srv)
                row["used_tokens"] = gauge(text, "num_used_tokens")
                # running vs queued: SGLang publishes both with each batch it logs, so before the first batch they
                # read 0 whatever is waiting (the log's opening lines tell that time apart)
                row.setdefault("running_queued", []).append([gauge(text, "num_running_reqs"),
                                                             gauge(text, "num_queue_reqs")])
                time.sleep(max(0.0, min(20.0, stop_at - time.time())))

        with cf.ThreadPoolExecutor(257) as pool:
            futures = [pool.submit(client, k) for k in range(256)] + [pool.submit(sample)]
            for f in futures:
                f.result()
        return {"minutes": minutes, "metas": metas, "counters": counters,
                "first_response_s": round(first_response[0], 1) if first_response else None}

    first = first_requests(srv, prompts, max_prompt)
    first_minute = -(-int(warmup) // 60)  # the warm-up's whole minutes
    before, prom_before = ledger(srv), prometheus(srv)
    run = traffic(60 * first_minute + seconds, seed=0)
    time.sleep(2)
    d, prom = moved(before, ledger(srv)), moved(prom_before, prometheus(srv))
    summary = soak_summary(run["minutes"], run["metas"], seconds, d, prom, run["counters"], first_minute)
    warm = [run["minutes"][m] for m in range(first_minute) if m in run["minutes"]]
    warm_row = {"seconds": 60 * first_minute, "responses": sum(r.get("requests", 0) for r in warm),
                "first_response_s": run["first_response_s"],
                "invariant_failures": sum(r.get("invariant_failures", 0) for r in warm)}
    return {"first_requests": first, "verdicts": soak_verdicts(summary), "first_response_s": run["first_response_s"],
            "warmup": warm_row if first_minute else None, **summary}


def client_request(block: list[dict], client: int) -> dict:
    """The request a client sends, every time: its own entry of the block. With each client on one kind the requests
    in flight hold the block's mix at every moment. Clients taking the block's next request in turn (the soaks of
    2026-12-04 to 12-06) let the mix in flight drift -- the long kinds pile up, a 32k prompt is in one minute's batches
    and not the next's -- and the scheduler's own decode counter moved by 20% between minutes of one such run."""
    return block[client % len(block)]


def soak_summary(minutes: dict[int, dict], metas: list[dict], seconds: float, ledger_moved: dict | None,
                 metrics_moved: dict | None, counters: list[tuple[float, dict]] | None = None,
                 first_minute: int = 0) -> dict:
    """The soak's verdicts from its per-minute rows and its responses: throughput per whole minute (the last one, cut
    by the stop, left out) and its spread, GPU memory and pool usage in the first and last whole minute, and the
    ledger and /metrics each against the responses' sums. Beside the output tokens of the requests that finished in
    a minute, the tokens the scheduler decoded and prefilled in it (its counters, `counters`): a spread in the first
    but not the second is when requests finished, not how fast the server ran. The measured minutes are the whole ones
    from `first_minute` (the warm-up's before it) to `seconds` later."""
    keys = ("requests", "verify_steps", "accepted_drafts")
    full = [m for m in sorted(minutes) if first_minute <= m < first_minute + seconds // 60]
    per_min = [minutes[m]["tokens"] / 60 for m in full]
    decoded = counter_per_minute(counters or [], full, "decode")
    decode_per_s = [None if x is None else round(x / 60, 1) for x in decoded]
    return {"minutes": minutes, "responses": len(metas), "sums": sums(metas), "ledger_moved": ledger_moved,
            "responses_per_minute": [minutes[m].get("requests", 0) for m in full],
            "server_counters": counters,
            "decoded_tokens_per_s_per_minute": decode_per_s,
            "prefill_computed_tokens_per_minute": [None if x is None else round(x) for x in
                                                   counter_per_minute(counters or [], full, "prefill_compute")],
            "decode_throughput_spread": _spread(decode_per_s),
            "metrics_moved": metrics_moved, "invariant_failures": sum(not invariant_holds(m) for m in metas),
            "ledger_equals_responses": None if ledger_moved is None else
            {k: ledger_moved[k] for k in keys} == sums(metas),
            "metrics_equal_responses": None if metrics_moved is None or ledger_moved is None else
            {k: metrics_moved[k] for k in keys} == sums(metas),
            "errors": sum(r.get("errors", 0) for r in minutes.values()),
            "output_tokens_per_s_per_minute": [round(x, 1) for x in per_min],
            "prompt_tokens_per_minute": [minutes[m].get("prompt_tokens", 0) for m in full],
            "cached_tokens_per_minute": [minutes[m].get("cached_tokens", 0) for m in full],
            "accepted_drafts_per_step_per_minute": [round(minutes[m]["accepted_drafts"] / minutes[m]["verify_steps"], 3)
                                                    if minutes[m].get("verify_steps") else None for m in full],
            "jit_cache_entries_first_last": [minutes[full[0]].get("jit_cache_entries"),
                                             minutes[full[-1]].get("jit_cache_entries")] if full else None,
            "throughput_spread": _spread(per_min),
            "gpu_mib_first_last": [minutes[full[0]].get("gpu_mib"), minutes[full[-1]].get("gpu_mib")] if full else None,
            # the allocator's view of the same two minutes: held by tensors (allocated) vs cached (reserved)
            **{f"{k}_mib_first_last": [_mib((minutes[m].get("cuda_memory") or {}).get(f"{k}_bytes")) for m in
                                       (full[0], full[-1])] if full else None for k in ("allocated", "reserved")},
            "used_tokens_first_last": [minutes[full[0]].get("used_tokens"), minutes[full[-1]].get("used_tokens")]
            if full else None,
            **eviction_per_minute(minutes, full)}


def eviction_per_minute(minutes: dict[int, dict], full: list[int]) -> dict:
    """From each minute's last reading of the radix cache's cumulative counters: the evictions and their host seconds
    in each measured minute (against the minute before's reading), and the evictable leaves at its end (None where a
    minute or the one before has no reading)."""
    def moved(m, key):
        now, before = (minutes.get(m) or {}).get("prefix_cache"), (minutes.get(m - 1) or {}).get("prefix_cache")
        return None if not now or not before else round(now[key] - before[key], 3)

    return {"evictions_per_minute": [moved(m, "evictions") for m in full],
            "evict_seconds_per_minute": [moved(m, "evict_seconds") for m in full],
            "evictable_leaves_per_minute": [((minutes[m].get("prefix_cache") or {}).get("evictable_leaves"))
                                            for m in full]}


def _spread(per_minute: list[float | None]) -> float | None:
    """(max - min) / max over the minutes (None with fewer than two, or any unmeasured)."""
    if len(per_minute) < 2 or None in per_minute or not max(per_minute):
        return None
    return (max(per_minute) - min(per_minute)) / max(per_minute)


def _mib(n: int | None) -> float | None:
    return None if n is None else round(n / 2 ** 20, 1)


POOL_BAND = 0.10  # the pool's use follows the requests in flight: a last minute within 10% of the first is no growth


def soak_verdicts(v: dict) -> dict:
    """The soak's criteria, each True / False (None: not measured): no error, every response's invariant, the ledger
    and /metrics equal to the responses' sums, output tokens/s of every whole minute within 5% of the best, GPU memory
    no higher in the last whole minute than in the first (the growth and the kernels compiled meanwhile beside it), the
    pool's used tokens within POOL_BAND of the first minute's; beside the memory verdict, the growth of the bytes the
    allocator holds for tensors and of what it reserves (None from a soak that did not read them)."""
    gpu, pool, jit = v.get("gpu_mib_first_last"), v.get("used_tokens_first_last"), v.get("jit_cache_entries_first_last")
    allocated, reserved = v.get("allocated_mib_first_last"), v.get("reserved_mib_first_last")
    known = lambda pair: pair is not None and None not in pair  # noqa: E731
    return {"no_errors": v["errors"] == 0, "invariant_on_every_response": v["invariant_failures"] == 0,
            "ledger_equals_responses": v["ledger_equals_responses"],
            "metrics_equal_responses": v["metrics_equal_responses"],
            "throughput_within_5pct": None if v["throughput_spread"] is None else v["throughput_spread"] <= 0.05,
            "decode_throughput_within_5pct": None if v.get("decode_throughput_spread") is None else
            v["decode_throughput_spread"] <= 0.05,
            "gpu_memory_no_growth": gpu[1] <= gpu[0] if known(gpu) else None,
            "gpu_memory_growth_mib": gpu[1] - gpu[0] if known(gpu) else None,
            "kernels_compiled_meanwhile": jit[1] - jit[0] if known(jit) else None,
            "allocated_growth_mib": round(allocated[1] - allocated[0], 1) if known(allocated) else None,
            "reserved_growth_mib": round(reserved[1] - reserved[0], 1) if known(reserved) else None,
            "pool_no_growth": pool[1] <= (1 + POOL_BAND) * pool[0] if known(pool) else None}


def log_opening(log: str, batches: int = 40) -> list[str]:
    """The soak's log from its start: the last 30 lines before the first scheduler batch (what the server did between
    the first request and the first batch), the first batch lines, and every other warning or error line -- where a
    first minute without a finished request is read."""
    lines = log.splitlines()
    is_batch = [("Prefill batch" in x or "Decode batch" in x) for x in lines]
    before = lines[:is_batch.index(True)] if True in is_batch else lines
    first = [x for x, b in zip(lines, is_batch) if b][:batches]
    notable = [x for x, b in zip(lines, is_batch) if not b and re.search(r"WARNING|Error|error|compil", x)
               and x not in before[-30:]][:40]
    return before[-30:] + first + notable


def prometheus(srv: Server) -> dict:
    """The plugin's acceptance counters on /metrics (check_serving's reader)."""
    m = CS.metrics_counters(srv.get("/metrics"))
    return {k: m.get(k, 0.0) for k in ("requests", "verify_steps", "accepted_drafts")}


def gpu_memory_mib() -> int | None:
    try:
        return int(subprocess.check_output(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                           text=True).split()[0])
    except Exception:  # noqa: BLE001
        return None


DETERMINISTIC = os.environ.get("GPU_TRAFFIC_DETERMINISTIC", "1") == "1"  # logprobs compared with the target alone's


def arm_args(name: str, soak: bool = False) -> list[str]:
    head, drafting, extra, _env = (None, [], [], {}) if name == "target" else ARMS[name]
    args = CS.server_args(head, drafting) + extra
    if DETERMINISTIC and not soak:
        args.append("--enable-deterministic-inference")
    if soak:
        args += SOAK_ARGS  # later flags win: the running limit and graphs to 128 replace check_serving's 64
        if is_chain(name) and "--speculative-adaptive" not in args:
            args += SOAK_PROTECTION_ARGS
    return args


def run_arm(name: str, srv: Server, parts: list[str], prompts: list[list[int]], tokenizer, reference,
            max_prompt: int) -> dict:
    if not srv.wait_ready(600):
        return {"started": False, "error": srv.last_error(), "log_tail": srv.log()[-3000:]}
    row = {"started": True, "start_s": round(srv.ready_s)}
    progress(f"{name}: server ready in {row['start_s']} s")
    if "options" in parts:
        row["options"] = part_options(srv, prompts, tokenizer, reference)
    if "aborts" in parts:
        row["aborts"] = part_aborts(srv, prompts)
    if "soak" in parts:
        start = len(srv.log())
        row["soak"] = part_soak(srv, prompts, float(os.environ.get("GPU_TRAFFIC_SOAK_S", "600")), max_prompt,
                                float(os.environ.get("GPU_TRAFFIC_SOAK_WARMUP_S", "60")))
        row["soak"]["log_opening"] = log_opening(srv.log()[start:])
        # the protection's own account of the depths it chose, every batch-size slot every 10 s (the plugin's summary
        # line): which depths each minute ran, beside that minute's throughput
        row["soak"]["policy_summaries"] = [x for x in srv.log()[start:].splitlines()
                                           if "adaptive speculation summary" in x]
    return row


def main():
    os.makedirs(OUT, exist_ok=True)  # the report goes there at the end: a missing folder must not lose a run
    argv = sys.argv[1:]
    arms = list(ARMS)
    if "--arms" in argv:
        i = argv.index("--arms")
        arms, argv = argv[i + 1].split(","), argv[:i] + argv[i + 2:]
    parts = argv or ["options", "aborts"]
    if "soak" in parts and "--arms" not in sys.argv:
        # one server at a time: soaks side by side would share the GPU, and each minute's throughput the others' load
        arms = [SOAK_ARM]
    unknown = [a for a in arms if a not in ARMS] + [p for p in parts if p not in ("options", "aborts", "soak")]
    if unknown:
        raise SystemExit(f"unknown arm(s) or part(s) {unknown}; arms: {list(ARMS)}; parts: options aborts soak")
    prompts = CS.load_state()["prompts"]  # check_serving's: the same target, prompts and heads
    context = json.load(open(f"{CS.WORK}/target/config.json")).get("max_position_embeddings", 4096)
    max_prompt = min(int(os.environ.get("GPU_TRAFFIC_MAX_PROMPT", "32768")), context - 512)
    soak = "soak" in parts
    # the target alone's logprobs (deterministic mode): its server starts while the heads train
    target = (Server("traffic-target", arm_args("target"), {}, port_number=port() + len(ARMS))
              if DETERMINISTIC and "options" in parts and not soak else None)  # a soak server runs SGLang's defaults
    trainer = CS.train_heads()
    if trainer is not None:
        progress(f"training the heads not in {CS.WORK} yet ({CS.WORK}/train.log)")
    if trainer is not None and trainer.wait() != 0:
        if target is not None:
            target.stop()
        raise SystemExit(open(f"{CS.WORK}/train.log").read()[-3000:])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(f"{CS.WORK}/target")
    for name in arms:
        CS.prepare_head(ARMS[name][0])
    # the arms' servers side by side (correctness checks, not timings; GPU_CHECK_MAX_TOTAL_TOKENS caps each pool)
    servers = {name: Server(f"traffic-{name}", arm_args(name, soak),
                            {**ARMS[name][3], **(soak_env(name) if soak else {})}, port_number=port() + i)
               for i, name in enumerate(arms)}
    report, reference = {}, None
    try:
        if target is not None:
            with target:
                if target.wait_ready(600):
                    fn = option_requests(tokenizer)["logprobs"]
                    reference = [_safe(fn, target, ids) for ids in prompts[:16]]
                else:
                    print(f"[traffic] the target alone did not start: {target.last_error()}", flush=True)
        with cf.ThreadPoolExecutor(len(arms)) as pool:
            futures = {name: pool.submit(run_arm, name, servers[name], parts, prompts, tokenizer, reference,
                                         max_prompt) for name in arms}
            for name, f in futures.items():
                try:
                    report[name] = f.result()
                except Exception as e:  # noqa: BLE001 -- one arm's crash is its row, the others still report
                    report[name] = {"started": True, "error": f"{type(e).__name__}: {e}"}
                print(json.dumps({name: report[name]}, indent=1, default=str), flush=True)
                json.dump(report, open(os.path.join(OUT, "traffic.json"), "w"), indent=1, default=str)
    finally:
        for srv in servers.values():
            srv.stop()
    print_tables(report)


LEDGER_CELL = {True: "=", False: "!=", None: "-"}  # None: no meta_info to sum (chat), or no ledger (upstream)


def print_tables(report: dict) -> None:
    options = sorted({o for r in report.values() for o in r.get("options", {})})
    if options:
        print("| option | " + " | ".join(report) + " |\n|---|" + "---|" * len(report))
        for o in options:
            cells = []
            for r in report.values():
                c = r.get("options", {}).get(o)
                cells.append("-" if c is None else f"{c['status']}; invariant failures {c['invariant_failures']}; "
                             f"ledger {LEDGER_CELL[c['ledger_equals_responses']]}")
            print(f"| {o} | " + " | ".join(cells) + " |")
    for name, r in report.items():
        if not r.get("started", True) or r.get("error"):
            print(f"{name}: {r.get('error')}")
        v = r.get("soak")
        if v:
            if v.get("first_requests"):
                print(f"{name} soak, first requests one at a time: " +
                      ", ".join(f"{k} {x['seconds']} s" for k, x in v["first_requests"].items()))
            w = v.get("warmup") or {}
            if w:
                print(f"{name} soak warm-up ({w['seconds']:.0f} s, not measured): {w['responses']} responses, first "
                      f"after {w['first_response_s']} s, invariant failures {w['invariant_failures']}")
            print(f"{name} soak: {v['responses']} responses, {v['errors']} errors, invariant failures "
                  f"{v['invariant_failures']}, ledger = responses {v['ledger_equals_responses']}, /metrics = responses "
                  f"{v['metrics_equal_responses']}, output tok/s per minute {v['output_tokens_per_s_per_minute']} "
                  f"(spread {v['throughput_spread']}), decoded tok/s per minute (the scheduler's counter) "
                  f"{v.get('decoded_tokens_per_s_per_minute')} (spread {v.get('decode_throughput_spread')}), "
                  f"prefill-computed tokens per minute {v.get('prefill_computed_tokens_per_minute')}, "
                  f"prompt / cached tokens per minute "
                  f"{v.get('prompt_tokens_per_minute')} / {v.get('cached_tokens_per_minute')}, accepted drafts "
                  f"per step per minute "
                  f"{v.get('accepted_drafts_per_step_per_minute')}, JIT cache entries first/last "
                  f"{v.get('jit_cache_entries_first_last')}, "
                  f"GPU MiB first/last {v['gpu_mib_first_last']} (allocated {v.get('allocated_mib_first_last')}, "
                  f"reserved {v.get('reserved_mib_first_last')}), used tokens "
                  f"first/last {v['used_tokens_first_last']}")
            if v.get("verdicts"):
                print(f"{name} soak criteria: " + ", ".join(f"{k} {x}" for k, x in v["verdicts"].items()))
        for k, v in (r.get("aborts") or {}).items():
            print(f"{name} aborts {k}: counted once {v['counted_once']}, pool back to idle {v['pool_back_to_idle']}, "
                  f"serves after {v['serves_after']}")


if __name__ == "__main__":
    main()
