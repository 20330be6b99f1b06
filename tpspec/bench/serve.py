"""``tpspec bench serve``: an OpenAI-compatible server under load, measured as ``vllm bench serve`` does.

A client only (no torch): it sends ``--num-prompts`` requests of a dataset (``random`` or
``prefix-repetition``, see :mod:`tpspec.bench.serve_datasets`) to ``--base-url`` + ``--endpoint``
(``/v1/completions``, or ``/v1/chat/completions``) of any server — ``tpspec serve`` or another
engine — at each ``--request-rate`` (requests/s, Poisson arrivals, ``inf`` = all at once;
``--burstiness`` other than 1 draws gamma intervals instead), at most ``--max-concurrency`` at a
time. Every request streams with ``stream_options.include_usage``; its token counts are the
server's ``usage``.

Per request: TTFT (send to the first chunk that carries output), ITL (the gaps between
consecutive output chunks: one chunk may carry several tokens, e.g. a speculative step's),
E2EL (send to the last output chunk) and TPOT = (E2EL - TTFT) / (output tokens - 1), for
requests of more than one token. Per rate: completed and failed requests, request, output and
total (input + output) token throughput over the run's duration, and each latency's mean,
median, std and ``--metric-percentiles`` (default p99), in milliseconds, with vLLM's result
names (``mean_ttft_ms``, ``p99_itl_ms``, ...). Prints vLLM's result block per rate and a table,
writes ``<out>/serve.json`` (every result, per-request lists included) and ``<out>/serve.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from . import report

METRICS = (("ttft", "TTFT", "Time to First Token"), ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
           ("itl", "ITL", "Inter-token Latency"), ("e2el", "E2EL", "End-to-end Latency"))
COLUMNS = ["request_rate", "completed", "failed", "duration", "request_throughput", "output_throughput",
           "total_token_throughput", "median_ttft_ms", "median_tpot_ms", "median_itl_ms", "median_e2el_ms"]


# ---------------------------------------------------------------------------------------------- arrivals
def arrival_times(num: int, request_rate: float, *, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """When each of ``num`` requests is sent, in seconds from the start of the run.

    ``request_rate`` ``inf``: all at 0. Otherwise the cumulative sums of ``num`` intervals drawn
    from a gamma distribution of shape ``burstiness`` and mean ``1 / request_rate`` (burstiness 1:
    exponential intervals, a Poisson process; ``inf``: every interval ``1 / request_rate``),
    the first request one interval after the start, then scaled so the last one is sent at
    ``num / request_rate`` as vLLM does (every seed gives a run of the same length).
    ``seed`` seeds the draws (numpy's ``default_rng``)."""
    if num < 1:
        raise ValueError(f"num must be >= 1, got {num}")
    if not request_rate > 0:
        raise ValueError(f"the request rate must be > 0 (or inf), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"the burstiness must be > 0 (or inf), got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num
    if math.isinf(burstiness):
        intervals = np.full(num, 1.0 / request_rate)
    else:
        rng = np.random.default_rng(seed)
        intervals = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num)
    times = np.cumsum(intervals)
    return (times * (num / request_rate / times[-1])).tolist()


# ---------------------------------------------------------------------------------------------- one request
@dataclass
class RequestResult:
    """What one request measured (seconds, client clock). ``output_len``: generated tokens (the
    server's ``usage``); ``itl``: the gaps between consecutive output chunks."""

    success: bool = False
    prompt_len: int = 0
    expected_prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    chunks: int = 0
    text: str = ""
    usage: bool = False
    error: str = ""


class StreamTimer:
    """Reads one streamed response's events as they arrive and fills a :class:`RequestResult`.

    An event with choices is an output chunk, except a chat stream's opening chunk that only
    announces the assistant's role (no content, no finish reason): it carries no token, so it
    neither ends the wait for the first token nor counts as one. An event with ``usage`` gives
    the token counts; one with ``error`` fails the request."""

    def __init__(self, result: RequestResult, start: float) -> None:
        self.result = result
        self.start = start
        self.last = start
        result.start_time = start

    def add(self, event: dict[str, Any], now: float) -> None:
        r = self.result
        if "error" in event:
            err = event["error"]
            raise RuntimeError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
        choices = event.get("choices") or []
        if choices and not _role_only(choices[0]):
            if r.chunks == 0:
                r.ttft = now - self.start
            else:
                r.itl.append(now - self.last)
            self.last = now
            r.chunks += 1
            first = choices[0]
            r.text += (first.get("delta") or {}).get("content") or first.get("text") or ""
        usage = event.get("usage")
        if usage:
            r.usage = True
            r.output_len = int(usage.get("completion_tokens") or 0)
            if usage.get("prompt_tokens") is not None:
                r.prompt_len = int(usage["prompt_tokens"])

    def finish(self) -> None:
        """The stream ended: the request succeeded when some output came."""
        r = self.result
        if r.chunks == 0:
            raise RuntimeError("the stream ended without any output chunk")
        r.latency = self.last - self.start
        r.success = True


def _role_only(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    return isinstance(delta, dict) and "role" in delta and not delta.get("content") and not choice.get("finish_reason")


def _headers() -> dict[str, str]:
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


async def send_request(session: Any, url: str, payload: dict[str, Any], expected_prompt_len: int) -> RequestResult:
    """POST one streamed request; never raises (a failure is a result with ``error`` set)."""
    import aiohttp

    result = RequestResult(prompt_len=expected_prompt_len, expected_prompt_len=expected_prompt_len)
    timer = StreamTimer(result, time.perf_counter())
    try:
        async with session.post(url, json=payload, headers=_headers()) as response:
            if response.status != 200:
                body = await response.text()
                try:
                    message = json.loads(body)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = body[:500]
                raise RuntimeError(f"HTTP {response.status} {response.reason}: {message}")
            async for raw in response.content:  # one line at a time
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments (pings), other fields
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                timer.add(json.loads(data), time.perf_counter())
        timer.finish()
    except (RuntimeError, ValueError, OSError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
        result.success = False
        result.error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, RuntimeError) else str(exc)
    return result


# ---------------------------------------------------------------------------------------------- metrics
def _stats(name: str, values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float | None]:
    """``mean_/median_/std_/p{P}_<name>_ms`` of ``values`` (seconds), None when there are none."""
    ms = np.asarray(values, dtype=np.float64) * 1000.0
    out: dict[str, float | None] = {}
    for stat, fn in (("mean", np.mean), ("median", np.median), ("std", np.std)):
        out[f"{stat}_{name}_ms"] = float(fn(ms)) if len(ms) else None
    for p in percentiles:
        out[f"p{_percentile_name(p)}_{name}_ms"] = float(np.percentile(ms, p)) if len(ms) else None
    return out


def _percentile_name(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def peak_concurrency(results: Sequence[RequestResult]) -> int:
    """The most successful requests in flight at once, each over ``[start, start + latency)``."""
    events = sorted([(r.start_time, 1) for r in results if r.success]
                    + [(r.start_time + r.latency, -1) for r in results if r.success])
    peak = now = 0
    for _, delta in events:  # at equal times an end (-1) sorts before a start (+1)
        now += delta
        peak = max(peak, now)
    return peak


def compute_metrics(results: Sequence[RequestResult], duration: float,
                    percentiles: Sequence[float] = (99,)) -> dict[str, Any]:
    """The run's results from its requests' and its ``duration`` (seconds), vLLM's names:
    ``completed``, ``failed``, ``total_input_tokens``, ``total_output_tokens``,
    ``request_throughput`` (completed / s), ``output_throughput`` and ``total_token_throughput``
    (tokens / s), ``max_concurrent_requests``, and the stats of ``ttft``, ``tpot``
    ((latency - ttft) / (output_len - 1) of each request of more than one token), ``itl``
    (every gap between output chunks) and ``e2el`` (latency)."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    out: dict[str, Any] = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "max_concurrent_requests": peak_concurrency(results),
    }
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    values = {"ttft": [r.ttft for r in ok], "tpot": tpots, "itl": [g for r in ok for g in r.itl],
              "e2el": [r.latency for r in ok]}
    for name, _, _ in METRICS:
        out.update(_stats(name, values[name], percentiles))
    return out


# ---------------------------------------------------------------------------------------------- the run
@dataclass
class Target:
    """Where and how requests go."""

    url: str
    model: str
    chat: bool
    ignore_eos: bool
    temperature: float | None
    timeout_s: float

    def payload(self, prompt: str | list[int], output_len: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "stream": True, "stream_options": {"include_usage": True}}
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
            body["max_completion_tokens"] = output_len
        else:
            body["prompt"] = prompt
            body["max_tokens"] = output_len
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.temperature is not None:
            body["temperature"] = self.temperature
        return body


def _session(max_concurrency: int | None, timeout_s: float) -> Any:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, keepalive_timeout=60)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s))


async def _check_server(target: Target, prompt: str | list[int]) -> None:
    """One short request before the run: a server that does not answer is reported, not timed."""
    async with _session(1, target.timeout_s) as session:
        result = await send_request(session, target.url, target.payload(prompt, 1), 0)
    if not result.success:
        raise _fail(f"the test request to {target.url} failed: {result.error}")


async def run_rate(target: Target, requests: Sequence[Any], request_rate: float, *, burstiness: float,
                   max_concurrency: int | None, seed: int, progress: bool) -> tuple[list[RequestResult], float]:
    """Send ``requests`` at ``request_rate``; return every request's result (in dataset order,
    ``start_time`` in seconds from the run's start) and the run's duration (from its start to
    the last response)."""
    from tqdm import tqdm

    times = arrival_times(len(requests), request_rate, burstiness=burstiness, seed=seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    rate = "inf" if math.isinf(request_rate) else f"{request_rate:g}"
    bar = tqdm(total=len(requests), desc=f"rate {rate}", unit="req", disable=not progress, file=sys.stderr)

    async with _session(max_concurrency, target.timeout_s) as session:
        async def one(req: Any) -> RequestResult:
            payload = target.payload(req.prompt, req.output_len)
            if limit is None:
                result = await send_request(session, target.url, payload, req.prompt_len)
            else:
                async with limit:
                    result = await send_request(session, target.url, payload, req.prompt_len)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for req, at in zip(requests, times):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    bar.close()
    for r in results:
        r.start_time -= start
    return results, duration


def _output_lens_without_usage(results: Sequence[RequestResult], tokenizer: Any) -> None:
    """A server that sent no ``usage``: count output tokens from the text (with the tokenizer)
    or, without one, as output chunks."""
    for r in results:
        if r.success and not r.usage:
            r.output_len = (len(tokenizer.encode(r.text, add_special_tokens=False).ids) if tokenizer is not None
                            else r.chunks)


def result_of_rate(request_rate: float, max_concurrency: int | None, results: Sequence[RequestResult],
                   duration: float, percentiles: Sequence[float]) -> dict[str, Any]:
    """One rate's JSON entry: :func:`compute_metrics` plus the per-request lists."""
    out: dict[str, Any] = {"request_rate": _rate_value(request_rate), "max_concurrency": max_concurrency}
    out.update(compute_metrics(results, duration, percentiles))
    out["input_len_mismatches"] = sum(1 for r in results if r.success and r.prompt_len != r.expected_prompt_len)
    out["usage_missing"] = sum(1 for r in results if r.success and not r.usage)
    out.update({
        "input_lens": [r.prompt_len for r in results], "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results], "latencies": [r.latency for r in results],
        "start_times": [r.start_time for r in results], "errors": [r.error for r in results],
    })
    return out


def _rate_value(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def print_result(result: dict[str, Any], percentiles: Sequence[float]) -> None:
    """vLLM's result block."""
    def line(label: str, value: Any, fmt: str = "") -> None:
        text = "-" if value is None else format(value, fmt)
        print(f"{label:<40} {text:<10}")

    print("{:=^50}".format(" Serving Benchmark Result "))
    line("Successful requests:", result["completed"])
    line("Failed requests:", result["failed"])
    if result["max_concurrency"] is not None:
        line("Maximum request concurrency:", result["max_concurrency"])
    if result["request_rate"] != "inf":
        line("Request rate configured (RPS):", result["request_rate"], ".2f")
    line("Benchmark duration (s):", result["duration"], ".2f")
    line("Total input tokens:", result["total_input_tokens"])
    line("Total generated tokens:", result["total_output_tokens"])
    line("Request throughput (req/s):", result["request_throughput"], ".2f")
    line("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    line("Total token throughput (tok/s):", result["total_token_throughput"], ".2f")
    line("Peak concurrent requests:", result["max_concurrent_requests"])
    for name, short, header in METRICS:
        print("{:-^50}".format(header))
        line(f"Mean {short} (ms):", result[f"mean_{name}_ms"], ".2f")
        line(f"Median {short} (ms):", result[f"median_{name}_ms"], ".2f")
        for p in percentiles:
            line(f"P{_percentile_name(p)} {short} (ms):", result[f"p{_percentile_name(p)}_{name}_ms"], ".2f")
    print("=" * 50)
    failed = [e for e in result["errors"] if e]
    for i, err in enumerate(failed[:10]):
        print(f"error {i}: {err}")


def _plot(results: Sequence[dict[str, Any]]):
    labels = [r["request_rate"] if r["request_rate"] == "inf" else f"{r['request_rate']:g}" for r in results]

    def plot(ax: Any) -> None:
        x = np.arange(len(results))
        ax.bar(x, [r["output_throughput"] for r in results], color="tab:blue", alpha=0.6, label="output tok/s")
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("output tokens / s")
        twin = ax.twinx()
        for name, color in (("ttft", "tab:red"), ("tpot", "tab:green"), ("e2el", "tab:purple")):
            ys = [r[f"median_{name}_ms"] for r in results]
            twin.plot(x, [np.nan if y is None else y for y in ys], "o-", color=color, label=f"median {name} (ms)")
        twin.set_ylabel("ms")
        twin.set_yscale("log")
        handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        ax.legend(handles, [h.get_label() for h in handles], loc="upper left", fontsize=8)
        ax.set_title("tpspec bench serve: throughput and latency by request rate")

    return plot


# ---------------------------------------------------------------------------------------------- command line
def _rates(text: str) -> list[float]:
    try:
        rates = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise _fail(f"--request-rate: expected comma-separated numbers or inf, got {text!r}") from None
    if not rates or not all(r > 0 for r in rates):
        raise _fail(f"--request-rate: expected rates > 0 (or inf), got {text!r}")
    return rates


def _percentiles(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or not all(0 < v <= 100 for v in values):
        raise _fail(f"--metric-percentiles: expected comma-separated numbers in (0, 100], got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    parser.add_argument("--endpoint", default="/v1/completions",
                        help="/v1/completions (default) or /v1/chat/completions")
    parser.add_argument("--backend", choices=("openai", "openai-chat"), default=None,
                        help="the API (default: from --endpoint)")
    parser.add_argument("--model", default=None, help="the model id to request (default: the server's first model)")
    parser.add_argument("--tokenizer", default=None,
                        help="text prompts through this tokenizer: a checkpoint directory, a tokenizer.json, a Hub id "
                             "or 'tiny' (default: --model's, when it loads as one)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="no tokenizer: token-id prompts drawn from [0, VOCAB_SIZE) (completions only)")
    parser.add_argument("--dataset", "--dataset-name", dest="dataset", choices=("random", "prefix-repetition"),
                        default="random")
    parser.add_argument("--num-prompts", type=int, default=1000, help="requests per rate (default 1000)")
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="lengths drawn from [L(1-r), L(1+r)] (default 0: fixed)")
    parser.add_argument("--random-prefix-len", type=int, default=0, help="a random prefix every prompt shares")
    parser.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    parser.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    parser.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    parser.add_argument("--prefix-repetition-output-len", type=int, default=128)
    parser.add_argument("--request-rate", default="inf",
                        help="requests/s, comma-separated for several runs, e.g. 1,4,16,inf (default inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the arrival intervals (1: Poisson; < 1 burstier; inf: constant)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: any)")
    parser.add_argument("--ignore-eos", action="store_true", help="generate every request's full output length")
    parser.add_argument("--temperature", type=float, default=None, help="sent with every request (default: not sent)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrival times (default 0)")
    parser.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles (default 99)")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request fails (600)")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _fail(message: str) -> SystemExit:
    return SystemExit(f"tpspec bench serve: {message}")


def _validate(args: argparse.Namespace) -> tuple[bool, list[float], list[float]]:
    chat = args.endpoint.rstrip("/").endswith("chat/completions")
    if args.backend is not None and (args.backend == "openai-chat") != chat:
        raise _fail(f"--backend {args.backend} does not match --endpoint {args.endpoint}")
    if args.num_prompts < 1:
        raise _fail(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise _fail(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not args.burstiness > 0:
        raise _fail(f"--burstiness must be > 0, got {args.burstiness}")
    if args.seed < 0:
        raise _fail(f"--seed must be >= 0, got {args.seed}")
    if not args.request_timeout > 0:
        raise _fail(f"--request-timeout must be > 0, got {args.request_timeout}")
    if args.vocab_size is not None:
        if args.tokenizer is not None:
            raise _fail("give --tokenizer (text prompts) or --vocab-size (token-id prompts), not both")
        if args.vocab_size < 1:
            raise _fail(f"--vocab-size must be >= 1, got {args.vocab_size}")
        if chat:
            raise _fail("the chat endpoint takes text: give --tokenizer instead of --vocab-size")
    return chat, _rates(args.request_rate), _percentiles(args.metric_percentiles)


async def _first_model(base_url: str, timeout_s: float) -> str:
    import aiohttp

    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with _session(1, timeout_s) as session, session.get(url, headers=_headers()) as response:
            response.raise_for_status()
            data = (await response.json()).get("data") or []
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        raise _fail(f"cannot list the models at {url}: {type(exc).__name__}: {exc}") from None
    if not data:
        raise _fail(f"{url} lists no model")
    return str(data[0]["id"])


def _prompt_maker(args: argparse.Namespace, model: str) -> tuple[Any, Any]:
    """(tokenizer or None, PromptMaker) from --tokenizer / --vocab-size / the model id."""
    from .serve_datasets import PromptMaker, load_tokenizer

    if args.vocab_size is not None:
        return None, PromptMaker(vocab_size=args.vocab_size)
    name = args.tokenizer or model
    try:
        tokenizer = load_tokenizer(name)
    except ValueError as exc:
        hint = "" if args.tokenizer else (" (the model id taken as the tokenizer); give --tokenizer PATH|HUB_ID|tiny, "
                                          "or --vocab-size V for token-id prompts")
        raise _fail(f"{exc}{hint}") from None
    return tokenizer, PromptMaker(tokenizer)


def _dataset(args: argparse.Namespace, maker: Any, rng: np.random.Generator) -> list[Any]:
    from .serve_datasets import prefix_repetition_dataset, random_dataset

    try:
        if args.dataset == "random":
            return random_dataset(maker, rng, args.num_prompts, input_len=args.random_input_len,
                                  output_len=args.random_output_len, range_ratio=args.random_range_ratio,
                                  prefix_len=args.random_prefix_len)
        return prefix_repetition_dataset(maker, rng, args.num_prompts, prefix_len=args.prefix_repetition_prefix_len,
                                         suffix_len=args.prefix_repetition_suffix_len,
                                         num_prefixes=args.prefix_repetition_num_prefixes,
                                         output_len=args.prefix_repetition_output_len)
    except ValueError as exc:
        raise _fail(str(exc)) from None


def _dataset_meta(args: argparse.Namespace) -> dict[str, Any]:
    if args.dataset == "random":
        keys = ("random_input_len", "random_output_len", "random_range_ratio", "random_prefix_len")
    else:
        keys = ("prefix_repetition_prefix_len", "prefix_repetition_suffix_len", "prefix_repetition_num_prefixes",
                "prefix_repetition_output_len")
    return {k: getattr(args, k) for k in keys}


def run(args: argparse.Namespace) -> int:
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise _fail("needs aiohttp (pip install 'tpspec[bench]')") from None
    chat, rates, percentiles = _validate(args)
    base_url = args.base_url.rstrip("/")
    model = args.model or asyncio.run(_first_model(base_url, args.request_timeout))
    tokenizer, maker = _prompt_maker(args, model)
    target = Target(url=base_url + "/" + args.endpoint.lstrip("/"), model=model, chat=chat,
                    ignore_eos=args.ignore_eos, temperature=args.temperature, timeout_s=args.request_timeout)
    # Each rate gets its own prompts (a server that caches prefixes must not find a whole prompt
    # of an earlier rate), all drawn from one seeded generator.
    rng = np.random.default_rng(args.seed)
    datasets = [_dataset(args, maker, rng) for _ in rates]
    print(f"tpspec bench serve: {target.url}, model {model!r}, dataset {args.dataset}, {args.num_prompts} prompts "
          f"a rate ({'text' if maker.text else 'token ids'}), rates {','.join(str(_rate_value(r)) for r in rates)}, "
          f"max concurrency {args.max_concurrency}, burstiness {args.burstiness:g}")
    # The test request's prompt is none of the timed ones (nor a prefix of them).
    check = maker.random_ids(np.random.default_rng([args.seed, len(rates)]), max(1, 8 - maker.num_special))
    asyncio.run(_check_server(target, maker.prompt(check)[0]))

    results = []
    for i, (rate, requests) in enumerate(zip(rates, datasets)):
        outcome, duration = asyncio.run(run_rate(target, requests, rate, burstiness=args.burstiness,
                                                 max_concurrency=args.max_concurrency, seed=args.seed + i,
                                                 progress=not args.disable_tqdm))
        _output_lens_without_usage(outcome, tokenizer)
        result = result_of_rate(rate, args.max_concurrency, outcome, duration, percentiles)
        print_result(result, percentiles)
        if result["input_len_mismatches"] and not chat:  # chat prompts gain the chat template's tokens
            print(f"note: the server counted other prompt lengths than the dataset for "
                  f"{result['input_len_mismatches']} requests (its tokenizer differs); the results use its counts")
        results.append(result)

    meta = {"base_url": base_url, "endpoint": args.endpoint, "model": model, "chat": chat, "dataset": args.dataset,
            **_dataset_meta(args), "num_prompts": args.num_prompts, "prompts": "text" if maker.text else "token_ids",
            "tokenizer": None if tokenizer is None else (args.tokenizer or model), "vocab_size": args.vocab_size,
            "request_rates": [_rate_value(r) for r in rates], "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency, "ignore_eos": args.ignore_eos, "temperature": args.temperature,
            "seed": args.seed, "percentiles": percentiles, "results": results}
    rows = [[r[c] for c in COLUMNS] for r in results]
    report.write_report(args.out, "serve", columns=COLUMNS, rows=rows, meta=meta, plot=_plot(results))
    if any(r["completed"] == 0 for r in results):
        print("tpspec bench serve: every request of a rate failed (see the errors above)", file=sys.stderr)
        return 1
    return 0
