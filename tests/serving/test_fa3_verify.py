"""Draft-tree target verify on FA3 as decode rows (sglang_ext.serving.fa3_verify): SGLang's own FlashAttentionBackend
metadata and cascade path on the CPU against the plugin's rows, the kernel call against plain decode's, and the
startup warning."""

import json
import os
import types

import pytest

from conftest import WORKERS as HERE, python_run  # noqa: E402


def built_for_this_release() -> bool:
    from sglang_ext.serving import fa3_verify

    return fa3_verify.HOOKS[0].covers()


@pytest.fixture(scope="module")
def worker():
    # run against every installed release, registered or not: the installed SGLang's own FA3 metadata and cascade
    # are what the rows must reproduce (0.5.23's read the same; the hook is registered where a GPU run confirmed it)
    p = python_run([os.path.join(HERE, "fa3_verify_worker.py")], timeout=900,
                   env=dict(os.environ, TRITON_INTERPRET="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_each_verify_token_attends_to_its_prefix_and_ancestors_in_one_decode_call(worker):
    """One call per layer (upstream's cascade makes two and merges), each row the request's prefix plus the tree's
    ancestors and itself: prefixes 9, 3, 14; tree 0 <- 1, 2; 1 <- 3."""
    assert worker["upstream_calls_per_layer"] == 2 and worker["our_calls_per_layer"] == 1
    assert worker["row_lengths"] == [10, 11, 11, 12, 4, 5, 5, 6, 15, 16, 16, 17]
    assert worker["output_norm"] > 1.0
    # the same attention as upstream's cascade, and exactly the attention read straight from the verify mask
    assert worker["ours_vs_cascade"] < 1e-12 and worker["ours_vs_direct"] == 0.0


def test_the_rows_call_is_the_call_plain_decoding_makes(worker):
    """Deterministic mode makes a decode row batch-invariant; the verify rows take the same call (one query per row,
    causal, the backend's split count) so each is computed as that token's decode step."""
    assert worker["our_call"] == worker["decode_call"]
    assert worker["our_call"]["num_splits"] == 1 and worker["our_call"]["max_seqlen_q"] == 1


def test_rows_are_built_once_per_forward_and_ignore_stale_table_entries(worker):
    assert worker["rows_built_in_first_forward"] == 1 and worker["rows_built_in_two_forwards"] == 2
    assert worker["wide_rows_equal"]  # a CUDA-graph-wide prefix table with stale entries past each prefix


def test_only_deterministic_mode_takes_it_by_default(worker):
    assert worker["wrapped"] and not worker["auto_nondeterministic_wrapped"] and not worker["extend_wrapped"]


@pytest.mark.parametrize("mode,deterministic,attrs,expected", [
    ("auto", True, {}, []),
    ("decode", False, {}, []),
    ("auto", False, {}, ["only with --enable-deterministic-inference"]),
    ("extend", True, {}, ["extend"]),
    ("auto", True, {"topk": 1}, ["chain"]),
    ("auto", True, {"use_mla": False}, ["not MLA"]),
    ("auto", True, {"kv_cache_dtype_str": "fp8_e4m3"}, ["fp8_e4m3"]),
    ("auto", True, {"page_size": 64}, ["page size 64"]),
    ("auto", True, {"is_draft_runner": True}, ["draft"]),
    ("auto", True, {"_unified_dense": True}, ["unified"]),  # 0.5.17's mark
    ("auto", True, {"kv_index_translator": types.SimpleNamespace(is_translating=True)}, ["unified"]),  # 0.5.23's
    ("auto", True, {"kv_index_translator": types.SimpleNamespace(is_translating=False)}, []),
    ("auto", True, {"_kv_shard_pool": object()}, ["sharded"]),
])
def test_where_the_rows_apply(mode, deterministic, attrs, expected):
    from sglang_ext.serving import fa3_verify

    backend = types.SimpleNamespace(**{**dict(use_mla=True, topk=4, page_size=1, kv_cache_dtype_str="auto",
                                              fa_impl_ver=3, is_draft_runner=False), **attrs})
    why = fa3_verify.reasons(backend, deterministic, mode)
    assert len(why) == len(expected) and all(e in w for e, w in zip(expected, why)), why


def test_the_startup_warning_names_why_trees_are_not_exact():
    from sglang_ext.config import pair
    from sglang_ext.serving import fa3_verify
    from sglang_ext import settings

    target, draft = types.SimpleNamespace(is_mla=True), types.SimpleNamespace(head_format="mla")
    exact = fa3_verify.server_reason(settings.Settings(), None)
    if not built_for_this_release():  # another release: upstream's cascade, and the warning says so
        assert "built for SGLang 0.5.17" in exact
        assert "built for SGLang 0.5.17" in pair.backend_errors(target, draft, "fa3", "fa3", 4, True,
                                                               fa3_trees_inexact=exact)[1][0]
        return
    assert exact is None  # SGLang 0.5.17, bf16 KV, the default option
    assert pair.backend_errors(target, draft, "fa3", "fa3", 4, True, fa3_trees_inexact=exact) == ([], [])
    why = fa3_verify.server_reason(settings.Settings(), "fp8_e4m3")
    _, warnings = pair.backend_errors(target, draft, "fa3", "fa3", 4, True, fa3_trees_inexact=why)
    assert len(warnings) == 1 and "--kv-cache-dtype fp8_e4m3" in warnings[0] and "not equal" in warnings[0]
    assert "extend" in fa3_verify.server_reason(settings.Settings(mla_verify="extend"), None)


def test_deterministic_is_the_flag_or_the_one_kv_split_the_backend_resolved():
    """SGLang 0.5.23 resolves deterministic mode from more than --enable-deterministic-inference (--rl-on-policy-target
    turns it on in the resolved settings only) and then runs FA3 with one KV split: that backend's trees take the
    rows too; a backend with split-KV (num_splits 0) and no flag keeps the cascade under `auto`."""
    from sglang_ext.serving import fa3_verify

    class FlashAttentionBackend(types.SimpleNamespace):
        def forward_extend(self, *args, **kwargs):
            return "cascade"

    def built(num_splits, flag):
        be = FlashAttentionBackend(use_mla=True, topk=4, page_size=1, kv_cache_dtype_str="auto", fa_impl_ver=3,
                                   is_draft_runner=False, num_splits=num_splits)
        runner = types.SimpleNamespace(server_args=types.SimpleNamespace(enable_deterministic_inference=flag))
        return fa3_verify.built_after(be, model_runner=runner, backend_str="fa3")

    assert "forward_extend" in built(1, False).__dict__  # wrapped on the instance
    assert "forward_extend" in built(0, True).__dict__
    assert "forward_extend" not in built(0, False).__dict__
