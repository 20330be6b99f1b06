"""Logit controls on vocabulary-sharded logits: logit bias and token masks (structured
outputs, ``allowed_token_ids``, ``bad_words``), beside the penalties.

A step's rows carry one :class:`RowControls`: per-row additive biases of a few global
columns, the rows' penalties (:class:`~tpspec.sampling.penalties.RowPenalties`) and a per-row
**token bitmask**: ``[R, words]`` int32, bit ``c & 31`` of word ``c >> 5`` set when global
column ``c`` may be chosen (llguidance's layout; a row without a mask is all ones). Each rank
applies it to its own columns only (:meth:`RowControls.apply`, the ``SamplingRows.penalties``
hook): the bitmask is read at the rank's columns, nothing crosses between ranks. Every
column's result depends only on its own logit and the row's inputs, so the same function on a
full row (``vocab_offset=0``) is the reference, bit for bit, at any TP size.

Order (vLLM's, in effect): bias (``l + b``, one float32 rounding), then the penalties, then the
mask (a column the mask clears becomes ``-inf``). vLLM masks first; ``-inf`` stays ``-inf``
under a bias and every penalty, so the two orders give the same values. After this, a masked
column has no mass and no Gumbel score above ``-inf``: greedy, sampled, top-k / top-p / min-p
and rejection sampling all draw from the masked distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .penalties import RowPenalties

BITS_PER_WORD = 32


def bitmask_words(vocab_size: int) -> int:
    """Int32 words a token bitmask of ``vocab_size`` columns takes."""
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def allowed_columns(bitmask: torch.Tensor, vocab_offset: int, width: int) -> torch.Tensor:
    """``[R, width]`` bool: which of the global columns ``[vocab_offset, vocab_offset + width)``
    each row's ``bitmask`` (``[R, words]`` int32) allows. Columns past ``32 * words`` are not
    allowed. Reads only the words of those columns; tensor operations only (no host sync)."""
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"a token bitmask must be [rows, words] int32, got {tuple(bitmask.shape)} {bitmask.dtype}")
    rows, words = bitmask.shape
    first = min(vocab_offset // BITS_PER_WORD, words)
    last = min((vocab_offset + width + BITS_PER_WORD - 1) // BITS_PER_WORD, words)
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask[:, first:last].unsqueeze(-1) >> shifts) & 1).reshape(rows, -1) != 0
    start = vocab_offset - first * BITS_PER_WORD
    bits = bits[:, start:start + width]
    if bits.shape[1] < width:  # columns past the bitmask
        bits = torch.cat([bits, torch.zeros(rows, width - bits.shape[1], dtype=torch.bool, device=bits.device)], 1)
    return bits


def pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` bool (C a multiple of 32) -> ``[R, C / 32]`` int32 bitmask (bit ``c & 31`` of
    word ``c >> 5``)."""
    rows, cols = allowed.shape
    if cols % BITS_PER_WORD:
        raise ValueError(f"pack_bits needs a multiple of {BITS_PER_WORD} columns, got {cols}")
    weights = torch.tensor([1 << b for b in range(BITS_PER_WORD)], dtype=torch.int64)
    words = (allowed.reshape(rows, -1, BITS_PER_WORD).to(torch.int64) * weights).sum(dim=2)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@dataclass
class RowControls:
    """The logit controls of one selection's ``R`` rows, applied by each rank to its slice.

    ``bias_rows`` / ``bias_columns`` / ``bias_values``: ``[N]`` (int64 row, int64 global
    column, float32 bias) of every biased (row, column), None = no bias; no (row, column) twice.
    ``penalties``: the rows' :class:`~tpspec.sampling.penalties.RowPenalties`, or None.
    ``bitmask``: ``[R, words]`` int32 token bitmask (see the module docstring), or None = every
    column allowed. All on the logits' device.
    """

    bias_rows: torch.Tensor | None = None
    bias_columns: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    penalties: RowPenalties | None = None
    bitmask: torch.Tensor | None = None

    def apply(self, local_logits: torch.Tensor, vocab_offset: int) -> torch.Tensor:
        """Controlled logits of one rank's slice: ``[R, W]`` (global columns ``[vocab_offset,
        vocab_offset + W)``) -> ``[R, W]`` float32, a new tensor. Local: no collective."""
        if local_logits.dim() != 2:
            raise ValueError(f"local_logits must be [rows, width], got {tuple(local_logits.shape)}")
        rows, width = local_logits.shape
        device = local_logits.device
        x = local_logits.to(torch.float32)
        if self.bias_rows is not None and self.bias_rows.numel():
            # A sink column takes the entries of other ranks' columns: every rank runs the same
            # ops, no host sync, and a column without bias keeps its exact bits (-0.0 included).
            columns = self.bias_columns.to(device=device, dtype=torch.int64) - vocab_offset
            inside = (columns >= 0) & (columns < width)
            columns = torch.where(inside, columns, torch.full_like(columns, width))
            x = torch.cat([x, torch.zeros(rows, 1, dtype=torch.float32, device=device)], dim=1)
            x.index_put_((self.bias_rows.to(device=device, dtype=torch.int64), columns),
                         self.bias_values.to(device=device, dtype=torch.float32), accumulate=True)
            x = x[:, :width]
        if self.penalties is not None:
            x = self.penalties.apply(x, vocab_offset)
        if self.bitmask is not None:
            if self.bitmask.shape[0] != rows:
                raise ValueError(f"the token bitmask has {self.bitmask.shape[0]} rows, the logits {rows}")
            keep = allowed_columns(self.bitmask.to(device), vocab_offset, width)
            x = torch.where(keep, x, torch.full_like(x, float("-inf")))
        return x


def row_bias(biases: Sequence[dict[int, float] | None], device: torch.device | str = "cpu") -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(rows, columns, values)`` of per-row ``{token id: bias}`` dicts (None = no bias), for
    :class:`RowControls`; None when no row has a bias."""
    entries = [(r, t, v) for r, bias in enumerate(biases) if bias for t, v in bias.items()]
    if not entries:
        return None
    rows, columns, values = zip(*entries)
    return (torch.tensor(rows, dtype=torch.int64, device=device), torch.tensor(columns, dtype=torch.int64,
                                                                               device=device),
            torch.tensor(values, dtype=torch.float32, device=device))
