"""Verifying draft tokens: strict acceptance and rejection sampling.

Both return ``accepted_tokens [B, D+1]`` int64 (the tokens a request emits this step,
padded with -1) and ``num_accepted [B]`` int64 (how many are valid: accepted drafts
plus the one token the target adds; context requests emit exactly 1). Everything
here is deterministic given its inputs, so ranks holding the same inputs return the
same tensors without any communication.
"""

from __future__ import annotations

from typing import Any

import torch

from ..keys import gumbel_noise
from ..sampling.ops import key_argmax
from ..sampling.streams import ACCEPT_RESIDUAL_SUBSTREAM, ACCEPT_UNIFORM_SUBSTREAM, uniforms

PAD_TOKEN = -1


def _draft_lens(
    draft_lens: torch.Tensor | None, batch: int, max_len: int, device: torch.device, check_values: bool = True
) -> torch.Tensor:
    if draft_lens is None:
        return torch.full((batch,), max_len, dtype=torch.int64, device=device)
    if not isinstance(draft_lens, torch.Tensor) or draft_lens.shape != (batch,):
        raise ValueError(f"draft_lens must be a [{batch}] tensor, got {getattr(draft_lens, 'shape', draft_lens)}")
    lens = draft_lens.to(device=device, dtype=torch.int64)
    if check_values and bool(((lens < 0) | (lens > max_len)).any()):
        raise ValueError(f"draft_lens must lie in [0, {max_len}]")
    return lens


def accept_from_targets(
    target_tokens: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_lens: torch.Tensor | None = None,
    *,
    check_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Strict acceptance on a per-request matrix.

    ``target_tokens``: ``[B, D+1]`` int (the target's choice at each position);
    ``draft_tokens``: ``[B, D]`` int; ``draft_lens``: ``[B]`` drafts that count per request
    (default all ``D``; 0 for a context request). A request accepts drafts while each
    equals the target's choice, then adds the target's token at the first mismatch
    (or after the last draft). Returns ``(accepted_tokens [B, D+1], num_accepted [B])``.
    ``check_values=False`` skips the range check of ``draft_lens`` (a device sync), for
    trusted callers inside CUDA graph capture.
    """
    if target_tokens.dim() != 2 or draft_tokens.dim() != 2 or target_tokens.shape[0] != draft_tokens.shape[0]:
        raise ValueError(
            f"target_tokens must be [B, D+1] and draft_tokens [B, D], got {tuple(target_tokens.shape)} "
            f"and {tuple(draft_tokens.shape)}"
        )
    batch, width = target_tokens.shape
    num_drafts = draft_tokens.shape[1]
    if width != num_drafts + 1:
        raise ValueError(f"target_tokens has {width} columns but draft_tokens has {num_drafts} (need D+1 and D)")
    device = target_tokens.device
    lens = _draft_lens(draft_lens, batch, num_drafts, device, check_values)
    positions = torch.arange(width, dtype=torch.int64, device=device).reshape(1, -1)
    match = (draft_tokens.to(torch.int64) == target_tokens[:, :num_drafts].to(torch.int64)) & (
        positions[:, :num_drafts] < lens.reshape(-1, 1)
    )
    num_drafts_accepted = torch.cumprod(match.to(torch.int64), dim=1).sum(dim=1)
    # Accepted drafts equal the target's tokens, so the emitted prefix is the target's row.
    accepted = torch.where(positions <= num_drafts_accepted.reshape(-1, 1), target_tokens.to(torch.int64), PAD_TOKEN)
    return accepted, num_drafts_accepted + 1


def strict_accept(
    target_tokens: torch.Tensor, draft_tokens: torch.Tensor, num_contexts: int, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Strict acceptance in the flat row layout (context requests first).

    ``target_tokens``: ``[num_contexts + num_gens * (D+1)]`` int, the target's token per
    logits row (context requests: 1 row each, then generation requests: D+1 rows
    each). ``draft_tokens``: ``[num_gens, D]`` or ``[batch_size, D]`` (context rows
    ignored). Returns ``(accepted_tokens [B, D+1] padded with -1, num_accepted [B])``;
    context requests emit their one token.
    """
    if target_tokens.dim() != 1:
        raise ValueError(f"target_tokens must be 1-D [rows], got shape {tuple(target_tokens.shape)}")
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be 2-D [requests, D], got shape {tuple(draft_tokens.shape)}")
    if not 0 <= num_contexts <= batch_size:
        raise ValueError(f"num_contexts={num_contexts} is out of range [0, batch_size={batch_size}]")
    num_gens = batch_size - num_contexts
    num_drafts = draft_tokens.shape[1]
    if draft_tokens.shape[0] == batch_size:
        gen_drafts = draft_tokens[num_contexts:]
    elif draft_tokens.shape[0] == num_gens:
        gen_drafts = draft_tokens
    else:
        raise ValueError(f"draft_tokens has {draft_tokens.shape[0]} rows; expected {num_gens} or {batch_size}")
    expected_rows = num_contexts + num_gens * (num_drafts + 1)
    if target_tokens.shape[0] != expected_rows:
        raise ValueError(
            f"target_tokens has {target_tokens.shape[0]} rows; {num_contexts} contexts + {num_gens} generations "
            f"x (D+1={num_drafts + 1}) need {expected_rows}"
        )
    device = target_tokens.device
    ctx_targets = torch.full((num_contexts, num_drafts + 1), PAD_TOKEN, dtype=torch.int64, device=device)
    ctx_targets[:, 0] = target_tokens[:num_contexts].to(torch.int64)
    gen_targets = target_tokens[num_contexts:].to(torch.int64).reshape(num_gens, num_drafts + 1)
    targets = torch.cat([ctx_targets, gen_targets], dim=0)
    drafts = torch.cat(
        [torch.full((num_contexts, num_drafts), PAD_TOKEN, dtype=torch.int64, device=device), gen_drafts.to(torch.int64)]
    )
    lens = torch.cat(
        [torch.zeros(num_contexts, dtype=torch.int64, device=device),
         torch.full((num_gens,), num_drafts, dtype=torch.int64, device=device)]
    )
    return accept_from_targets(targets, drafts, lens)


def _flashinfer_chain() -> Any:
    try:
        from flashinfer.sampling import chain_speculative_sampling  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001
        return None
    return chain_speculative_sampling


def rejection_sample(
    draft_probs: torch.Tensor | None,
    draft_token_ids: torch.Tensor,
    target_probs: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    *,
    draft_lens: torch.Tensor | None = None,
    needs_reproducible_streams: bool = True,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative (rejection) sampling, Leviathan et al. 2023: lossless.

    ``draft_probs``: ``[B, D, V]`` the draft distributions q the drafts were drawn from,
    or ``None`` for a deterministic drafter (q = one-hot at the draft token: still
    lossless); ``draft_token_ids``: ``[B, D]`` int in ``[0, V)``; ``target_probs``:
    ``[B, D+1, V]`` the target distributions p; ``seeds``/``offsets``: ``[B]`` int64, the
    request's acceptance stream (the acceptance slot of its window). ``draft_lens``:
    ``[B]`` drafts that count (default D; 0 = emit one token drawn from p_0).

    Draft ``i`` is accepted when ``u_i * q(x_i) < p(x_i)`` (i.e. with probability
    ``min(1, p/q)``), ``u_i`` = Philox uniform of column ``i`` at ``offset + 0``; at the
    first rejection the token is drawn from ``norm(max(0, p - q))``, after all drafts
    from ``p_D`` — by Gumbel-max with the noise of ``offset + 1``. Returns
    ``(accepted_tokens [B, D+1] padded with -1, num_accepted [B] int64)``, the same for
    the same inputs on every rank and device type. ``backend="auto"`` and ``"torch"`` run
    this path; flashinfer's ``chain_speculative_sampling`` runs only when asked for
    (``backend="flashinfer"``: it reads one seed for the whole batch, so it also needs
    ``needs_reproducible_streams=False``, CUDA tensors, explicit ``draft_probs`` and no
    ``draft_lens``; ``RuntimeError`` otherwise).
    """
    if backend not in ("auto", "torch", "flashinfer"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'flashinfer', got {backend!r}")
    if draft_token_ids.dim() != 2:
        raise ValueError(f"draft_token_ids must be [B, D], got shape {tuple(draft_token_ids.shape)}")
    batch, num_drafts = draft_token_ids.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (batch, num_drafts + 1):
        raise ValueError(f"target_probs must be [B={batch}, D+1={num_drafts + 1}, V], got {tuple(target_probs.shape)}")
    vocab = target_probs.shape[2]
    if draft_probs is not None and tuple(draft_probs.shape) != (batch, num_drafts, vocab):
        raise ValueError(f"draft_probs must be [{batch}, {num_drafts}, {vocab}], got {tuple(draft_probs.shape)}")
    for name, t in (("seeds", seeds), ("offsets", offsets)):
        if not isinstance(t, torch.Tensor) or t.shape != (batch,):
            raise ValueError(f"{name} must be a [{batch}] int64 tensor, got {getattr(t, 'shape', t)}")
    device = target_probs.device
    lens = _draft_lens(draft_lens, batch, num_drafts, device)
    drafts = draft_token_ids.to(device=device, dtype=torch.int64)
    positions = torch.arange(num_drafts + 1, dtype=torch.int64, device=device)
    counted = positions[:num_drafts].reshape(1, -1) < lens.reshape(-1, 1)
    if bool(((drafts < 0) | (drafts >= vocab))[counted].any()):
        raise ValueError(f"draft_token_ids must lie in [0, {vocab}) (map draft-vocab ids to target ids first)")

    chain = _flashinfer_chain() if backend == "flashinfer" else None  # never by default: no GPU run has checked it
    fi_ok = chain is not None and device.type == "cuda" and not needs_reproducible_streams and draft_probs is not None and draft_lens is None
    if backend == "flashinfer" and not fi_ok:
        raise RuntimeError(
            "flashinfer chain_speculative_sampling cannot be used here: it needs flashinfer, CUDA tensors, "
            "draft_probs, no draft_lens and needs_reproducible_streams=False"
        )
    if fi_ok:
        out = chain(draft_probs, drafts.to(torch.int32), target_probs, deterministic=True,
                    seed=int(seeds[0]), offset=int(offsets[0]))
        out = out.to(torch.int64)
        return out, (out != PAD_TOKEN).sum(dim=1)

    seeds = seeds.to(device=device, dtype=torch.int64)
    offsets = offsets.to(device=device, dtype=torch.int64)
    safe_drafts = torch.where(counted, drafts, 0)
    # Acceptance test in float64: p and q are at most float32, so the products are exact enough.
    p_x = target_probs[:, :num_drafts].gather(2, safe_drafts.unsqueeze(2)).squeeze(2).to(torch.float64)
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.gather(2, safe_drafts.unsqueeze(2)).squeeze(2).to(torch.float64)
    columns = torch.arange(num_drafts, dtype=torch.int64, device=device)
    u = uniforms(seeds, offsets + ACCEPT_UNIFORM_SUBSTREAM, columns)
    accept = (u * q_x < p_x) & counted
    n = torch.cumprod(accept.to(torch.int64), dim=1).sum(dim=1)  # drafts accepted per request

    # The final token: from norm(max(0, p_n - q_n)) after a rejection, from p_n after all drafts.
    rows = torch.arange(batch, device=device)
    p_n = target_probs[rows, n].to(torch.float32)
    rejected = n < lens
    if draft_probs is None:
        q_n = torch.zeros_like(p_n)
        at = safe_drafts.gather(1, n.clamp(max=max(num_drafts - 1, 0)).reshape(-1, 1)) if num_drafts else None
        if at is not None:
            q_n.scatter_(1, at, 1.0)
    else:
        q_n = draft_probs[rows, n.clamp(max=max(num_drafts - 1, 0))].to(torch.float32) if num_drafts else torch.zeros_like(p_n)
    q_n = torch.where(rejected.reshape(-1, 1), q_n, torch.zeros_like(q_n))
    residual = (p_n - q_n).clamp(min=0.0)
    # Rounding can leave a rejected row with no residual mass; its target row is the
    # only sensible fallback (that case has probability ~0 in exact arithmetic).
    empty = residual.sum(dim=1, keepdim=True) <= 0
    residual = torch.where(empty, p_n, residual)
    vocab_columns = torch.arange(vocab, dtype=torch.int64, device=device)
    scores = torch.log(residual) + gumbel_noise(seeds, offsets + ACCEPT_RESIDUAL_SUBSTREAM, vocab_columns)
    final = key_argmax(scores)

    padded_drafts = torch.cat([drafts, torch.full((batch, 1), PAD_TOKEN, dtype=torch.int64, device=device)], dim=1)
    accepted = torch.where(positions.reshape(1, -1) < n.reshape(-1, 1), padded_drafts, PAD_TOKEN)
    accepted = accepted.scatter(1, n.reshape(-1, 1), final.reshape(-1, 1))
    return accepted, n + 1
