"""The commands: sglang_ext.commands.COMMANDS is what pyproject.toml installs ([project.scripts], the packages and
their folders) and what `python -m sglang_ext` dispatches; each command answers --help and --version."""

import os
import subprocess
import sys
import tomllib

import pytest

from sglang_ext.commands import COMMANDS, VERSION, scripts

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pyproject() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_console_scripts_are_the_commands_table():
    assert pyproject()["project"]["scripts"] == scripts()
    assert len({c.script for c in COMMANDS.values()}) == len(COMMANDS)


def test_every_package_of_the_tree_is_installed_under_sglang_ext():
    """The packages are listed, not found: a new subpackage missing from the list would be left out of the wheel."""
    st = pyproject()["tool"]["setuptools"]
    dirs = {"sglang_ext": "sglang_ext", **st["package-dir"]}
    assert dirs == {"sglang_ext": "sglang_ext", "sglang_ext.training": "training", "sglang_ext.eval": "eval"}
    found = set()
    for name, folder in dirs.items():
        for root, subdirs, files in os.walk(os.path.join(REPO, folder)):
            subdirs[:] = [d for d in subdirs if d != "__pycache__"]
            if "__init__.py" in files:
                rel = os.path.relpath(root, os.path.join(REPO, folder))
                found.add(name if rel == "." else ".".join([name, *rel.split(os.sep)]))
    data = {"sglang_ext.data.gsm8k"}  # a folder of data files (no __init__.py), listed as setuptools asks
    assert sorted(st["packages"]) == sorted(found | data)
    assert st["package-data"] == {"sglang_ext.data": ["gsm8k/*.jsonl", "gsm8k/LICENSE"]}
    for c in COMMANDS.values():
        assert c.module.rsplit(".", 1)[0] in found


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglang_ext", *args], capture_output=True, text=True, timeout=300,
                          cwd=REPO)


@pytest.mark.slow  # a fresh interpreter, SmolLM2 or an end-to-end run: `make test`, not `make test-fast`
@pytest.mark.parametrize("name", list(COMMANDS))
def test_each_command_answers_help_and_version(name):
    p = run(name, "--help")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith(f"usage: {COMMANDS[name].script} "), p.stdout[:200]
    p = run(name, "--version")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == VERSION


def test_python_m_sglang_ext_lists_the_commands():
    p = run("--help")
    assert p.returncode == 0
    for name, c in COMMANDS.items():
        assert f"  {name} " in p.stdout and c.script in p.stdout
    p = run("--version")
    assert p.returncode == 0 and p.stdout.strip() == VERSION
    p = run("no-such-command")
    assert p.returncode == 2 and "commands:" in p.stderr


def test_figures_are_skipped_naming_the_extra_when_matplotlib_is_missing(monkeypatch, capsys):
    """Without matplotlib a command still writes its JSON and markdown reports; the figure is skipped with the extra
    that installs it, not a traceback after the work."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    from sglang_ext.plotting import pyplot

    assert pyplot("eval", "throughput.png") is None
    err = capsys.readouterr().err
    assert "throughput.png not written" in err and "sglang-eagle3-mla[eval]" in err


@pytest.mark.slow  # a fresh interpreter, SmolLM2 or an end-to-end run: `make test`, not `make test-fast`
def test_the_demo_trains_exports_and_inspects_a_pair_offline(tmp_path):
    """`make demo` from an empty directory: a tiny MLA target, an MLA head trained and exported for it, the pair
    accepted by the startup checks; about a minute on 2 cores."""
    p = subprocess.run([sys.executable, "-m", "sglang_ext", "demo", "--out", str(tmp_path / "demo")],
                       capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "OK: the server would accept this pair." in p.stdout
    assert "untrained head" in p.stdout and (tmp_path / "demo" / "head" / "training_curve.png").exists()


@pytest.mark.parametrize("name", ["spec-bench", "train"])
def test_a_checkout_shadowing_the_installed_package_is_named_with_the_fix(name):
    """`python -m sglang_ext` run from the checkout's root imports the checkout's sglang_ext/ (the working directory
    comes first on sys.path), which has no training/ or eval/ inside it: the command says so and how to run it,
    instead of a traceback ending in ModuleNotFoundError. -S leaves the editable install's import hook unread, as in
    an environment where the package is installed from a wheel."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-S", "-m", "sglang_ext", name, "--help"], capture_output=True, text=True,
                       timeout=120, cwd=REPO, env=env)
    assert p.returncode == 2, (p.stdout[-500:], p.stderr[-2000:])
    assert "Traceback" not in p.stderr
    assert f"{COMMANDS[name].script}: error: module {COMMANDS[name].module.rsplit('.', 1)[0]} not found" in p.stderr
    assert "python -P -m sglang_ext" in p.stderr and "pip install -e" in p.stderr
