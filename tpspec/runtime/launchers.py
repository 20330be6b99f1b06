"""Executors: how the ranks of one TP group are started and driven.

* :class:`InProcessExecutor` — this process *is* a rank (torchrun, or a single plain
  process). Every rank runs the same program; each returns the results.
* :class:`MPExecutor` — the driver spawns ``tp_size`` local worker processes (gloo on CPU,
  NCCL on GPUs) and talks to them over queues.
* :class:`RayExecutor` — one Ray actor per rank in a placement group.

All three run :class:`~tpspec.runtime.engine.Engine` on every rank with the same
requests; rank 0 reports progress and results. The driver never waits unboundedly:
worker death is noticed by liveness checks within a fraction of a second, a hung
group by the absence of progress for ``step_timeout_s``, slow start-up by
``init_timeout_s``; each raises :class:`WorkerError` and tears the workers down.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable

import torch

from .. import distributed as D
from .config import EngineConfig, Request
from .engine import Engine, ProgressFn, SequenceResult, SequenceUpdate

POLL_S = 0.2


class WorkerError(RuntimeError):
    """A worker died, hung, or raised. The executor is unusable afterwards."""


def _worker_threads(tp_size: int) -> int:
    """CPU threads per rank: the cores split between the local ranks (at least 1)."""
    if os.environ.get("TPSPEC_NUM_THREADS"):
        return max(1, int(os.environ["TPSPEC_NUM_THREADS"]))
    return max(1, (os.cpu_count() or 1) // max(1, tp_size))


def _pick_device(config: EngineConfig, local_rank: int) -> torch.device:
    if config.device == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def free_port() -> int:
    """A TCP port free on every interface of this host right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class _Throttle:
    """Calls ``send`` at most every ``interval_s`` seconds (and always on the first call)."""

    def __init__(self, send: ProgressFn, interval_s: float) -> None:
        self.send = send
        self.interval_s = interval_s
        self.last = 0.0

    def __call__(self, steps: int, tokens: int) -> None:
        now = time.monotonic()
        if now - self.last >= self.interval_s:
            self.last = now
            self.send(steps, tokens)


class Executor:
    """The driver's handle on the ranks of one TP group."""

    #: rank of this process in the group when it is a rank itself (in-process), else None
    local_rank: int | None = None

    def start(self) -> None:
        raise NotImplementedError

    def run(self, requests: list[Request], on_progress: ProgressFn | None = None) -> list[SequenceResult]:
        """Run the requests on every rank; return rank 0's results (one per request, in order)."""
        raise NotImplementedError

    def step(self, new_requests: list[Request], aborts: list[int]) -> list[SequenceUpdate]:
        """One engine step driven by the driver: every rank adds ``new_requests``, aborts the
        sequences ``aborts`` and runs one step (none when nothing is left); returns rank 0's
        updates. The ranks get the same commands in the same order (continuous batching)."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """End the workers (idempotent, bounded)."""
        raise NotImplementedError


# ---------------------------------------------------------------------------- in-process
class InProcessExecutor(Executor):
    """This process is one rank: torchrun (``RANK``/``WORLD_SIZE`` in the environment) or a
    single plain process (world size 1). Collective: every rank constructs it and calls
    :meth:`run` with the same requests; every rank gets the results."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.engine: Engine | None = None
        self._owns_group = False

    def start(self) -> None:
        import torch.distributed as dist

        existed = dist.is_available() and dist.is_initialized()
        mapping = D.init_distributed(tp_size=self.config.tp_size, device=self.config.device,
                                     enable_attention_dp=self.config.attention_dp)
        self._owns_group = not existed
        if mapping.world_size != self.config.tp_size:
            if self._owns_group:
                D.destroy_distributed()
            raise ValueError(
                f"launcher='torchrun' runs one TP group: WORLD_SIZE={mapping.world_size} must equal "
                f"tp_size={self.config.tp_size}"
            )
        self.local_rank = mapping.rank
        device = torch.device("cuda", torch.cuda.current_device()) if self.config.device == "cuda" else None
        self.engine = Engine(self.config, mapping, device)

    def run(self, requests: list[Request], on_progress: ProgressFn | None = None) -> list[SequenceResult]:
        if self.engine is None:
            raise RuntimeError("the executor is not started (or already shut down)")
        return self.engine.generate(requests, on_progress if self.local_rank == 0 else None)

    def step(self, new_requests: list[Request], aborts: list[int]) -> list[SequenceUpdate]:
        if self.engine is None:
            raise RuntimeError("the executor is not started (or already shut down)")
        return _engine_step(self.engine, new_requests, aborts)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
            if self._owns_group:
                D.destroy_distributed()


# ---------------------------------------------------------------------------- multiprocessing
def _mp_worker_main(rank: int, world_size: int, port: int, config: EngineConfig, commands: Any, out: Any,
                    env: dict[str, str], parent: int) -> None:
    """Body of one spawned rank: build the engine, then serve ``generate`` commands."""
    # The forkserver's environment is from when it started: take the driver's current one
    # (TPSPEC_FORCE_NUM_ACCEPTED_TOKENS, TPSPEC_NUM_THREADS, NCCL_* ... set since then).
    os.environ.update(env)
    engine = None
    try:
        torch.set_num_threads(_worker_threads(world_size))
        os.environ["LOCAL_RANK"] = str(rank)
        mapping = D.init_distributed(rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port,
                                     tp_size=world_size, device=config.device,
                                     enable_attention_dp=config.attention_dp)
        engine = Engine(config, mapping, _pick_device(config, rank))
        out.put(("ready", rank))
        while True:
            try:
                cmd = commands.get(timeout=1.0)
            except queue.Empty:
                if not _pid_alive(parent):  # the driver is gone: do not linger
                    return
                continue
            if cmd[0] == "shutdown":
                return
            if cmd[0] == "step":
                _, call_id, new_requests, aborts = cmd
                updates = _engine_step(engine, new_requests, aborts)
                if rank == 0:
                    out.put(("stepped", call_id, updates))
                continue
            _, call_id, requests = cmd
            progress = None
            if rank == 0:
                progress = _Throttle(lambda s, t: out.put(("progress", call_id, s, t)), config.progress_interval_s)
            results = engine.generate(requests, progress)
            if rank == 0:
                out.put(("result", call_id, results))
    except BaseException:  # noqa: BLE001 - the driver must hear about every failure
        out.put(("error", rank, traceback.format_exc()))
    finally:
        try:
            if engine is not None:
                engine.close()
            D.destroy_distributed()
        except Exception:  # noqa: BLE001
            pass


def _engine_step(engine: Engine, new_requests: list[Request], aborts: list[int]) -> list[SequenceUpdate]:
    """What every rank does for one driver step (the same on every rank)."""
    engine.add_requests(new_requests)
    engine.abort(aborts)
    return engine.step() if engine.has_unfinished else []


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
    """Spawned workers need nothing from the user's ``__main__`` (their target and arguments
    live in tpspec), so keep ``multiprocessing`` from re-running the user's script in them:
    scripts then work without an ``if __name__ == "__main__":`` guard."""
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
    """``tp_size`` spawned local processes, one per rank."""

    def __init__(self, config: EngineConfig, *, init_timeout_s: float = 300.0, step_timeout_s: float = 120.0) -> None:
        self.config = config
        self.init_timeout_s = init_timeout_s
        self.step_timeout_s = step_timeout_s
        self.procs: list[Any] = []
        self._commands: list[Any] = []
        self._out: Any = None
        self._call_id = 0
        self._broken: str | None = None

    @property
    def pids(self) -> list[int]:
        """Process ids of the ranks, index = rank."""
        return [p.pid for p in self.procs]

    def start(self) -> None:
        ctx = _worker_context()
        n = self.config.tp_size
        if self.config.device == "cuda" and torch.cuda.device_count() < n:
            raise ValueError(f"tp_size={n} needs {n} GPUs, this host has {torch.cuda.device_count()}")
        self._out = ctx.Queue()
        self._commands = [ctx.Queue() for _ in range(n)]
        port = D.find_free_port()
        self.procs = [
            ctx.Process(target=_mp_worker_main,
                        args=(r, n, port, self.config, self._commands[r], self._out, dict(os.environ), os.getpid()),
                        daemon=True, name=f"tpspec-rank{r}")
            for r in range(n)
        ]
        with _main_module_hidden():
            for p in self.procs:
                p.start()
        ready: set[int] = set()
        deadline = time.monotonic() + self.init_timeout_s
        try:
            while len(ready) < n:
                msg = self._next_message(deadline, f"start-up (model load) of {n} ranks")
                if msg[0] == "ready":
                    ready.add(msg[1])
        except BaseException:
            self._abort()
            raise

    def run(self, requests: list[Request], on_progress: ProgressFn | None = None) -> list[SequenceResult]:
        if self._broken:
            raise WorkerError(f"the workers are gone ({self._broken}); create a new LLM")
        if not self.procs:
            raise RuntimeError("the executor is not started (or already shut down)")
        self._call_id += 1
        call_id = self._call_id
        for q in self._commands:
            q.put(("generate", call_id, requests))
        try:
            while True:
                msg = self._next_message(time.monotonic() + self.step_timeout_s,
                                         f"progress (no step finished in {self.step_timeout_s:.0f} s)")
                if msg[0] == "progress" and msg[1] == call_id and on_progress is not None:
                    on_progress(msg[2], msg[3])
                elif msg[0] == "result" and msg[1] == call_id:
                    return msg[2]
        except BaseException as exc:
            self._abort()
            self._broken = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise

    def step(self, new_requests: list[Request], aborts: list[int]) -> list[SequenceUpdate]:
        if self._broken:
            raise WorkerError(f"the workers are gone ({self._broken}); create a new LLM")
        if not self.procs:
            raise RuntimeError("the executor is not started (or already shut down)")
        self._call_id += 1
        call_id = self._call_id
        for q in self._commands:
            q.put(("step", call_id, new_requests, aborts))
        try:
            while True:
                msg = self._next_message(time.monotonic() + self.step_timeout_s,
                                         f"a step (none finished in {self.step_timeout_s:.0f} s)")
                if msg[0] == "stepped" and msg[1] == call_id:
                    return msg[2]
        except BaseException as exc:
            self._abort()
            self._broken = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise

    def _next_message(self, deadline: float, waiting_for: str) -> tuple:
        """The next message from the ranks; raises :class:`WorkerError` on a rank's error,
        a dead rank, or the deadline."""
        while True:
            try:
                msg = self._out.get(timeout=POLL_S)
            except queue.Empty:
                self._check_alive()
                if time.monotonic() > deadline:
                    states = ", ".join(f"rank {r}: pid {p.pid} {'alive' if p.is_alive() else 'dead'}"
                                       for r, p in enumerate(self.procs))
                    raise WorkerError(f"timed out waiting for {waiting_for}; {states}") from None
                continue
            if msg[0] == "error":
                self._raise_rank_error(msg[1], msg[2])
            return msg

    def _raise_rank_error(self, rank: int, tb: str) -> None:
        """A rank raised. When a peer died, that death is the news (the raise is its echo:
        a collective lost its peer), so name the dead rank first."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            dead = [(r, p) for r, p in enumerate(self.procs) if r != rank and p.exitcode not in (None, 0)]
            if dead:
                r, p = dead[0]
                last = tb.strip().splitlines()[-1] if tb.strip() else ""
                raise WorkerError(f"worker rank {r} (pid {p.pid}) died with exit code {p.exitcode}; "
                                  f"rank {rank} then failed: {last}")
            time.sleep(0.05)
        raise WorkerError(f"worker rank {rank} raised:\n{tb}")

    def _check_alive(self) -> None:
        for rank, p in enumerate(self.procs):
            if p.exitcode is not None:
                # A crashing rank usually posts its traceback first: prefer that message.
                try:
                    msg = self._out.get(timeout=0.5)
                    if msg[0] == "error" and msg[1] == rank:
                        raise WorkerError(f"worker rank {rank} raised:\n{msg[2]}")
                except queue.Empty:
                    pass
                raise WorkerError(f"worker rank {rank} (pid {p.pid}) died with exit code {p.exitcode}")

    def _abort(self) -> None:
        started = [p for p in self.procs if p.pid is not None]
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
    """One TP rank inside a Ray actor (threaded: ``progress`` answers while ``generate`` runs)."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.rank = -1
        self._progress = (0, 0, 0)

    def node_info(self) -> tuple[str, str, list[str]]:
        """(node id, node IP, GPU ids Ray gave this actor)."""
        import ray

        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), ray.util.get_node_ip_address(), [str(g) for g in ray.get_gpu_ids()]

    def free_port(self) -> int:
        return free_port()

    def setup(self, rank: int, world_size: int, addr: str, port: int, config: EngineConfig,
              env: dict[str, str]) -> bool:
        # Before anything touches CUDA: every actor of a node sees all of that node's GPUs,
        # sorted as integers, so CUDA IPC between ranks works; LOCAL_RANK picks ours.
        os.environ.update(env)
        self.rank = rank
        torch.set_num_threads(_worker_threads(world_size) if config.device == "cpu" else 1)
        mapping = D.init_distributed(rank=rank, world_size=world_size, master_addr=addr, master_port=port,
                                     tp_size=world_size, device=config.device,
                                     enable_attention_dp=config.attention_dp)
        local = int(os.environ.get("LOCAL_RANK", "0"))
        self.engine = Engine(config, mapping, _pick_device(config, local))
        return True

    def generate(self, call_id: int, requests: list[Request]) -> list[SequenceResult] | None:
        assert self.engine is not None
        if self.engine.device.type == "cuda":  # the current device is per thread; this may be a new one
            torch.cuda.set_device(self.engine.device)

        def record(steps: int, tokens: int) -> None:
            self._progress = (call_id, steps, tokens)

        results = self.engine.generate(requests, record if self.rank == 0 else None)
        return results if self.rank == 0 else None

    def step(self, new_requests: list[Request], aborts: list[int]) -> list[SequenceUpdate] | None:
        assert self.engine is not None
        if self.engine.device.type == "cuda":
            torch.cuda.set_device(self.engine.device)
        updates = _engine_step(self.engine, new_requests, aborts)
        return updates if self.rank == 0 else None

    def progress(self) -> tuple[int, int, int]:
        return self._progress

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        D.destroy_distributed()


class RayExecutor(Executor):
    """One actor per TP rank in a placement group of ``{"GPU": 1}`` bundles (``{"CPU": 1}`` on
    CPU). Connects to ``RAY_ADDRESS`` when set, else starts (and later stops) a local Ray."""

    def __init__(self, config: EngineConfig, *, init_timeout_s: float = 300.0, step_timeout_s: float = 120.0,
                 placement_timeout_s: float = 60.0, ray_init_kwargs: dict | None = None) -> None:
        self.config = config
        self.init_timeout_s = init_timeout_s
        self.step_timeout_s = step_timeout_s
        self.placement_timeout_s = placement_timeout_s
        self.ray_init_kwargs = dict(ray_init_kwargs or {})
        self.actors: list[Any] = []
        self.pg: Any = None
        self._started_ray = False
        self._call_id = 0
        self._broken: str | None = None

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
        n = self.config.tp_size
        if not ray.is_initialized():
            if os.environ.get("RAY_ADDRESS") or "address" in self.ray_init_kwargs:
                kwargs = dict(self.ray_init_kwargs)  # join a running cluster (e.g. inside `ray job submit`)
            else:  # start a local Ray for this LLM (stopped again at shutdown)
                kwargs = {"include_dashboard": False, "log_to_driver": False, **self.ray_init_kwargs}
            ray.init(**kwargs)
            self._started_ray = True
        gpu = self.config.device == "cuda"
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
        env = self._rank_envs(infos)
        for e in env:  # the driver's tpspec settings reach the actors (forced acceptance, threads)
            e.update({k: v for k, v in os.environ.items() if k.startswith("TPSPEC_")})
        config = self.config
        if len({node for node, _, _ in infos}) > 1:
            config = dataclasses.replace(config, exchange="allgather")  # the LL exchange is one node only
        addr = infos[0][1]
        port = self._wait([self.actors[0].free_port.remote()], 30.0, "rank 0's port")[0]
        self._wait([a.setup.remote(r, n, addr, port, config, env[r]) for r, a in enumerate(self.actors)],
                   self.init_timeout_s, "process group and model load")

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
            raise WorkerError(f"Ray actors did not finish {what} within {timeout_s:.0f} s")
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

    def run(self, requests: list[Request], on_progress: ProgressFn | None = None) -> list[SequenceResult]:
        import ray

        if self._broken:
            raise WorkerError(f"the workers are gone ({self._broken}); create a new LLM")
        if not self.actors:
            raise RuntimeError("the executor is not started (or already shut down)")
        self._call_id += 1
        call_id = self._call_id
        refs = [a.generate.remote(call_id, requests) for a in self.actors]
        last_change = time.monotonic()
        last_seen = None
        try:
            while True:
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=POLL_S)
                for ref in ready:
                    self._get(ref, "generate")
                if len(ready) == len(refs):
                    return self._get(refs[0], "generate")
                try:
                    seen = ray.get(self.actors[0].progress.remote(), timeout=5.0)
                except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
                    seen = last_seen
                if seen != last_seen and seen is not None and seen[0] == call_id:
                    last_seen, last_change = seen, time.monotonic()
                    if on_progress is not None:
                        on_progress(seen[1], seen[2])
                if time.monotonic() - last_change > self.step_timeout_s:
                    raise WorkerError(f"no step finished in {self.step_timeout_s:.0f} s: a Ray rank is hung")
        except BaseException as exc:
            self._broken = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self._kill_actors()
            raise

    def step(self, new_requests: list[Request], aborts: list[int]) -> list[SequenceUpdate]:
        if self._broken:
            raise WorkerError(f"the workers are gone ({self._broken}); create a new LLM")
        if not self.actors:
            raise RuntimeError("the executor is not started (or already shut down)")
        refs = [a.step.remote(new_requests, aborts) for a in self.actors]
        try:
            return self._wait(refs, self.step_timeout_s, "a step")[0]
        except BaseException as exc:
            self._broken = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
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


def make_executor(launcher: str, config: EngineConfig, **timeouts: Any) -> Executor:
    """``"mp"`` -> :class:`MPExecutor`, ``"ray"`` -> :class:`RayExecutor`, ``"torchrun"`` ->
    :class:`InProcessExecutor`."""
    if launcher == "mp":
        return MPExecutor(config, **timeouts)
    if launcher == "ray":
        return RayExecutor(config, **timeouts)
    if launcher == "torchrun":
        return InProcessExecutor(config)
    raise ValueError(f"launcher must be 'mp', 'torchrun' or 'ray', got {launcher!r}")
