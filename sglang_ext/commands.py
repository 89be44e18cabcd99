"""The package's commands, one table: `python -m sglang_ext COMMAND ...` dispatches through it, and each command is
also a console script (pyproject.toml's [project.scripts] lists the same entries literally; tests/tools/test_commands.py
checks that the two agree). Each module's `main(argv: list[str] | None) -> int` takes the arguments after the command
name and returns the exit status; its parser has `--help` and `--version`.

Importing this module is cheap: the commands' modules (torch, SGLang) are imported only when one runs.
"""

from __future__ import annotations

import importlib
import sys
from typing import NamedTuple

from sglang_ext import __version__

VERSION = f"sglang-eagle3-mla {__version__}"  # what every command's --version prints


class Command(NamedTuple):
    module: str  # its `main(argv) -> int`
    description: str
    script: str  # the console script


COMMANDS: dict[str, Command] = {
    "demo": Command("sglang_ext.demo", "a one-minute CPU demo: tiny MLA target, train an Eagle3 head, inspect the pair",
                    "eagle3-demo"),
    "inspect-draft": Command("sglang_ext.inspect_draft", "check an Eagle3 head against its target before serving",
                             "eagle3-inspect"),
    "train": Command("sglang_ext.training.train_draft",
                     "regenerate data, capture features, train and export an Eagle3 head", "eagle3-train"),
    "eval-gsm8k": Command("sglang_ext.eval.gsm8k", "GSM8K accuracy and acceptance, with and without speculation",
                          "eagle3-eval-gsm8k"),
    "bench": Command("sglang_ext.eval.bench", "serving benchmark of running servers: chat prompts, a concurrency "
                     "sweep, TTFT / TPOT / tokens/s / acceptance, with and without speculation", "eagle3-bench"),
    "spec-bench": Command("sglang_ext.eval.spec_bench",
                          "GPU: speculation speedup on a Kimi-K2.5-shaped target, plugin vs upstream (servers it "
                          "starts)",
                          "eagle3-spec-bench"),
    "remeasure": Command("sglang_ext.training.remeasure", "re-measure an exported head's reported acceptance",
                         "eagle3-remeasure"),
}


def prog(name: str) -> str:
    """The program name a command's parser shows (usage, errors): its console script."""
    return COMMANDS[name].script


def scripts() -> dict[str, str]:
    """[project.scripts] as the table implies it: console script -> "module:main"."""
    return {c.script: f"{c.module}:main" for c in COMMANDS.values()}


def run(name: str, argv: list[str] | None = None) -> int:
    """Run command `name` with `argv` (default: sys.argv[1:]); its exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        module = importlib.import_module(COMMANDS[name].module)
    except ModuleNotFoundError as e:
        problem = checkout_shadow(e)
        if problem is None:
            raise
        print(f"{prog(name)}: error: {problem}", file=sys.stderr)
        return 2
    return module.main(argv)


def checkout_shadow(error: ModuleNotFoundError) -> str | None:
    """Why a command's module is missing when `sglang_ext` was imported from a source checkout: training/ and eval/
    install as sglang_ext.training and sglang_ext.eval (pyproject.toml's package-dir), so the checkout's own
    sglang_ext/ folder lacks them, and `python -m` puts the working directory first on sys.path, ahead of an
    installed wheel. None when the error is another one."""
    import os

    import sglang_ext

    missing = error.name or ""
    if missing not in ("sglang_ext.training", "sglang_ext.eval"):
        return None
    package = os.path.dirname(os.path.abspath(sglang_ext.__file__))
    root = os.path.dirname(package)
    folder = missing.split(".")[1]
    if not os.path.isdir(os.path.join(root, folder)):
        return None
    return (f"module {missing} not found: sglang_ext was imported from the source checkout {package}, where "
            f"{folder}/ sits beside the package instead of inside it. Fix: install the checkout (pip install -e "
            f"{root}), run the console script instead of python -m, or add -P (python -P -m sglang_ext ...) so that "
            "the installed package is used")
