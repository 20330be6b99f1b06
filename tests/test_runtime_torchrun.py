"""``LLM`` in a process that torchrun started: it joins torchrun's ranks by default, an
explicit ``mp`` backend starts its own workers without torchrun's variables, and neither
hangs (the run is bounded by a timeout)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from tpspec.distributed import find_free_port
from tpspec.model.tiny import make_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import json, os, sys
    from tpspec import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4)
    out = {"rank": int(os.environ["RANK"])}
    with LLM(sys.argv[1], tensor_parallel_size=2, init_timeout_s=120) as llm:  # joins torchrun's two ranks
        out["joined"] = [llm.distributed_executor_backend, llm.rank,
                         llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids]
    with LLM(sys.argv[1], tensor_parallel_size=1, distributed_executor_backend="mp", init_timeout_s=120) as llm:
        out["own"] = llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids
    try:
        LLM(sys.argv[1], tensor_parallel_size=1)  # torchrun has two ranks: a clear error, not a hang
    except ValueError as exc:
        out["refused"] = str(exc)
    # One write of the whole line: the two ranks share torchrun's stdout, and a line written in
    # pieces (the text, then its newline) can interleave with the other rank's.
    sys.stdout.write("RESULT " + json.dumps(out) + "\\n")
    sys.stdout.flush()
""")


def test_llm_under_torchrun_joins_its_ranks_or_runs_its_own_without_hanging(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "tiny", seed=0)
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    port = find_free_port()  # a port of its own: a stale rendezvous elsewhere cannot interfere
    env = dict(os.environ, PYTHONPATH=str(REPO), TPSPEC_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={port}", str(script),
           str(ckpt)]
    # Its own session, so that a hang is ended with every rank (torchrun's and their workers).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"LLM under torchrun hung\n{stdout[-3000:]}\n{stderr[-3000:]}") from None
    assert proc.returncode == 0, stdout + stderr
    results = sorted((json.loads(line[len("RESULT "):]) for line in stdout.splitlines()
                      if line.startswith("RESULT ")), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        backend, rank, tokens = r["joined"]
        assert backend == "external_launcher" and rank == r["rank"]
        assert tokens == r["own"] == results[0]["own"]  # TP=2 over torchrun's ranks == TP=1 in its own worker
        assert "WORLD_SIZE=2 must equal tensor_parallel_size=1" in r["refused"]
