"""Start and stop `python -m sglang.launch_server` inside one GPU run (used by tests/gpu/*.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

BASE_ARGS = ["--max-running-requests", "32", "--cuda-graph-bs-decode", "1", "2", "4", "8", "16", "32",
             "--disable-prefill-cuda-graph", "--host", "127.0.0.1", "--log-level", "info"]
BACKEND_ENV = "GPU_CHECK_ATTENTION_BACKEND"  # unset: no flag, SGLang's own choice (fa3 for an MLA target on Hopper)


def attention_backend() -> str | None:
    return os.environ.get(BACKEND_ENV) or None


def launch_args() -> list[str]:
    """What every server gets before its own arguments (an arm's own --attention-backend comes later and wins):
    the attention backend of GPU_CHECK_ATTENTION_BACKEND, the static memory fraction (GPU_CHECK_MEM_FRACTION) and a
    KV pool cap (GPU_CHECK_MAX_TOTAL_TOKENS). One server at a time: fraction 0.3, no cap. Servers started side by
    side (GPU_CHECK_PARALLEL > 1): fraction 0.6 and 65,536 tokens. SGLang keeps (1 - fraction) of the memory free
    when a server starts out of its budget, and its neighbours' weights and pools, allocated while it loads, come out
    of that reserve: at 0.25 the third of three servers found no memory for its KV cache (FA3, H100, 2026-12-07)."""
    side_by_side = int(os.environ.get("GPU_CHECK_PARALLEL", "1")) > 1
    backend = attention_backend()
    out = BASE_ARGS + (["--attention-backend", backend] if backend else [])
    out += ["--mem-fraction-static", os.environ.get("GPU_CHECK_MEM_FRACTION", "0.6" if side_by_side else "0.3")]
    cap = os.environ.get("GPU_CHECK_MAX_TOTAL_TOKENS", "65536" if side_by_side else "")
    if cap:
        out += ["--max-total-tokens", cap]
    return out


def port() -> int:
    """Read per server, not at import: one process may start servers for several callers (GPU_CHECK_PORT)."""
    return int(os.environ.get("GPU_CHECK_PORT", "30177"))


def tp_args(tp: int) -> list[str]:
    """--tp-size, and at TP > 1 FlashInfer's all-reduce fusion off: on an nvidia-h200-x2 VM (Firecracker,
    NVLink multicast disabled) SGLang 0.5.17 auto-enables it for DeepseekV3 targets and then hangs for good after
    setting up its TRTLLM workspace (SymmDeviceMemory), with or without --disable-custom-all-reduce (an earlier run,
    docs/results.md, "Tensor parallelism"). With the fusion off TP=2 serves."""
    return ["--tp-size", str(tp)] + (["--enforce-disable-flashinfer-allreduce-fusion"] if tp > 1 else [])


def group_pids(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`, from /proc."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            fields = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            out.append(int(d))
    return out


class Server:
    def __init__(self, name: str, args: list[str], env: dict | None = None, log_dir: str = "/tmp/gpu-logs",
                 port_number: int | None = None):
        os.makedirs(log_dir, exist_ok=True)
        self.name, self.log_path = name, os.path.join(log_dir, f"{name}.log")
        self.port = port_number or port()
        self.url = f"http://127.0.0.1:{self.port}"
        full_env = dict(os.environ, **(env or {}))
        self.t0 = time.time()
        self.proc = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", *launch_args(),
                                      "--port", str(self.port), *args],
                                     stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, env=full_env,
                                     start_new_session=True)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def last_error(self) -> str:
        """The log's last line naming an error (what a server that did not start died of)."""
        errors = [x for x in self.log().splitlines() if "Error" in x]
        return errors[-1][:300] if errors else "no error line"

    def wait_ready(self, timeout: float = 300) -> bool:
        while time.time() - self.t0 < timeout:
            if "ready to roll" in self.log():
                self.ready_s = time.time() - self.t0
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(1)
        return False

    def post(self, path: str, payload: dict, timeout: float = 300):
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
        try:
            return json.loads(body)
        except ValueError:  # a plain-text answer: SGLang's /start_profile says "Start profiling." (an earlier run's
            return body.decode()  # profiles failed on parsing it, and the benchmark then stopped the server)

    def get(self, path: str, timeout: float = 60) -> str:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return r.read().decode()

    def stop(self) -> None:
        """Stop the server's whole process group and wait until none of its processes is alive (a zombie
        has released its GPU memory), so the next server on this GPU finds the memory free. Waiting on
        processes, not on the GPU's used memory: another job (a trainer, a server on another port) may
        share the GPU."""
        pgid = self.proc.pid
        for sig, limit in ((signal.SIGTERM, 40), (signal.SIGKILL, 20)):
            if not group_pids(pgid):
                break
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            t = time.time()
            while group_pids(pgid) and time.time() - t < limit:
                self.proc.poll()  # reap the leader
                time.sleep(0.5)
        self.proc.poll()
        time.sleep(1)  # the driver frees the contexts of exited processes

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
