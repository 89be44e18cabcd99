"""Run by tests/serving/test_draft_prefill.py: the installed SGLang's own Eagle3 head (LlamaForCausalLMEagle3, one or
two decoder layers) over a draft-prefill batch on the CPU, through its real layers, RadixAttention and SGLang's
torch-native attention backend with real pools (MHATokenToKVPool, ReqToTokenPool): upstream's forward against the
same forward with the plugin's last-rows path (sglang_ext.serving.draft_prefill, installed by its real hook on a
draft worker whose eager runner runs the model as SGLang's does: attention metadata, then ``model.forward``).

Three requests extend 7, 4 and 9 tokens after prefixes of 0, 5 and 3 cached tokens. The only stand-in is the
rotary kernel's import (vLLM's, which SGLang's RotaryEmbedding imports off CUDA and never calls here: its torch
path runs). Prints JSON."""

import dataclasses
import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
_ops = types.ModuleType("vllm._custom_ops")
_ops.rotary_embedding = None
sys.modules.setdefault("vllm", types.ModuleType("vllm"))._custom_ops = _ops
sys.modules.setdefault("vllm._custom_ops", _ops)

import torch  # noqa: E402
from sglang.srt import runtime_context  # noqa: E402
from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel  # noqa: E402
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode  # noqa: E402
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.speculative.eagle_info import EagleDraftExtendInput  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

from sglang_ext.serving import draft_prefill  # noqa: E402

if dataclasses.is_dataclass(ServerArgs):  # 0.5.17: the defaults, without __post_init__ (it resolves a model path)
    args = ServerArgs.__new__(ServerArgs)
    for f in dataclasses.fields(ServerArgs):
        if f.default is not dataclasses.MISSING:
            setattr(args, f.name, f.default)
        elif f.default_factory is not dataclasses.MISSING:
            setattr(args, f.name, f.default_factory())
    args.model_path, args.device = "eagle3-head", "cpu"
else:  # later releases resolve only when asked
    args = ServerArgs(model_path="dummy", device="cpu")  # "dummy": resolution without a checkpoint
if dataclasses.is_dataclass(ServerArgs):
    runtime_context.publish(args, role="draft")
else:  # and the launcher's placement of this one process
    runtime_context.publish(args, role="draft", ranks=runtime_context.SpawnRanks(world_rank=0))
init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                             distributed_init_method=f"tcp://127.0.0.1:{29500 + os.getpid() % 500}")
if dataclasses.is_dataclass(ServerArgs):
    initialize_model_parallel(1)
else:  # the widths come from the published context (one rank)
    initialize_model_parallel()
from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3  # noqa: E402

HIDDEN, TARGET_HIDDEN, KV_HEADS, HEAD_DIM = 64, 48, 2, 16
PREFIX, EXTEND = [0, 5, 3], [7, 4, 9]
T, BS = sum(EXTEND), len(EXTEND)


def head(layers: int) -> LlamaForCausalLMEagle3:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=4, num_key_value_heads=KV_HEADS,
                      num_hidden_layers=layers, vocab_size=100, max_position_embeddings=256, rms_norm_eps=1e-6)
    cfg.draft_vocab_size, cfg.target_hidden_size = 100, TARGET_HIDDEN
    model = LlamaForCausalLMEagle3(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.2)
    for m in model.modules():
        if hasattr(m, "use_fallback_kernel"):
            m.use_fallback_kernel = False  # RotaryEmbedding's torch path (the fallback is a CUDA/vLLM kernel)
    return model


class Runner:
    """A draft model runner's parts the forward reads: its pools, its attention backend and its eager runner."""

    def __init__(self, model, layers: int):
        self.model, self.device = model, "cpu"
        self.req_to_token_pool = ReqToTokenPool(8, 64, "cpu", False)
        self.token_to_kv_pool = MHATokenToKVPool(200, 1, torch.float32, KV_HEADS, HEAD_DIM, layers, "cpu", False)
        self.attn_backend = TorchNativeAttnBackend(self)
        self.eager_runner = types.SimpleNamespace(execute=self.execute)

    def execute(self, forward_batch):
        """What SGLang's eager runner does for an extend batch: attention metadata, then the model's forward (the
        model body: the logits step needs a sampling context this harness does not build)."""
        self.attn_backend.init_forward_metadata(forward_batch)
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=self.attn_backend)):
            return self.model.model(forward_batch.input_ids, forward_batch.positions, forward_batch)


def batch(runner: Runner, **overrides) -> ForwardBatch:
    torch.manual_seed(1)
    r2t = runner.req_to_token_pool.req_to_token
    req = torch.tensor([1, 2, 3])
    seq = torch.tensor(PREFIX) + torch.tensor(EXTEND)
    slots = torch.randperm(199) + 1
    used = 0
    for i, r in enumerate(req.tolist()):
        r2t[r, : int(seq[i])] = slots[used: used + int(seq[i])].to(r2t.dtype)
        used += int(seq[i])
    fields = dict(
        forward_mode=ForwardMode.EXTEND, batch_size=BS, input_ids=torch.randint(0, 100, (T,)), req_pool_indices=req,
        seq_lens=seq, seq_lens_sum=int(seq.sum()), extend_num_tokens=T,
        out_cache_loc=torch.cat([r2t[r, PREFIX[i]: int(seq[i])].long() for i, r in enumerate(req.tolist())]),
        positions=torch.cat([torch.arange(PREFIX[i], int(seq[i])) for i in range(BS)]),
        extend_seq_lens=torch.tensor(EXTEND), extend_prefix_lens=torch.tensor(PREFIX),
        extend_start_loc=torch.tensor([0, EXTEND[0], EXTEND[0] + EXTEND[1]]),
        spec_info=EagleDraftExtendInput(hidden_states=torch.randn(T, 3 * TARGET_HIDDEN), num_tokens_per_req=1,
                                        num_tokens_for_logprob_per_req=1),
        capture_hidden_mode=CaptureHiddenMode.LAST)
    fields.update(overrides)
    return ForwardBatch(**fields)


def kv(runner: Runner, fb: ForwardBatch) -> torch.Tensor:
    pool = runner.token_to_kv_pool
    return torch.stack([torch.cat([pool.k_buffer[i][fb.out_cache_loc], pool.v_buffer[i][fb.out_cache_loc]])
                        for i in range(len(pool.k_buffer))])


def run(layers: int, **overrides) -> dict:
    """Upstream's forward, then the same batch through the plugin's hook (a fresh pool each)."""
    upstream = Runner(head(layers), layers)
    fb = batch(upstream, **overrides)
    ref_hidden, ref_aux = upstream.execute(fb)
    ref_kv = kv(upstream, fb)

    ours = Runner(head(layers), layers)
    fb2 = batch(ours, **overrides)
    worker = types.SimpleNamespace(draft_runner=ours)
    mlp_rows = []
    for layer in ours.model.model.layers:
        layer.mlp.down_proj.register_forward_hook(lambda m, inp, out, i=len(mlp_rows): mlp_rows[i].append(len(inp[0])))
        mlp_rows.append([])
    hidden, aux = draft_prefill.draft_extend_for_prefill(lambda w, b: w.draft_runner.eager_runner.execute(b),
                                                         worker, fb2)
    state = getattr(worker, draft_prefill.STATE)
    same = draft_prefill.install(worker) is state
    ours.eager_runner = types.SimpleNamespace(execute=ours.execute)  # as SGLang rebuilding its eager runner
    rewrapped = draft_prefill.install(worker) is not state
    last = (fb2.extend_start_loc + fb2.extend_seq_lens - 1).long()
    rest = torch.ones(T, dtype=torch.bool)
    rest[last] = False
    return dict(
        kv_max_diff=float((kv(ours, fb2) - ref_kv).abs().max()),
        kv_norm=float(ref_kv.norm()),
        last_hidden_max_diff=float((hidden[last] - ref_hidden[last]).abs().max()),
        last_aux_max_diff=float((aux[0][last] - ref_aux[0][last]).abs().max()),
        last_hidden_norm=float(ref_hidden[last].norm()),
        other_rows_differ=not torch.allclose(hidden[rest], ref_hidden[rest]),
        mlp_rows_per_layer=[r[0] for r in mlp_rows],
        installed=state is not None,
        kept_then_rewrapped=same and rewrapped,
        rows_after=state.rows is None,
    )


def selected(**overrides):
    """What LastRows.select gives for a batch (armed as inside the draft's prefill)."""
    state = draft_prefill.LastRows()
    state.armed = True
    rows = state.select(batch(Runner(head(1), 1), **overrides))
    return None if rows is None else rows.tolist()


def mla_head_layer() -> bool:
    """The plugin's MLA-format head class (upstream's Eagle3DeepseekV2ForCausalLM): the path finds its one layer.
    Its forward is not run here: SGLang's MLA attention has no CPU backend to dispatch to."""
    from transformers import DeepseekV3Config

    from sglang_ext.serving.mla_head import Eagle3MLAHeadForCausalLM

    cfg = DeepseekV3Config(hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                           q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                           vocab_size=100, num_hidden_layers=1, max_position_embeddings=256, first_k_dense_replace=1)
    # the one rope SGLang builds for an MLA layer on the CPU
    cfg.rope_scaling = {"rope_type": "deepseek_yarn", "factor": 1.0, "original_max_position_embeddings": 256}
    cfg.architectures, cfg.target_hidden_size, cfg.draft_vocab_size = ["Eagle3DeepseekV2ForCausalLM"], 48, 100
    model = Eagle3MLAHeadForCausalLM(cfg)
    return draft_prefill.last_layer(model) is model.model.midlayer


out = dict(
    one_layer=run(1),
    two_layers=run(2),
    selection=dict(
        prefill=selected(),
        full_capture=selected(capture_hidden_mode=CaptureHiddenMode.FULL),
        logprob=selected(return_logprob=True),
        dp_attention=selected(global_num_tokens_cpu=[T]),
        target_verify=selected(forward_mode=ForwardMode.TARGET_VERIFY),
        one_token_each=selected(input_ids=torch.zeros(BS, dtype=torch.int64), extend_seq_lens=torch.ones(BS),
                                extend_start_loc=torch.arange(BS)),
    ),
    not_armed=draft_prefill.LastRows().select(batch(Runner(head(1), 1))) is None,
    other_model=draft_prefill.last_layer(torch.nn.Linear(2, 2)) is None,
    mla_head_layer=mla_head_layer(),
)
print(json.dumps(out))
