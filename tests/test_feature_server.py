"""Draft-training features from an SGLang feature server (sglang_ext/serving/feature_capture.py) read by
training.features.ServerFeatureExtractor: the server side's writer and the client give the same records as
the in-process extractor. SGLang cannot serve on this CPU, so the server here is a stand-in HTTP endpoint
that runs the transformers target and writes with the plugin's own `write_chunks`, as the plugin does after
each prefill forward (split in two chunks, beside another request, as chunked prefill would)."""

import http.server
import json
import os
import threading

import pytest
import torch

from sglang_ext.core import tiny
from sglang_ext.core.capture import AuxCapture
from sglang_ext.serving import feature_capture as FC
from training import data as D
from training.features import FeatureExtractor, ServerFeatureExtractor, read_request

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
        written = FC.write_chunks(root, ["user-request", rid], [7, start], [3, n],
                                  torch.tensor([1, 2, 3] + ids[start:end]),
                                  [torch.cat([other[0], aux[start:end]])[:, :64], torch.cat([other[0], aux[start:end]])[:, 64:]],
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
    target = root = None
    rids: list = []
    lock = threading.Lock()  # one forward at a time, as a server's batches are (hooks on one model)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/generate" and body["sampling_params"]["max_new_tokens"] == 1
        with self.lock:
            self.rids.append(body["rid"])
            aux, last = target_features(self.target, body["input_ids"])
            write_like_a_prefill(self.root, body["rid"], body["input_ids"], aux, last)
        out = json.dumps({"text": "x", "meta_info": {}}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


def test_server_extractor_gives_the_in_process_records(pair, tmp_path):
    target, tok = pair
    StandIn.target, StandIn.root, StandIn.rids = target, str(tmp_path), []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        convs = conversations() + [D.Conversation("empty", [{"role": "user", "content": "hi"}])]  # nothing to train
        local = FeatureExtractor(target, tok, AUX, dtype=torch.bfloat16).many(convs)
        remote = ServerFeatureExtractor(f"http://127.0.0.1:{srv.server_port}", tok, str(tmp_path), concurrency=3,
                                        aux_width=3 * 64).many(convs)
        assert remote[-1] is None and local[-1] is None and len(StandIn.rids) == 5
        assert all(r.startswith(FC.RID_PREFIX) for r in StandIn.rids) and len(set(StandIn.rids)) == 5
        for a, b in zip(local[:-1], remote[:-1]):
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
            assert torch.equal(a.aux, b.aux) and torch.equal(a.last_hidden, b.last_hidden)
        assert os.listdir(tmp_path) == []  # every request's files read and removed
        with pytest.raises(RuntimeError, match="SGLANG_EXT_EAGLE3_AUX_LAYERS"):  # the trainer expects 4 layers
            ServerFeatureExtractor(f"http://127.0.0.1:{srv.server_port}", tok, str(tmp_path),
                                   aux_width=4 * 64).many(convs[:1])
    finally:
        srv.shutdown()


def test_feature_server_refuses_a_radix_cache_and_turns_capture_on():
    from types import SimpleNamespace

    from sglang_ext.conventions import ConfigError

    calls = []
    model = SimpleNamespace(capture_aux_hidden_states=False, set_eagle3_layers_to_capture=calls.append)
    runner = SimpleNamespace(is_draft_worker=False, model=model, server_args=SimpleNamespace(disable_radix_cache=False))
    with pytest.raises(ConfigError) as e:
        FC.after_load_model(None, runner)
    assert e.value.field == "--disable-radix-cache" and "--disable-radix-cache" in e.value.fix
    runner.server_args.disable_radix_cache = True
    FC.after_load_model(None, runner)
    assert calls == [None]  # SGLang's capture entry point, which our aux_capture hook plans and checks
    draft = SimpleNamespace(is_draft_worker=True, model=model, server_args=runner.server_args)
    FC.after_load_model(None, draft)
    assert calls == [None]  # the draft's runner is left alone


def test_train_draft_needs_the_feature_dir_with_a_server():
    from training.train_draft import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--features-server", "http://x:1"])
    args = parse_args(["--features-server", "http://x:1", "--features-dir", "/shared/features"])
    assert args.features_dir == "/shared/features"


def test_plugin_hooks_the_target_load_only_for_a_feature_server(tmp_path):
    import subprocess
    import sys

    code = ("from sglang.srt.plugins import load_plugins; load_plugins()\n"
            "from sglang.srt.model_executor.model_runner import ModelRunner\n"
            "print('HOOKED', hasattr(ModelRunner.load_model, '__wrapped__'))")
    for value, hooked in (("", "False"), (str(tmp_path), "True")):
        env = dict(os.environ, SGLANG_EXT_FEATURE_DIR=value, SGLANG_PLUGINS="sglang_eagle3_mla")
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert f"HOOKED {hooked}" in p.stdout, p.stderr[-2000:]
