"""Mapping layout rules, process-group bootstrap (explicit, torchrun env, single process), run_ranks failures."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tpspec import Mapping
from tpspec import distributed as D
from tpspec.testing import RankError, run_ranks

REPO = Path(__file__).resolve().parents[1]


def test_mapping_layout():
    m = Mapping(world_size=8, rank=5, tp_size=4)
    assert (m.tp_rank, m.tp_group_index, m.num_tp_groups) == (1, 1, 2)
    assert m.tp_group_ranks == [4, 5, 6, 7]
    assert m.all_tp_group_ranks == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert m.lm_head_is_sharded and m.attention_tp_size == 4
    adp = Mapping(4, 1, 4, enable_attention_dp=True)
    assert not adp.lm_head_is_sharded and adp.attention_tp_size == 1 and adp.attention_tp_rank == 0
    assert Mapping(4, 1, 4, enable_attention_dp=True, enable_lm_head_tp_in_adp=True).lm_head_is_sharded
    assert Mapping().tp_size == 1 and not Mapping().lm_head_is_sharded


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(world_size=6, rank=0, tp_size=4), "tp_size=4 does not divide world_size=6"),
        (dict(world_size=2, rank=2), "rank=2 is out of range"),
        (dict(world_size=2, rank=-1), "rank=-1 is out of range"),
        (dict(world_size=0), "world_size must be a positive int"),
        (dict(world_size=2, tp_size=0), "tp_size must be a positive int"),
        (dict(world_size=2, enable_lm_head_tp_in_adp=True), "needs enable_attention_dp"),
        (dict(world_size=2, rank=True), "rank=True is out of range"),
        (dict(world_size=2, enable_attention_dp="no"), "enable_attention_dp must be a bool"),
    ],
)
def test_mapping_rejects_bad_combinations(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Mapping(**kwargs)


def test_single_plain_process_needs_no_group(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    mapping = D.init_distributed(backend="gloo")
    assert (mapping.world_size, mapping.rank, mapping.tp_size) == (1, 0, 1)
    assert D.tp_group() is None and D.group_size() == 1
    t = torch.tensor([3.0])
    assert D.all_reduce_(t).item() == 3.0


def test_init_argument_errors(monkeypatch):
    with pytest.raises(ValueError, match="both rank and world_size"):
        D.init_distributed(rank=0)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="RANK and WORLD_SIZE"):
        D.init_distributed()
    with pytest.raises(ValueError, match="master_addr and master_port"):
        D.init_distributed(rank=0, world_size=2, backend="gloo")


def tp_group_worker(rank, world):
    mapping = Mapping(world, rank, 2)
    value = torch.tensor([float(rank + 1)])
    D.all_reduce_(value, "sum", D.tp_group())
    # With no rank/world_size (and no torchrun environment) the existing group is reused.
    again = D.init_distributed(tp_size=2)
    return mapping.tp_group_ranks, value.item(), D.group_size(D.tp_group()), (again.rank, again.world_size)


def test_rank_threads_come_from_the_spec_the_variable_or_the_cores(monkeypatch):
    """``TPSPEC_NUM_THREADS``: a positive integer, else ``ValueError``; unset, the host's cores
    split between its ranks; ``GroupSpec(num_threads=)`` wins over both."""
    from tpspec.runtime.launchers import GroupSpec

    monkeypatch.delenv("TPSPEC_NUM_THREADS", raising=False)
    assert GroupSpec(world_size=2).threads(2) == max(1, (os.cpu_count() or 1) // 2)
    assert GroupSpec(world_size=2).threads(4 * (os.cpu_count() or 1)) == 1
    monkeypatch.setenv("TPSPEC_NUM_THREADS", "3")
    assert GroupSpec(world_size=2).threads(2) == 3
    assert GroupSpec(world_size=2, num_threads=5).threads(2) == 5
    for bad in ("0", "-1", "x", "1.5"):
        monkeypatch.setenv("TPSPEC_NUM_THREADS", bad)
        with pytest.raises(ValueError, match="TPSPEC_NUM_THREADS must be a positive integer"):
            GroupSpec(world_size=2).threads(2)


def test_tp_groups_reduce_within_their_group():
    results = run_ranks(tp_group_worker, 4, tp_size=2)
    assert [r[1] for r in results] == [3.0, 3.0, 7.0, 7.0]
    assert all(r[2] == 2 for r in results)
    assert [r[3] for r in results] == [(rank, 4) for rank in range(4)]


def test_torchrun_environment_bootstrap(tmp_path):
    """Two plain processes with torchrun's variables join one group, running this checkout's tpspec
    (the script lives elsewhere, so PYTHONPATH names the checkout and the script checks it)."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import torch
        import tpspec
        from tpspec import distributed as D
        m = D.init_distributed(backend="gloo")
        t = torch.tensor([float(m.rank)])
        D.all_reduce_(t)
        print(f"rank={m.rank} world={m.world_size} sum={t.item()} from={tpspec.__file__}")
        D.destroy_distributed()
    """))
    port = D.find_free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=str(REPO))
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True,
                                      cwd=tmp_path))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert "rank=0 world=2 sum=1.0" in outs[0] and "rank=1 world=2 sum=1.0" in outs[1]
    assert all(f"from={REPO / 'tpspec' / '__init__.py'}" in out for out in outs), outs


def failing_worker(rank, world):
    if rank == 1:
        raise ValueError("deliberate failure on rank 1")
    return rank


def dying_worker(rank, world):
    if rank == 0:
        os._exit(3)
    return rank


def quietly_exiting_worker(rank, world):
    if rank == 1:
        os._exit(0)  # a clean exit code, but no result
    return rank


class _ParentCannotLoad:
    def __reduce__(self):
        return (_refuse_to_load, ())


def _refuse_to_load():
    raise RuntimeError("cannot load in parent")


def unloadable_result_worker(rank, world):
    import multiprocessing

    # Loads fine in the rank, fails to load in the parent (where this is the main process).
    return _ParentCannotLoad() if multiprocessing.parent_process() is not None else rank


def hanging_worker(rank, world):
    if rank == 1:
        time.sleep(600)
    return rank


def test_run_ranks_reports_the_failing_rank_with_traceback():
    with pytest.raises(RankError, match="rank 1 raised") as info:
        run_ranks(failing_worker, 2)
    assert info.value.rank == 1 and "deliberate failure on rank 1" in str(info.value)


def test_run_ranks_reports_a_dead_rank():
    with pytest.raises(RankError, match="rank 0 died with exit code 3"):
        run_ranks(dying_worker, 2, timeout_s=60)


def test_run_ranks_reports_a_rank_that_exits_without_a_result_at_once():
    start = time.monotonic()
    with pytest.raises(RankError, match="rank 1 died with exit code 0 before returning a result"):
        run_ranks(quietly_exiting_worker, 2, timeout_s=120)
    assert time.monotonic() - start < 60  # not after the whole timeout


def test_run_ranks_reports_a_result_the_parent_cannot_load():
    with pytest.raises(RankError, match="could not be unpickled in the parent.*cannot load in parent"):
        run_ranks(unloadable_result_worker, 2, timeout_s=60)


def test_run_ranks_times_out_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises(RankError, match=r"ranks \[(0, )?1\] did not finish within 4 s"):
        run_ranks(hanging_worker, 2, timeout_s=4)
    assert time.monotonic() - start < 60
