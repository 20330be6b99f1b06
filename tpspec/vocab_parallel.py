"""The vocabulary-sharded LM head and the logits it produces."""

from __future__ import annotations

import functools
import importlib
import math
from types import ModuleType
from typing import Callable

import torch
from torch import nn

from . import distributed as D
from .exchange.allgather import AllGatherKeyExchange
from .exchange.base import Channel, KeyExchange
from .exchange.local import LocalKeyExchange
from . import keys as K
from .keys import SamplingRows
from .mapping import Mapping
from .validation import check_int, is_real


MAX_TOP_LOGPROBS = 20
"""The most top logprobs :meth:`VocabShardedLogits.logprobs` reports per row."""

KEY_KERNELS_ON_CUDA = True
"""Whether selection on CUDA runs the Triton kernels of :mod:`tpspec.keys_triton` and
:mod:`tpspec.sampling.kernels_triton` (bit for bit the torch functions they replace) for the
filtered draw, penalties and logprobs; see :func:`use_key_kernels`. On: tests/test_key_kernels.py's
``gpu`` tests passed on a GPU (only such a checked path may stand on)."""
GREEDY_ARGMAX_KERNEL = True
"""Whether, where the key kernels run, the argmax of a head that is not vocabulary-sharded (one
rank: TP 1, or attention DP's replicated head) runs :func:`tpspec.keys_triton.row_argmax` instead
of ``torch.argmax``: the same tokens (tests/test_key_kernels.py, on a GPU at Llama 3's 128256
columns too), in two short launches where ``torch.argmax`` runs one program a row."""
KEY_KERNELS_UNDER_INTERPRETER = False
"""The CPU tests' switch: selection on CPU runs the same kernels under Triton's interpreter."""


@functools.lru_cache(maxsize=None)
def key_kernels() -> ModuleType | None:
    """:mod:`tpspec.keys_triton`, or None where ``triton`` does not import."""
    try:
        return importlib.import_module("tpspec.keys_triton")
    except ImportError:
        return None


def use_key_kernels(device: torch.device | str) -> bool:
    """Whether selection on ``device`` runs the Triton key kernels: on CUDA while
    :data:`KEY_KERNELS_ON_CUDA` is on and ``triton`` compiles (not its interpreter); on CPU only under
    Triton's interpreter (``TRITON_INTERPRET=1``) with :data:`KEY_KERNELS_UNDER_INTERPRETER` on, how
    the CPU tests run them. Every rank decides alike (the same device type everywhere)."""
    kernels = key_kernels()
    if kernels is None:
        return False
    kind = torch.device(device).type
    if kind == "cuda":
        return KEY_KERNELS_ON_CUDA and not kernels.INTERPRETED
    return kind == "cpu" and kernels.INTERPRETED and KEY_KERNELS_UNDER_INTERPRETER


def vocab_shard_bounds(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int, int]:
    """``(offset, shard_width, real_width)`` of one rank's vocab slice.

    Every rank holds ``shard_width = ceil(vocab_size / tp_size)`` columns starting at
    ``offset = tp_rank * shard_width``; only the first ``real_width`` are real
    (the last shard is zero-padded). Raises ``ValueError`` when a rank would hold no
    real column at all (``vocab_size`` too small for ``tp_size``).
    """
    if vocab_size < 1 or tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"bad vocab split: vocab_size={vocab_size}, tp_size={tp_size}, tp_rank={tp_rank}")
    width = math.ceil(vocab_size / tp_size)
    if (tp_size - 1) * width >= vocab_size:
        raise ValueError(
            f"vocab_size={vocab_size} cannot be split over tp_size={tp_size}: the last rank would hold no real "
            f"column (slices of ceil({vocab_size}/{tp_size})={width})"
        )
    offset = tp_rank * width
    return offset, width, min(width, vocab_size - offset)


class VocabShardedLogits:
    """One rank's ``[R, shard_width]`` slice of the logits, and how to pick tokens from it.

    ``local`` columns ``[0, shard_width)`` are global columns ``vocab_offset + c``;
    those at or past ``vocab_size`` are padding and never chosen. All methods are
    collective over the exchange's group and return the same tensor on every rank.
    """

    def __init__(self, local: torch.Tensor, vocab_offset: int, vocab_size: int, exchange: KeyExchange) -> None:
        if not isinstance(local, torch.Tensor) or local.dim() != 2:
            raise ValueError(f"logits slice must be a 2-D [rows, shard] tensor, got {getattr(local, 'shape', local)!r}")
        check_int("vocab_offset", vocab_offset, low=0)
        check_int("vocab_size", vocab_size, low=1)
        if not isinstance(exchange, KeyExchange):
            raise ValueError(f"exchange must be a KeyExchange, got {type(exchange).__name__}")
        self.local = local
        self.vocab_offset = vocab_offset
        self.vocab_size = vocab_size
        self.exchange = exchange

    @property
    def num_rows(self) -> int:
        return self.local.shape[0]

    @property
    def shard_width(self) -> int:
        return self.local.shape[1]

    @property
    def last_rank_offset(self) -> int:
        """The first global column of the group's last slice, the one with the fewest real columns
        (a decision on it is the same on every rank)."""
        return (self.exchange.world_size - 1) * self.shard_width

    def argmax(self, *, channel: int = Channel.TARGET) -> torch.Tensor:
        """Greedy tokens: ``[R]`` int64 == ``torch.argmax`` of the full logits rows."""
        if GREEDY_ARGMAX_KERNEL and self.exchange.world_size == 1 and use_key_kernels(self.local.device):
            # The exchange's checks (host only), then its pick: the maximum of the float32 keys.
            self.exchange.validate_logits_call(self.local, self.vocab_offset, self.vocab_size, None, channel)
            real = min(self.shard_width, self.vocab_size - self.vocab_offset)
            if real > 0:
                return key_kernels().row_argmax(self.local, self.vocab_offset, real)
        return self.exchange.argmax_logits(self.local, self.vocab_offset, vocab_size=self.vocab_size, channel=channel)

    def sample(
        self,
        temperature: torch.Tensor | float,
        seeds: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
        *,
        channel: int = Channel.TARGET,
        check_values: bool = True,
    ) -> torch.Tensor:
        """Gumbel-max draws from softmax(logits / T), one per row: ``[R]`` int64.

        ``temperature``: a float or ``[R]`` tensor (rows below the greedy threshold take the
        argmax). ``seeds``/``offsets``: ``[R]`` int64 streams; without them the exchange's
        step counter seeds the rows. The same streams give the same tokens at every TP size,
        on every exchange backend, and equal ``tpspec.sampling.ops.sample_from_logits`` on the
        gathered rows. One key exchange. Top-k / top-p / min-p draws are
        :func:`tpspec.sampling.sample_tokens` (the sampling layer).

        Raises ``ValueError`` for a NaN or infinite temperature. Tensor values are checked on
        the host (one sync; not while a CUDA graph is being captured); ``check_values=False``
        skips the check for callers whose temperatures are already validated.
        """
        temperature = self.temperature_rows(temperature, check_values=check_values)
        return self.exchange.argmax_logits(self.local, self.vocab_offset, vocab_size=self.vocab_size,
                                           rows=SamplingRows(temperature, seeds, offsets), channel=channel)

    def temperature_rows(self, temperature: torch.Tensor | float, *, check_values: bool = True) -> torch.Tensor:
        """``temperature`` as a ``[R]`` float tensor on the logits' device (a float fills every row);
        ``ValueError`` for a non-number or a NaN or infinite value (tensor values checked on the host
        unless ``check_values=False`` or a CUDA graph is being captured)."""
        if not isinstance(temperature, torch.Tensor):
            if not is_real(temperature):
                raise ValueError(f"temperature must be a float or a [rows] tensor, got {type(temperature).__name__}")
            if not math.isfinite(temperature):
                raise ValueError(f"temperature must be finite, got {temperature}")
            return torch.full((self.num_rows,), float(temperature), dtype=torch.float32, device=self.local.device)
        if (
            check_values
            and temperature.is_floating_point()
            and not (temperature.is_cuda and torch.cuda.is_current_stream_capturing())  # no host sync in a capture
            and not bool(torch.isfinite(temperature).all())
        ):
            # Every rank holds the same temperatures, so every rank raises here (no collective has started).
            raise ValueError(f"temperature has NaN or infinite values: {temperature.tolist()[:8]}")
        return temperature

    def logprobs(
        self, tokens: torch.Tensor, *, top_n: int = 0, channel: int = Channel.TARGET
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-softmax of the raw logits, without gathering them.

        ``tokens``: ``[R]`` int64 global token ids (one per row); ``top_n``: N in ``[0, 20]``.
        Returns ``(token_logprobs [R] float64, top_ids [R, N] int64, top_logprobs [R, N]
        float64, token_ranks [R] int64)``: the logprob of each row's token and the N best
        columns of the row (key order: ties to the lower id) with theirs, and the token's rank:
        the number of columns whose raw logit is at least the token's (vLLM's count, so a tie
        ranks every tied column last among them; 1 = nothing above it), each rank counting its
        own columns, summed exactly. ``logprob(x) = (x - m) - ln(Z * 2**-40)`` in
        float64, ``m`` the row max and ``Z`` the exact int64 sum of every column's mass
        ``floor(exp(l - m) * 2**40)`` (``keys.column_masses``): within 1e-5 of float64
        ``torch.log_softmax``, identical at every TP size. Rows whose max is NaN or infinite
        get NaN logprobs (ranks then follow the key order: NaN above ``+inf``). Collective: two
        small exchanges (``[R, N + 1]`` keys, ``[2R]`` sums).
        """
        top_n = check_int("top_n", top_n, low=0, high=MAX_TOP_LOGPROBS)
        if top_n > self.vocab_size:
            raise ValueError(f"top_n={top_n} exceeds vocab_size={self.vocab_size}")
        rows, width = self.local.shape
        device = self.local.device
        if not isinstance(tokens, torch.Tensor) or tuple(tokens.shape) != (rows,) or tokens.is_floating_point():
            raise ValueError(f"tokens must be an integer [{rows}] tensor, got {getattr(tokens, 'shape', tokens)!r}")
        tokens = tokens.to(device=device, dtype=torch.int64)
        local = self.local.detach()
        best = max(top_n, 1)
        kernels = key_kernels() if use_key_kernels(device) and rows and width else None
        if kernels is not None:
            padded_keys, block_max = kernels.score_keys(local, self.vocab_offset, self.vocab_size)
            keys = padded_keys[:, :width]
            if kernels.top_keys_apply(width, self.last_rank_offset, self.vocab_size, best):  # alike on every rank
                top = kernels.top_keys(padded_keys, block_max, best)
            else:
                top = torch.topk(keys, min(best, width), dim=1).values
        else:
            columns = torch.arange(self.vocab_offset, self.vocab_offset + width, dtype=torch.int64, device=device)
            real = (columns < self.vocab_size).reshape(1, -1)
            values = K.canonical_float32(local)
            keys = torch.where(real, K.pack_keys(values, columns.reshape(1, -1)), torch.full((), K.EMPTY_KEY,
                                                                                              device=device))
            top = torch.topk(keys, min(best, width), dim=1).values if width else keys[:, :0]
        if top.shape[1] < best:  # a slice narrower than N: pad with keys below every column
            top = torch.cat([top, torch.full((rows, best - top.shape[1]), K.EMPTY_KEY, device=device)], dim=1)
        # The token's own key, from the rank that holds its column (EMPTY_KEY elsewhere).
        inside = (tokens >= self.vocab_offset) & (tokens < self.vocab_offset + width) & (tokens < self.vocab_size)
        position = torch.where(inside, tokens - self.vocab_offset, torch.zeros_like(tokens))
        token_key = torch.where(inside, keys.gather(1, position.reshape(-1, 1)).reshape(-1) if width else tokens,
                                torch.full_like(tokens, K.EMPTY_KEY))
        gathered = self.exchange.gather_rows(torch.cat([top, token_key.reshape(-1, 1)], dim=1).contiguous(),
                                             channel=channel)
        gathered = gathered.view(rows, -1, best + 1)
        ranked = torch.sort(gathered[:, :, :best].reshape(rows, -1), dim=1, descending=True).values
        token_value, _ = K.unpack_keys(gathered[:, :, best].max(dim=1).values)
        row_max, _ = K.unpack_keys(ranked[:, 0])
        # The token's rank: this rank's columns at or above the token's value (the key's high half).
        token_high = gathered[:, :, best].max(dim=1).values >> 32
        if kernels is not None:
            mass_sum, at_or_above = kernels.row_masses_and_counts(padded_keys, row_max, token_high, width)
        else:
            masses = torch.where(real, K.column_masses(values, row_max), torch.zeros((), dtype=torch.int64,
                                                                                     device=device))
            mass_sum = masses.sum(dim=1)
            at_or_above = (real & ((keys >> 32) >= token_high.reshape(-1, 1))).sum(dim=1)
        sums = self.exchange.sum_rows(torch.cat([mass_sum, at_or_above]), channel=channel)
        total, ranks = sums[:rows], sums[rows:]
        log_z = torch.log(total.to(torch.float64)) - K.MASS_BITS * math.log(2.0)
        shift = torch.where(torch.isfinite(row_max), row_max.to(torch.float64) + log_z,
                            torch.full((), float("nan"), dtype=torch.float64, device=device)).reshape(-1, 1)
        top_values, top_ids = K.unpack_keys(ranked[:, :top_n])
        token_logprobs = (token_value.to(torch.float64).reshape(-1, 1) - shift).reshape(-1)
        top_logprobs = top_values.to(torch.float64) - shift
        return token_logprobs, top_ids, top_logprobs, ranks

    def gather(self) -> torch.Tensor:
        """The full ``[R, vocab_size]`` logits on every rank (one all-gather), padding removed."""
        world = self.exchange.world_size
        if world == 1:
            return self.local.detach()[:, : self.vocab_size]  # as the all-gather's copy: no autograd
        local = self.local.detach().contiguous()  # selection is not differentiable
        out = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
        D.all_gather_into(out, local.reshape(-1), self.exchange.group)
        full = out.view(world, self.num_rows, self.shard_width).permute(1, 0, 2)
        return full.reshape(self.num_rows, world * self.shard_width)[:, : self.vocab_size]  # no -1: rows may be 0


class VocabParallelHead(nn.Module):
    """The LM head split over the vocabulary: rank ``r`` holds weight rows
    ``[r * shard, (r + 1) * shard)``, ``shard = ceil(vocab_size / tp_size)``.

    ``forward(hidden [R, hidden_size]) -> VocabShardedLogits``. With ``tp_size == 1``
    it needs no process group. Padding rows of the last shard are zero and masked.
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        mapping: Mapping | None = None,
        exchange: KeyExchange | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
        bias: bool = False,
    ) -> None:
        super().__init__()
        check_int("hidden_size", hidden_size, low=1)
        check_int("vocab_size", vocab_size, low=1)
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be float32, bfloat16 or float16 (what the exchange selects from), got {dtype}")
        mapping = mapping or Mapping()
        self.mapping = mapping
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        sharded = mapping.lm_head_is_sharded
        tp_size, tp_rank = (mapping.tp_size, mapping.tp_rank) if sharded else (1, 0)
        self.vocab_offset, self.shard_width, self.real_width = vocab_shard_bounds(vocab_size, tp_size, tp_rank)
        if exchange is None:
            exchange = AllGatherKeyExchange(D.tp_group(), device=device) if sharded else LocalKeyExchange(device or "cpu")
        if exchange.world_size != tp_size:
            raise ValueError(f"the exchange spans {exchange.world_size} ranks but the head is split over {tp_size}")
        if exchange.rank != tp_rank:  # else this rank would load another rank's slice: wrong tokens, silently
            raise ValueError(f"the mapping says TP rank {tp_rank} but this process is rank {exchange.rank} of the "
                             f"exchange's group")
        self.exchange = exchange
        # Inference weights: no autograd.
        self.weight = nn.Parameter(torch.zeros(self.shard_width, hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.zeros(self.shard_width, dtype=dtype, device=device), requires_grad=False) if bias else None
        )
        # The logits' matrix product, F.linear's contract; the model layer puts its own dispatch here.
        self.linear: Callable[..., torch.Tensor] = torch.nn.functional.linear

    @torch.no_grad()
    def load_full_weight(self, full_weight: torch.Tensor, full_bias: torch.Tensor | None = None) -> None:
        """Copy this rank's rows out of the full ``[vocab_size, hidden_size]`` weight (padding stays zero)."""
        if tuple(full_weight.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(
                f"full LM-head weight must be [{self.vocab_size}, {self.hidden_size}], got {tuple(full_weight.shape)}"
            )
        if full_bias is not None and tuple(full_bias.shape) != (self.vocab_size,):
            raise ValueError(f"full LM-head bias must be [{self.vocab_size}], got {tuple(full_bias.shape)}")
        self.load_shard(full_weight[self.vocab_offset : self.vocab_offset + self.real_width],
                        None if full_bias is None else full_bias[self.vocab_offset : self.vocab_offset + self.real_width])

    @torch.no_grad()
    def load_shard(self, weight_rows: torch.Tensor, bias_rows: torch.Tensor | None = None) -> None:
        """Copy this rank's ``[real_width, hidden_size]`` rows, and ``[real_width]`` bias rows
        when the head has a bias (padding stays zero). Checks everything before copying."""
        if tuple(weight_rows.shape) != (self.real_width, self.hidden_size):
            raise ValueError(f"shard must be [{self.real_width}, {self.hidden_size}], got {tuple(weight_rows.shape)}")
        if bias_rows is not None:
            if self.bias is None:
                raise ValueError("a bias was given but the head was built with bias=False")
            if tuple(bias_rows.shape) != (self.real_width,):
                raise ValueError(f"bias shard must be [{self.real_width}], got {tuple(bias_rows.shape)}")
        self.weight.zero_()
        self.weight[: self.real_width].copy_(weight_rows)
        if self.bias is not None and bias_rows is not None:
            self.bias.zero_()
            self.bias[: self.real_width].copy_(bias_rows)

    def forward(self, hidden: torch.Tensor) -> VocabShardedLogits:
        """``hidden [R, hidden_size]`` (the head's dtype and device) -> this rank's logits slice."""
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden must be [rows, {self.hidden_size}], got shape {tuple(hidden.shape)}")
        if hidden.dtype != self.weight.dtype or hidden.device != self.weight.device:
            raise ValueError(f"hidden is {hidden.dtype} on {hidden.device}, the head is {self.weight.dtype} on "
                             f"{self.weight.device}")
        local = self.linear(hidden, self.weight, self.bias)
        return VocabShardedLogits(local, self.vocab_offset, self.vocab_size, self.exchange)
