"""The release-dependent lookups (sglang_ext/serving/compat.py): each branch against stand-ins, with the release
it is for stated (compat.version patched), and the lookups of the installed SGLang against its real modules."""

import contextlib
import types

import pytest

from sglang_ext.errors import ConfigError
from sglang_ext.serving import compat

pytest.importorskip("sglang")


@pytest.fixture
def release(monkeypatch):
    """release("0.5.21"): the lookups answer as on that SGLang release."""
    return lambda v: monkeypatch.setattr(compat, "version", lambda: v)


def test_releases_compare_by_their_base_version(release):
    assert compat.parse("0.5.21.post2") == compat.parse("0.5.21") and compat.parse("?") is None
    release("0.5.20")
    assert compat.at_least("0.5.18") and not compat.at_least("0.5.21")
    release("0.5.23rc1")
    assert compat.at_least("0.5.23")


def test_the_translated_kv_pool_check_per_release(release):
    translated_old = types.SimpleNamespace(_translate_kv_loc=lambda loc: loc)
    translated_new = types.SimpleNamespace(kv_index_translator=types.SimpleNamespace(is_translating=True))
    plain_new = types.SimpleNamespace(kv_index_translator=types.SimpleNamespace(is_translating=False))
    release("0.5.17")
    assert compat.translates_kv_loc(translated_old) and not compat.translates_kv_loc(translated_new)
    release("0.5.21")
    assert compat.translates_kv_loc(translated_new) and not compat.translates_kv_loc(plain_new)


def test_an_mla_verify_backend_on_a_translated_pool_keeps_upstreams_kernel(monkeypatch):
    from sglang_ext.serving import mla_verify

    monkeypatch.setenv("SGLANG_EXT_MLA_VERIFY", "auto")
    base = {"use_mla": True, "topk": 1, "dcp_size": 1, "sliding_window_size": None, "page_size": 1}
    if compat.at_least("0.5.21"):
        translated = {"kv_index_translator": types.SimpleNamespace(is_translating=True)}
    else:
        translated = {"_translate_kv_loc": lambda loc: loc}
    assert mla_verify.applies(types.SimpleNamespace(**base, _translate_kv_loc=None))
    assert not mla_verify.applies(types.SimpleNamespace(**base, **translated))


def test_the_draft_tp_context_per_release(release):
    entered = []

    def attribute(group, **kw):
        entered.append((group, kw))
        return contextlib.nullcontext()

    draft = types.SimpleNamespace(draft_tp_context=attribute, draft_runner=types.SimpleNamespace(tp_group="g"),
                                  draft_owns_attention=True)
    release("0.5.18")
    compat.draft_tp_context(draft)
    release("0.5.21")
    compat.draft_tp_context(draft)
    assert entered == [("g", {}), ("g", {"owns_attention": True})]


def test_the_installed_releases_draft_tp_context():
    """On 0.5.23+ SGLang's own spec_utils.draft_tp_context: a draft without a group of its own enters nothing."""
    layout = types.SimpleNamespace(tp_group=None, disable_cp=False)
    draft = types.SimpleNamespace(parallel_layout=layout, draft_runner=types.SimpleNamespace(tp_group=None),
                                  draft_owns_attention=False, draft_tp_context=lambda group, **kw: contextlib.nullcontext())
    with compat.draft_tp_context(draft):
        pass


def test_the_kv_indices_kernel_and_the_config_merger_of_the_installed_release():
    assert callable(compat.create_flashinfer_kv_indices_triton())
    assert hasattr(compat.config_argument_merger(), "merge_config_with_args")


def test_attention_dp_width_per_release(release):
    legacy = types.SimpleNamespace(tp_size=8, enable_dp_attention=True, dp_size=4)
    field = types.SimpleNamespace(tp_size=8, enable_dp_attention=False, dp_size=1, attn_dp_size=2)
    release("0.5.17")
    assert compat.attention_dp_size(legacy) == 4 and compat.attention_dp_size(field) == 1
    release("0.5.23")
    assert compat.attention_dp_size(legacy) == 4 and compat.attention_dp_size(field) == 2
    from sglang_ext.serving import startup

    assert startup.attention_tp(field) == 4 and startup.attention_tp(types.SimpleNamespace(tp_size=2)) == 2


def test_sglangs_own_draft_kv_dtype_field_per_release(release, monkeypatch):
    args = types.SimpleNamespace(speculative_draft_kv_cache_dtype="bfloat16")
    monkeypatch.delenv("SGLANG_EXT_DRAFT_KV_CACHE_DTYPE", raising=False)
    release("0.5.17")  # no such SGLang flag: the plugin's option alone
    assert compat.upstream_draft_kv_cache_dtype(args) is None and compat.draft_kv_dtype(args=args) is None
    release("0.5.18")
    assert compat.upstream_draft_kv_cache_dtype(args) == "bfloat16" and compat.draft_kv_dtype(args=args) == "bf16"
    assert compat.upstream_draft_kv_cache_dtype(types.SimpleNamespace(speculative_draft_kv_cache_dtype="auto")) is None
    monkeypatch.setenv("SGLANG_EXT_DRAFT_KV_CACHE_DTYPE", "bf16")
    assert compat.draft_kv_dtype(args=args) == "bf16"  # the same dtype twice: accepted
    monkeypatch.setenv("SGLANG_EXT_DRAFT_KV_CACHE_DTYPE", "fp8_e4m3")
    with pytest.raises(ConfigError) as e:
        compat.draft_kv_dtype(args=args)
    assert e.value.field == "--speculative-draft-kv-cache-dtype (SGLANG_EXT_DRAFT_KV_CACHE_DTYPE)"


def test_the_startup_check_refuses_a_variable_contradicting_sglangs_flag(release, monkeypatch):
    from sglang_ext.serving import startup

    monkeypatch.setattr(startup.hooks, "missing_symbols", lambda s: [])
    monkeypatch.setenv("SGLANG_EXT_DRAFT_KV_CACHE_DTYPE", "fp8_e4m3")
    args = types.SimpleNamespace(speculative_algorithm="EAGLE3", speculative_draft_kv_cache_dtype="bf16")
    release("0.5.17")
    startup.validate(args)  # the field is no SGLang flag there: nothing to contradict
    release("0.5.18")
    with pytest.raises(ConfigError, match="SGLang's own --speculative-draft-kv-cache-dtype bf16"):
        startup.validate(args)


def test_the_draft_depth_per_release(release):
    args = types.SimpleNamespace(speculative_num_steps=3)
    release("0.5.17")
    assert compat.spec_num_steps(args) == 3
    release("0.5.21")  # nothing published in this process: the record, as resolved
    assert compat.spec_num_steps(args) == 3 and compat.spec_num_steps(types.SimpleNamespace()) is None


def test_verify_width_per_release(release):
    backend = types.SimpleNamespace(num_draft_tokens=4, _target_verify_num_tokens_per_req=lambda spec: 2)
    spec = types.SimpleNamespace(draft_token_num=3, num_tokens_per_req=2)
    release("0.5.17")
    assert compat.verify_tokens_per_req(backend, spec) == 3 and compat.verify_tokens_per_req(backend, None) == 4
    release("0.5.21")
    assert compat.verify_tokens_per_req(backend, spec) == 2


def test_pool_terms_per_release(release):
    kvc = types.SimpleNamespace(fused_entry_bytes=lambda name: 4096, draft_attn_tp_size=1)
    configurator = types.SimpleNamespace(_fixed_overhead_bytes=1024)
    release("0.5.21")
    assert compat.fused_draft_entry_bytes(kvc) is None and compat.fixed_pool_overhead_bytes(configurator) == 0
    assert compat.draft_loc_space_scale() == 1
    release("0.5.23")
    assert compat.fused_draft_entry_bytes(kvc) == 4096 and compat.fixed_pool_overhead_bytes(configurator) == 1024
    assert compat.fused_draft_entry_bytes(types.SimpleNamespace(fused_entry_bytes=lambda name: None)) is None
    assert compat.draft_attn_tp_size(kvc) == 1


def test_no_server_args_outside_a_server():
    assert compat.server_args() is None
    assert compat.upstream_draft_kv_cache_dtype() is None


def test_the_resolve_once_startup_check_runs_once_per_record(monkeypatch):
    from sglang_ext.serving import startup

    seen = []
    monkeypatch.setattr(startup, "validate", lambda args, record=None: seen.append(record))
    record = types.SimpleNamespace(model_path="m")
    startup.resolve_once_after(None, record)
    startup.resolve_once_after(None, record)  # resolved again (it returns early), or a child process's copy
    assert seen == [record] and getattr(record, startup.CHECKED) is True  # the raw record beside its resolved view


def test_the_draft_pool_budget_reads_sglangs_draft_kv_dtype_and_leaves_fused_entries_to_sglang(release, monkeypatch):
    """DefaultPoolConfigurator.__init__'s hook (kv_pools): the draft's bytes per token from its own config, in SGLang's
    --speculative-draft-kv-cache-dtype from 0.5.18 (the plugin's variable unset); a draft fused into the target's
    entries (0.5.23) keeps SGLang's own size."""
    import torch
    from sglang.srt.configs import hybrid_arch

    from sglang_ext.config import Eagle3DraftConfig
    from sglang_ext.serving import kv_pools

    draft = Eagle3DraftConfig(head_format="mha", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                              vocab_size=100, target_hidden_size=64, num_key_value_heads=2, head_dim=32)
    monkeypatch.setattr(kv_pools, "server_draft", lambda: (draft, {}))
    monkeypatch.setattr(kv_pools, "_attn_tp_size", lambda kvc=None: 1)  # no process groups here
    monkeypatch.setattr(hybrid_arch, "mambaish_config", lambda model_config: None)
    monkeypatch.delenv("SGLANG_EXT_DRAFT_KV_CACHE_DTYPE", raising=False)
    fused = []
    kvc = types.SimpleNamespace(spec_algorithm=types.SimpleNamespace(is_eagle3=lambda: True), is_draft_worker=False,
                                model_config=None, kv_cache_dtype=torch.bfloat16, draft_attn_tp_size=1,
                                layer_info=types.SimpleNamespace(num_effective_layers=8),
                                fused_entry_bytes=lambda name: fused[0] if fused else None)

    def sized(sglang_draft_dtype=None):
        monkeypatch.setattr(compat, "server_args",
                            lambda: types.SimpleNamespace(speculative_draft_kv_cache_dtype=sglang_draft_dtype))
        pool = types.SimpleNamespace(_cell_size=None, _compute_cell_size=lambda kvc, n: 1000)

        def upstream(self, kvc):
            self._cell_size = 1000 + 125  # "one more target layer"

        kv_pools.pool_configurator_init(upstream, pool, kvc)
        return pool._cell_size

    release("0.5.17")
    assert sized() == 1000 + 2 * 2 * 32 * 2  # K and V of 2 heads x 32, bf16
    release("0.5.18")
    assert sized("fp8_e4m3") == 1000 + 2 * 2 * 32  # SGLang's flag: fp8
    release("0.5.23")
    fused.append(4096)
    assert sized() == 1125  # the draft's KV inside the target's entries: SGLang's size


def test_the_mla_heads_q_proj_goes_on_its_predecessors_ranks_in_the_installed_releases_terms():
    """serving/mla_head.py replaces upstream's q_proj with a twice-as-wide one on the same ranks: the keywords must
    be ones the installed ColumnParallelLinear takes (0.5.23 dropped tp_rank/tp_size for parallel_group; the MLA
    head failed to build there before this lookup), and they must carry the existing layer's placement."""
    import inspect

    from sglang.srt.layers.linear import ColumnParallelLinear

    accepted = inspect.signature(ColumnParallelLinear.__init__).parameters
    like = types.SimpleNamespace(tp_rank=1, tp_size=2, parallel_group="attn_tp")
    kwargs = compat.same_ranks_as(like)
    assert kwargs and set(kwargs) <= set(accepted)
    assert kwargs in ({"tp_rank": 1, "tp_size": 2}, {"parallel_group": "attn_tp"})
    # a layer built without naming a group is upstream's MLA attention-TP one
    if "parallel_group" in accepted:
        assert compat.same_ranks_as(types.SimpleNamespace(parallel_group=None)) == {"parallel_group": "attn_tp"}

