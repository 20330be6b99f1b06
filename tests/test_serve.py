"""``tpspec serve``: the real server (FastAPI + uvicorn, the tiny model at TP = 2 on CPU, bound
to 127.0.0.1), driven by the official ``openai`` client: completions and chat, streamed and
not, n > 1, stop strings, logprobs; 16 concurrent streams each equal to the request sent
alone; every bad request gets OpenAI's error object with vLLM's status; a 10 MB body gets 413
while a small request completes; slow clients are cut off; a dead rank gets 503 and ends a
stream with an error event and [DONE]; SIGTERM with half-sent bodies ends the server and its
ranks within 5 s."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

import pytest
from listeners import LOOPBACK, listening_addresses

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Server:
    def __init__(self, ckpt: str, log_path: Path, *extra: str, tp: int = 2) -> None:
        self.ckpt = ckpt
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, TPSPEC_NUM_THREADS="1", PYTHONPATH=str(REPO))
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tpspec", "serve", ckpt, "--served-model-name", MODEL, "-tp", str(tp), "--device",
             "cpu", "--port", str(self.port), "--max-num-seqs", "8", *extra],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, log_path.read_text()
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.3)
        else:
            raise AssertionError(f"the server did not come up:\n{log_path.read_text()}")
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=120)

    def ranks(self) -> list[int]:
        """The rank processes: the children of the server's multiprocessing fork server."""
        def cmdline(pid: int) -> str:
            try:
                return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="ignore")
            except OSError:
                return ""

        servers = [p for p in _descendants(self.proc.pid) if "forkserver" in cmdline(p)
                   and _parent(p) == self.proc.pid]
        return [p for s in servers for p in _descendants(s) if _parent(p) == s]

    def stop(self, sig: int = signal.SIGTERM) -> list[int]:
        """Send ``sig``, wait; return the processes below it that are still alive."""
        below = _descendants(self.proc.pid)
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.log.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in below):
            time.sleep(0.2)
        return [p for p in below if _alive(p)]


def _post(base: str, path: str, body: bytes | None, method: str = "POST") -> tuple[int, dict]:
    req = urllib.request.Request(base + path, data=body, headers={"content-type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tpspec.runtime.llm import tiny_model_path

    return tiny_model_path()


MAX_BODY = 4_000_000


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    srv = Server(ckpt, tmp_path_factory.mktemp("serve") / "server.log", "--max-body-bytes", str(MAX_BODY))
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


def test_models_and_health(server):
    assert [m.id for m in server.client.models.list().data] == [MODEL]
    with urllib.request.urlopen(server.base + "/health") as r:
        assert r.status == 200


def test_the_server_and_its_ranks_listen_on_loopback_only(server):
    """No --host: the HTTP port and every rank's sockets bind to loopback."""
    addresses = {pid: listening_addresses(pid) for pid in [server.proc.pid, *_descendants(server.proc.pid)]}
    assert addresses[server.proc.pid], addresses  # the HTTP listener
    assert set().union(*addresses.values()) <= LOOPBACK, addresses


def test_completions_and_chat_streamed_and_not(server):
    c = server.client
    full = c.completions.create(model=MODEL, prompt="The cat sat on the", max_tokens=12, temperature=0)
    text = full.choices[0].text
    assert full.choices[0].finish_reason in ("length", "stop") and full.usage.completion_tokens > 0
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt="The cat sat on the", max_tokens=12, temperature=0, stream=True))
    assert streamed == text
    # stream_options.include_usage: a last chunk without choices carries the request's usage.
    chunks = list(c.completions.create(model=MODEL, prompt="The cat sat on the", max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all(ch.usage is None for ch in chunks[:-1])
    messages = [{"role": "user", "content": "Say something."}]
    reply = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert reply.choices[0].message.role == "assistant"
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                            stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == reply.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == reply.choices[0].finish_reason


def test_n_samples_stop_strings_and_logprobs(server):
    c = server.client
    many = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, n=3, temperature=1.0, seed=7)
    assert sorted(ch.index for ch in many.choices) == [0, 1, 2]
    again = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, n=3, temperature=1.0, seed=7)
    assert [ch.text for ch in many.choices] == [ch.text for ch in again.choices]  # seeded: reproducible
    full = c.completions.create(model=MODEL, prompt="one two three", max_tokens=16, temperature=0).choices[0]
    stop = next(ch for ch in full.text[2:] if ch.isascii() and ch.isprintable() and not ch.isspace())
    cut = c.completions.create(model=MODEL, prompt="one two three", max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == full.text[: full.text.index(stop)] and cut.choices[0].finish_reason == "stop"
    lp = c.completions.create(model=MODEL, prompt="one two three", max_tokens=5, temperature=0, logprobs=2)
    lps = lp.choices[0].logprobs
    assert len(lps.token_logprobs) == 5 and all(v <= 0 for v in lps.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in lps.top_logprobs)
    # text_offset: where each token's text starts in the choice's text, streamed or not.
    assert lps.text_offset == [sum(len(t) for t in lps.tokens[:i]) for i in range(5)]
    assert "".join(lps.tokens) == lp.choices[0].text
    chunks = list(c.completions.create(model=MODEL, prompt="one two three", max_tokens=5, temperature=0, logprobs=2,
                                       stream=True))
    assert [o for ch in chunks if ch.choices and ch.choices[0].logprobs
            for o in ch.choices[0].logprobs.text_offset] == lps.text_offset
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                     temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(t.logprob <= 0 for t in content)


def test_echo_with_logprobs_as_vllm(server):
    """``echo`` puts the prompt in front of the text, and with ``logprobs`` the prompt tokens'
    logprobs (None for the first) in front of the generated ones; the prompt's values equal
    ``LLM(prompt_logprobs=N)``'s, streamed or not, for every sample (within 1e-5: the default
    mode's batches and TP sizes round differently)."""
    from tpspec import LLM, SamplingParams

    c = server.client
    prompt = "one two three four"
    plain = c.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=2).choices[0]
    got = c.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True, n=2)
    with LLM(server.ckpt, max_model_len=256) as llm:
        ref = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    num_prompt = len(ref.prompt_token_ids)
    for choice in got.choices:
        lps = choice.logprobs
        assert choice.text == prompt + plain.text
        assert len(lps.tokens) == len(lps.token_logprobs) == len(lps.top_logprobs) == num_prompt + 4
        assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
        want = [e[t].logprob for t, e in zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:])]
        assert lps.token_logprobs[1:num_prompt] == pytest.approx(want, abs=1e-5)  # TP 2 vs 1: rounding
        assert lps.token_logprobs[num_prompt:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
        assert all(1 <= len(top) <= 3 for top in lps.top_logprobs[1:])
    streamed = c.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True,
                                    stream=True)
    chunks = list(streamed)
    assert "".join(ch.choices[0].text for ch in chunks) == prompt + plain.text
    values = [v for ch in chunks for v in ch.choices[0].logprobs.token_logprobs]
    assert values[0] is None and values[1:] == pytest.approx(got.choices[0].logprobs.token_logprobs[1:], abs=1e-5)
    # echo without logprobs: the text only.
    bare = c.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True).choices[0]
    assert bare.text == prompt + plain.text and bare.logprobs is None


def test_concurrent_streams_each_equal_the_request_alone(server):
    c = server.client
    prompts = [f"Request {i}: the {['cat', 'dog', 'bird', 'fish'][i % 4]} went" for i in range(16)]
    alone = [c.completions.create(model=MODEL, prompt=p, max_tokens=20, temperature=0).choices[0].text
             for p in prompts]
    got: dict[int, str] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(16)

    def one(i: int) -> None:
        try:
            start.wait()
            got[i] = "".join(ch.choices[0].text for ch in c.completions.create(
                model=MODEL, prompt=prompts[i], max_tokens=20, temperature=0, stream=True))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not errors, errors
    assert [got.get(i) for i in range(16)] == alone


NESTED = b'{"model": "%s", "prompt": ' % MODEL.encode() + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.mark.parametrize("path, body, status, what", [
    ("/v1/completions", b"{not json", 400, "not valid JSON: Expecting property name enclosed in double quotes at line 1 "
                                          "column 2"),
    ("/v1/completions", b'{"model": "%s", "prompt": "\xff\xfe"}' % MODEL.encode(), 400, "not valid UTF-8"),
    ("/v1/completions", NESTED, 400, "nests JSON arrays or objects too deeply"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "a lone \ud800"}).encode(), 400,
     "prompt is not valid Unicode text: a lone surrogate '\\ud800' at character 7"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "\udfff"}]}).encode(),
     400, "lone surrogate"),
    ("/v1/completions", json.dumps({"model": MODEL}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": []}).encode(), 400, "prompt is empty"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "temperature": -1}).encode(), 400, "temperature"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "n": 0}).encode(), 400, "n"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "n": 9}).encode(), 400,
     "n=9 is more than max_num_seqs=8"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "top_p": 2}).encode(), 400, "top_p"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 0}).encode(), 400, "max_tokens"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4094}).encode(), 400,
     "'max_tokens' or 'max_completion_tokens' is too large: 4094. This model's maximum context length is 4096 "
     "tokens and your request has 3 input tokens (4094 > 4096 - 3)."),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                         "max_completion_tokens": 5000}).encode(), 400, "is too large: 5000"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": [1, 2, 999999]}).encode(), 400, "outside"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "bogus_field": 1}).encode(), 400, "bogus_field"),
    ("/v1/completions", json.dumps({"model": "other", "prompt": "x"}).encode(), 404, "does not exist"),
    ("/v1/nothing", b"{}", 404, "no route POST /v1/nothing"),
    ("/v1/completions", None, 405, "method GET is not allowed on /v1/completions"),
])
def test_bad_requests_get_openai_errors(server, path, body, status, what):
    code, reply = _post(server.base, path, body, method="GET" if body is None else "POST")
    assert code == status, reply
    assert set(reply) == {"error"} and set(reply["error"]) == {"message", "type", "param", "code"}, reply
    assert reply["error"]["code"] == status and what in reply["error"]["message"] + str(reply["error"]["param"])


def test_a_10_mb_body_gets_413_while_a_small_request_completes(server):
    """A 10 MB body (above the server's --max-body-bytes) is answered 413 as soon as its headers
    say so; one sent chunked, once the limit is read; a 3 MB prompt under the limit is refused as
    too long from its length alone (never tokenized). Meanwhile a small request completes in
    under 2 s: nothing big reaches the engine thread."""
    big = json.dumps({"model": MODEL, "prompt": "x " * 5_000_000}).encode()
    assert len(big) > 10_000_000
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(big))
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(head)
        sender = threading.Thread(target=_send_quietly, args=(sock, big))
        sender.start()
        started = time.monotonic()
        small = server.client.completions.create(model=MODEL, prompt="The cat", max_tokens=4, temperature=0)
        took = time.monotonic() - started
        reply = _read_response(sock)
        sender.join(timeout=60)
    assert small.choices[0].text and took < 2.0, took
    assert reply.startswith(b"HTTP/1.1 413") and b"larger than 4000000 bytes" in reply, reply[:300]

    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"a" * 1_000_000
        _send_quietly(sock, b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(5)))
        assert _read_response(sock).startswith(b"HTTP/1.1 413")

    started = time.monotonic()
    code, reply = _post(server.base, "/v1/completions",
                        json.dumps({"model": MODEL, "prompt": "The cat sat. " * 230_000}).encode())
    assert code == 400 and "has at least" in reply["error"]["message"] and "max_model_len=4096" in \
        reply["error"]["message"], reply
    assert time.monotonic() - started < 2.0


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    """Send what the server takes (it closes the connection once it has answered)."""
    try:
        sock.sendall(data)
    except OSError:
        pass


def _read_response(sock: socket.socket) -> bytes:
    """The bytes the server sends until it closes the connection (or a reset ends it)."""
    data = b""
    while True:
        try:
            part = sock.recv(65536)
        except OSError:
            return data
        if not part:
            return data
        data += part


def test_malformed_chat_and_client_errors(server):
    code, reply = _post(server.base, "/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}).encode())
    assert code == 400 and "messages" in reply["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model=MODEL, prompt="x", temperature=-2.0)
    # The server is still healthy after the rejected requests.
    assert server.client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0).choices


def _half_sent_body(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"model\": ")
    return sock


def test_slow_clients_are_cut_off(ckpt, tmp_path):
    """Headers still arriving after --header-timeout-s: the connection is closed; a body still
    arriving after --body-timeout-s: 408. Other clients are served meanwhile. Ctrl-C (SIGINT)
    then stops the server: exit status 0, no traceback, no process left."""
    srv = Server(ckpt, tmp_path / "server.log", "--header-timeout-s", "1", "--body-timeout-s", "1", tp=1)
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as slow_headers, \
                _half_sent_body(srv.port) as slow_body:
            slow_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
            assert srv.client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0).choices
            assert _read_response(slow_headers) == b""  # closed by the server, within the socket's 30 s
            reply = _read_response(slow_body)
        assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in reply, reply[:300]
    finally:
        assert srv.stop(signal.SIGINT) == []
    log = srv.log_path.read_text()
    assert srv.proc.returncode == 0 and "Traceback" not in log and "leaked" not in log, log[-2000:]


def _metrics(base: str) -> dict[str, int]:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        assert r.headers["content-type"].startswith("text/plain")
        lines = r.read().decode().splitlines()
    return {k: int(v) for k, v in (line.split() for line in lines if not line.startswith("#"))}


def _streaming_request(port: int, max_tokens: int) -> socket.socket:
    """A raw streamed completion, read until its first event has arrived (it is generating)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True, "temperature": 0}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    data = b""
    while b"data: {" not in data:
        part = sock.recv(65536)
        assert part, data
        data += part
    return sock


def _wait_for_metrics(base: str, done: Callable[[dict[str, int]], bool], timeout_s: float = 30.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        now = _metrics(base)
        if done(now) or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def test_a_client_that_disconnects_leaves_the_batch(server):
    """A stream whose client goes away is aborted: the server's running requests drop to none,
    and the tokens generated stop growing far below what the request asked for."""
    before = _metrics(server.base)
    sock = _streaming_request(server.port, max_tokens=1500)
    running = _wait_for_metrics(server.base, lambda m: m["tpspec:num_requests_running"] == 1)
    assert running["tpspec:num_requests_running"] == 1, running
    sock.close()
    idle = _wait_for_metrics(server.base, lambda m: m["tpspec:num_requests_running"] == 0)
    assert idle["tpspec:num_requests_running"] == idle["tpspec:num_requests_waiting"] == 0, idle
    time.sleep(0.5)
    after = _metrics(server.base)
    generated = after["tpspec:generation_tokens_total"] - before["tpspec:generation_tokens_total"]
    assert after["tpspec:generation_tokens_total"] == idle["tpspec:generation_tokens_total"]  # nothing runs on
    assert 0 < generated < 1500, generated


def test_metrics_count_prefix_cache_hits_and_a_prompt_too_long_gets_400(server):
    prompt = [(7 * i) % 400 + 3 for i in range(40)]  # 2 full pages of 16 and a part
    before = _metrics(server.base)
    outs = [server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
            for _ in range(2)]
    assert outs[0].choices[0].text == outs[1].choices[0].text
    after = _metrics(server.base)
    assert after["tpspec:prefix_cache_queries_total"] - before["tpspec:prefix_cache_queries_total"] == 80
    assert after["tpspec:prefix_cache_hits_total"] - before["tpspec:prefix_cache_hits_total"] == 32
    assert after["tpspec:num_preemptions_total"] >= 0
    assert after["tpspec:prompt_tokens_total"] - before["tpspec:prompt_tokens_total"] == 80
    generated = sum(o.usage.completion_tokens for o in outs)
    assert after["tpspec:generation_tokens_total"] - before["tpspec:generation_tokens_total"] == generated
    assert after["tpspec:num_requests_running"] == after["tpspec:num_requests_waiting"] == 0  # idle
    too_long = json.dumps({"model": MODEL, "prompt": [5] * 4096, "max_tokens": 1}).encode()
    code, reply = _post(server.base, "/v1/completions", too_long)
    assert code == 400 and "max_model_len" in reply["error"]["message"], reply


def test_clean_shutdown_leaves_no_rank_process(server):
    """Runs last on the module's server (default timeouts: a body may take 60 s). Five clients
    hold half-sent bodies and one stream is generating 1500 tokens; SIGTERM still ends the server
    within 5 s: the requests get 2 s, then the bodies get 503 and the stream an error event and
    ``[DONE]``, with no traceback in the log; the engine stops its ranks; the server exits normally (0), so its exit handlers
    unlink the rank queues' semaphores (no "leaked" warning); no process is left."""
    ranks = server.ranks()
    assert len(ranks) >= 2, ranks
    below = _descendants(server.proc.pid)
    clients = [_half_sent_body(server.port) for _ in range(5)]
    generating = _streaming_request(server.port, max_tokens=1500)
    try:
        time.sleep(0.5)  # the requests are in: their handlers wait for the bodies
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=30)
        took = time.monotonic() - started
        replies = [_read_response(c) for c in clients]
        streamed = _read_response(generating)
    finally:
        for c in clients + [generating]:
            c.close()
        server.log.close()
    log = server.log_path.read_text()
    assert took < 5.0, (took, log[-2000:])
    assert server.proc.returncode == 0, log[-2000:]
    assert all(r.startswith(b"HTTP/1.1 503") and b"shutting down" in r for r in replies), replies
    # The stream was cut off: an error event, then [DONE].
    assert streamed.count(b"data: {") < 1500 and b"the server is shutting down" in streamed, streamed[-300:]
    assert streamed.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), streamed[-300:]  # and the response ends properly
    assert "Application shutdown complete" in log and "leaked" not in log and "Traceback" not in log, log[-3000:]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in below):
        time.sleep(0.2)
    assert not any(_alive(p) for p in below + ranks)


def test_dead_rank_gets_503(ckpt, tmp_path):
    srv = Server(ckpt, tmp_path / "server.log")
    try:
        assert srv.client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0).choices
        # A stream running when the rank dies ends with an error event, then [DONE].
        body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 3000, "ignore_eos": True, "stream": True})
        req = urllib.request.Request(srv.base + "/v1/completions", data=body.encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as stream:
            assert stream.readline().startswith(b"data: {")
            os.kill(srv.ranks()[-1], signal.SIGKILL)
            events = [line.strip() for line in stream.read().split(b"\n") if line.strip()]
        assert events[-1] == b"data: [DONE]" and b'"error"' in events[-2] and b"ranks are gone" in events[-2], \
            events[-3:]
        code, reply = _post(srv.base, "/v1/completions",
                            json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 4}).encode())
        if code == 200:  # the request raced the death: the next one must see it
            time.sleep(2)
            code, reply = _post(srv.base, "/v1/completions",
                                json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 4}).encode())
        assert code == 503 and "ranks are gone" in reply["error"]["message"]
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(srv.base + "/health")
        assert info.value.code == 503
    finally:
        leftovers = srv.stop()
    assert leftovers == []
    assert "every request now gets 503" in (tmp_path / "server.log").read_text()


def test_fields_left_out_take_the_checkpoints_generation_defaults():
    """A request's fields over the checkpoint's generation defaults (``LLM.generation_defaults``,
    fields of ``SamplingParams``); a default ``max_tokens`` is cut to the room the prompt leaves,
    one the request sets must fit (400). The LLM here is a stand-in with just those attributes."""
    from types import SimpleNamespace

    from tpspec.serve.app import ApiError, _prepare

    config = SimpleNamespace(max_seq_len=20, check_prompt_len=lambda n, what: None)
    llm = SimpleNamespace(config=config, generation_defaults={"temperature": 0.6, "top_k": 20, "max_tokens": 50})
    _, params = _prepare(llm, [5, 6, 7], {"temperature": 0.9}, "prompt")
    assert (params.temperature, params.top_k, params.max_tokens) == (0.9, 20, 17)
    _, params = _prepare(llm, [5, 6, 7], {"max_tokens": 4}, "prompt")
    assert (params.temperature, params.top_k, params.max_tokens) == (0.6, 20, 4)
    with pytest.raises(ApiError, match="max_tokens"):
        _prepare(llm, [5, 6, 7], {"max_tokens": 18}, "prompt")


def test_serve_defaults_are_the_readmes():
    """`tpspec serve` with no options: loopback, port 8000, a 32 MiB body, 10 s for the headers
    and 60 s for the body, prefix caching on, 256 sequences."""
    from tpspec.cli import build_parser

    args = build_parser(["serve"]).parse_args(["serve"])
    assert (args.host, args.port, args.max_body_bytes, args.header_timeout_s, args.body_timeout_s) == (
        "127.0.0.1", 8000, 32 * 2**20, 10.0, 60.0)
    assert args.enable_prefix_caching is True and args.max_num_seqs == 256
