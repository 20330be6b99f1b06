"""Cross-rank key exchanges (SPEC §3)."""

from .allgather import AllGatherKeyExchange
from .base import KeyExchange
from .factory import make_key_exchange

__all__ = ["KeyExchange", "AllGatherKeyExchange", "make_key_exchange"]
