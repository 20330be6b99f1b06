"""Pick the fastest exchange the group allows; every choice gives identical tokens."""

from __future__ import annotations

from typing import Any

from .allgather import AllGatherKeyExchange
from .base import KeyExchange


def make_key_exchange(group: Any = None, prefer: str = "auto", **kwargs: Any) -> KeyExchange:
    """``prefer``: ``"auto"`` (LL when CUDA, cupy and one node allow it), ``"ll"`` (LL or an
    error saying why not), ``"allgather"``. Collective over ``group``.
    """
    if prefer not in ("auto", "ll", "allgather"):
        raise ValueError(f"prefer must be 'auto', 'll' or 'allgather', got {prefer!r}")
    if prefer == "allgather":
        return AllGatherKeyExchange(group, device=kwargs.get("device"))
    # The LL exchange lands with the LL issue; until then 'auto' is the all-gather.
    if prefer == "ll":
        raise RuntimeError("the LL exchange is not available in this build")
    return AllGatherKeyExchange(group, device=kwargs.get("device"))
