"""The driver never hangs: a killed worker or a hung (stopped) worker surfaces as a
``WorkerError`` within the executor's bounds, and the LLM refuses further work."""

from __future__ import annotations

import os
import re
import signal
import threading

import pytest

from tpspec import LLM, SamplingParams
from tpspec.model.tiny import make_tiny_checkpoint
from tpspec.runtime import WorkerError

LONG = SamplingParams(temperature=0, max_tokens=2000)  # far longer than the time it takes to break a worker


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TPSPEC_NUM_THREADS", "1")
        yield make_tiny_checkpoint(tmp_path_factory.mktemp("failures") / "tiny", seed=0)


def _after_first_progress(llm: LLM, action) -> threading.Event:
    """Run ``action(pids)`` once rank 0 has reported its first step (the run is under way)."""
    started = threading.Event()
    executor = llm._executor  # noqa: SLF001 - test hook: watch the executor's progress callback
    original_call = executor.call

    def call(fn, *args, on_progress=None, timeout_s=None):
        def hook(steps, tokens):
            if not started.is_set():
                started.set()
                action(llm._executor.pids if llm._executor else [])  # noqa: SLF001
            if on_progress is not None:
                on_progress(steps, tokens)

        return original_call(fn, *args, on_progress=hook, timeout_s=timeout_s)

    executor.call = call
    return started


@pytest.mark.parametrize("victim,sig,expect", [
    (0, signal.SIGKILL, "rank 0 died"),  # the rank whose results the driver returns
    (1, signal.SIGKILL, "rank 1 died"),
    (1, signal.SIGSTOP, r"did not finish within 3 s .*rank 1 holds the others up"),
], ids=["rank0-killed", "rank1-killed", "rank1-hung"])
def test_broken_worker_raises(ckpt, victim, sig, expect):
    with LLM(ckpt, tensor_parallel_size=2, max_model_len=2048, step_timeout_s=3.0) as llm:
        pids = llm._executor.pids  # noqa: SLF001
        started = _after_first_progress(llm, lambda p: os.kill(p[victim], sig))
        with pytest.raises(WorkerError, match=expect):
            llm.generate([[5, 6, 7]], LONG)
        assert started.is_set()
        with pytest.raises(WorkerError, match="workers are gone"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    # Every worker was reaped (a stopped one too).
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("tensor,row", [("model.norm.weight", 3), ("lm_head.weight", 400)],
                         ids=["every-rank", "rank-1-only"])
def test_worker_error_reaches_the_driver(ckpt, tmp_path, tensor, row):
    """A rank that raises at start-up reports its traceback; here the load finds a NaN
    weight, which only the rank reading it can see (row 400 of the LM head: rank 1's shard).
    The error's first line says what went wrong: the file and the tensor."""
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "nan"
    shutil.copytree(ckpt, bad)
    tensors = load_file(bad / "model.safetensors")
    tensors[tensor][row] = float("nan")
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WorkerError) as info:
        LLM(str(bad), tensor_parallel_size=2, init_timeout_s=60.0)
    first = str(info.value).splitlines()[0]
    assert re.match(rf"rank \d raised CheckpointError: tensor '{tensor}' in '.*model\.safetensors' holds NaN or "
                    rf"infinite values", first), first


def _raise_on_rank_1(ctx) -> None:
    import torch
    import torch.distributed as dist

    if ctx.rank == 1:
        raise ValueError("the real cause")
    dist.all_reduce(torch.ones(4))  # rank 0 waits for a peer that never comes: gloo's error


def test_a_peers_collective_error_comes_after_the_cause():
    """Rank 1 raises; rank 0, in a collective with it, fails with gloo's text. Whichever reaches
    the driver first, the error leads with rank 1's exception."""
    from tpspec.runtime.launchers import GroupSpec, MPExecutor

    with MPExecutor(GroupSpec(world_size=2, device="cpu"), timeout_s=60.0) as executor:
        with pytest.raises(WorkerError) as info:
            executor.call(_raise_on_rank_1)
    assert str(info.value).startswith("rank 1 raised ValueError: the real cause"), str(info.value)[:500]


def test_corrupt_checkpoint_is_refused_before_any_worker_starts(ckpt, tmp_path):
    import shutil

    for name, damage in (("garbage", lambda data: b"not a safetensors file"), ("truncated", lambda data: data[:-1000])):
        bad = tmp_path / name
        shutil.copytree(ckpt, bad)
        data = (bad / "model.safetensors").read_bytes()
        (bad / "model.safetensors").write_bytes(damage(data))
        with pytest.raises(ValueError, match=r"cannot read safetensors file .*model\.safetensors"):
            LLM(str(bad), tensor_parallel_size=2, init_timeout_s=60.0)
    bad = tmp_path / "broken-config"
    shutil.copytree(ckpt, bad)
    (bad / "config.json").write_text('{"vocab_size": 512,')
    with pytest.raises(ValueError, match=r"broken-config/config\.json is not valid JSON: Expecting property name"):
        LLM(str(bad), tensor_parallel_size=2, init_timeout_s=60.0)


def _disagreeing_ranks_worker(rank: int, world_size: int) -> str:
    from tpspec import distributed as D
    from tpspec.runtime.engine import Engine, SequenceResult

    engine = object.__new__(Engine)  # only the end-of-generate check, on a real gloo group
    engine.group = D.tp_group()
    engine._check_ranks_agree([SequenceResult([1, 2, 3], "length", None)])  # equal: passes
    try:
        engine._check_ranks_agree([SequenceResult([1, 2, 3 + rank], "length", None)])
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_ranks_that_generate_different_tokens_raise_on_every_rank():
    from tpspec.testing import run_ranks

    for message in run_ranks(_disagreeing_ranks_worker, 2, timeout_s=60):
        assert "ranks disagree on the generated tokens" in message
