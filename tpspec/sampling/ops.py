"""Sampling on full logits rows: greedy, temperature, top-k, top-p, min-p.

The torch reference here runs on CPU and GPU and **defines** behaviour:

* greedy rows (temperature below the greedy threshold) take the argmax with the
  key order of ``tpspec.keys`` (ties to the lowest column, NaN wins, ``-0 == +0``):
  exactly ``torch.argmax``;
* sampled rows keep the columns that survive the filters, applied in this order on
  ``softmax(logits / T)``: top-k (the ``k`` largest logits, ties to the lowest column),
  then top-p (the smallest prefix of the top-k-renormalized distribution, sorted by
  logit, whose mass reaches ``top_p``; the first column always stays), then min-p
  (``p >= min_p * p_max``; the ratio does not change with renormalization). Filtered
  columns become ``-inf`` and the token is the **Gumbel-max** of the masked logits
  with the noise of ``tpspec.keys.gumbel_scores`` keyed by (seed, offset, global
  column) — the same noise the sharded path adds. Hence a temperature-only row drawn
  here gives bit for bit the token the vocab-sharded exchange gives, at any TP size,
  and every draw is reproducible per request stream.

flashinfer (``top_k_top_p_sampling_from_logits``) is used instead for the sampled
rows when it is installed, the logits are on CUDA, no row needs min-p, and the caller
says no row needs a reproducible per-request stream: its kernels read only
``seed[0]``/``offset[0]``. ``TPSPEC_DISABLE_FLASHINFER=1`` turns it off.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..keys import GREEDY_TEMPERATURE_THRESHOLD, canonical_float32, gumbel_scores, pack_keys, unpack_indices
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

def keep_mask(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which columns a sampled row may draw: ``[R, V]`` bool (see the module docstring).

    ``temperature`` ``[R]`` (must be >= the greedy threshold on the rows that matter;
    other rows are computed with T = 1 and should be ignored by the caller);
    ``top_k`` ``[R]`` int (>= V or INT32_MAX: off), ``top_p`` ``[R]`` float (1: off),
    ``min_p`` ``[R]`` float (0: off). ``None`` means off for every row.
    """
    _check_logits(logits)
    rows, vocab = logits.shape
    device = logits.device
    t = _rows(temperature, rows, "temperature", device, torch.float32)
    t = torch.where(t < GREEDY_TEMPERATURE_THRESHOLD, torch.ones_like(t), t)
    top_k = _rows(top_k, rows, "top_k", device, torch.int64)
    top_p = _rows(top_p, rows, "top_p", device, torch.float32)
    min_p = _rows(min_p, rows, "min_p", device, torch.float32)
    x = canonical_float32(logits)
    scaled = x / t.reshape(-1, 1)
    keep = torch.ones(rows, vocab, dtype=torch.bool, device=device)
    use_k = top_k is not None and bool((top_k < vocab).any())
    use_p = top_p is not None and bool((top_p < 1.0).any())
    if use_k or use_p:
        columns = torch.arange(vocab, dtype=torch.int64, device=device)
        # Rank columns by logit (key order: ties to the lowest column), largest first.
        order = torch.sort(pack_keys(x, columns.reshape(1, -1)), dim=1, descending=True).indices
        positions = columns.reshape(1, -1).expand(rows, -1)
        keep_sorted = torch.ones(rows, vocab, dtype=torch.bool, device=device)
        if use_k:
            keep_sorted &= positions < top_k.clamp(min=1).reshape(-1, 1)
        if use_p:
            sorted_scaled = scaled.gather(1, order).masked_fill(~keep_sorted, NEG_INF)
            sorted_probs = torch.softmax(sorted_scaled, dim=1)
            before = torch.cumsum(sorted_probs, dim=1) - sorted_probs  # mass strictly before each column
            before[:, 0] = 0.0
            nucleus = (before < top_p.reshape(-1, 1)) | (top_p >= 1.0).reshape(-1, 1)
            keep_sorted &= nucleus
        keep = torch.zeros_like(keep).scatter_(1, order, keep_sorted)
    use_min_p = min_p is not None and bool((min_p > 0).any())
    if use_min_p:
        probs = torch.softmax(scaled, dim=1)
        p_max = probs.max(dim=1, keepdim=True).values
        keep &= probs >= min_p.reshape(-1, 1) * p_max
    if use_k or use_p or use_min_p:
        # Every filter keeps a row's top column (key order). Say so explicitly: float32 edge
        # cases (a top_p that rounds to 0, NaN probabilities under min-p) must never leave a
        # row with nothing to draw. Without filters every column is kept already.
        keep.scatter_(1, key_argmax(x).reshape(-1, 1), True)
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
        one_hot = torch.zeros_like(probs).scatter_(1, key_argmax(logits).reshape(-1, 1), 1.0)
        probs = torch.where(point_mass.reshape(-1, 1), one_hot, probs)
    return probs


# ---------------------------------------------------------------------------- sampling

def _flashinfer_sampling() -> Any:
    if os.environ.get("TPSPEC_DISABLE_FLASHINFER", "") not in ("", "0"):
        return None
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
    ``[R]`` or None (off). ``backend``: ``"auto"`` (flashinfer when installed, on CUDA,
    and allowed: no min-p and ``needs_reproducible_streams=False``), ``"torch"`` or
    ``"flashinfer"`` (an error when it cannot be used). Deterministic: equal inputs give
    equal tokens on every rank.
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
    fs = _flashinfer_sampling() if backend in ("auto", "flashinfer") else None
    fi_ok = (
        fs is not None
        and device.type == "cuda"
        and not needs_reproducible_streams
        and (min_p is None or not bool((min_p > 0).any()))
    )
    if backend == "flashinfer" and not fi_ok:
        raise RuntimeError(
            "flashinfer sampling cannot be used here: it needs flashinfer installed, CUDA logits, no min-p, and "
            "needs_reproducible_streams=False (its kernels read only seed[0]/offset[0])"
        )
    safe_t = torch.where(greedy, torch.ones_like(t), t)
    if fi_ok:
        # flashinfer takes one stream for the batch: a sampled row's, never a greedy (or
        # padding) row's, whose offset is a constant and would repeat draws step after step.
        first = int(torch.nonzero(~greedy)[0])
        sampled = _flashinfer_sample(fs, logits, safe_t, top_k, top_p, int(seeds[first]), int(offsets[first]))
    else:
        masked = filtered_logits(logits, safe_t, top_k, top_p, min_p)
        columns = torch.arange(vocab, dtype=torch.int64, device=device)
        sampled = key_argmax(gumbel_scores(masked, columns, safe_t, seeds, offsets))
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
