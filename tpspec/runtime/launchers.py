"""Executors: the one way tpspec starts the ranks of a process group and runs work on them.

An :class:`Executor` starts ``world_size`` ranks that join one process group
(:class:`GroupSpec` says how), then runs *calls* on them: ``call(fn, *args)`` runs
``fn(ctx, *args)`` on every rank, where ``ctx`` is the rank's :class:`RankContext`
(rank, mapping, device, and a ``state`` dict that outlives the call, where the runtime
keeps its engine), and returns every rank's result. ``fn`` must be a module-level
function (it travels by name).

* :class:`InProcessExecutor` — this process *is* a rank (torchrun, or a single plain
  process); every rank runs the same program and makes the same calls.
* :class:`MPExecutor` — ``world_size`` local worker processes (gloo on CPU, NCCL on GPUs)
  driven over queues.
* :class:`RayExecutor` — one Ray actor per rank in a placement group.

The runtime's ``LLM``, ``tpspec check``, the benchmarks and
:func:`tpspec.testing.run_ranks` all start their ranks through these.

The driver never waits unboundedly: a rank's death is noticed within a fraction of a
second, a hung group by ``timeout_s`` passing without progress, slow start-up by
``init_timeout_s``; each raises :class:`WorkerError` naming the rank and leaves the
executor unusable (its ranks are killed). The ranks watch their driver too: a worker
whose driver died exits within seconds, busy or idle (a parent-death signal on Linux
plus a check at every progress report and while idle), so nothing is left running.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .. import distributed as D
from ..log import plural
from ..mapping import Mapping
from .config import LAUNCHERS

POLL_S = 0.2
DRIVER_CHECK_S = 0.5  # how often a busy rank checks that its driver is alive
PROGRESS_INTERVAL_S = 0.25  # how often a rank reports its progress to the driver
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
                 "TORCH_NCCL_ASYNC_ERROR_HANDLING")
"""The variables torchrun sets for its ranks: never passed on to an executor's own workers."""

ProgressFn = Callable[[int, int], None]
"""``on_progress(steps_done, tokens_generated_so_far)``."""


class WorkerError(RuntimeError):
    """A rank died, hung, or raised. The executor is unusable afterwards.

    ``rank``: the rank at fault when known; ``remote_traceback``: its traceback when it raised.
    """

    def __init__(self, message: str, rank: int | None = None, remote_traceback: str | None = None) -> None:
        text = message if remote_traceback is None else f"{message}\n--- rank {rank} traceback ---\n{remote_traceback}"
        super().__init__(text)
        self.rank = rank
        self.remote_traceback = remote_traceback


@dataclass(frozen=True)
class GroupSpec:
    """How the ranks of an executor join their process group.

    ``world_size``: ranks. ``device``: ``"cpu"``, ``"cuda"`` (each rank gets a GPU,
    ``LOCAL_RANK`` modulo the GPUs) or ``None`` (the calls pick their devices).
    ``backend``: process-group backend (default: ``nccl`` on cuda, else ``gloo``).
    ``tp_size`` / ``attention_dp``: the :class:`~tpspec.mapping.Mapping` of every rank.
    ``num_threads``: torch intra-op threads per rank (default: ``$TPSPEC_NUM_THREADS``, else
    the host's cores split between the local ranks). ``env``: added to every rank's
    environment before it joins. ``pg_timeout_s``: timeout of the group's collectives.
    """

    world_size: int
    device: str | None = "cpu"
    backend: str | None = None
    tp_size: int | None = None
    attention_dp: bool = False
    num_threads: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    pg_timeout_s: float = D.DEFAULT_TIMEOUT_S

    def threads(self, local_ranks: int) -> int:
        """Torch intra-op threads of a rank that shares this host with ``local_ranks`` ranks."""
        if self.num_threads is not None:
            return self.num_threads
        raw = os.environ.get("TPSPEC_NUM_THREADS", "")
        if raw.strip():
            if not raw.strip().isdigit() or int(raw) < 1:
                raise ValueError(f"TPSPEC_NUM_THREADS must be a positive integer, got {raw!r}")
            return int(raw)
        return max(1, (os.cpu_count() or 1) // max(1, local_ranks))


class RankContext:
    """What a call sees on its rank: ``rank``, ``world_size``, ``mapping``, ``device``, a
    ``state`` dict kept between calls, and :meth:`report` for progress."""

    def __init__(self, rank: int, world_size: int, mapping: Mapping, device: torch.device,
                 driver_pid: int | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.mapping = mapping
        self.device = device
        self.state: dict[str, Any] = {}
        self._sink: ProgressFn | None = None
        self._driver_pid = driver_pid
        self._last_sent = 0.0
        self._last_check = time.monotonic()

    def begin_call(self, sink: ProgressFn | None) -> None:
        """Executors: where :meth:`report` sends this call's progress (None: nowhere)."""
        self._sink = sink
        self._last_sent = 0.0

    def close(self) -> None:
        """Close what the calls left in ``state`` (anything with a ``close``), then empty it."""
        for item in self.state.values():
            if hasattr(item, "close"):
                item.close()
        self.state.clear()

    def report(self, steps: int, tokens: int) -> None:
        """Progress of the current call (every rank may report; throttled). A rank whose
        driver has died exits here, even while busy."""
        now = time.monotonic()
        if self._driver_pid is not None and now - self._last_check >= DRIVER_CHECK_S:
            self._last_check = now
            if not _pid_alive(self._driver_pid):
                os._exit(1)  # the driver is gone: nobody reads our results
        if self._sink is not None and now - self._last_sent >= PROGRESS_INTERVAL_S:
            self._last_sent = now
            self._sink(steps, tokens)


def _join_group(rank: int, spec: GroupSpec, addr: str, port: int, local_ranks: int,
                driver_pid: int | None) -> RankContext:
    """Join the process group as ``rank`` and build the rank's context."""
    torch.set_num_threads(spec.threads(local_ranks))
    mapping = D.init_distributed(rank=rank, world_size=spec.world_size, master_addr=addr, master_port=port,
                                 tp_size=spec.tp_size, backend=spec.backend, device=spec.device,
                                 enable_attention_dp=spec.attention_dp, timeout_s=spec.pg_timeout_s)
    device = torch.device("cuda", torch.cuda.current_device()) if spec.device == "cuda" else torch.device("cpu")
    return RankContext(rank, spec.world_size, mapping, device, driver_pid)


class Executor:
    """The driver's handle on the ranks of one process group.

    ``local_rank``: this process's rank when it is a rank itself (in-process), else None.
    """

    local_rank: int | None = None

    def __init__(self, spec: GroupSpec) -> None:
        self.spec = spec
        self._broken: str | None = None

    def start(self) -> None:
        """Start the ranks and join them in the group (bounded by ``init_timeout_s``)."""
        raise NotImplementedError

    def call(self, fn: Callable[..., Any], *args: Any, on_progress: ProgressFn | None = None,
             timeout_s: float | None = None) -> list[Any]:
        """Run ``fn(ctx, *args)`` on every rank; return the results, index = rank (``None``
        for ranks that live in other processes under :class:`InProcessExecutor`).
        ``on_progress`` receives rank 0's reports; ``timeout_s``: how long the driver waits
        without any progress before it declares the group hung. Raises
        :class:`WorkerError` when a rank raises, dies or hangs."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """End the ranks (idempotent, bounded)."""
        raise NotImplementedError

    def _check_usable(self) -> None:
        if self._broken:
            raise WorkerError(f"the workers are gone ({self._broken}); create a new executor (a new LLM)")

    def _mark_broken(self, exc: BaseException) -> None:
        first = str(exc).splitlines()[0] if str(exc) else ""
        self._broken = first or f"interrupted by {type(exc).__name__}"

    def __enter__(self) -> "Executor":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


# ---------------------------------------------------------------------------- in-process
class InProcessExecutor(Executor):
    """This process is one rank: torchrun (``RANK``/``WORLD_SIZE`` in the environment, or a
    process group that already exists) or a single plain process (world size 1). Every
    rank constructs it and makes the same calls; each gets its own result.

    The process group outlives the executor: the next executor of this process joins it
    again (a second rendezvous on torchrun's store would not complete)."""

    def __init__(self, spec: GroupSpec) -> None:
        super().__init__(spec)
        self.ctx: RankContext | None = None

    def start(self) -> None:
        import torch.distributed as dist

        # Checked before joining: a group of the wrong size is an error, not a rendezvous to wait in.
        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size()
        else:
            world = int(os.environ.get("WORLD_SIZE", "1") or "1")
        if world != self.spec.world_size:
            raise ValueError(f"an in-process rank runs one TP group: WORLD_SIZE={world} must equal "
                             f"tensor_parallel_size={self.spec.world_size}")
        mapping = D.init_distributed(tp_size=self.spec.tp_size, backend=self.spec.backend, device=self.spec.device,
                                     enable_attention_dp=self.spec.attention_dp, timeout_s=self.spec.pg_timeout_s)
        self.local_rank = mapping.rank
        device = torch.device("cuda", torch.cuda.current_device()) if self.spec.device == "cuda" else \
            torch.device("cpu")
        self.ctx = RankContext(mapping.rank, mapping.world_size, mapping, device)

    def call(self, fn: Callable[..., Any], *args: Any, on_progress: ProgressFn | None = None,
             timeout_s: float | None = None) -> list[Any]:
        self._check_usable()
        if self.ctx is None:
            raise RuntimeError("the executor is not started (or already shut down)")
        self.ctx.begin_call(on_progress)
        try:
            value = fn(self.ctx, *args)
        except KeyboardInterrupt as exc:  # the peers are mid-collective: this group cannot go on
            self._mark_broken(exc)
            raise
        finally:
            self.ctx.begin_call(None)
        results: list[Any] = [None] * self.ctx.world_size
        results[self.ctx.rank] = value
        return results

    def shutdown(self) -> None:
        if self.ctx is None:
            return
        ctx, self.ctx = self.ctx, None
        ctx.close()


# ---------------------------------------------------------------------------- multiprocessing
def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent exits (the forkserver, which itself exits
    when the driver does, or the driver under ``spawn``)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _mp_worker_main(rank: int, spec: GroupSpec, port: int, commands: Any, out: Any, env: dict[str, str],
                    driver_pid: int) -> None:
    """Body of one worker process: join the group, then run calls until told to stop."""
    _die_with_parent()
    if not _pid_alive(driver_pid):  # the driver died before the death signal was armed
        os._exit(1)
    for name in TORCHRUN_VARS:  # the forkserver may have been started under torchrun
        os.environ.pop(name, None)
    os.environ.update(env)
    os.environ.update(spec.env)
    os.environ["LOCAL_RANK"] = str(rank)
    ctx = None
    try:
        ctx = _join_group(rank, spec, "127.0.0.1", port, spec.world_size, driver_pid)
        out.put(("ready", None, rank))
        while True:
            try:
                cmd = commands.get(timeout=1.0)
            except queue.Empty:
                if not _pid_alive(driver_pid):
                    os._exit(1)  # nobody will read what we would flush
                continue
            if cmd[0] == "shutdown":
                return
            _, call_id, fn, args = cmd
            ctx.begin_call(lambda s, t, c=call_id: out.put(("progress", c, rank, s, t)))
            value = fn(ctx, *args)
            ctx.begin_call(None)
            out.put(("result", call_id, rank, pickle.dumps(value)))
    except BaseException as exc:  # noqa: BLE001 - the driver must hear about every failure
        out.put(("error", None, rank, traceback.format_exc(), _summary(exc), _lost_peer(exc)))
    finally:
        try:
            if ctx is not None:
                ctx.close()
            D.destroy_distributed()
        except Exception:  # noqa: BLE001
            pass


def _summary(exc: BaseException) -> str:
    """``Type: message`` of an exception, on one line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that failed because a peer went away (gloo's or NCCL's
    error): the echo of another rank's failure, not a cause."""
    import torch.distributed as dist

    echoes = tuple(getattr(dist, name) for name in ("DistBackendError", "DistNetworkError") if hasattr(dist, name))
    if echoes and isinstance(exc, echoes):
        return True
    text = str(exc)
    return any(mark in text for mark in ("gloo", "NCCL", "Connection closed by peer", "Connection reset by peer"))


def _exit_grace(exc: BaseException) -> float:
    """Seconds the ranks get to exit by themselves after ``exc``: a rank raised (it is exiting;
    its peers may be stuck in a collective and are killed after this), else none."""
    return 1.0 if isinstance(exc, WorkerError) and exc.remote_traceback is not None else 0.0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _process_state(pid: int | None) -> str:
    """``running``/``sleeping``/``stopped``/... of a Linux process (``/proc``), else ``alive``."""
    names = {"R": "running", "S": "sleeping", "D": "in uninterruptible wait", "T": "stopped", "t": "stopped",
             "Z": "exited", "X": "exited"}
    try:
        with open(f"/proc/{pid}/stat") as f:
            return names.get(f.read().rsplit(")", 1)[1].split()[0], "alive")
    except (OSError, IndexError):
        return "alive"


def _worker_context() -> Any:
    """``forkserver`` with torch and tpspec preloaded where available: the server imports
    torch once (seconds) and every later worker is a cheap fork of a process that never ran
    a torch op or touched CUDA (safe, unlike forking the driver). ``spawn`` elsewhere."""
    import multiprocessing as mp

    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["tpspec.runtime.launchers"])
        return ctx
    return mp.get_context("spawn")


@contextlib.contextmanager
def _main_module_hidden():
    """Workers need nothing from the user's ``__main__`` (their target and arguments live in
    importable modules), so keep ``multiprocessing`` from re-running the user's script in
    them: scripts then work without an ``if __name__ == "__main__":`` guard."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__dict__["__spec__"] = None
        yield
    finally:
        if main is not None:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


class MPExecutor(Executor):
    """``world_size`` local worker processes, one per rank, joined over 127.0.0.1.

    ``import_main``: the workers import the driver's ``__main__`` module, as calls of
    functions defined there need (the script then needs an ``if __name__ == "__main__":``
    guard); by default they do not, so scripts that only drive tpspec need no guard.
    """

    def __init__(self, spec: GroupSpec, *, init_timeout_s: float = 300.0, timeout_s: float = 120.0,
                 import_main: bool = False) -> None:
        super().__init__(spec)
        self.import_main = import_main
        self.init_timeout_s = init_timeout_s
        self.timeout_s = timeout_s
        self.procs: list[Any] = []
        self._commands: list[Any] = []
        self._out: Any = None
        self._call_id = 0
        self._steps: dict[int, int] = {}
        self._backlog: list[tuple] = []

    @property
    def pids(self) -> list[int]:
        """Process ids of the ranks, index = rank."""
        return [p.pid for p in self.procs]

    def start(self) -> None:
        ctx = _worker_context()
        n = self.spec.world_size
        if self.spec.device == "cuda" and torch.cuda.device_count() < n:
            raise ValueError(f"{plural(n, 'rank')} need {plural(n, 'GPU')}, this host has "
                             f"{torch.cuda.device_count()}")
        self._out = ctx.Queue()
        self._commands = [ctx.Queue() for _ in range(n)]
        port = D.find_free_port()
        env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
        self.procs = [
            ctx.Process(target=_mp_worker_main,
                        args=(r, self.spec, port, self._commands[r], self._out, env, os.getpid()),
                        daemon=True, name=f"tpspec-rank{r}")
            for r in range(n)
        ]
        try:
            with contextlib.nullcontext() if self.import_main else _main_module_hidden():
                for p in self.procs:
                    p.start()
            ready: set[int] = set()
            deadline = time.monotonic() + self.init_timeout_s
            while len(ready) < n:
                msg = self._next_message(deadline, set(range(n)) - ready, "start-up",
                                         self.init_timeout_s)
                if msg[0] == "ready":
                    ready.add(msg[2])
        except BaseException as exc:
            self._mark_broken(exc)
            self._abort(grace_s=_exit_grace(exc))
            raise

    def call(self, fn: Callable[..., Any], *args: Any, on_progress: ProgressFn | None = None,
             timeout_s: float | None = None) -> list[Any]:
        self._check_usable()
        if not self.procs:
            raise RuntimeError("the executor is not started (or already shut down)")
        timeout = self.timeout_s if timeout_s is None else timeout_s
        self._call_id += 1
        call_id = self._call_id
        self._steps = {}
        for q in self._commands:
            q.put(("call", call_id, fn, args))
        results: dict[int, Any] = {}
        try:
            deadline = time.monotonic() + timeout
            while len(results) < len(self.procs):
                pending = set(range(len(self.procs))) - set(results)
                msg = self._next_message(deadline, pending, "call", timeout)
                if msg[1] != call_id:
                    continue
                if msg[0] == "progress":
                    self._steps[msg[2]] = msg[3]
                    deadline = time.monotonic() + timeout
                    if msg[2] == 0 and on_progress is not None:
                        on_progress(msg[3], msg[4])
                elif msg[0] == "result":
                    try:
                        results[msg[2]] = pickle.loads(msg[3])
                    except Exception as exc:  # noqa: BLE001 - e.g. a result type the driver cannot import
                        raise WorkerError(f"rank {msg[2]}'s result could not be unpickled in the parent: "
                                          f"{type(exc).__name__}: {exc}", msg[2]) from None
        except BaseException as exc:
            self._mark_broken(exc)
            self._abort(grace_s=_exit_grace(exc))
            raise
        return [results[r] for r in range(len(self.procs))]

    def _next_message(self, deadline: float, pending: set[int], waiting_for: str, timeout: float) -> tuple:
        """The next message from the ranks; raises :class:`WorkerError` on a rank's error, a
        dead rank among ``pending`` or the deadline."""
        while True:
            try:
                msg = self._backlog.pop(0) if self._backlog else self._out.get(timeout=POLL_S)
            except queue.Empty:
                self._check_alive(pending)
                if time.monotonic() > deadline:
                    raise WorkerError(self._hung_message(pending, waiting_for, timeout),
                                      self._suspects(pending)[0] if self._suspects(pending) else None) from None
                continue
            if msg[0] == "error":
                self._raise_rank_error(msg)
            return msg

    def _suspects(self, pending: set[int]) -> list[int]:
        """The ranks that most likely hold the others up: stopped processes, else the pending
        ranks behind the rest in finished steps."""
        stopped = [r for r in sorted(pending) if _process_state(self.procs[r].pid) == "stopped"]
        if stopped:
            return stopped
        if self._steps:
            top = max(self._steps.values())
            behind = [r for r in sorted(pending) if self._steps.get(r, -1) < top]
            if behind:
                return behind
        return []

    def _hung_message(self, pending: set[int], waiting_for: str, timeout: float) -> str:
        states = "; ".join(
            f"rank {r} (pid {p.pid}): {_process_state(p.pid)}"
            + (f", {self._steps[r]} steps done" if r in self._steps else "")
            for r, p in enumerate(self.procs))
        suspects = self._suspects(pending)
        blame = (f"; rank {suspects[0]} holds the others up" if len(suspects) == 1
                 else f"; ranks {suspects} hold the others up" if suspects else "")
        return (f"ranks {sorted(pending)} did not finish within {timeout:.0f} s ({waiting_for}: no progress "
                f"for that long){blame}. {states}")

    def _raise_rank_error(self, msg: tuple) -> None:
        """A rank raised: the first line of the :class:`WorkerError` says what went wrong (the
        exception of the rank at fault), a collective's error after it. A rank whose collective
        lost its peer is an echo: when a peer died, that death is the news; when a peer raised,
        its error is."""
        _, _, rank, tb, summary, echo = msg
        deadline = time.monotonic() + 1.0
        while echo and time.monotonic() < deadline:
            dead = [(r, p) for r, p in enumerate(self.procs) if r != rank and p.exitcode not in (None, 0)]
            if dead:
                r, p = dead[0]
                raise WorkerError(f"rank {r} died with exit code {p.exitcode} (pid {p.pid}); "
                                  f"rank {rank} then failed: {summary}", r)
            try:
                other = self._out.get(timeout=0.05)
            except queue.Empty:
                continue
            if other[0] == "error" and not other[5]:  # the cause: lead with it, the echo after
                raise WorkerError(f"rank {other[2]} raised {other[4]} (then rank {rank}'s collective failed: "
                                  f"{summary})", other[2], other[3])
        raise WorkerError(f"rank {rank} raised {summary}", rank, tb)

    def _check_alive(self, pending: set[int]) -> None:
        """Raise when a rank the driver still waits for has exited; a rank that exits usually
        posts its traceback (or its result) first, so read on a moment before blaming it."""
        for rank in sorted(pending):
            p = self.procs[rank]
            if p.exitcode is None:
                continue
            try:
                self._backlog.append(self._out.get(timeout=1.0))  # handled by the caller's loop
            except queue.Empty:
                raise WorkerError(f"rank {rank} died with exit code {p.exitcode} before returning a result "
                                  f"(pid {p.pid})", rank) from None
            return

    def _abort(self, grace_s: float = 0.0) -> None:
        """Kill the ranks, after ``grace_s`` for those already on their way out (a rank that
        raised exits by itself: killed mid-exit, it would leave its semaphores to the resource
        tracker, which then warns)."""
        started = [p for p in self.procs if p.pid is not None]
        deadline = time.monotonic() + grace_s
        for p in started:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in started:
            if p.is_alive():
                p.kill()
        for p in started:
            p.join(timeout=5.0)

    def shutdown(self) -> None:
        if not self.procs:
            return
        for q, p in zip(self._commands, self.procs):
            if p.is_alive():
                try:
                    q.put(("shutdown",))
                except Exception:  # noqa: BLE001
                    pass
        deadline = time.monotonic() + 10.0
        for p in self.procs:
            if p.pid is not None:
                p.join(timeout=max(0.1, deadline - time.monotonic()))
        self._abort()
        for q in self._commands + [self._out]:
            q.close()
            q.cancel_join_thread()
        self.procs = []


# ---------------------------------------------------------------------------- ray
class _RayRank:
    """One rank inside a Ray actor (two threads: ``progress`` answers while ``call`` runs;
    calls themselves run one at a time)."""

    def __init__(self) -> None:
        self.ctx: RankContext | None = None
        self._progress = (0, 0, 0)
        self._lock = threading.Lock()

    def node_info(self) -> tuple[str, str, list[str]]:
        """(node id, node IP, GPU ids Ray gave this actor)."""
        import ray

        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), ray.util.get_node_ip_address(), [str(g) for g in ray.get_gpu_ids()]

    def free_port(self) -> int:
        return D.find_free_port()

    def join(self, rank: int, spec: GroupSpec, addr: str, port: int, env: dict[str, str]) -> bool:
        # Before anything touches CUDA: every actor of a node sees all of that node's GPUs,
        # sorted as integers, so CUDA IPC between ranks works; LOCAL_RANK picks ours.
        os.environ.update(env)
        os.environ.update(spec.env)
        local_ranks = 1 if spec.device == "cuda" else spec.world_size
        self.ctx = _join_group(rank, spec, addr, port, local_ranks, None)
        return True

    def call(self, call_id: int, fn: Callable[..., Any], args: tuple) -> Any:
        assert self.ctx is not None
        with self._lock:
            if self.ctx.device.type == "cuda":  # the current device is per thread; this may be a new one
                torch.cuda.set_device(self.ctx.device)

            def record(steps: int, tokens: int) -> None:
                self._progress = (call_id, steps, tokens)

            self.ctx.begin_call(record)
            try:
                return fn(self.ctx, *args)
            finally:
                self.ctx.begin_call(None)

    def progress(self) -> tuple[int, int, int]:
        return self._progress

    def shutdown(self) -> None:
        if self.ctx is not None:
            self.ctx.close()
            self.ctx = None
        D.destroy_distributed()


class RayExecutor(Executor):
    """One actor per rank in a placement group of ``{"GPU": 1}`` bundles (``{"CPU": 1}`` on
    CPU). Joins the Ray cluster that ``RAY_ADDRESS`` or ``ray_init_kwargs["address"]`` names;
    otherwise starts a local Ray of its own and stops it at shutdown."""

    def __init__(self, spec: GroupSpec, *, init_timeout_s: float = 300.0, timeout_s: float = 120.0,
                 placement_timeout_s: float = 60.0, ray_init_kwargs: dict | None = None) -> None:
        super().__init__(spec)
        self.init_timeout_s = init_timeout_s
        self.timeout_s = timeout_s
        self.placement_timeout_s = placement_timeout_s
        self.ray_init_kwargs = dict(ray_init_kwargs or {})
        self.actors: list[Any] = []
        self.pg: Any = None
        self._started_ray = False
        self._call_id = 0
        self._infos: list[tuple[str, str, list[str]]] = []

    def start(self) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise RuntimeError("launcher='ray' needs ray: pip install 'tpspec[ray]'") from None
        try:
            self._start(ray, placement_group, PlacementGroupSchedulingStrategy)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, ray: Any, placement_group: Callable, strategy_cls: Any) -> None:
        n = self.spec.world_size
        if not ray.is_initialized():
            ray.init(**ray_init_arguments(self.ray_init_kwargs))
            self._started_ray = True
        gpu = self.spec.device == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        self.pg = placement_group([dict(bundle) for _ in range(n)], strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=self.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise WorkerError(
                f"Ray could not place {n} bundles of {bundle} within {self.placement_timeout_s:.0f} s "
                f"(cluster resources: {ray.cluster_resources()}, available: {ray.available_resources()})"
            ) from None
        actor_cls = ray.remote(_RayRank)
        self.actors = [
            actor_cls.options(
                num_cpus=1,
                num_gpus=1 if gpu else 0,
                max_concurrency=2,
                scheduling_strategy=strategy_cls(placement_group=self.pg, placement_group_bundle_index=r),
            ).remote()
            for r in range(n)
        ]
        infos = self._wait([a.node_info.remote() for a in self.actors], self.init_timeout_s, "actor start-up")
        self._infos = infos
        env = self._rank_envs(infos)
        for e in env:  # the driver's tpspec settings reach the actors (threads, timeouts)
            e.update({k: v for k, v in os.environ.items() if k.startswith("TPSPEC_")})
        addr = infos[0][1]
        port = self._wait([self.actors[0].free_port.remote()], 30.0, "rank 0's port")[0]
        self._wait([a.join.remote(r, self.spec, addr, port, env[r]) for r, a in enumerate(self.actors)],
                   self.init_timeout_s, "process group start-up")

    @property
    def num_nodes(self) -> int:
        """Nodes the actors run on (known after :meth:`start`)."""
        return len({node for node, _, _ in self._infos})

    @staticmethod
    def _rank_envs(infos: list[tuple[str, str, list[str]]]) -> list[dict[str, str]]:
        """Per rank: all GPUs Ray gave the actors of its node (sorted as integers) and the
        index of its own among them."""
        by_node: dict[str, list[str]] = {}
        for node, _, gpus in infos:
            by_node.setdefault(node, []).extend(gpus)
        envs = []
        local_counter: dict[str, int] = {}
        for node, _, gpus in infos:
            visible = sorted(set(by_node[node]), key=int)
            if gpus:
                local = visible.index(gpus[0])
                envs.append({"CUDA_VISIBLE_DEVICES": ",".join(visible), "LOCAL_RANK": str(local)})
            else:
                local = local_counter.get(node, 0)
                local_counter[node] = local + 1
                envs.append({"LOCAL_RANK": str(local)})
        return envs

    def _wait(self, refs: list[Any], timeout_s: float, what: str) -> list[Any]:
        import ray

        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for ref in ready:  # surface an actor's error first (it explains a missing peer)
            self._get(ref, what)
        if pending:
            missing = [i for i, ref in enumerate(refs) if ref in pending]
            raise WorkerError(f"Ray ranks {missing} did not finish {what} within {timeout_s:.0f} s",
                              missing[0] if len(missing) == 1 else None)
        return [self._get(ref, what) for ref in refs]

    @staticmethod
    def _get(ref: Any, what: str) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=5.0)
        except ray.exceptions.RayActorError as exc:
            raise WorkerError(f"a Ray actor died during {what}: {exc}") from None
        except ray.exceptions.RayTaskError as exc:
            raise WorkerError(f"a Ray actor raised during {what}:\n{exc}") from None

    def call(self, fn: Callable[..., Any], *args: Any, on_progress: ProgressFn | None = None,
             timeout_s: float | None = None) -> list[Any]:
        import ray

        self._check_usable()
        if not self.actors:
            raise RuntimeError("the executor is not started (or already shut down)")
        timeout = self.timeout_s if timeout_s is None else timeout_s
        self._call_id += 1
        call_id = self._call_id
        refs = [a.call.remote(call_id, fn, args) for a in self.actors]
        last_change = time.monotonic()
        last_seen = None
        try:
            while True:
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=POLL_S)
                for ref in ready:
                    self._get(ref, "the call")
                if len(ready) == len(refs):
                    return [self._get(ref, "the call") for ref in refs]
                try:
                    seen = ray.get(self.actors[0].progress.remote(), timeout=5.0)
                except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
                    seen = last_seen
                if seen != last_seen and seen is not None and seen[0] == call_id:
                    last_seen, last_change = seen, time.monotonic()
                    if on_progress is not None:
                        on_progress(seen[1], seen[2])
                if time.monotonic() - last_change > timeout:
                    missing = [r for r, ref in enumerate(refs) if ref not in ready]
                    raise WorkerError(f"Ray ranks {missing} did not finish within {timeout:.0f} s "
                                      "(call: no progress for that long)")
        except BaseException as exc:
            self._mark_broken(exc)
            self._kill_actors()
            raise

    def _kill_actors(self) -> None:
        import ray

        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self.actors = []

    def shutdown(self) -> None:
        try:
            import ray
        except ImportError:
            return
        if self.actors:
            try:
                ray.wait([a.shutdown.remote() for a in self.actors], num_returns=len(self.actors), timeout=10.0)
            except Exception:  # noqa: BLE001
                pass
            self._kill_actors()
        if self.pg is not None:
            try:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001
                pass
            self.pg = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False


def ray_init_arguments(ray_init_kwargs: dict | None = None) -> dict:
    """``ray.init`` arguments: join the cluster that ``RAY_ADDRESS`` or an explicit
    ``address`` names; otherwise start a new local Ray (never the cluster a ``ray start``
    on this host left recorded), without dashboard. Ray itself picks the address its
    services listen on: it turns a loopback node address into the host's own."""
    kwargs = dict(ray_init_kwargs or {})
    if os.environ.get("RAY_ADDRESS") or "address" in kwargs:
        return kwargs
    return {"address": "local", "include_dashboard": False, "log_to_driver": False, **kwargs}


def make_executor(launcher: str, spec: GroupSpec, **options: Any) -> Executor:
    """``"mp"`` -> :class:`MPExecutor`, ``"ray"`` -> :class:`RayExecutor`,
    ``"external_launcher"`` (torchrun started this process) -> :class:`InProcessExecutor`
    (which takes no options)."""
    if launcher == "mp":
        return MPExecutor(spec, **options)
    if launcher == "ray":
        return RayExecutor(spec, **options)
    if launcher == "external_launcher":
        return InProcessExecutor(spec)
    raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")
