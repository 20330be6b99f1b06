"""Run a function on N ranks of a fresh process group: the harness of the multi-rank
tests, the determinism suite and users' own checks.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes (the runtime's
:class:`~tpspec.runtime.launchers.MPExecutor`), joins them in a gloo (or NCCL) group,
calls ``fn(rank, world_size, *args)`` on each and returns the list of results, index =
rank. A failing rank raises :class:`RankError` carrying that rank's traceback; a rank
that dies or does not finish within ``timeout_s`` raises too. Never hangs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from typing import Any, Callable, Iterator

from .runtime.launchers import GroupSpec, MPExecutor, RankContext, WorkerError

RankError = WorkerError
"""A rank raised, died, or did not finish in time (``rank``, ``remote_traceback``)."""


def call_with_rank(ctx: RankContext, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Executor call that runs ``fn(rank, world_size, *args, **kwargs)`` (the form of the
    functions :func:`run_ranks` takes)."""
    return fn(ctx.rank, ctx.world_size, *args, **kwargs)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 180.0,
    backend: str = "gloo",
    tp_size: int | None = None,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` fresh processes.

    ``fn`` must be importable by name (a module-level function) and its result
    picklable; tensors come back by value. The default process group is set up
    before ``fn`` runs (``tpspec.distributed.tp_group()`` gives the TP group, of
    ``tp_size`` ranks, default all), with one torch thread per rank. ``env`` is added
    to each rank's environment. The ranks are an :class:`~tpspec.runtime.launchers.MPExecutor`
    started for this one call and shut down after it. Returns the results ordered by
    rank; raises :class:`RankError` naming the first rank that failed (with its
    traceback), died or did not finish within ``timeout_s``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    spec = GroupSpec(world_size=world_size, device=None, backend=backend, tp_size=tp_size, num_threads=1,
                     env=dict(env or {}), pg_timeout_s=max(30.0, timeout_s))
    with MPExecutor(spec, init_timeout_s=timeout_s, timeout_s=timeout_s,
                    import_main=getattr(fn, "__module__", None) == "__main__") as executor:
        return executor.call(call_with_rank, fn, args, kwargs)


# ------------------------------------------------ rank processes sharing GPUs (MPS)

MPS_PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
MPS_LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
MPS_CONTROL = "nvidia-cuda-mps-control"  # the control daemon and its client are one binary


class MPSDaemon:
    """Start NVIDIA MPS so rank processes sharing one GPU run concurrently.

    Without MPS the GPU time-slices between processes and every cross-process wait
    costs a slice (~2 ms). ``start()`` returns ``None`` when MPS runs (already, or
    started now) or the reason it could not start; ``stop()`` quits only a daemon this
    object started. Must run before this process touches CUDA; children inherit the
    environment it sets.
    """

    def __init__(self, pipe_dir: str = "/tmp/tpspec-mps", log_dir: str = "/tmp/tpspec-mps-log") -> None:
        self.pipe_dir = os.environ.get(MPS_PIPE_ENV) or pipe_dir
        self.log_dir = os.environ.get(MPS_LOG_ENV) or log_dir
        self.started = False

    def _control(self, *args: str, command: str | None = None, timeout: float) -> subprocess.CompletedProcess:
        """Run the MPS control client on this object's pipe and log directories (the caller
        has checked that the binary is on PATH; OSError and TimeoutExpired propagate)."""
        env = dict(os.environ, **{MPS_PIPE_ENV: self.pipe_dir, MPS_LOG_ENV: self.log_dir})
        return subprocess.run([shutil.which(MPS_CONTROL) or MPS_CONTROL, *args], input=command,
                              capture_output=True, text=True, timeout=timeout, env=env)

    def running(self) -> bool:
        """Whether an MPS control daemon answers on ``pipe_dir``. A control pipe left by a
        daemon that died is not enough: the client is asked for the server list, and only
        exit status 0 (it reached the daemon) counts. Without the client binary the pipe
        alone decides (nothing else can be asked)."""
        if not os.path.exists(os.path.join(self.pipe_dir, "control")):
            return False
        if shutil.which(MPS_CONTROL) is None:
            return True
        try:
            return self._control(command="get_server_list\n", timeout=10).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    def start(self) -> str | None:
        os.environ[MPS_PIPE_ENV] = self.pipe_dir
        os.environ[MPS_LOG_ENV] = self.log_dir
        if self.running():
            return None
        if shutil.which(MPS_CONTROL) is None:
            return f"{MPS_CONTROL} is not on PATH"
        os.makedirs(self.pipe_dir, exist_ok=True)
        os.makedirs(self.log_dir, exist_ok=True)
        try:
            result = self._control("-d", timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{MPS_CONTROL} -d failed: {exc}"
        if result.returncode != 0:
            return f"{MPS_CONTROL} -d exited {result.returncode}: {result.stderr.strip()}"
        for _ in range(50):
            if self.running():
                self.started = True
                return None
            time.sleep(0.1)
        return f"MPS control pipe did not appear in {self.pipe_dir}"

    def stop(self) -> None:
        if not self.started:
            return
        if shutil.which(MPS_CONTROL):
            self._control(command="quit\n", timeout=30)
        self.started = False


def rank_backend(device: str, world_size: int) -> str:
    """The process-group backend for ``world_size`` local rank processes on ``device``:
    NCCL with a GPU per rank; gloo on CPU and when ranks share GPUs (NCCL refuses two
    ranks on one GPU; gloo carries CUDA tensors through the host)."""
    import torch

    if device == "cuda" and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


@contextlib.contextmanager
def shared_gpu_mps(device: str, world_size: int) -> Iterator[str | None]:
    """Around a :func:`run_ranks` call: when ``world_size`` CUDA ranks share GPUs, make sure
    NVIDIA MPS runs (so they run concurrently) and quit it afterwards if this started it.
    Yields ``None`` when MPS runs or is not needed, else why it could not start."""
    import torch

    if device != "cuda" or torch.cuda.device_count() >= world_size:
        yield None
        return
    daemon = MPSDaemon()
    note = daemon.start()
    try:
        yield note
    finally:
        daemon.stop()
