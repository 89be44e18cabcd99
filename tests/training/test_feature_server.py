"""Draft-training features from an SGLang feature server (sglang_ext/serving/feature_capture.py) read by
sglang_ext.training.features.ServerFeatureExtractor: the server side's writer and the client give the same records as
the in-process extractor. SGLang cannot serve on this CPU, so the server here is a stand-in HTTP endpoint
that runs the transformers target and writes with the plugin's own `write_chunks`, as the plugin does after
each prefill forward (split in two chunks, beside another request, as chunked prefill would)."""

import http.server
import json
import os
import threading

import pytest
import torch

from conftest import python_run, stub_server
from sglang_ext.core import tiny
from sglang_ext.core.capture import AuxCapture
from sglang_ext.serving import feature_capture as FC
from sglang_ext.training import data as D
from sglang_ext.training.features import FeatureExtractor, ServerFeatureExtractor, read_request

AUX = [0, 1, 2]


@pytest.fixture(scope="module")
def pair():
    return tiny.build_target(tiny.llama_config(num_layers=3, vocab=400, hidden=64)), tiny.train_tokenizer(400)


def conversations(n=5):
    return [D.Conversation(str(i), [{"role": "user", "content": f"number {i} please"},
                                    {"role": "assistant", "content": f"the answer is {i * 7} apples and {i} more"}])
            for i in range(n)]


@torch.no_grad()
def target_features(target, ids: list[int]):
    cap = AuxCapture(target, AUX)
    try:
        last = target.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        return cap.concat()[0], last
    finally:
        cap.remove()


def write_like_a_prefill(root, rid, ids, aux, last):
    """Two chunks of `rid`, each in a batch with another request (a plain one, not written)."""
    k = len(ids) // 2
    other = torch.randn(3, aux.shape[1]), torch.randn(3, last.shape[1])
    for start, end in ((0, k), (k, len(ids))):
        n = end - start
        rows = torch.cat([other[0], aux[start:end]])
        written = FC.write_chunks(root, ["user-request", rid], [7, start], [3, n],
                                  torch.tensor([1, 2, 3] + ids[start:end]),
                                  [rows[:, :64], rows[:, 64:]],  # as a list of per-layer states, as SGLang may hand it
                                  torch.cat([other[1], last[start:end]]))
        assert written == 1


def test_chunks_round_trip_and_refuse_gaps(pair, tmp_path):
    target, _ = pair
    ids = list(range(5, 25))
    aux, last = target_features(target, ids)
    write_like_a_prefill(str(tmp_path), FC.RID_PREFIX + "a", ids, aux, last)
    assert sorted(os.listdir(tmp_path)) == [FC.RID_PREFIX + "a"]  # the plain request wrote nothing
    got_aux, got_last = read_request(str(tmp_path), FC.RID_PREFIX + "a", ids)
    assert torch.equal(got_aux, aux.to(torch.bfloat16)) and torch.equal(got_last, last.to(torch.bfloat16))
    assert not os.path.exists(tmp_path / (FC.RID_PREFIX + "a"))  # read once, then removed
    # a radix-cache hit: the server computed (and wrote) only the second half
    FC.write_chunks(str(tmp_path), [FC.RID_PREFIX + "b"], [10], [10], torch.tensor(ids[10:]), aux[10:], last[10:])
    with pytest.raises(RuntimeError, match=r"tokens \[0, 0\) of 20.*--disable-radix-cache"):
        read_request(str(tmp_path), FC.RID_PREFIX + "b", ids)
    FC.write_chunks(str(tmp_path), [FC.RID_PREFIX + "c"], [0], [20], torch.tensor(ids[::-1]), aux, last)
    with pytest.raises(RuntimeError, match="other tokens at 0"):
        read_request(str(tmp_path), FC.RID_PREFIX + "c", ids)


class StandIn(http.server.BaseHTTPRequestHandler):
    """SGLang's /generate as a feature server answers it, and /v1/chat/completions (greedy) for regeneration."""
    target = tok = root = None
    rids: list = []
    lock = threading.Lock()  # one forward at a time, as a server's batches are (hooks on one model)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            if self.path == "/v1/chat/completions":
                from sglang_ext.training.chat import prompt_ids

                ids = torch.tensor([prompt_ids(self.tok, body["messages"])])
                gen = self.target.generate(ids, max_new_tokens=body["max_tokens"], do_sample=False,
                                           pad_token_id=self.tok.eos_token_id)
                text = self.tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
                reply = {"choices": [{"message": {"content": text}}]}
            else:
                assert self.path == "/generate" and body["sampling_params"]["max_new_tokens"] == 1
                self.rids.append(body["rid"])
                aux, last = target_features(self.target, body["input_ids"])
                write_like_a_prefill(self.root, body["rid"], body["input_ids"], aux, last)
                reply = {"text": "x", "meta_info": {}}
        out = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


def test_server_extractor_gives_the_in_process_records(pair, tmp_path):
    target, tok = pair
    StandIn.target, StandIn.tok, StandIn.root, StandIn.rids = target, tok, str(tmp_path), []
    with stub_server(StandIn) as url:
        convs = conversations() + [D.Conversation("empty", [{"role": "user", "content": "hi"}])]  # nothing to train
        local = FeatureExtractor(target, tok, AUX, dtype=torch.bfloat16).many(convs)
        remote = ServerFeatureExtractor(url, tok, str(tmp_path), concurrency=3, aux_width=3 * 64).many(convs)
        assert remote[-1] is None and local[-1] is None and len(StandIn.rids) == 5
        assert all(r.startswith(FC.RID_PREFIX) for r in StandIn.rids) and len(set(StandIn.rids)) == 5
        for a, b in zip(local[:-1], remote[:-1]):
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
            assert torch.equal(a.aux, b.aux) and torch.equal(a.last_hidden, b.last_hidden)
        assert os.listdir(tmp_path) == []  # every request's files read and removed
        with pytest.raises(RuntimeError, match="SGLANG_EXT_EAGLE3_AUX_LAYERS"):  # the trainer expects 4 layers
            ServerFeatureExtractor(url, tok, str(tmp_path), aux_width=4 * 64).many(convs[:1])


def test_feature_server_refuses_a_radix_cache_and_turns_capture_on(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from sglang_ext.config import AuxLayerPlan
    from sglang_ext.errors import ConfigError

    calls = []
    monkeypatch.setenv("SGLANG_EXT_FEATURE_DIR", str(tmp_path))

    def set_layers(ids):  # what our aux_capture hook leaves on a DeepseekV3 / Llama target
        calls.append(ids)
        model._sglang_ext_aux_plan = AuxLayerPlan((1, 3, 4), "default", "output", None)

    model = SimpleNamespace(capture_aux_hidden_states=False, set_eagle3_layers_to_capture=set_layers)
    runner = SimpleNamespace(is_draft_worker=False, model=model, server_args=SimpleNamespace(disable_radix_cache=False))
    with pytest.raises(ConfigError) as e:
        FC.after_load_model(None, runner)
    assert e.value.field == "--disable-radix-cache" and "--disable-radix-cache" in e.value.fix
    runner.server_args.disable_radix_cache = True
    FC.after_load_model(None, runner)
    assert calls == [None]  # SGLang's capture entry point, which our aux_capture hook plans and checks
    # the layers it captures are recorded for the trainer, which refuses features of other layers
    assert json.load(open(tmp_path / FC.PLAN_FILE))["output_ids"] == [1, 3, 4]
    draft = SimpleNamespace(is_draft_worker=True, model=model, server_args=runner.server_args)
    FC.after_load_model(None, draft)
    assert calls == [None]  # the draft's runner is left alone
    other = SimpleNamespace(capture_aux_hidden_states=False, set_eagle3_layers_to_capture=lambda ids: None)
    with pytest.raises(ConfigError, match="not SimpleNamespace"):  # a family our capture does not cover
        FC.after_load_model(None, SimpleNamespace(is_draft_worker=False, model=other, server_args=runner.server_args))


def test_train_draft_needs_the_feature_dir_with_a_server():
    from sglang_ext.training.train_draft import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--features-server", "http://x:1"])
    args = parse_args(["--features-server", "http://x:1", "--features-dir", "/shared/features"])
    assert args.features_dir == "/shared/features"


@pytest.mark.slow  # a fresh interpreter, SmolLM2 or an end-to-end run: `make test`, not `make test-fast`
def test_plugin_hooks_the_target_load_only_for_a_feature_server(tmp_path):
    code = ("from sglang.srt.plugins import load_plugins; load_plugins()\n"
            "from sglang.srt.model_executor.model_runner import ModelRunner\n"
            "print('HOOKED', hasattr(ModelRunner.load_model, '__wrapped__'))")
    for value, hooked in (("", "False"), (str(tmp_path), "True")):
        env = dict(os.environ, SGLANG_EXT_FEATURE_DIR=value, SGLANG_PLUGINS="sglang_eagle3_mla")
        p = python_run(["-c", code], env=env, timeout=300)
        assert f"HOOKED {hooked}" in p.stdout, p.stderr[-2000:]


@pytest.mark.slow  # a fresh interpreter, SmolLM2 or an end-to-end run: `make test`, not `make test-fast`
@pytest.mark.parametrize("fmt", ["mla", "mha"])
def test_train_draft_with_only_the_target_weights_it_needs(tmp_path, capsys, fmt):
    """A target too large for this process: its servers regenerate and capture, the trainer reads the embedding,
    lm_head, final norm and one layer's attention from its safetensors, and exports a head. An MLA head starts
    from that layer whole; an MHA head takes its MLP and norms, and its attention is fitted to the layer's."""
    from safetensors.torch import load_file

    from sglang_ext.training.train_draft import main, parse_args

    cfg = tiny.deepseek_v3_config(num_layers=8, moe_layers=1, hidden=64, heads=4, vocab=300, q_lora_rank=32,
                                  kv_lora_rank=32, qk_nope=16, qk_rope=8, v_head=16, n_routed_experts=4)
    full = tiny.build_target(cfg, seed=0)  # aux layers [1, 3, 4]; the head starts from layer 5 (dense)
    tok = tiny.train_tokenizer(300)
    target_dir = tiny.save_target(full, tok, str(tmp_path / "target"))
    full = tiny.build_target(cfg, seed=0).to(torch.bfloat16).float()  # what the server computes from
    with pytest.raises(SystemExit):
        parse_args(["--target", target_dir, "--target-weights-only", "--features-server", "http://x:1",
                    "--features-dir", "/x"])  # and regeneration?
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"count to {i}"},
                                                     {"role": "assistant", "content": "x"}]}) + "\n"
                            for i in range(12)))
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(json.dumps({"question": "one plus one?", "answer": "#### 2"}) + "\n")
    feats = tmp_path / "features"
    feats.mkdir()
    StandIn.target, StandIn.tok, StandIn.root, StandIn.rids = full, tok, str(feats), []
    with stub_server(StandIn) as url:
        rc = main(["--target", target_dir, "--target-weights-only", "--regen-server", url, "--features-server", url,
                   "--features-dir", str(feats), "--data", f"messages:{data}", "--draft-format", fmt,
                   "--work", str(tmp_path / "work"), "--out", str(tmp_path / "head"), "--eval-dataset-path", str(gsm),
                   "--eval-num-prompts", "1", "--max-new-tokens", "8", "--epochs", "1", "--draft-vocab-size", "128",
                   "--ttt-steps", "2", "--aux-layers", "1,3,4", "--device", "cpu"])
    assert rc == 0 and len(StandIn.rids) == 12
    report = json.load(open(tmp_path / "head" / "training_report.json"))
    assert report["acceptance"]["trained"] is None and report["train_conversations"] > 0
    out = capsys.readouterr().out
    assert "target weights read: 15 tensors" in out  # embedding, lm_head, norm, layer 5's attention, MLP, norms
    if fmt == "mla":
        assert ("self_attn, mlp, input_layernorm, hidden_norm, post_attention_layernorm initialised from target "
                "layer 5") in out
        assert report["attention_fit"] == {}
    else:
        assert "mlp, input_layernorm, hidden_norm, post_attention_layernorm initialised from target layer 5" in out
        fit = report["attention_fit"]
        assert fit["steps"] == 300 and fit["layer"] == 5 and fit["relative_error_end"] < fit["relative_error_start"]
        assert "attention fitted to target layer 5's attention block (300 steps" in out
    assert "fc.weight" in load_file(str(tmp_path / "head" / "model.safetensors"))


def test_target_weights_are_the_checkpoints_and_the_rest_stays_on_meta(tmp_path):
    from sglang_ext.core.targets import load_target, load_target_weights

    cfg = tiny.deepseek_v3_config(num_layers=4, moe_layers=1, hidden=64, heads=4, vocab=300, q_lora_rank=32,
                                  kv_lora_rank=32, qk_nope=16, qk_rope=8, v_head=16, n_routed_experts=4)
    d = tiny.save_target(tiny.build_target(cfg, seed=0), tiny.train_tokenizer(300), str(tmp_path / "t"))
    part, full = load_target_weights(d, layer=-1), load_target(d)
    loaded = part._sglang_ext_weights_only
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
            "model.layers.3.self_attn.kv_b_proj.weight"} <= set(loaded)
    assert not any(".mlp." in n for n in loaded)  # layer 3 is MoE: its experts are never read
    for name in loaded:
        assert torch.equal(part.get_parameter(name), full.get_parameter(name)), name
    assert part.get_parameter("model.layers.0.self_attn.kv_b_proj.weight").is_meta


def test_fp8_blocks_dequantize_as_deepseek_stores_them():
    from sglang_ext.core.targets import dequantize_fp8_blocks

    w = torch.randn(200, 300)
    scale = torch.rand(2, 3) + 0.5  # one per 128 x 128 block (ragged at the edges)
    blocks = scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    q = (w / blocks).to(torch.float8_e4m3fn)
    back = dequantize_fp8_blocks(q, scale)
    assert ((back - w).abs() <= 0.07 * w.abs() + 1e-2).all()  # e4m3: 3 mantissa bits


def test_a_feature_server_serves_the_target_alone():
    from types import SimpleNamespace

    from sglang_ext.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        FC.check_server(SimpleNamespace(speculative_algorithm="EAGLE3", disable_radix_cache=True))
    assert e.value.field == "--speculative-algorithm" and "without speculative decoding" in e.value.fix


def test_the_forward_wrapper_writes_each_prefill_once_even_when_the_layers_are_set_again(tmp_path, monkeypatch):
    """SGLang may set the capture layers more than once: the target's forward is wrapped once, not twice."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from sglang_ext.serving import aux_capture

    class Inner(torch.nn.Module):
        norm = torch.nn.Identity()

        def forward(self, input_ids, positions, forward_batch):
            h = torch.randn(len(input_ids), 8)
            return h, [h + 1, h + 2]

    written = []
    monkeypatch.setattr(FC, "write_chunks", lambda *a: written.append(a[1]) or 1)
    monkeypatch.setattr("sglang_ext.serving.acceptance.is_reporting_rank", lambda: True)
    inner = Inner()
    for _ in range(2):
        aux_capture._wrap_forward(inner, False, None, "deepseek", str(tmp_path))
    batch = SimpleNamespace(forward_mode=ForwardMode.EXTEND, rids=[FC.RID_PREFIX + "x"], extend_prefix_lens_cpu=[0],
                            extend_seq_lens_cpu=[5])
    inner.forward(torch.arange(5), torch.arange(5), batch)
    assert written == [[FC.RID_PREFIX + "x"]]
    inner.forward(torch.arange(5), torch.arange(5), SimpleNamespace(forward_mode=ForwardMode.DECODE, rids=batch.rids))
    assert len(written) == 1  # decode steps write nothing
