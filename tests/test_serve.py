"""``tpspec serve``: the real server (FastAPI + uvicorn, the tiny model at TP = 2 on CPU, bound
to 127.0.0.1), driven by the official ``openai`` client: completions and chat, streamed and
not, n > 1, stop strings, logprobs; 16 concurrent streams each equal to the request sent
alone; malformed requests get 400s; a dead rank gets 503; shutdown leaves no rank process."""

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

import pytest

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
    def __init__(self, ckpt: str, log_path: Path) -> None:
        self.ckpt = ckpt
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, TPSPEC_NUM_THREADS="1", PYTHONPATH=str(REPO))
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tpspec", "serve", ckpt, "--served-model-name", MODEL, "-tp", "2", "--device",
             "cpu", "--port", str(self.port), "--max-num-seqs", "8"],
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

    def stop(self) -> list[int]:
        """SIGTERM, wait; return the processes below it that are still alive."""
        below = _descendants(self.proc.pid)
        self.proc.send_signal(signal.SIGTERM)
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


def _post(base: str, path: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(base + path, data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tpspec.runtime.llm import tiny_model_path

    return tiny_model_path()


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    srv = Server(ckpt, tmp_path_factory.mktemp("serve") / "server.log")
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


def test_models_and_health(server):
    assert [m.id for m in server.client.models.list().data] == [MODEL]
    with urllib.request.urlopen(server.base + "/health") as r:
        assert r.status == 200


def test_completions_and_chat_streamed_and_not(server):
    c = server.client
    full = c.completions.create(model=MODEL, prompt="The cat sat on the", max_tokens=12, temperature=0)
    text = full.choices[0].text
    assert full.choices[0].finish_reason in ("length", "stop") and full.usage.completion_tokens > 0
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt="The cat sat on the", max_tokens=12, temperature=0, stream=True))
    assert streamed == text
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


@pytest.mark.parametrize("body, status, what", [
    (b"{not json", 400, ""),
    (json.dumps({"model": MODEL}).encode(), 400, "prompt"),
    (json.dumps({"model": MODEL, "prompt": "x", "temperature": -1}).encode(), 400, "temperature"),
    (json.dumps({"model": MODEL, "prompt": "x", "n": 0}).encode(), 400, "n"),
    (json.dumps({"model": MODEL, "prompt": "x", "top_p": 2}).encode(), 400, "top_p"),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": [1, 2, 999999]}).encode(), 400, "outside"),
    (json.dumps({"model": MODEL, "prompt": "x", "bogus_field": 1}).encode(), 400, "bogus_field"),
    (json.dumps({"model": "other", "prompt": "x"}).encode(), 404, "does not exist"),
])
def test_malformed_requests_get_openai_errors(server, body, status, what):
    code, reply = _post(server.base, "/v1/completions", body)
    assert code == status, reply
    assert reply["error"]["code"] == status and what in reply["error"]["message"] + str(reply["error"]["param"])


def test_malformed_chat_and_client_errors(server):
    code, reply = _post(server.base, "/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}).encode())
    assert code == 400 and "messages" in reply["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model=MODEL, prompt="x", temperature=-2.0)
    # The server is still healthy after the rejected requests.
    assert server.client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0).choices


def _metrics(base: str) -> dict[str, int]:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        assert r.headers["content-type"].startswith("text/plain")
        lines = r.read().decode().splitlines()
    return {k: int(v) for k, v in (line.split() for line in lines if not line.startswith("#"))}


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
    too_long = json.dumps({"model": MODEL, "prompt": [5] * 4096, "max_tokens": 1}).encode()
    code, reply = _post(server.base, "/v1/completions", too_long)
    assert code == 400 and "max_model_len" in reply["error"]["message"], reply


def test_clean_shutdown_leaves_no_rank_process(server):
    ranks = server.ranks()
    assert len(ranks) >= 2, ranks
    assert server.stop() == []
    # uvicorn finishes its shutdown, then exits by the signal it caught (-SIGTERM) or 0.
    assert server.proc.returncode in (0, -signal.SIGTERM), server.log_path.read_text()[-2000:]
    assert "Application shutdown complete" in server.log_path.read_text()
    assert not any(_alive(p) for p in ranks)


def test_dead_rank_gets_503(ckpt, tmp_path):
    srv = Server(ckpt, tmp_path / "server.log")
    try:
        assert srv.client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0).choices
        os.kill(srv.ranks()[-1], signal.SIGKILL)
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
