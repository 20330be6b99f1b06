"""Forced acceptance for benchmarks: ``TPSPEC_FORCE_NUM_ACCEPTED_TOKENS``.

The env var is a float ``a >= 0``. Every generation request accepts ``floor(a)``
drafts each step, plus one more with probability ``a - floor(a)``; never more than
its drafts. The extra draft is decided by a uniform from a fixed-seed pool of
:data:`POOL_SIZE` values (Philox words of :data:`POOL_SEED`, identical on every rank
and device), at index ``(counter * 6007 + slot * 1009) mod POOL_SIZE``. ``counter``
lives on the device and advances once per step, so a CUDA graph replay advances it
without host work; eager warm-up steps of CUDA graph capture pass ``is_warmup=True``
and neither force anything nor advance the counter, so the forced sequence does not
depend on how many warm-up steps ran.
"""

from __future__ import annotations

import math
import os

import torch

from ..sampling.streams import uniforms
from ..validation import check_real
from .accept import PAD_TOKEN

FORCE_ENV = "TPSPEC_FORCE_NUM_ACCEPTED_TOKENS"
POOL_SIZE = 65536
POOL_SEED = 0x5EED_F0CE_ACCE_0001
COUNTER_STRIDE = 6007
SLOT_STRIDE = 1009


class ForcedAcceptanceWarning(UserWarning):
    """Forced acceptance is active outside a benchmark: the tokens are not the model's."""


def read_forced_rate(environ: dict | None = None) -> float | None:
    """The forced acceptance rate from the environment, or None when unset/empty.

    Raises ``ValueError`` for a value that is not a finite float >= 0.
    """
    env = os.environ if environ is None else environ
    raw = env.get(FORCE_ENV, "")
    if raw.strip() == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{FORCE_ENV}={raw!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{FORCE_ENV}={raw!r} must be a finite number >= 0")
    return value


class ForcedAcceptance:
    """Decides how many drafts each request accepts, independent of the tokens.

    ``rate``: the float of the env var; ``device``: where the pool and the counter live.
    Deterministic: every rank with the same slots and the same number of steps gets
    the same counts.
    """

    def __init__(self, rate: float, *, device: str | torch.device = "cpu") -> None:
        self.rate = check_real("forced acceptance rate", rate, low=0)
        self.whole = int(math.floor(self.rate))
        self.fraction = self.rate - self.whole
        self.device = torch.device(device)
        seed = torch.tensor([POOL_SEED - 2**64 if POOL_SEED >= 2**63 else POOL_SEED], dtype=torch.int64)
        pool = uniforms(seed, torch.zeros(1, dtype=torch.int64), torch.arange(POOL_SIZE, dtype=torch.int64))[0]
        self.pool = pool.to(self.device)
        self.counter = torch.zeros(1, dtype=torch.int64, device=self.device)

    @classmethod
    def from_env(cls, *, device: str | torch.device = "cpu", environ: dict | None = None) -> "ForcedAcceptance | None":
        """A ``ForcedAcceptance`` when ``TPSPEC_FORCE_NUM_ACCEPTED_TOKENS`` is set, else None."""
        rate = read_forced_rate(environ)
        return None if rate is None else cls(rate, device=device)

    def pool_uniforms(self, slot_ids: torch.Tensor) -> torch.Tensor:
        """``[B]`` float64 uniforms of this step for the given KV slots (does not advance)."""
        slots = slot_ids.to(device=self.device, dtype=torch.int64)
        index = torch.remainder(self.counter * COUNTER_STRIDE + slots * SLOT_STRIDE, POOL_SIZE)
        return self.pool[index]

    def num_drafts_accepted(self, slot_ids: torch.Tensor, draft_lens: torch.Tensor, *, advance: bool = True) -> torch.Tensor:
        """``[B]`` int64 drafts to accept: ``min(draft_len, floor(a) + [u < frac(a)])``.

        Advances the device counter once when ``advance``.
        """
        extra = (self.pool_uniforms(slot_ids) < self.fraction).to(torch.int64)
        n = torch.minimum(self.whole + extra, draft_lens.to(device=self.device, dtype=torch.int64))
        if advance:
            self.counter.add_(1)
        return n

    def rewind(self) -> None:
        """Step the device counter back once: the next step draws what the last one drew (a step
        that is run again, see ``SpecWorker.step(repeat=True)``)."""
        self.counter.sub_(1)

    def apply(
        self,
        target_tokens: torch.Tensor,
        draft_tokens: torch.Tensor,
        draft_lens: torch.Tensor,
        slot_ids: torch.Tensor,
        *,
        is_warmup: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Forced ``(accepted_tokens [B, D+1], num_accepted [B])``, or None during warm-up.

        ``target_tokens``: ``[B, D+1]`` the target's token per position; ``draft_tokens``
        ``[B, D]``; ``draft_lens`` ``[B]`` (0 for context requests, which emit 1 token).
        The first ``n`` drafts are emitted as accepted, then the target's token at ``n``.
        """
        if is_warmup:
            return None
        batch, width = target_tokens.shape
        n = self.num_drafts_accepted(slot_ids, draft_lens)
        positions = torch.arange(width, dtype=torch.int64, device=target_tokens.device).reshape(1, -1)
        pad = torch.full((batch, 1), PAD_TOKEN, dtype=torch.int64, device=target_tokens.device)
        drafts = torch.cat([draft_tokens.to(torch.int64), pad], dim=1)
        accepted = torch.where(positions < n.reshape(-1, 1), drafts, PAD_TOKEN)
        accepted = accepted.scatter(1, n.reshape(-1, 1), target_tokens.to(torch.int64).gather(1, n.reshape(-1, 1)))
        return accepted, n + 1
