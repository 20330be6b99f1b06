"""``tpspec bench serve``: its arrival times (Poisson, gamma, fixed seed), the definitions of its
metrics on synthetic streams, its datasets, and whole runs against ``tpspec serve tiny`` (TP=1,
CPU, loopback) that write every metric for both datasets, a finite rate and inf, a
concurrency cap, text and token-id prompts, completions and chat — without importing torch."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tpspec.bench.serve import RequestResult, StreamTimer, arrival_times, compute_metrics, peak_concurrency
from tpspec.bench.serve_datasets import PromptMaker, load_tokenizer, prefix_repetition_dataset, random_dataset
from tpspec.cli import main

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------- arrivals
def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(5, math.inf, seed=3) == [0.0] * 5


def test_poisson_arrivals_are_seeded_exponential_and_end_at_num_over_rate():
    from scipy import stats

    rate, num = 4.0, 4000
    times = arrival_times(num, rate, seed=7)
    assert times == arrival_times(num, rate, seed=7) and times != arrival_times(num, rate, seed=8)
    assert times[-1] == pytest.approx(num / rate) and all(b > a for a, b in zip(times, times[1:]))
    intervals = np.diff([0.0, *times])
    assert stats.kstest(intervals * rate, "expon").pvalue > 0.01  # exponential gaps of mean 1 / rate
    assert stats.kstest(intervals * rate, "uniform", args=(0, 2)).pvalue < 1e-6  # the test can tell


def test_burstiness_shapes_the_intervals():
    rate, num = 2.0, 4000
    bursty = np.diff([0.0, *arrival_times(num, rate, burstiness=0.25, seed=1)])
    assert np.std(bursty) / np.mean(bursty) == pytest.approx(2.0, rel=0.1)  # gamma(k): CV = 1 / sqrt(k)
    steady = np.diff([0.0, *arrival_times(num, rate, burstiness=math.inf)])
    assert np.allclose(steady, 1 / rate)


@pytest.mark.parametrize("rate, burstiness", [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (math.nan, 1.0)])
def test_arrivals_reject_bad_rates(rate, burstiness):
    with pytest.raises(ValueError):
        arrival_times(3, rate, burstiness=burstiness)


# ------------------------------------------------------------------------------------------- metrics
def _trace(events: list[tuple[float, dict]], start: float = 0.0) -> RequestResult:
    result = RequestResult(prompt_len=3, expected_prompt_len=3)
    timer = StreamTimer(result, start)
    for now, event in events:
        timer.add(event, now)
    timer.finish()
    return result


def _chunk(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def test_chat_stream_times_the_first_content_not_the_role_chunk():
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    content = [{"choices": [{"index": 0, "delta": {"content": t}, "finish_reason": None}]} for t in ("a", "bc")]
    last = {"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "length"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}}
    r = _trace([(0.1, role), (0.5, content[0]), (0.7, content[1]), (1.0, last), (1.05, usage)])
    assert r.success and r.text == "abc" and r.chunks == 3
    assert r.ttft == pytest.approx(0.5) and r.itl == pytest.approx([0.2, 0.3])
    assert r.latency == pytest.approx(1.0)  # the last output chunk, not the usage event
    assert (r.prompt_len, r.output_len, r.usage) == (12, 5, True)


def test_stream_errors_fail_the_request():
    with pytest.raises(RuntimeError, match="ranks are gone"):
        _trace([(0.2, _chunk("a")), (0.3, {"error": {"message": "the engine's ranks are gone", "code": 503}})])
    with pytest.raises(RuntimeError, match="without any output"):
        _trace([(0.2, {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 0}})])


def test_metric_definitions_on_a_synthetic_trace():
    usage = {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 4}}
    # Request a: sent at 1.0, chunks at 1.2, 1.5, 1.6 (4 tokens): TTFT 0.2, ITL 0.3 and 0.1, E2EL 0.6.
    a = _trace([(1.2, _chunk("x")), (1.5, _chunk("yy")), (1.6, _chunk("z", "length")), (1.7, usage)], start=1.0)
    # Request b: sent at 1.1, one chunk of one token at 1.5: TTFT 0.4, no ITL, no TPOT.
    b = _trace([(1.5, _chunk("q", "length")), (1.6, {"choices": [], "usage": {"prompt_tokens": 6,
                                                                               "completion_tokens": 1}})], start=1.1)
    # Request c: sent at 2.0 (after a and b ended), 3 tokens in 3 chunks: TTFT 0.1, ITL 0.2, 0.2, E2EL 0.5.
    c = _trace([(2.1, _chunk("r")), (2.3, _chunk("s")), (2.5, _chunk("t", "length")),
                (2.6, {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 3}})], start=2.0)
    failed = RequestResult(prompt_len=5, expected_prompt_len=5, error="HTTP 400")
    m = compute_metrics([a, b, c, failed], duration=2.0, percentiles=(50, 99))
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (24, 8)
    assert m["request_throughput"] == pytest.approx(1.5) and m["output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(16.0)
    ttfts, itls, e2els = [200, 400, 100], [300, 100, 200, 200], [600, 400, 500]
    tpots = [(600 - 200) / 3, (500 - 100) / 2]  # (E2EL - TTFT) / (output tokens - 1); b has one token
    for name, values in (("ttft", ttfts), ("itl", itls), ("e2el", e2els), ("tpot", tpots)):
        assert m[f"mean_{name}_ms"] == pytest.approx(np.mean(values))
        assert m[f"median_{name}_ms"] == pytest.approx(np.median(values))
        assert m[f"std_{name}_ms"] == pytest.approx(np.std(values))
        assert m[f"p50_{name}_ms"] == pytest.approx(np.percentile(values, 50))
        assert m[f"p99_{name}_ms"] == pytest.approx(np.percentile(values, 99))
    assert m["max_concurrent_requests"] == 2 == peak_concurrency([a, b, c])
    empty = compute_metrics([failed], duration=1.0)
    assert empty["completed"] == 0 and empty["mean_ttft_ms"] is None and empty["p99_tpot_ms"] is None


# ------------------------------------------------------------------------------------------- datasets
def test_token_id_datasets_have_exact_lengths_and_shared_prefixes():
    maker = PromptMaker(vocab_size=50)
    rng = np.random.default_rng(0)
    reqs = random_dataset(maker, rng, 20, input_len=10, output_len=6, range_ratio=0.5, prefix_len=4)
    assert len(reqs) == 20 and all(r.prompt_len == len(r.prompt) for r in reqs)
    assert {r.prompt_len for r in reqs} <= set(range(4 + 5, 4 + 16)) and len({r.prompt_len for r in reqs}) > 1
    assert {r.output_len for r in reqs} <= set(range(3, 10)) and len({tuple(r.prompt[:4]) for r in reqs}) == 1
    assert all(0 <= t < 50 for r in reqs for t in r.prompt)
    reqs = prefix_repetition_dataset(maker, np.random.default_rng(1), 7, prefix_len=8, suffix_len=3, num_prefixes=3,
                                     output_len=5)
    assert len(reqs) == 7 and all(r.prompt_len == 11 and r.output_len == 5 for r in reqs)
    prefixes = [tuple(r.prompt[:8]) for r in reqs]
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [2, 2, 3]
    with pytest.raises(ValueError, match="num-prefixes"):
        prefix_repetition_dataset(maker, rng, 2, prefix_len=8, suffix_len=3, num_prefixes=3, output_len=5)
    with pytest.raises(ValueError, match="range-ratio"):
        random_dataset(maker, rng, 2, input_len=8, output_len=4, range_ratio=1.0)


@pytest.fixture(scope="module")
def ckpt():
    from tpspec.runtime.llm import tiny_model_path

    return tiny_model_path()


def test_text_prompts_encode_to_the_lengths_the_dataset_states(ckpt):
    tokenizer = load_tokenizer(ckpt)
    maker = PromptMaker(tokenizer)
    assert maker.text and not {0, 1, 2, 3} & set(maker.allowed.tolist())  # the tiny model's special tokens
    reqs = random_dataset(maker, np.random.default_rng(0), 12, input_len=40, output_len=4)
    assert all(len(tokenizer.encode(r.prompt).ids) == r.prompt_len == 40 for r in reqs)
    reqs = prefix_repetition_dataset(PromptMaker(tokenizer), np.random.default_rng(0), 6, prefix_len=24,
                                     suffix_len=8, num_prefixes=2, output_len=4)
    assert all(len(tokenizer.encode(r.prompt).ids) == r.prompt_len for r in reqs)
    assert len({r.prompt[:20] for r in reqs}) == 2


def test_tokenizer_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path))


# ------------------------------------------------------------------------------------------- against tpspec serve
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    """``tpspec serve`` of the tiny model at TP=1 on a free loopback port; stopped (SIGTERM) after."""
    port = _free_port()
    log_path = tmp_path_factory.mktemp("bench-serve") / "server.log"
    env = dict(os.environ, TPSPEC_NUM_THREADS="1", PYTHONPATH=str(REPO))
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tpspec", "serve", ckpt, "--served-model-name", "tiny-bench",
                                 "-tp", "1", "--device", "cpu", "--port", str(port), "--max-num-seqs", "4"],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.3)
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


EVERY_METRIC = ["completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
                "output_throughput", "total_token_throughput", "max_concurrent_requests",
                *(f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el")
                  for stat in ("mean", "median", "std", "p99"))]


def _check_results(report: dict, num_prompts: int) -> list[dict]:
    results = report["meta"]["results"]
    for r in results:
        assert (r["completed"], r["failed"]) == (num_prompts, 0), r["errors"]
        for key in EVERY_METRIC:
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]) and r[key] >= 0, key
        assert r["request_throughput"] > 0 and r["mean_ttft_ms"] > 0 and r["mean_e2el_ms"] >= r["mean_ttft_ms"]
        assert r["total_output_tokens"] == sum(r["output_lens"]) and r["usage_missing"] == 0
        assert len(r["ttfts"]) == len(r["itls"]) == len(r["latencies"]) == num_prompts
        assert [row[0] for row in report["rows"]] == [x["request_rate"] for x in results]
    return results


def test_random_dataset_text_prompts_finite_rate_and_inf_with_a_concurrency_cap(server, ckpt, tmp_path):
    """In a fresh process, to see that the client never imports torch."""
    out = tmp_path / "out"
    args = ["bench", "serve", "--base-url", server, "--tokenizer", ckpt, "--dataset", "random", "--num-prompts", "6",
            "--random-input-len", "16", "--random-output-len", "6", "--random-range-ratio", "0.5",
            "--request-rate", "20,inf", "--max-concurrency", "2", "--ignore-eos", "--out", str(out)]
    code = ("import sys; from tpspec.cli import main; rc = main(sys.argv[1:]); "
            "print('torch imported:', 'torch' in sys.modules); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "torch imported: False" in proc.stdout and "Serving Benchmark Result" in proc.stdout
    assert "rate 20" in proc.stderr  # the progress bar
    report = json.loads((out / "serve.json").read_text())
    assert report["benchmark"] == "serve" and (out / "serve.png").read_bytes()[:8] == PNG_MAGIC
    meta = report["meta"]
    assert (meta["model"], meta["prompts"], meta["request_rates"]) == ("tiny-bench", "text", [20.0, "inf"])
    for r in _check_results(report, 6):
        assert r["max_concurrency"] == 2 and 1 <= r["max_concurrent_requests"] <= 2
        assert r["input_len_mismatches"] == 0  # the server counted the prompt tokens the dataset made
        assert all(8 <= n <= 24 for n in r["input_lens"]) and all(3 <= n <= 9 for n in r["output_lens"])
    assert meta["results"][0]["duration"] >= 6 / 20  # at 20 req/s the last of 6 is sent 0.3 s after the start


def test_prefix_repetition_token_id_prompts(server, tmp_path):
    out = tmp_path / "out"
    assert main(["bench", "serve", "--base-url", server, "--vocab-size", "512", "--dataset", "prefix-repetition",
                 "--num-prompts", "6", "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-prefix-len", "16",
                 "--prefix-repetition-suffix-len", "4", "--prefix-repetition-output-len", "5", "--request-rate", "inf",
                 "--ignore-eos", "--disable-tqdm", "--seed", "3", "--out", str(out)]) == 0
    report = json.loads((out / "serve.json").read_text())
    (r,) = _check_results(report, 6)
    assert report["meta"]["prompts"] == "token_ids" and report["meta"]["tokenizer"] is None
    assert r["input_lens"] == [20] * 6 and r["output_lens"] == [5] * 6 and r["max_concurrency"] is None
    assert r["mean_tpot_ms"] > 0 and len(r["itls"][0]) >= 1


def test_chat_endpoint(server, ckpt, tmp_path):
    out = tmp_path / "out"
    assert main(["bench", "serve", "--base-url", server, "--model", "tiny-bench", "--tokenizer", ckpt, "--endpoint",
                 "/v1/chat/completions", "--num-prompts", "3", "--random-input-len", "12", "--random-output-len", "4",
                 "--ignore-eos", "--disable-tqdm", "--out", str(out)]) == 0
    (r,) = _check_results(json.loads((out / "serve.json").read_text()), 3)
    assert all(n > 12 for n in r["input_lens"])  # the chat template's tokens, counted by the server
    assert r["output_lens"] == [4] * 3


def test_bad_servers_and_options_get_clear_errors(server, tmp_path):
    common = ["--disable-tqdm", "--out", str(tmp_path), "--num-prompts", "2", "--vocab-size", "512"]
    nothing = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(SystemExit, match="cannot list the models"):
        main(["bench", "serve", "--base-url", nothing, *common])
    with pytest.raises(SystemExit, match="test request .* 404 .*does not exist"):
        main(["bench", "serve", "--base-url", server, "--model", "other", *common])
    with pytest.raises(SystemExit, match="--request-rate"):
        main(["bench", "serve", "--base-url", server, "--request-rate", "0", *common])
    with pytest.raises(SystemExit, match="chat endpoint takes text"):
        main(["bench", "serve", "--base-url", server, "--endpoint", "/v1/chat/completions", *common])
    with pytest.raises(SystemExit, match="--max-concurrency"):
        main(["bench", "serve", "--base-url", server, "--max-concurrency", "0", *common])
