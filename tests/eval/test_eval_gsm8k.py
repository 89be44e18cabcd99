"""GSM8K evaluation: answer extraction, chat rendering, McNemar, reports, bad input, and an
end-to-end run of the reference backend on a tiny model."""

import json
import os

import pytest
import torch

from conftest import GSM8K_TEST, stub_server
from sglang_ext.eval import gsm8k as G


@pytest.mark.parametrize("text,strict,flexible", [
    ("so she makes 9 * 2 = $18 every day.\n#### 18", "18", "18"),
    ("#### 1,234", "1234", "1234"),
    ("The answer is #### $1,000.50", "1000.5", "1000.5"),
    ("It drops by 5 degrees, so #### -5", "-5", "-5"),
    ("#### 18.00", "18", "18"),
    ("Total: 3.5 hours, then 7 more. The answer is 10.", None, "10"),
    ("I don't know.", None, None),
    ("He pays $45.", None, "45"),
    ("version 1.2.3", None, "1.2"),  # not "1.2" then ".3"
    ("pages 1,2,3", None, "3"),  # a list, not 123
    ("so...5", None, "5"),
    ("he paid $.75", None, "0.75"),
    ("#### -$5", "-5", "-5"),
    ("#### 12345678901234567", "12345678901234567", "12345678901234567"),  # no float rounding
])
def test_answer_extraction(text, strict, flexible):
    assert G.extract_strict(text) == strict
    assert G.extract_flexible(text) == flexible


def test_fewshot_chat_rendering_for_chatml():
    from sglang_ext.core import tiny

    tok = tiny.train_tokenizer(300)
    shots = [{"question": "1+1?", "answer": "1+1=2\n#### 2"}, {"question": "2+3?", "answer": "#### 5"}]
    text = G.render_prompt(tok, G.fewshot_messages(shots, "4+4?"))
    assert text == ("<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n1+1=2\n#### 2<|im_end|>\n"
                    "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n#### 5<|im_end|>\n"
                    "<|im_start|>user\n4+4?<|im_end|>\n<|im_start|>assistant\n")
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat_template"):
        G.render_prompt(tok, [{"role": "user", "content": "x"}])


def test_mcnemar_known_table():
    # 10 pairs only the first arm got right, 2 only the second: exact two-sided p = 0.0386
    a = [True] * 10 + [False] * 2 + [True] * 5
    b = [False] * 10 + [True] * 2 + [True] * 5
    r = G.mcnemar(a, b)
    assert (r["only_first_correct"], r["only_second_correct"]) == (10, 2)
    assert r["p_value"] == pytest.approx(0.03857, abs=1e-4)
    assert G.mcnemar([True, False], [True, False])["p_value"] == 1.0


def test_accuracy_stderr():
    r = G.accuracy([True, False, True, True])
    assert r["accuracy"] == 0.75 and r["stderr"] == pytest.approx((0.75 * 0.25 / 4) ** 0.5)


def test_server_meta_without_speculation_is_reported_not_zero():
    results = [{"text": "#### 3", "completion_tokens": 5, "spec": G.spec_from_meta({"completion_tokens": 5})}]
    s = G.score([{"question": "q", "answer": "#### 3"}], results, 1.0, None, want_spec=True)
    assert s["acceptance"] is None and "no speculative" in s["acceptance_note"]
    spec = G.spec_from_meta({"spec_verify_ct": 4, "spec_correct_drafts_histogram": [1, 1, 0, 2]})
    assert spec == {"verify_steps": 4, "accepted_drafts": 7, "histogram_counts": [1, 1, 0, 2]}
    acc = G.acceptance([{"spec": spec}], None)
    assert acc["accepted_drafts_per_step"] == 1.75 and acc["per_position_acceptance"] == [0.75, 0.5, 0.5]


def test_unreachable_server_gives_a_clear_error():
    backend = G.ServerBackend("http://127.0.0.1:9", tokenizer=None, retries=1)
    with pytest.raises(ConnectionError, match="cannot reach http://127.0.0.1:9/generate after 2 attempts"):
        backend._post({"text": "x"})


def test_malformed_data_lines_are_skipped_and_counted(tmp_path):
    p = tmp_path / "g.jsonl"
    p.write_text('{"question": "a?", "answer": "#### 1"}\nnot json\n{"question": 3}\n\n'
                 '{"question": "b?", "answer": "#### 2"}\n')
    rows, bad = G.load_gsm8k(str(p), "test", None)
    assert [r["question"] for r in rows] == ["a?", "b?"] and bad == 2


def test_reference_backend_end_to_end_on_a_tiny_model(tmp_path):
    from sglang_ext.core import tiny

    cfg = tiny.llama_config(num_layers=2, vocab=300)
    t = tiny.build_target(cfg)
    tok = tiny.train_tokenizer(300)
    tiny.save_target(t, tok, str(tmp_path / "target"), dtype=torch.float32)
    tiny.random_head(tiny.head_config_for(cfg, "mha", [0, 1]), t).save_pretrained(str(tmp_path / "draft"))
    out = tmp_path / "report"
    data = GSM8K_TEST
    if not os.path.exists(data):  # outside the workplace layout: five rows of the same shape
        data = str(tmp_path / "gsm8k.jsonl")
        with open(data, "w") as f:
            for i in range(5):
                f.write(json.dumps({"question": f"What is {i} plus {i}?", "answer": f"{i}+{i}={2 * i}\n#### {2 * i}"})
                        + "\n")
    rc = G.main(["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--dataset-path", data,
                 "--fewshot-path", data, "--num-prompts", "5", "--num-shots", "1", "--max-new-tokens", "12",
                 "--compare", "--out", str(out)])
    assert rc == 0
    assert sorted(os.listdir(out)) == ["acceptance.png", "report.json", "report.md"]
    r = json.load(open(out / "report.json"))
    assert r["questions"] == 5 and set(r["arms"]) == {"spec", "no-spec"}
    spec, plain = r["arms"]["spec"], r["arms"]["no-spec"]
    assert spec["acceptance"]["verify_steps"] > 0 and plain["acceptance"] is None
    assert spec["acceptance"]["standard_error"] >= 0  # across the 5 questions (docs/metrics.md, "Noise")
    # greedy speculation is lossless: the same answers, so McNemar sees no discordant pair
    assert r["compare"]["mcnemar_strict"]["only_first_correct"] == r["compare"]["mcnemar_strict"]["only_second_correct"] == 0
    assert [s["output"] for s in r["samples"]["spec"]] == [s["output"] for s in r["samples"]["no-spec"]]
    # per-question records: what a server run of the same target is compared against
    agree = G.agreement(r["per_question"]["spec"], r["per_question"]["no-spec"][:3])
    assert agree["questions"] == 3 and agree["identical_outputs"] == 3 and agree["same_answer"] == 3
    changed = [dict(q, output_sha1="0", answer="x", strict=not q["strict"]) for q in r["per_question"]["no-spec"]]
    other = G.agreement(r["per_question"]["spec"], changed)
    assert other["identical_outputs"] == 0 and other["mcnemar_strict"]["only_first_correct"] + \
        other["mcnemar_strict"]["only_second_correct"] == 5
    assert "accepted drafts / step" in (out / "report.md").read_text()


def test_bench_stream_parsing_and_summary():
    from sglang_ext.eval import bench

    lines = [b"data: " + json.dumps({"text": "a", "meta_info": {"completion_tokens": 1}}).encode() + b"\n", b"\n",
             b"data: " + json.dumps({"text": "ab", "meta_info": {"completion_tokens": 2, "spec_verify_ct": 1,
                                                                  "spec_correct_drafts_histogram": [0, 1]}}).encode(),
             b"data: [DONE]", b"data: {\"never\": 1}"]
    evs = list(bench.sse_events(lines))
    assert [e["text"] for e in evs] == ["a", "ab"]
    s = bench.summarize([{"ttft": 0.1, "tpot": 0.01, "completion_tokens": 10, "latency": 0.2,
                          "spec": {"verify_steps": 4, "accepted_drafts": 6, "histogram_counts": None}}], 2.0)
    assert s["output_tokens_per_s"] == 5.0 and s["accepted_drafts_per_step"] == 1.5


def test_bench_p99_is_nearest_rank_and_requests_are_kept_in_order():
    """p99 of 4 first-token times is the slowest one (the old index gave the 3rd of 4: a 400 ms first request
    hid behind a 31 ms "p99"), and each request's start, first token and end are kept, from the first start, whose
    wall-clock time is kept too (to read the requests beside a server log's timestamps)."""
    import time

    from sglang_ext.eval import bench

    t0 = time.perf_counter() - 5.0  # the first request started 5 s ago
    rows = [{"start": t0 + i * 0.5, "ttft": t, "latency": 1.0, "tpot": 0.01, "completion_tokens": 5, "spec": None}
            for i, t in enumerate([0.4, 0.03, 0.031, 0.029])]
    s = bench.summarize(rows, 3.0)
    assert abs(s["start_unix"] - (time.time() - 5.0)) < 0.5
    assert bench.summarize([{"error": "HTTPError"}], 1.0)["start_unix"] is None
    assert s["ttft_p99_s"] == 0.4
    assert s["per_request_ms"][0] == [0.0, 400.0, 1000.0] and s["per_request_ms"][3] == [1500.0, 1529.0, 2500.0]
    assert bench.percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and bench.percentile([5.0], 0.99) == 5.0


def test_truncated_server_histogram_uses_the_server_depth():
    # SGLang reported [7] for 7 verify steps with no accepted draft at --speculative-num-steps 3
    spec = G.spec_from_meta({"spec_verify_ct": 7, "spec_correct_drafts_histogram": [7]})
    acc = G.acceptance([{"spec": spec}], 3)
    assert acc["per_position_acceptance"] == [0.0, 0.0, 0.0] and acc["histogram_counts"] == [7, 0, 0, 0]


@pytest.mark.parametrize("argv,text", [
    (["--num-prompts", "0"], "--num-prompts 0"),
    (["--speculative-num-steps", "-1"], "--speculative-num-steps -1"),
    (["--dataset-path", "/nonexistent/test.jsonl"], "no such file"),
    (["--draft", "/nonexistent/head"], "no exported head there"),
    (["--base-url", "http://127.0.0.1:9", "--compare"], "--nospec-base-url"),
])
def test_bad_command_lines_are_refused_before_any_model_loads(argv, text, capsys):
    from sglang_ext.eval import gsm8k as G

    with pytest.raises(SystemExit) as e:
        G.main(argv)
    assert e.value.code == 2 and text in capsys.readouterr().err


def test_an_unreachable_server_is_an_error_not_a_traceback(capsys, tmp_path):
    from sglang_ext.eval import gsm8k as G

    data = tmp_path / "test.jsonl"  # a local split: a clean clone has no ../shared data (and no network)
    data.write_text(json.dumps({"question": "What is 1 + 1?", "answer": "#### 2"}) + "\n")
    argv = ["--base-url", "http://127.0.0.1:9", "--num-prompts", "1", "--dataset-path", str(data), "--num-shots", "0"]
    assert G.main(argv) == 2  # nothing listens on port 9
    assert "cannot ask http://127.0.0.1:9" in capsys.readouterr().err


def test_acceptance_is_never_cut_to_the_depth_nor_invented():
    """A histogram with more bins than the server's depth (an adaptive server) is read whole; a request without its
    accepted-draft count is left out and counted, not read as zero drafts; one question has no standard error
    (null in the report, which stays strict JSON)."""
    deeper = G.spec_from_meta({"spec_verify_ct": 10, "spec_correct_drafts_histogram": [2, 2, 2, 2, 2]})
    acc = G.acceptance([{"spec": deeper}], 3)
    assert (acc["verify_steps"], acc["accepted_drafts"], acc["accepted_drafts_per_step"]) == (10, 20, 2.0)
    unknown = {"verify_steps": 5, "accepted_drafts": None, "histogram_counts": None}
    known = {"verify_steps": 3, "accepted_drafts": 6, "histogram_counts": None}
    acc = G.acceptance([{"spec": unknown}, {"spec": known}], 3)
    assert acc["accepted_drafts_per_step"] == 2.0 and acc["requests_without_draft_counts"] == 1
    assert acc["standard_error"] is None
    guessed = G.acceptance([{"spec": {"verify_steps": 4, "accepted_drafts": 4, "histogram_counts": [1, 1, 2]}}], None)
    assert "draft_acceptance_rate" not in guessed and guessed["depth"] is None


def test_report_recounts_from_its_questions(tmp_path):
    rows = [{"question": "q1", "answer": "#### 3"}, {"question": "q2", "answer": "#### 4"}]
    results = [{"text": "#### 3", "completion_tokens": 5,
                "spec": {"verify_steps": 2, "accepted_drafts": 2, "histogram_counts": [1, 0, 1, 0]}},
               {"text": "#### 5", "completion_tokens": 7,
                "spec": {"verify_steps": 3, "accepted_drafts": 4, "histogram_counts": [1, 1, 0, 1]}}]
    per_q = G.per_question(rows, results)
    arm = G.score(rows, results, 1.0, 3, want_spec=True)["acceptance"]
    assert sum(q["accepted_drafts"] for q in per_q) / sum(q["verify_steps"] for q in per_q) == \
        arm["accepted_drafts_per_step"] == 1.2
    from sglang_ext.core.accounting import accepted_drafts_per_step_se

    assert arm["standard_error"] == accepted_drafts_per_step_se([2, 4], [2, 3])


def test_bench_keeps_failed_requests_out_of_the_figures_and_says_so():
    from sglang_ext.eval import bench

    ok = {"start": 0.0, "ttft": 0.1, "latency": 1.1, "completion_tokens": 11, "tpot": 0.1,
          "spec": {"verify_steps": 5, "accepted_drafts": 5, "histogram_counts": None}}
    one_token = dict(ok, completion_tokens=1, tpot=None, spec={"verify_steps": 1, "accepted_drafts": None,
                                                                  "histogram_counts": None})
    s = bench.summarize([ok, one_token, {"error": "HTTPError: HTTP Error 500"}], 2.0)
    assert s["requests"] == 2 and s["failed_requests"] == 1 and "500" in s["errors"][0]
    assert s["tpot_mean_s"] == 0.1 and s["accepted_drafts_per_step"] == 1.0
    assert bench.one_request("http://127.0.0.1:9", "x", 4, timeout=2)["error"]  # refused: recorded, not raised


def test_a_server_that_refuses_a_request_is_not_retried_and_its_message_kept():
    import http.server

    from sglang_ext.http_client import ServerRefused, post_json

    calls = []

    class Refuse(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            calls.append(1)
            body = b'{"error": "input is longer than the context length"}'
            self.send_response(400)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    with stub_server(Refuse) as url, pytest.raises(ServerRefused, match="HTTP 400.*longer than the context"):
        post_json(f"{url}/v1/chat/completions", {}, retries=3)
    assert len(calls) == 1


def test_clients_send_the_api_key_of_a_server_started_with_one(monkeypatch):
    """A server started with --api-key answers 401 without the bearer token: every client sends --api-key (default
    $OPENAI_API_KEY), and a missing key is named in the error; the key is not written to reports."""
    import http.server

    from sglang_ext.eval.gsm8k import ServerBackend, parse_args
    from sglang_ext.http_client import ServerRefused, get_json, post_json, redacted

    class Keyed(http.server.BaseHTTPRequestHandler):
        def _answer(self):
            ok = self.headers.get("Authorization") == "Bearer sk-test"
            body = json.dumps({"model_path": "m", "text": "x", "meta_info": {}} if ok else {"error": "bad key"}).encode()
            self.send_response(200 if ok else 401)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *a):
            pass

    with stub_server(Keyed) as url:
        assert get_json(f"{url}/get_model_info", api_key="sk-test")["model_path"] == "m"
        assert ServerBackend(url, None, api_key="sk-test")._post({"text": "q"})["text"] == "x"
        with pytest.raises(ServerRefused, match="HTTP 401.*pass --api-key or set OPENAI_API_KEY"):
            post_json(f"{url}/generate", {})
        with pytest.raises(ServerRefused, match="did not accept the API key"):
            get_json(f"{url}/get_model_info", api_key="wrong")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    served = ["--base-url", "http://127.0.0.1:9", "--tokenizer", "t"]
    assert parse_args(served).api_key == "sk-env" and parse_args([*served, "--api-key", "k"]).api_key == "k"
    assert redacted({"api_key": "k", "lr": 1})["api_key"] == "<given>"
