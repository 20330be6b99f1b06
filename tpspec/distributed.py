"""Process-group bootstrap and the few collectives the library uses.

Three ways in, all ending in one default process group and a :class:`Mapping`:

* torchrun: ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` in the environment;
* explicit: ``init_distributed(rank=..., world_size=..., master_addr=..., master_port=...)``
  (what the Ray actors and the multi-process launcher use);
* a single plain process: no environment, no arguments -> world size 1, no process group.

The backend is ``nccl`` when the rank drives a CUDA device and ``gloo`` otherwise.
An explicit loopback ``master_addr`` (one host) keeps every listener of the group on
127.0.0.1: rank 0 serves the store there, and gloo and NCCL use the loopback interface
unless ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` say otherwise. Any other address
(several hosts) listens on every interface, as the peers must reach it.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from .mapping import Mapping

DEFAULT_TIMEOUT_S = 300.0

_TP_GROUP: Any = None
_TP_GROUP_RANKS: list[int] | None = None


def default_backend(device: str | torch.device | None = None) -> str:
    """``nccl`` for a CUDA device, ``gloo`` for everything else."""
    if device is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def find_free_port() -> int:
    """A TCP port that is free on this host's loopback right now (for rank 0's store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def is_loopback(addr: str) -> bool:
    """Whether ``addr`` names this host's loopback (``127.x.x.x``, ``::1``, ``localhost``)."""
    return addr == "localhost" or addr == "::1" or addr.startswith("127.")


def _loopback_store(port: int, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
    """The group's TCP store for a one-host job: rank 0 serves it on a socket bound to
    127.0.0.1 only (torch's own store would listen on every interface)."""
    if rank != 0:
        return dist.TCPStore("127.0.0.1", port, world_size, False, timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(max(128, world_size))
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"rank 0 could not serve the process group's store on 127.0.0.1:{port}: {exc}") from None
    # The store takes the listening socket over: detach it so that Python never closes it.
    return dist.TCPStore("127.0.0.1", port, world_size, True, timeout, master_listen_fd=sock.detach())


def _use_loopback_interface() -> None:
    """Point gloo and NCCL at the loopback interface unless the user chose one: their
    listeners then bind to 127.0.0.1 instead of the host's external address."""
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    loopback = "lo" if "lo" in names else None
    if loopback is None:
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def init_distributed(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    tp_size: int | None = None,
    backend: str | None = None,
    device: str | torch.device | None = None,
    enable_attention_dp: bool = False,
    enable_lm_head_tp_in_adp: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Mapping:
    """Join (or create) the job's process group and return this rank's :class:`Mapping`.

    Explicit ``rank``/``world_size`` win over torchrun's environment; with neither, an
    already initialized default group is reused as it is, and otherwise the process runs
    alone (world size 1, no process group is created). Explicit or torchrun values must
    match an existing group. On CUDA the rank's device is set to
    ``LOCAL_RANK`` (or ``rank % device_count``) before the group is created.
    Raises ``ValueError`` for inconsistent arguments.
    """
    if (rank is None) != (world_size is None):
        raise ValueError("pass both rank and world_size, or neither")
    if rank is None:
        rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
        if (rank is None) != (world_size is None):
            raise ValueError("torchrun environment is incomplete: RANK and WORLD_SIZE must both be set")
    if rank is None:
        if dist.is_available() and dist.is_initialized():  # reuse the existing group as it is
            rank, world_size = dist.get_rank(), dist.get_world_size()
        else:
            rank, world_size = 0, 1
    mapping = Mapping(world_size, rank, tp_size, enable_attention_dp, enable_lm_head_tp_in_adp)

    initialized = dist.is_available() and dist.is_initialized()
    if backend is None:  # an existing group keeps its backend (e.g. gloo ranks sharing one GPU)
        backend = str(dist.get_backend()) if initialized else default_backend(device)
    uses_cuda = backend == "nccl" or (device is not None and torch.device(device).type == "cuda")
    if uses_cuda and torch.cuda.is_available():
        local_rank = _env_int("LOCAL_RANK")
        # Modulo: several ranks may share one GPU (gloo + CUDA IPC); NCCL itself refuses that clearly.
        torch.cuda.set_device((rank if local_rank is None else local_rank) % torch.cuda.device_count())

    if initialized:
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise ValueError(
                f"a process group already exists with rank {dist.get_rank()}/{dist.get_world_size()}, "
                f"not {rank}/{world_size}"
            )
    elif world_size > 1:
        addr = master_addr or os.environ.get("MASTER_ADDR")
        port = master_port or _env_int("MASTER_PORT")
        if addr is None or port is None:
            raise ValueError("a multi-rank job needs master_addr and master_port (or MASTER_ADDR/MASTER_PORT)")
        timeout = datetime.timedelta(seconds=timeout_s)
        if master_addr is not None and is_loopback(addr):
            # A one-host job of our launchers: every listener binds to loopback, the store's
            # and the backend's. (torchrun's ranks keep torchrun's store, which its agent may host.)
            _use_loopback_interface()
            dist.init_process_group(backend=backend, store=_loopback_store(port, rank, world_size, timeout),
                                    rank=rank, world_size=world_size, timeout=timeout)
        else:  # several hosts: the store listens where the peers can reach it (all interfaces)
            dist.init_process_group(backend=backend, init_method=f"tcp://{addr}:{port}", rank=rank,
                                    world_size=world_size, timeout=timeout)
    _init_tp_group(mapping)
    return mapping


def _init_tp_group(mapping: Mapping) -> None:
    """Create every TP group (a collective call on all ranks) and keep this rank's."""
    global _TP_GROUP, _TP_GROUP_RANKS
    _TP_GROUP_RANKS = mapping.tp_group_ranks
    if not (dist.is_available() and dist.is_initialized()):
        _TP_GROUP = None
        return
    if mapping.num_tp_groups == 1:
        _TP_GROUP = dist.group.WORLD
        return
    for ranks in mapping.all_tp_group_ranks:
        group = dist.new_group(ranks)
        if mapping.rank in ranks:
            _TP_GROUP = group


def tp_group() -> Any:
    """This rank's TP process group (``None`` in a single plain process)."""
    return _TP_GROUP


def group_size(group: Any = None) -> int:
    """Ranks in ``group``; 1 when no process group exists."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def group_rank(group: Any = None) -> int:
    """This rank's index in ``group``; 0 when no process group exists."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def group_backend(group: Any = None) -> str | None:
    """``'nccl'``/``'gloo'`` of ``group``, or ``None`` when no process group exists."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return str(dist.get_backend(group))


def all_gather_into(output: torch.Tensor, local: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Gather ``local`` of every rank into ``output`` (``[world * n, ...]``, rank-major).

    One collective. Uses whichever spelling the installed torch provides without
    deprecation noise.
    """
    if group_size(group) == 1:
        output.copy_(local.reshape(output.shape))
        return output
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=FutureWarning)
        warnings.simplefilter("ignore", category=DeprecationWarning)
        dist.all_gather_into_tensor(output, local.contiguous(), group=group)
    return output


def all_reduce_(tensor: torch.Tensor, op: str = "sum", group: Any = None) -> torch.Tensor:
    """In-place all-reduce (``sum``, ``max``, ``min`` or ``band``); identity without a group."""
    if group_size(group) == 1:
        return tensor
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "band": dist.ReduceOp.BAND}
    dist.all_reduce(tensor, op=ops[op], group=group)
    return tensor


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Every rank returns rank ``src``'s ``obj`` (picklable)."""
    if group_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank returns the list of every rank's ``obj``."""
    if group_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * group_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


# Gloo's worker threads let go of a finished collective's tensors after its caller has returned, and
# a tensor whose Python object is already gone needs the GIL to be freed. A worker that gets the GIL
# only once the interpreter is finalizing aborts the process ("terminate called without an active
# exception") -- so the teardown gives the GIL away for a moment, for them to finish while Python is up.
EXIT_DRAIN_S = 0.05


def destroy_distributed() -> None:
    """Tear down the default group (idempotent), then sleep :data:`EXIT_DRAIN_S` with the GIL
    released, so that no collective's worker thread is left to free its tensors while the
    interpreter exits."""
    global _TP_GROUP, _TP_GROUP_RANKS
    _TP_GROUP = None
    _TP_GROUP_RANKS = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        time.sleep(EXIT_DRAIN_S)
