"""Per-request sampling parameters and their normalization.

A request says how its tokens are drawn with ``SamplingParams(temperature, top_k,
top_p, min_p, seed)``, every field optional. The parameters are validated when the
object is built and normalized once, so the batch code never sees ``None``:

* greedy when ``temperature`` is None or 0 (or below the greedy threshold) or
  ``top_k == 1``; a greedy request gets the sentinel temperature
  :data:`GREEDY_SENTINEL_TEMPERATURE` (below ``GREEDY_TEMPERATURE_THRESHOLD``, so
  every kernel takes the argmax and never divides by it);
* a disabled top-k (None or 0) becomes :data:`TOP_K_DISABLED` (INT32_MAX);
* neutral top-p is 1.0 and neutral min-p is 0.0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..keys import GREEDY_TEMPERATURE_THRESHOLD

TOP_K_DISABLED = 2**31 - 1
"""Normalized top-k of a request that does not filter by rank (INT32_MAX)."""

GREEDY_SENTINEL_TEMPERATURE = 1e-6
"""Normalized temperature of greedy requests: below the greedy threshold (1e-5)."""

SEED_RANGE = (0, 2**64)
"""User seeds are integers in ``[0, 2**64)``; they are used as a 64-bit Philox key."""

FLOAT32_MAX = 3.4028234663852886e38  # temperatures above it become inf in the kernels' float32
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32: a top_p below it would round to 0

assert GREEDY_SENTINEL_TEMPERATURE < GREEDY_TEMPERATURE_THRESHOLD


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples its tokens. Immutable and hashable.

    ``temperature``: None or a finite float >= 0 (None/0 = greedy).
    ``top_k``: None or an int >= 0 (None/0 = no rank filter, 1 = greedy).
    ``top_p``: None or a float in (0, 1] (1 = no nucleus filter).
    ``min_p``: None or a float in [0, 1] (0 = no filter; keeps tokens with
    ``p >= min_p * p_max``).
    ``seed``: None (the request draws from the shared unseeded stream) or an int in
    ``[0, 2**64)``: the request's own stream. Given identical logits the request draws the
    same tokens whatever its batch, batch position, KV slot history or TP size; the default
    model forward does not promise identical logits across batches or TP sizes.

    Raises ``ValueError`` naming the bad field. The normalized values are properties
    (:attr:`is_greedy`, :attr:`norm_temperature`, :attr:`norm_top_k`, ...).
    """

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        # Values are checked as the float32 the kernels will hold, not only as Python floats.
        if t is not None and (not _is_real(t) or not math.isfinite(t) or t < 0 or t > FLOAT32_MAX):
            raise ValueError(f"SamplingParams.temperature must be None or a finite float32 >= 0, got {t!r}")
        k = self.top_k
        if k is not None and (not _is_int(k) or k < 0):
            raise ValueError(f"SamplingParams.top_k must be None or an int >= 0 (0 disables it), got {k!r}")
        if k is not None and k > TOP_K_DISABLED:
            raise ValueError(f"SamplingParams.top_k={k} exceeds INT32_MAX")
        p = self.top_p
        if p is not None and (not _is_real(p) or not (FLOAT32_TINY <= p <= 1.0)):
            raise ValueError(f"SamplingParams.top_p must be None or in (0, 1] (at least {FLOAT32_TINY:g} "
                             f"as float32), got {p!r}")
        m = self.min_p
        if m is not None and (not _is_real(m) or not (0.0 <= m <= 1.0)):
            raise ValueError(f"SamplingParams.min_p must be None or in [0, 1], got {m!r}")
        s = self.seed
        if s is not None and (not _is_int(s) or not SEED_RANGE[0] <= s < SEED_RANGE[1]):
            raise ValueError(f"SamplingParams.seed must be None or an int in [0, 2**64), got {s!r}")

    # -- normalization ---------------------------------------------------------------
    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax: no temperature (None/0/below threshold) or top_k == 1."""
        t = self.temperature
        return t is None or t < GREEDY_TEMPERATURE_THRESHOLD or self.top_k == 1

    @property
    def norm_temperature(self) -> float:
        """The temperature kernels use: the greedy sentinel for greedy requests."""
        return GREEDY_SENTINEL_TEMPERATURE if self.is_greedy else float(self.temperature)  # type: ignore[arg-type]

    @property
    def norm_top_k(self) -> int:
        """Top-k the kernels use: INT32_MAX when disabled (None/0) or greedy."""
        if self.is_greedy or not self.top_k:
            return TOP_K_DISABLED
        return int(self.top_k)

    @property
    def norm_top_p(self) -> float:
        return 1.0 if self.is_greedy or self.top_p is None else float(self.top_p)

    @property
    def norm_min_p(self) -> float:
        return 0.0 if self.is_greedy or self.min_p is None else float(self.min_p)

    @property
    def is_temperature_only(self) -> bool:
        """True when the request can be drawn on vocab shards by Gumbel-max: greedy, or a
        temperature with no top-k/top-p/min-p filter (after normalization)."""
        return self.is_greedy or (
            self.norm_top_k == TOP_K_DISABLED and self.norm_top_p >= 1.0 and self.norm_min_p <= 0.0
        )

    @property
    def is_seeded(self) -> bool:
        return self.seed is not None

    @property
    def seed_int64(self) -> int | None:
        """The seed as the signed int64 with the same 64 bits (what the Philox tensors hold)."""
        if self.seed is None:
            return None
        return self.seed - 2**64 if self.seed >= 2**63 else self.seed

    def normalized(self) -> tuple[float, int, float, float]:
        """``(temperature, top_k, top_p, min_p)`` after normalization."""
        return self.norm_temperature, self.norm_top_k, self.norm_top_p, self.norm_min_p


GREEDY = SamplingParams()
"""The default: greedy, unseeded."""
