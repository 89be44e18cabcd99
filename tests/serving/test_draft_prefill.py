"""The draft's prefill on its used rows only (sglang_ext.serving.draft_prefill): SGLang's own Eagle3 head on the CPU,
upstream's forward against the plugin's, and which batches the path takes."""

import json
import os

import pytest

from conftest import WORKERS as HERE, python_run  # noqa: E402

pytest.importorskip("sglang")


@pytest.fixture(scope="module")
def worker():
    p = python_run([os.path.join(HERE, "draft_prefill_worker.py")], timeout=600,
                   env=dict(os.environ, SGLANG_EXT_DRAFT_PREFILL="last"))
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("layers", ["one_layer", "two_layers"])
def test_the_draft_kv_and_the_kept_hidden_state_are_upstreams(worker, layers):
    """What drafting reads after the prefill -- every prompt token's draft KV and each request's last hidden state
    -- equals upstream's forward: the KV bit for bit (computed before the skipped part), the last rows to float32
    rounding (the GEMMs ran over 3 rows instead of 20)."""
    r = worker[layers]
    assert r["installed"] and r["kv_norm"] > 1.0 and r["kv_max_diff"] == 0.0
    assert r["last_hidden_norm"] > 0.5
    assert r["last_hidden_max_diff"] < 1e-5 and r["last_aux_max_diff"] < 1e-5
    assert r["other_rows_differ"]  # the rows nothing reads were indeed not computed
    assert r["rows_after"]  # the selection ends with its forward: later forwards (draft decode) run whole
    assert r["kept_then_rewrapped"]  # installed once; again on an eager runner SGLang rebuilt


def test_only_the_last_layers_mlp_runs_on_the_last_rows(worker):
    """3 requests extending 20 tokens: the last layer's MLP sees 3 rows; a first layer feeding the next one's KV
    stays whole."""
    assert worker["one_layer"]["mlp_rows_per_layer"] == [3]
    assert worker["two_layers"]["mlp_rows_per_layer"] == [20, 3]


def test_the_path_is_taken_only_for_a_draft_prefill_that_reads_one_row_per_request(worker):
    s = worker["selection"]
    assert s["prefill"] == [6, 10, 19]  # extends 7, 4, 9: each request's last token
    assert s["full_capture"] is None and s["logprob"] is None  # every row read
    assert s["dp_attention"] is None  # DP attention pads and gathers tokens across ranks
    assert s["target_verify"] is None and s["one_token_each"] is None
    assert worker["not_armed"]  # outside _draft_extend_for_prefill (the target's prefill, the draft's decode)
    assert worker["other_model"]  # a draft model that is not an Eagle3 head keeps upstream's forward
    assert worker["mla_head_layer"]  # the MLA-format head's one layer (model.midlayer) is the one wrapped


def test_last_is_the_default_full_keeps_upstreams_prefill_and_a_bad_value_is_refused(monkeypatch):
    from sglang_ext import settings
    from sglang_ext.errors import ConfigError
    from sglang_ext.serving import draft_prefill

    monkeypatch.delenv("SGLANG_EXT_DRAFT_PREFILL", raising=False)
    assert settings.current().draft_prefill == "last"
    assert draft_prefill.HOOKS[0].applies(settings.current())
    calls = []
    monkeypatch.setenv("SGLANG_EXT_DRAFT_PREFILL", "full")
    worker = object()  # no draft runner: reaching install() would fail on it
    assert draft_prefill.draft_extend_for_prefill(lambda w, b: calls.append(b) or "upstream", worker, "batch") \
        == "upstream"
    assert calls == ["batch"] and not hasattr(worker, draft_prefill.STATE)
    assert not draft_prefill.HOOKS[0].applies(settings.current())
    monkeypatch.setenv("SGLANG_EXT_DRAFT_PREFILL", "every")
    with pytest.raises(ConfigError, match="--speculative-draft-prefill"):
        settings.current()
