"""Cross-rank key exchanges.

``LLKeyExchange`` (CUDA IPC peer memory) is imported lazily: it needs CUDA and cupy
only when built.
"""

from typing import Any

from .allgather import AllGatherKeyExchange
from .base import Channel, KeyExchange
from .factory import make_key_exchange
from .local import LocalKeyExchange

__all__ = ["Channel", "KeyExchange", "AllGatherKeyExchange", "LocalKeyExchange", "LLKeyExchange", "LLTimeoutError", "make_key_exchange"]


def __getattr__(name: str) -> Any:
    if name in ("LLKeyExchange", "LLTimeoutError"):
        from . import ll

        return getattr(ll, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
