"""The README's user-facing programs run as documented: the examples, and `tpspec check`
under torchrun (each in its own processes, as a user would start it)."""

from __future__ import annotations

import ast
import json
import os
import sys
from pathlib import Path

import pytest

from started import Started
from tpspec.distributed import find_free_port

REPO = Path(__file__).resolve().parents[1]


def _torchrun(nproc: int, taken: set[int]) -> list[str]:
    port = find_free_port()  # a port of its own, so a stale rendezvous elsewhere cannot interfere
    while port in taken:  # nor another job of this module's
        port = find_free_port()
    taken.add(port)
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={port}"]


def _samples(out: str) -> list[list[tuple[str, list[int], str]]]:
    """generate.py's output: per prompt, its samples' ``(text, token ids, finish reason)``."""
    prompts: list[list[tuple[str, list[int], str]]] = []
    text = None
    for line in out.splitlines():
        if line.startswith("prompt "):
            prompts.append([])
        elif line.startswith("  ["):
            text = ast.literal_eval(line.split("] ", 1)[1])
        elif line.strip().startswith("tokens ["):
            ids, rest = line.strip()[len("tokens "):].split("], finish: ", 1)
            prompts[-1].append((text, ast.literal_eval(ids + "]"), rest.split(",")[0]))
    return prompts


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """Every program of this module, started at once, side by side: name -> :class:`Started`."""
    ports: set[int] = set()
    programs = {
        "generate": [sys.executable, str(REPO / "examples" / "generate.py")],
        "speculative": [sys.executable, str(REPO / "examples" / "speculative.py")],
        "torchrun": _torchrun(2, ports) + [str(REPO / "examples" / "torchrun_generate.py")],
        "check": _torchrun(2, ports) + ["-m", "tpspec", "check", "--launcher", "torchrun", "--device", "cpu", "--quick",
                                 "--json", "check.json"],
    }
    env = dict(os.environ, TPSPEC_NUM_THREADS="1", PYTHONPATH=str(REPO))
    runs: dict[str, Started] = {}
    try:
        for name, args in programs.items():
            runs[name] = Started(args, tmp_path_factory.mktemp(name), env)
        yield runs
    finally:
        for run in runs.values():
            run.close()


def test_generate_example(started):
    """Three prompts: a greedy one, two seeded samples of another, a top_k=1 one (greedy too):
    the same tokens as the same requests run here in one process (TP = 1, the example runs TP = 2)."""
    from tpspec import LLM, SamplingParams

    got = _samples(started["generate"].stdout(240))
    assert [len(samples) for samples in got] == [1, 2, 1], got
    for samples in got:
        for text, ids, finish in samples:
            assert 0 < len(ids) <= 24 and text and finish in ("length", "stop"), (text, ids, finish)
    prompts = ["The capital of France is", "def add(a, b):", {"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7]}]
    params = [SamplingParams(temperature=0, max_tokens=24), SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=24),
              SamplingParams(temperature=0, max_tokens=24)]  # top_k=1 in the example: greedy
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TPSPEC_NUM_THREADS", "1")
        with LLM("tiny", tensor_parallel_size=1) as llm:
            want = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [[ids for _, ids, _ in samples] for samples in got] == want
    assert want[1][0] != want[1][1]  # two samples, not one twice


def test_speculative_example_reproduces_plain_decoding(started):
    """Every speculative configuration emits plain decoding's tokens (the example compares them with
    the plain run, which it marks as the reference), and the draft-model ones do so while
    accepting drafts (more than one token a step), so the comparison covers verification."""
    out = started["speculative"].stdout(240)
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0] in
            ("plain", "ngram/strict", "draft/strict", "draft/rejection")}
    assert list(rows) == ["plain", "ngram/strict", "draft/strict", "draft/rejection"], out
    assert rows["plain"][1] == "reference", out
    assert all(rows[name][1] == "True" for name in ("ngram/strict", "draft/strict", "draft/rejection")), out
    assert all(float(rows[name][2]) > 1.0 for name in ("draft/strict", "draft/rejection")), out


def test_torchrun_example(started):
    out = started["torchrun"].stdout(240)
    assert "every rank got the same tokens: True" in out and "tokens/s on 2 ranks" in out, out


def test_check_under_torchrun(started):
    started["check"].stdout(240)
    report = started["check"].cwd / "check.json"
    rows = {r["key"]: r["status"] for r in json.loads(report.read_text())["results"]}
    assert rows["ranks_agree"] == rows["generate_tp"] == rows["greedy_argmax"] == "PASS", rows
    assert "FAIL" not in rows.values()
