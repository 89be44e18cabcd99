"""Python programs run as forks of one interpreter that has already imported SGLang's heavy modules.

Why: about twenty tests run a program in an interpreter of its own (SGLang's plugin loader, launch_server's argument
parsing, SGLang's kernels and controllers on the CPU), and on 2 cores importing SGLang takes 10-15 s of each. A
child forked from a server that imported those modules starts in milliseconds.

Faithful because: the server imports SGLang's modules and nothing else -- it never imports sglang_ext and never calls
SGLang's `load_plugins()`, so the plugin is loaded, configured from the child's environment and applied to
already-imported modules in the child, as in SGLang's own processes (launch_server and the scheduler import these
modules before they call `load_plugins()`). Variables read when a module is imported (`IMPORT_TIME_ENV`, e.g.
TRITON_INTERPRET, read by `triton.jit` as SGLang's kernels are defined) get a server of their own per value. Each
child gets the environment, working directory, argv and sys.path[0] the plain interpreter would.

    run(["-c", code, *args] | [script, *args] | ["-m", module, *args], env=..., cwd=..., timeout=...)
        -> subprocess.CompletedProcess (text stdout and stderr)
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile

# imported by the server before it forks (absent ones skipped: releases differ); no module of this repository
PRELOAD = ("torch", "transformers", "sglang.srt.server_args", "sglang.srt.model_executor.model_runner",
           "sglang.srt.speculative.eagle_worker_v2", "sglang.srt.managers.scheduler",
           "sglang.srt.layers.attention.triton_backend", "sglang.launch_server")
IMPORT_TIME_ENV = ("TRITON_INTERPRET", "PYTHONPATH", "PYTHONHASHSEED")

_servers: dict[tuple, subprocess.Popen] = {}


def _key(env: dict) -> tuple:
    return tuple(env.get(k) for k in IMPORT_TIME_ENV)


def _server(env: dict) -> subprocess.Popen:
    key = _key(env)
    srv = _servers.get(key)
    if srv is None or srv.poll() is not None:
        log = open(os.path.join(tempfile.gettempdir(), f"forkserver-{os.getpid()}-{len(_servers)}.log"), "w")
        srv = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        _servers[key] = srv
    return srv


@atexit.register
def _stop_all() -> None:
    for srv in _servers.values():
        if srv.poll() is None:
            srv.kill()


def run(argv: list[str], env: dict | None = None, cwd: str | None = None, timeout: float = 300
        ) -> subprocess.CompletedProcess:
    """As `subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=cwd,
    timeout=timeout)`, in a fork of the server for `env`'s import-time variables."""
    env = dict(os.environ if env is None else env)
    srv = _server(env)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        srv.stdin.write(json.dumps({"argv": list(argv), "env": env, "cwd": cwd or os.getcwd(), "stdout": out,
                                    "stderr": err}) + "\n")
        srv.stdin.flush()
        pid = json.loads(srv.stdout.readline())["pid"]
        ready, _, _ = select.select([srv.stdout], [], [], timeout)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            srv.stdout.readline()
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, open(out).read(), open(err).read())
        rc = json.loads(srv.stdout.readline())["rc"]
        return subprocess.CompletedProcess([sys.executable, *argv], rc, open(out).read(), open(err).read())


def _child(job: dict, root_logger: tuple) -> None:
    """In the forked child: become the program `job` describes, then exit with its status. The root logger is put
    back as a fresh interpreter has it (a module that logs through it at import adds a handler, and the program's own
    `logging.basicConfig` would then do nothing)."""
    import logging

    root = logging.getLogger()
    root.handlers[:], level = root_logger
    root.setLevel(level)
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    import runpy
    import traceback

    argv, code = job["argv"], 0
    try:
        if argv[0] == "-c":
            sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        elif argv[0] == "-m":
            sys.argv, sys.path[0] = [argv[1], *argv[2:]], os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 -- what the interpreter prints for an uncaught exception
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def _serve() -> None:
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the imports print goes to the log, not into the replies
    import importlib
    import logging

    root_logger = (list(logging.getLogger().handlers), logging.getLogger().level)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001
            print(f"forkserver: {name} not preloaded: {e!r}", file=sys.stderr)
    assert not any(m == "sglang_ext" or m.startswith("sglang_ext.") for m in sys.modules), "preloaded the plugin"
    for line in sys.stdin:
        job = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            replies.close()
            _child(job, root_logger)
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
