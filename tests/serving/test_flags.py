"""The plugin's options as real server flags: in `--help`, in a `--config` YAML file, exported to the environment
the scheduler processes read, ahead of an environment value, and reported in /get_server_info."""

import json
import os
import textwrap
import types

import pytest

from sglang_ext import settings
from sglang_ext.errors import ConfigError
from sglang_ext.serving import compat
from conftest import python_run  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PARSE = """
    import argparse, json, os, sys
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import ServerArgs
    from sglang_ext import settings
    from sglang_ext.serving import compat
    ConfigArgumentMerger = compat.config_argument_merger()  # moved in SGLang 0.5.21
    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)          # what prepare_server_args does, without building the ServerArgs
    argv = ["--model-path", "m", "--config", sys.argv[1], "--speculative-mla-verify", "extend"]
    argv = ConfigArgumentMerger(parser).merge_config_with_args(argv)
    ns = parser.parse_args(argv)
    print("RESULT" + json.dumps({"settings": settings.current().to_dict(), "help": parser.format_help(),
                                 "env": {o.env: os.environ.get(o.env) for o in settings.OPTIONS},
                                 "draft_kv": compat.draft_kv_dtype(args=ns), "release": compat.version()}))
"""


def test_flags_in_help_and_config_yaml_reach_the_environment(tmp_path):
    cfg = tmp_path / "server.yaml"
    cfg.write_text("speculative-adaptive-policy: cost\nspeculative-eagle3-aux-layers: '1,3,5'\n"
                   "speculative-draft-kv-cache-dtype: fp8_e4m3\n")
    env = dict(os.environ, SGLANG_EXT_MLA_VERIFY="decode", SGLANG_EXT_ADAPTIVE_DEPTH0="verify")
    p = python_run(["-c", textwrap.dedent(PARSE), str(cfg)], cwd=REPO, env=env, timeout=300)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT")), None)
    assert line, p.stdout[-2000:] + p.stderr[-3000:]
    r = json.loads(line[len("RESULT"):])
    for o in settings.OPTIONS:  # every option, with its variable named
        assert o.flag in r["help"] and o.env in r["help"], o.flag
    s = r["settings"]
    assert s["adaptive_policy"] == "cost" and s["aux_layers"] == "1,3,5"
    if compat.parse(r["release"]) >= compat.parse("0.5.18"):
        # SGLang's own flag of that name: its value stays SGLang's (no variable written), and the plugin reads it
        assert s["draft_kv_cache_dtype"] == "auto" and r["env"]["SGLANG_EXT_DRAFT_KV_CACHE_DTYPE"] is None
    else:
        assert s["draft_kv_cache_dtype"] == "fp8_e4m3"
    assert r["draft_kv"] == "fp8_e4m3"
    assert s["mla_verify"] == "extend"  # the flag wins over the variable it aliases
    assert s["adaptive_depth0"] == "verify"  # a variable alone still works
    assert r["env"]["SGLANG_EXT_ADAPTIVE_POLICY"] == "cost" and r["env"]["SGLANG_EXT_MLA_VERIFY"] == "extend"


def test_a_bad_value_names_the_flag_its_variable_and_the_choices():
    with pytest.raises(ConfigError) as e:
        settings.from_environment({"SGLANG_EXT_ADAPTIVE_POLICY": "greedy"})
    assert e.value.field == "--speculative-adaptive-policy (SGLANG_EXT_ADAPTIVE_POLICY)" and e.value.value == "greedy"
    assert "upstream, cost" in e.value.fix
    # registration reads it as the default instead of raising (SGLang's loader would swallow the error)
    assert settings.from_environment({"SGLANG_EXT_ADAPTIVE_POLICY": "greedy"}, strict=False).adaptive_policy == "upstream"
    with pytest.raises(ConfigError, match="SGLANG_EXT_AUX_DUMP_MAX"):
        settings.from_environment({"SGLANG_EXT_AUX_DUMP_MAX": "many"})
    aliases = settings.from_environment({"SGLANG_EXT_DRAFT_KV_CACHE_DTYPE": "FP8", "SGLANG_EXT_MLA_VERIFY": "off"})
    assert aliases.draft_kv_dtype == "fp8_e4m3" and aliases.mla_verify == "extend"


def test_server_info_reports_the_settings_in_effect(monkeypatch):
    from sglang_ext.serving import flags

    monkeypatch.setenv("SGLANG_EXT_ADAPTIVE_POLICY", "cost")
    result = types.SimpleNamespace(internal_state={})
    flags.internal_state_after(result, None)
    assert result.internal_state["sglang_ext_settings"]["adaptive_policy"] == "cost"
    assert json.dumps(result.internal_state)  # JSON, as /get_server_info returns it


def test_a_flag_the_parser_already_has_is_left_to_sglang():
    """A later SGLang release's own --speculative-draft-kv-cache-dtype: the plugin adds only what is missing."""
    import argparse

    from sglang_ext.serving import flags

    p = argparse.ArgumentParser()
    p.add_argument("--speculative-draft-kv-cache-dtype", help="SGLang's")
    added = flags.add_arguments(p)
    assert "--speculative-draft-kv-cache-dtype" not in added and len(added) == len(settings.OPTIONS) - 1
    assert flags.add_arguments(p) == []  # a second call adds nothing
    # its help names the variable the plugin also reads, once
    assert p.format_help().count("SGLANG_EXT_DRAFT_KV_CACHE_DTYPE") == 1


def test_sglangs_own_draft_kv_dtype_flag_is_read_and_a_contradicting_variable_refused(monkeypatch):
    """SGLang 0.5.18+ parses --speculative-draft-kv-cache-dtype itself: where the plugin's variable is unset its value
    is the draft's dtype; the variable naming the same dtype is accepted, another one refused."""
    import types

    from sglang_ext.config.kv import effective_draft_kv_dtype

    assert effective_draft_kv_dtype(None, None) is None and effective_draft_kv_dtype("bf16", "auto") == "bf16"
    assert effective_draft_kv_dtype(None, "bfloat16") == "bf16" and effective_draft_kv_dtype("bf16", "bf16") == "bf16"
    with pytest.raises(ConfigError, match="SGLANG_EXT_DRAFT_KV_CACHE_DTYPE"):
        effective_draft_kv_dtype("fp8_e4m3", "bf16")
    args = types.SimpleNamespace(speculative_draft_kv_cache_dtype="bf16")
    monkeypatch.delenv("SGLANG_EXT_DRAFT_KV_CACHE_DTYPE", raising=False)
    if compat.at_least("0.5.18"):
        assert compat.draft_kv_dtype(args=args) == "bf16"
        monkeypatch.setenv("SGLANG_EXT_DRAFT_KV_CACHE_DTYPE", "fp8_e4m3")
        with pytest.raises(ConfigError):
            compat.draft_kv_dtype(args=args)
    else:  # 0.5.17: no such SGLang field; the plugin's option alone
        assert compat.draft_kv_dtype(args=args) is None
        monkeypatch.setenv("SGLANG_EXT_DRAFT_KV_CACHE_DTYPE", "fp8_e4m3")
        assert compat.draft_kv_dtype(args=args) == "fp8_e4m3"
