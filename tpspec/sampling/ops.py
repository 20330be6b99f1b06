"""Sampling on full logits rows: the reference that defines every draw.

Each function here follows ``docs/determinism.md`` bit for bit; the vocabulary-sharded
path (``tpspec.sampling.select``) is tested against it. Per row:

* greedy rows (temperature below the greedy threshold) take the argmax in the key order
  of ``tpspec.keys`` (ties to the lowest column, NaN wins, ``-0 == +0``): ``torch.argmax``;
* sampled rows score ``s = logit / T`` (float32), take the row max ``m`` and the int64 masses
  ``q = floor(exp(s - m) * 2**40)`` (``keys.column_masses``, the portable ``exp``), then
  filter in key order of ``s``: top-k keeps the ``k`` best columns; top-p then the shortest
  prefix of those whose mass reaches ``ceil(top_p * Z)`` (``Z`` their total mass, ``top_p``
  rounded to 24 fractional bits, exact integer product); min-p the columns with
  ``q >= floor(min_p * 2**40)``. The best column always survives. A row whose max score is
  NaN or infinite keeps only its best column. The token is the Gumbel-max
  ``argmax(s - ln E)`` over the surviving columns with the noise of ``keys.gumbel_scores``
  (seed, offset, global column): without filters exactly the sharded exchange's token.

``top_k``: ``[R]`` int (``>= V`` or INT32_MAX: off); ``top_p``: ``[R]`` float (``>= 1``: off);
``min_p``: ``[R]`` float (``0``: off); ``None``: off for every row.
flashinfer's sampler draws with its own generator and filter arithmetic: it is used only
when asked for (``backend="flashinfer"``), never by the runtime.
"""

from __future__ import annotations

from typing import Any

import torch

from ..keys import (
    EMPTY_KEY,
    GREEDY_TEMPERATURE_THRESHOLD,
    canonical_float32,
    column_masses,
    gumbel_scores,
    min_p_threshold,
    pack_keys,
    top_p_fixed,
    top_p_target,
    unpack_indices,
    unpack_keys,
)
from .params import TOP_K_DISABLED

NEG_INF = float("-inf")


# ----------------------------------------------------------------------------- helpers

def _rows(t: torch.Tensor | None, rows: int, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != rows:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a 1-D tensor of {rows} rows, got {shape}")
    return t.to(device=device, dtype=dtype)


def _check_logits(logits: Any) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a 2-D tensor [rows, vocab], got {getattr(logits, 'shape', type(logits))}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")


def key_argmax(values: torch.Tensor) -> torch.Tensor:
    """Row argmax in key order (``[R, V]`` -> ``[R]`` int64): equals ``torch.argmax``,
    ties to the lowest column, the first NaN wins."""
    columns = torch.arange(values.shape[1], dtype=torch.int64, device=values.device)
    return unpack_indices(pack_keys(values, columns.reshape(1, -1)).max(dim=1).values)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Greedy tokens of full logits rows: ``[R, V]`` -> ``[R]`` int64 (``torch.argmax`` semantics)."""
    _check_logits(logits)
    return key_argmax(logits)


def greedy_rows(temperature: torch.Tensor, threshold: float = GREEDY_TEMPERATURE_THRESHOLD) -> torch.Tensor:
    """Boolean ``[R]``: rows whose temperature is below the greedy threshold."""
    return temperature.to(torch.float32) < threshold


# ----------------------------------------------------------------------------- filters

def scaled_scores(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``s = logit / T`` of every column, float32 canonical (``-0 -> +0``, one NaN):
    ``[R, V]`` logits and ``[R]`` temperatures (rows below the greedy threshold use T = 1)."""
    t = temperature.to(device=logits.device, dtype=torch.float32)
    t = torch.where(t < GREEDY_TEMPERATURE_THRESHOLD, torch.ones_like(t), t)
    return canonical_float32(canonical_float32(logits) / t.reshape(-1, 1))


def filter_flags(
    rows: int,
    vocab: int,
    device: torch.device,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row ``[R]`` bool: whether top-k, top-p and min-p are on (``None`` = off)."""
    off = torch.zeros(rows, dtype=torch.bool, device=device)
    k_on = off if top_k is None else top_k.to(device) < vocab
    p_on = off if top_p is None else top_p.to(device) < 1.0
    m_on = off if min_p is None else min_p.to(device) > 0.0
    return k_on, p_on, m_on


def keep_mask(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which columns a sampled row may draw: ``[R, V]`` bool (see the module docstring).

    ``temperature`` ``[R]`` (rows below the greedy threshold are computed with T = 1; the
    caller ignores them); ``top_k``/``top_p``/``min_p`` ``[R]`` or None (off). Rows without
    an active filter keep every column.
    """
    _check_logits(logits)
    rows, vocab = logits.shape
    device = logits.device
    t = _rows(temperature, rows, "temperature", device, torch.float32)
    top_k = _rows(top_k, rows, "top_k", device, torch.int64)
    top_p = _rows(top_p, rows, "top_p", device, torch.float32)
    min_p = _rows(min_p, rows, "min_p", device, torch.float32)
    k_on, p_on, m_on = filter_flags(rows, vocab, device, top_k, top_p, min_p)
    any_on = k_on | p_on | m_on
    keep = torch.ones(rows, vocab, dtype=torch.bool, device=device)
    if rows == 0 or not bool(any_on.any()):
        return keep
    scores = scaled_scores(logits, t)
    columns = torch.arange(vocab, dtype=torch.int64, device=device)
    sorted_keys, order = torch.sort(pack_keys(scores, columns.reshape(1, -1)), dim=1, descending=True)
    keep_sorted = sorted_filter_mask(sorted_keys, k_on, top_k, p_on, top_p, m_on, min_p)
    keep_sorted |= ~any_on.reshape(-1, 1)
    return torch.zeros_like(keep).scatter_(1, order, keep_sorted)


def sorted_filter_mask(
    sorted_keys: torch.Tensor,
    k_on: torch.Tensor,
    top_k: torch.Tensor | None,
    p_on: torch.Tensor,
    top_p: torch.Tensor | None,
    m_on: torch.Tensor,
    min_p: torch.Tensor | None,
    total: torch.Tensor | None = None,
) -> torch.Tensor:
    """The filters on keys sorted best first: ``[R, N]`` bool, which of ``sorted_keys`` survive.

    ``sorted_keys``: ``[R, N]`` int64 score keys in descending order, the row's best first
    (``EMPTY_KEY`` pads); ``*_on``: ``[R]`` bool; ``top_k``/``top_p``/``min_p``: ``[R]`` (read
    where on). ``total``: ``[R]`` int64 mass of the whole row for rows with top-p but no top-k
    (None: the sum of ``sorted_keys``' masses, right when the keys are the whole row). A row
    whose best score is not finite keeps only its best column. Shared by the full-row reference
    and the sharded path's candidates, so both cut at the same column.
    """
    rows, width = sorted_keys.shape
    device = sorted_keys.device
    values, _ = unpack_keys(sorted_keys)
    best = values[:, 0]
    real = sorted_keys != EMPTY_KEY
    masses = torch.where(real, column_masses(torch.where(real, values, torch.zeros_like(values)), best),
                         torch.zeros_like(sorted_keys))
    positions = torch.arange(width, dtype=torch.int64, device=device).reshape(1, -1)
    keep = torch.ones(rows, width, dtype=torch.bool, device=device)
    if top_k is not None:
        k = top_k.to(device=device, dtype=torch.int64).clamp(min=1).reshape(-1, 1)
        keep &= (positions < k) | ~k_on.reshape(-1, 1)
    if top_p is not None:
        kept_mass = torch.where(keep, masses, torch.zeros_like(masses))
        z = kept_mass.sum(dim=1)
        if total is not None:
            z = torch.where(k_on, z, total.to(device))
        target = top_p_target(z, top_p_fixed(top_p.to(device)))
        before = torch.cumsum(kept_mass, dim=1) - kept_mass
        keep &= (before < target.reshape(-1, 1)) | ~p_on.reshape(-1, 1)
    if min_p is not None:
        keep &= (masses >= min_p_threshold(min_p.to(device)).reshape(-1, 1)) | ~m_on.reshape(-1, 1)
    keep &= real
    degenerate = ~torch.isfinite(best)
    keep &= ~degenerate.reshape(-1, 1)
    keep[:, 0] = True
    return keep


def filtered_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float32 logits (not divided by T) with the filtered columns set to ``-inf``: ``[R, V]``."""
    keep = keep_mask(logits, temperature, top_k, top_p, min_p)
    return canonical_float32(logits).masked_fill(~keep, NEG_INF)


def filtered_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """The distribution each row is sampled from: ``[R, V]`` float32, rows sum to 1.

    Sampled rows: ``softmax(filtered_logits / T)``; greedy rows: one-hot at the argmax.
    Sampled rows with a NaN or ``+inf`` logit (or nothing but ``-inf``) have no softmax;
    their draw is a point mass on the key argmax (the first NaN, else the first ``+inf``,
    else column 0), so they are one-hot there too. This is exactly the law of
    :func:`sample_from_logits` (what rejection sampling needs as the target distribution).
    """
    _check_logits(logits)
    rows = logits.shape[0]
    t = _rows(temperature, rows, "temperature", logits.device, torch.float32)
    greedy = greedy_rows(t)
    safe_t = torch.where(greedy, torch.ones_like(t), t)
    probs = torch.softmax(filtered_logits(logits, safe_t, top_k, top_p, min_p) / safe_t.reshape(-1, 1), dim=1)
    point_mass = greedy | torch.isnan(probs).any(dim=1)
    if bool(point_mass.any()):
        # The best column of s = logit / T (logit itself on greedy rows): the draw of such rows.
        one_hot = torch.zeros_like(probs).scatter_(1, key_argmax(scaled_scores(logits, t)).reshape(-1, 1), 1.0)
        probs = torch.where(point_mass.reshape(-1, 1), one_hot, probs)
    return probs


# ---------------------------------------------------------------------------- sampling

def _flashinfer_sampling() -> Any:
    try:
        import flashinfer.sampling as fs  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - any import problem means "not available"
        return None
    return fs


def sample_from_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    *,
    needs_reproducible_streams: bool = True,
    backend: str = "auto",
) -> torch.Tensor:
    """One token per row of full logits ``[R, V]`` -> ``[R]`` int64 (see the module docstring).

    ``temperature``: ``[R]`` float (below the greedy threshold: argmax);
    ``seeds``/``offsets``: ``[R]`` int64 Philox streams; ``top_k``/``top_p``/``min_p``:
    ``[R]`` or None (off). ``backend``: ``"auto"`` and ``"torch"`` are the reference;
    ``"flashinfer"`` draws with flashinfer's own generator (an error when it cannot be used).
    ``needs_reproducible_streams`` is accepted for callers that pass it; the reference always
    draws from each row's own stream. Deterministic: equal inputs give equal tokens on every rank.
    """
    _check_logits(logits)
    if backend not in ("auto", "torch", "flashinfer"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'flashinfer', got {backend!r}")
    rows, vocab = logits.shape
    device = logits.device
    t = _rows(temperature, rows, "temperature", device, torch.float32)
    seeds = _rows(seeds, rows, "seeds", device, torch.int64)
    offsets = _rows(offsets, rows, "offsets", device, torch.int64)
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    greedy = greedy_rows(t)
    # One host sync for both facts (this path syncs anyway).
    all_greedy, all_finite = (bool(v) for v in torch.stack([greedy.all(), torch.isfinite(t).all()]).tolist())
    if not all_finite:
        raise ValueError(f"temperature has NaN or infinite values: {t.tolist()[:8]}")
    if all_greedy:
        return key_argmax(logits)
    safe_t = torch.where(greedy, torch.ones_like(t), t)
    if backend == "flashinfer":
        fs = _flashinfer_sampling()
        if fs is None or device.type != "cuda" or (min_p is not None and bool((min_p > 0).any())):
            raise RuntimeError("flashinfer sampling cannot be used here: it needs flashinfer installed, CUDA logits "
                               "and no min-p (it draws with its own generator from seed[0]/offset[0])")
        first = int(torch.nonzero(~greedy)[0])
        sampled = _flashinfer_sample(fs, logits, safe_t, top_k, top_p, int(seeds[first]), int(offsets[first]))
    else:
        keep = keep_mask(logits, safe_t, top_k, top_p, min_p)
        columns = torch.arange(vocab, dtype=torch.int64, device=device)
        keys = pack_keys(gumbel_scores(logits, columns, safe_t, seeds, offsets), columns.reshape(1, -1))
        sampled = unpack_indices(torch.where(keep, keys, torch.full_like(keys, EMPTY_KEY)).max(dim=1).values)
    return torch.where(greedy, key_argmax(logits), sampled)


def _flashinfer_sample(
    fs: Any,
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    seed: int,
    offset: int,
) -> torch.Tensor:
    rows, vocab = logits.shape
    scaled = logits.to(torch.float32) / temperature.reshape(-1, 1)
    k = torch.full((rows,), vocab, dtype=torch.int32, device=logits.device) if top_k is None else top_k
    k = k.clamp(max=min(vocab, TOP_K_DISABLED)).to(torch.int32)
    p = torch.ones(rows, dtype=torch.float32, device=logits.device) if top_p is None else top_p.to(torch.float32)
    tokens = fs.top_k_top_p_sampling_from_logits(scaled, k, p, deterministic=True, seed=seed, offset=offset)
    return tokens.to(torch.int64)
