"""Pick the fastest exchange the group allows; every choice gives identical tokens."""

from __future__ import annotations

import socket
import warnings
from typing import Any

import torch

from .. import distributed as D
from .allgather import AllGatherKeyExchange
from .base import KeyExchange

_LL_OPTIONS = ("max_rows", "num_channels", "timeout_s")


def _exchange_device(group: Any, device: Any) -> torch.device:
    """Where keys live: ``device`` if given, else CUDA for NCCL groups, else CPU."""
    if device is not None:
        return torch.device(device)
    if D.group_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def local_ll_blocker(device: torch.device) -> str | None:
    """Why this rank cannot run the LL exchange on ``device`` (``None``: it can)."""
    if device.type != "cuda":
        return f"keys live on {device}, not a CUDA device"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    from . import cuda_module

    if cuda_module.cupy_or_none() is None:
        return "cupy is not installed (pip install 'tpspec[cuda]')"
    try:
        cuda_module.source_path()
    except RuntimeError as exc:
        return str(exc)
    return None


def ll_decision(reports: list[tuple[str, str | None]]) -> str | None:
    """From every rank's ``(hostname, blocker)``: why the group cannot use LL, or ``None``.

    Pure and deterministic, so every rank reaches the same decision from the same list.
    """
    blocked = [(rank, why) for rank, (_, why) in enumerate(reports) if why is not None]
    if blocked:
        return "; ".join(f"rank {rank}: {why}" for rank, why in blocked)
    hosts = sorted({host for host, _ in reports})
    if len(hosts) > 1:
        return f"the group spans {len(hosts)} nodes ({', '.join(hosts)}); CUDA IPC needs one node"
    return None


def ll_unavailable_reason(group: Any, device: torch.device) -> str | None:
    """Why the group cannot use the LL exchange on ``device`` for lack of something
    (CUDA, cupy, the kernel source, one node), or ``None``. Collective over ``group``;
    every rank gets the same answer. A set-up that then fails is not covered: that is a
    fault, which ``LLKeyExchange`` raises on every rank."""
    reports = D.all_gather_object((socket.gethostname(), local_ll_blocker(device)), group)
    return ll_decision(reports)


def make_key_exchange(group: Any = None, prefer: str = "auto", **kwargs: Any) -> KeyExchange:
    """Build the group's key exchange. Collective over ``group``.

    ``prefer``: ``"auto"`` (LL when every rank has CUDA keys, cupy and the same host,
    else all-gather), ``"ll"`` (LL or a ``RuntimeError`` saying why not), ``"allgather"``.
    Keyword options: ``device`` (where keys live; default CUDA for NCCL groups, CPU for
    gloo), and for LL ``max_rows``, ``num_channels``, ``timeout_s``. Every choice gives
    identical tokens; the LL exchange itself falls back to an all-gather for calls with
    more than ``max_rows`` rows.
    """
    if prefer not in ("auto", "ll", "allgather"):
        raise ValueError(f"prefer must be 'auto', 'll' or 'allgather', got {prefer!r}")
    unknown = sorted(set(kwargs) - {"device", *_LL_OPTIONS})
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}; known: device, {', '.join(_LL_OPTIONS)}")
    device = _exchange_device(group, kwargs.get("device"))
    # Check the LL options here, whatever the choice: an option the LL exchange rejects is
    # rejected on every machine, and code that uses channel 3 on LL works on the fallback.
    from . import ll

    num_channels = kwargs.get("num_channels", 2)
    ll.validate_ll_arguments(kwargs.get("max_rows", ll.DEFAULT_MAX_ROWS), num_channels, 1)
    if "timeout_s" in kwargs:
        ll.resolve_timeout_s(kwargs["timeout_s"])
    if prefer == "allgather":
        return AllGatherKeyExchange(group, device=device, num_channels=num_channels)
    reason = ll_unavailable_reason(group, device)
    if reason is not None:
        if prefer == "ll":
            raise RuntimeError(f"the LL exchange is not available: {reason}")
        return AllGatherKeyExchange(group, device=device, num_channels=num_channels)

    options = {k: kwargs[k] for k in _LL_OPTIONS if k in kwargs}
    try:
        return ll.LLKeyExchange(group, device=device, **options)
    except ValueError:
        raise
    except RuntimeError as exc:  # raised on every rank alike (set-up errors are gathered)
        if prefer == "ll":
            raise
        warnings.warn(f"LL key exchange unavailable, using the all-gather exchange: {exc}", RuntimeWarning)
        return AllGatherKeyExchange(group, device=device, num_channels=num_channels)
