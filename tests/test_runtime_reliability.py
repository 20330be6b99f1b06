"""Faults and misuse: a killed driver leaves no process behind, a script that never calls
shutdown exits cleanly, one LLM serves several threads in any mix of calls and streams, every
listener is on loopback, a stray benchmark knob warns, and each smaller trap gets a clear error
or warning."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from listeners import LOOPBACK, listening_addresses
from tpspec import LLM, SamplingParams
from tpspec.model.tiny import make_tiny_checkpoint
from tpspec.runtime import WorkerError

REPO = Path(__file__).resolve().parents[1]
SPEC = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("reliability") / "tiny", seed=0))


@pytest.fixture(scope="module")
def llm_tp2(ckpt):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TPSPEC_NUM_THREADS", "1")
        with LLM(ckpt, tensor_parallel_size=2, distributed_executor_backend="mp") as llm:
            yield llm


# ------------------------------------------------------------------ processes in /proc

def _parents() -> dict[int, int]:
    """pid -> parent pid of every live (not zombie) process."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in ("Z", "X"):
            out[int(entry)] = int(fields[1])
    return out


def _descendants(pid: int) -> set[int]:
    parents = _parents()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pids: set[int]) -> set[int]:
    return pids & set(_parents())


DRIVER = textwrap.dedent("""
    import sys, threading, time
    from tpspec import LLM, SamplingParams

    llm = LLM(sys.argv[1], tensor_parallel_size=2, distributed_executor_backend=sys.argv[2])
    if sys.argv[3] == "idle":
        print("idle", flush=True)
        time.sleep(600)
    executor, generating = llm._executor, threading.Event()
    original = executor.call

    def call(fn, *args, on_progress=None, timeout_s=None):
        def hook(steps, tokens):
            generating.set()
        return original(fn, *args, on_progress=hook, timeout_s=timeout_s)

    executor.call = call
    long = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
    threading.Thread(target=llm.generate, args=([[5, 6, 7]], long), daemon=True).start()
    generating.wait(300)
    print("generating", flush=True)
    time.sleep(600)
""")


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")
    except OSError:
        return ""


RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")
"""Ray's own agents of a local Ray: they report a dead raylet to its (dead) head before they
exit, which Ray gives a minute; they hold no rank and no device."""


def _kill_driver(tmp_path: Path, ckpt: str, backend: str, state: str = "generating") -> set[int]:
    """Start a driver, SIGKILL it once its ranks generate (``state="idle"``: once its LLM is up);
    return its processes still alive 10 s later (the workers, the forkserver, the resource
    tracker, Ray's raylet, head and actors; Ray's agents are killed here, not counted)."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = dict(os.environ, PYTHONPATH=str(REPO), TPSPEC_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(script), ckpt, backend, "idle" if state == "idle" else "busy"],
                            stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        line = proc.stdout.readline()  # bounded: the driver gives up waiting after 300 s
        assert line.strip() == state, f"the driver did not get {state}: {line!r}"
        family = _descendants(proc.pid)
        assert len(family) >= 2, "no worker processes found"
        agents = {pid for pid in family if _command(pid).startswith(RAY_AGENTS)}
        family -= agents
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10.0
        while _alive(family) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in _alive(agents):
            os.kill(pid, signal.SIGKILL)
        return _alive(family)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


@pytest.mark.parametrize("state", ["generating", "idle"])
def test_killing_the_driver_leaves_nothing_running(tmp_path, ckpt, state):
    left = _kill_driver(tmp_path, ckpt, "mp", state)
    for pid in left:  # clean up before failing
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the killed driver ({state}) still running after 10 s: {sorted(left)}"


@pytest.mark.slow
def test_killing_the_ray_driver_mid_generate_leaves_nothing_running(tmp_path, ckpt):
    pytest.importorskip("ray")
    left = _kill_driver(tmp_path, ckpt, "ray")
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the killed Ray driver still running after 10 s: {sorted(left)}"


NO_SHUTDOWN = textwrap.dedent("""
    import sys
    from tpspec import LLM, SamplingParams

    llm = LLM(sys.argv[1], tensor_parallel_size=2)
    print(llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0].token_ids)
    print(*llm._executor.pids, flush=True)
""")


def test_a_script_that_never_calls_shutdown_exits_cleanly(tmp_path, ckpt):
    """vLLM scripts rarely call shutdown: at exit the workers end, with no resource-tracker
    warning about leaked semaphores."""
    script = tmp_path / "no_shutdown.py"
    script.write_text(NO_SHUTDOWN)
    env = dict(os.environ, PYTHONPATH=str(REPO), TPSPEC_NUM_THREADS="1", TPSPEC_LOG_LEVEL="WARNING")
    proc = subprocess.run([sys.executable, str(script), ckpt], capture_output=True, text=True, env=env, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    pids = {int(p) for p in proc.stdout.splitlines()[-1].split()}
    assert "leaked" not in proc.stderr and "resource_tracker" not in proc.stderr, proc.stderr
    assert not _alive(pids)


def test_a_garbage_collected_llm_ends_its_workers(ckpt):
    """An ``LLM`` nobody holds any more shuts its workers down when it is collected."""
    import gc

    llm = LLM(ckpt, tensor_parallel_size=2)
    assert llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2))[0].outputs[0].token_ids
    pids = set(llm._executor.pids)  # noqa: SLF001
    del llm
    gc.collect()
    deadline = time.monotonic() + 10.0
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pids)


# ------------------------------------------------------------------ threads

THREAD_PROMPTS = [[5, 6, 7, 8], [300, 301, 302], [9], [42] * 6, [100, 200, 300, 5]]
THREAD_PARAMS = SamplingParams(temperature=0.0, max_tokens=5)


def _call(llm: LLM, kind: str, i: int) -> list[list[int]]:
    """One call of ``kind`` on prompt ``i`` (and its neighbour): each request's tokens, in order.
    ``dropped``: a stream read for one output, then dropped (its requests are aborted)."""
    prompts = [THREAD_PROMPTS[i], THREAD_PROMPTS[(i + 1) % len(THREAD_PROMPTS)]]
    if kind == "generate":
        return [o.outputs[0].token_ids for o in llm.generate(prompts, THREAD_PARAMS)]
    if kind == "chat":
        return [o.outputs[0].token_ids for o in llm.chat([{"role": "user", "content": f"hi {i}"}], THREAD_PARAMS)]
    joined: dict[str, list[int]] = {}
    stream = llm.generate(prompts, THREAD_PARAMS, stream=True)
    for out in stream:
        joined.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        if kind == "dropped":
            stream.close()
            break
    return list(joined.values())


def test_threads_mixing_streams_and_calls_each_get_their_own_outputs(llm_tp2):
    """4 threads x 20 calls on one LLM, a seeded random mix of generate, chat, streams read to the
    end and streams dropped after one output: no call raises, and each gets exactly what it gets
    alone (a dropped stream: a prefix of it) - a stream never yields another caller's requests."""
    kinds = ("generate", "chat", "stream", "dropped")
    alone = {(kind, i): _call(llm_tp2, kind if kind != "dropped" else "stream", i)
             for kind in kinds for i in range(len(THREAD_PROMPTS))}
    errors: list[BaseException] = []
    wrong: list[tuple] = []

    def run(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(20):
            kind, i = kinds[rng.integers(len(kinds))], int(rng.integers(len(THREAD_PROMPTS)))
            try:
                got = _call(llm_tp2, kind, i)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                continue
            want = alone[(kind, i)]
            if kind == "dropped":
                ok = len(got) == 1 and any(w[:len(got[0])] == got[0] for w in want)
            else:
                ok = got == want
            if not ok:
                wrong.append((kind, i, got, want))

    threads = [threading.Thread(target=run, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors[:3]
    assert not wrong, wrong[:3]
    # The dropped streams' requests are gone after the next call, which runs alone again.
    assert llm_tp2.generate([[5, 6, 7, 8]], THREAD_PARAMS)[0].outputs[0].token_ids == alone[("generate", 0)][0]
    assert not llm_tp2._live  # noqa: SLF001


# ------------------------------------------------------------------ listeners


def test_every_listener_of_an_mp_job_is_on_loopback(llm_tp2):
    llm_tp2.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2))
    addresses = [a for pid in llm_tp2._executor.pids for a in listening_addresses(pid)]  # noqa: SLF001
    assert addresses, "no listening socket found (the store of rank 0 at least listens)"
    assert set(addresses) <= LOOPBACK, f"listeners off loopback: {addresses}"


def test_ray_starts_its_own_cluster_unless_one_is_named(monkeypatch):
    from tpspec.runtime.launchers import ray_init_arguments

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_init_arguments()["address"] == "local"  # a new local Ray, never a recorded cluster
    assert ray_init_arguments()["include_dashboard"] is False
    assert ray_init_arguments({"address": "ray://head:10001"}) == {"address": "ray://head:10001"}
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")
    assert "address" not in ray_init_arguments()


# ------------------------------------------------------------------ smaller traps

def test_a_stray_forcing_variable_warns_and_is_recorded(ckpt, monkeypatch):
    from tpspec.speculative.forced import ForcedAcceptanceWarning

    prompt, params = [[5, 6, 7, 8, 5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(ckpt, distributed_executor_backend="external_launcher", speculative_config=SPEC) as llm:
        plain = llm.generate(prompt, params)
        assert llm.last_stats.forced_acceptance_rate is None
    monkeypatch.setenv("TPSPEC_FORCE_NUM_ACCEPTED_TOKENS", "3")
    with LLM(ckpt, distributed_executor_backend="external_launcher", speculative_config=SPEC) as llm:
        with pytest.warns(ForcedAcceptanceWarning, match="rank 0: TPSPEC_FORCE_NUM_ACCEPTED_TOKENS=3"):
            llm.generate(prompt, params)
        assert llm.last_stats.forced_acceptance_rate == 3.0
        assert llm.last_stats.mean_accepted_drafts_per_step > plain[0].outputs[0].stats.num_accepted_drafts / max(
            1, len(plain[0].outputs[0].stats.accepted_drafts_per_step))


def test_max_model_len_defaults_to_the_models_positions_and_beyond_is_refused(ckpt):
    with pytest.raises(ValueError, match=r"max_model_len=1000000 exceeds the model's max_position_embeddings"):
        LLM(ckpt, max_model_len=1_000_000)
    with LLM(ckpt, distributed_executor_backend="external_launcher", tensor_parallel_size=1) as llm:
        assert llm.config.max_seq_len == llm.model_config.max_position_embeddings


def test_numpy_ids_seeds_and_temperatures_are_accepted(ckpt):
    with LLM(ckpt, distributed_executor_backend="external_launcher") as llm:
        ref = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.8, seed=3, max_tokens=6))
        got = llm.generate(np.array([5, 6, 7]), SamplingParams(temperature=np.float32(0.8), seed=np.int64(3),
                                                               max_tokens=np.int64(6)))
    assert got[0].outputs[0].token_ids == ref[0].outputs[0].token_ids


def test_token_id_prompts_with_a_sign_are_ids_not_text():
    from tpspec.runtime.generate_cli import _parse_prompt

    assert _parse_prompt("1,-3,4") == [1, -3, 4]  # LLM then refuses -3 by name
    assert _parse_prompt("1 2 3") == [1, 2, 3]
    assert _parse_prompt("1, two") == "1, two"


def test_an_interrupted_generate_says_the_llm_is_spent(ckpt):
    with LLM(ckpt, distributed_executor_backend="external_launcher") as llm:
        executor = llm._executor  # noqa: SLF001
        original = executor.call

        def interrupted(fn, *args, on_progress=None, timeout_s=None):
            def hook(steps, tokens):
                raise KeyboardInterrupt

            return original(fn, *args, on_progress=hook, timeout_s=timeout_s)

        executor.call = interrupted
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        with pytest.warns(RuntimeWarning, match="cannot generate again"), pytest.raises(KeyboardInterrupt):
            llm.generate([[5, 6, 7]], long)
        executor.call = original
        with pytest.raises(WorkerError, match="interrupted by KeyboardInterrupt"):
            llm.generate([[5, 6, 7]], long)
