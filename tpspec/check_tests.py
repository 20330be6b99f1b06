"""The properties of the determinism contract as checks: what ``tpspec check`` runs (see ``tpspec/check.py``
for the command, the launchers and the table, and ``docs/determinism.md`` for the contract).

Rank-level checks (``check_*(ctx) -> CheckResult``) run on every rank of a process group,
SPMD: every rank builds the same inputs from a fixed seed, so every collective is reached
by every rank in the same order, and every SKIP decision depends only on facts shared by
all ranks (the device type, what this build contains). Each check records the tokens it
selected; ``check_ranks_agree`` compares those ledgers across ranks at the end.
``driver_checks`` run whole generations through ``tpspec.LLM`` (TP=N vs TP=1, CUDA graphs
vs eager).

Test hook: ``TPSPEC_TEST_PERTURB_RANK=r`` makes the suite's own exchange wrapper
(:class:`PerturbedExchange`) flip the first token of every selection on rank ``r`` (the
library's exchanges are untouched), so the suite can show that it catches ranks that
disagree.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import os
import sys
import traceback
from typing import Any, Callable

import torch

from . import distributed as D
from . import keys as K
from .exchange.allgather import AllGatherKeyExchange
from .exchange.base import Channel, KeyExchange
from .exchange.local import LocalKeyExchange
from .log import plural
from .vocab_parallel import VocabShardedLogits, vocab_shard_bounds

PASS, PARTIAL, FAIL, SKIP = "PASS", "PARTIAL", "FAIL", "SKIP"
DEFAULT_SEED = 20261202
P_VALUE_THRESHOLD = 1e-3
PERTURB_ENV = "TPSPEC_TEST_PERTURB_RANK"
EMULATED_TP_SIZES = (1, 2, 4, 8)

# (key, table title), in table order. The key names the pytest test: test_<key>.
PROPERTIES: list[tuple[str, str]] = [
    ("ranks_agree", "rule 1 all ranks return identical tokens"),
    ("ll_equals_allgather", "rule 2 LL exchange == all-gather"),
    ("greedy_argmax", "rule 3 greedy == argmax(gathered logits)"),
    ("seeded_tp_invariant", "rule 4 seeded Gumbel: same tokens at every TP"),
    ("seeded_streams", "rule 4 seeded streams: batch / slot independent"),
    ("gumbel_exact", "rule 5 Gumbel-max exact (chi-square)"),
    ("rejection_exact", "rule 5 rejection sampling exact (chi-square)"),
    ("cuda_graph", "rule 6 CUDA-graph replay == eager"),
    ("cpu_gpu_bits", "rule 7 CPU reference == GPU, bit for bit"),
    ("filters_sharded", "rule 8 top-k/top-p/min-p on shards == full rows"),
    ("filters_exact", "top-k/top-p/min-p draws exact (chi-square)"),
    ("logprobs_exact", "rule 9 logprobs == float64 log_softmax, any TP"),
    ("deterministic_logits", "deterministic mode: logits bit-identical"),
    ("generate_tp", "generate at TP=N == TP=1"),
]
TITLES = dict(PROPERTIES)


@dataclasses.dataclass
class CheckResult:
    """One row of the table. ``status``: PASS (every part of the row ran and held), PARTIAL
    (what ran held, but a part of the row could not run here: ``detail`` says which and why),
    FAIL or SKIP (nothing ran: ``detail`` says why). ``rows``: rows/tokens/samples compared;
    ``p_value``: the smallest p-value of the statistical tests behind the row (None when none)."""

    key: str
    status: str
    rows: int = 0
    mismatches: int = 0
    p_value: float | None = None
    detail: str = ""

    @property
    def title(self) -> str:
        return TITLES.get(self.key, self.key)


class Skip(Exception):
    """Raised by a check whose layer is missing or does not apply here (same on every rank)."""


# ----------------------------------------------------------------------------- context

class PerturbedExchange(KeyExchange):
    """Test-only wrapper: delegates to ``inner`` and, on rank ``perturb_rank``, flips the
    lowest bit of the first token of every result (so that rank disagrees with the others)."""

    def __init__(self, inner: KeyExchange, perturb_rank: int) -> None:
        super().__init__(inner.group, inner.rank, inner.world_size, inner.device)
        self.inner = inner
        self.perturb_rank = perturb_rank
        self.MAX_ROWS = inner.MAX_ROWS
        self.NUM_CHANNELS = inner.NUM_CHANNELS
        self.step_counter = inner.step_counter

    def _perturb(self, out: torch.Tensor) -> torch.Tensor:
        if self.rank != self.perturb_rank or out.numel() == 0:
            return out
        out = out.clone()
        out[0] ^= 1
        return out

    def max_keys(self, keys: torch.Tensor, *, channel: int = Channel.DRAFT) -> torch.Tensor:
        return self._perturb(self.inner.max_keys(keys, channel=channel))

    def gather_rows(self, values: torch.Tensor, *, channel: int = Channel.DRAFT) -> torch.Tensor:
        return self.inner.gather_rows(values, channel=channel)

    def sum_rows(self, values: torch.Tensor, *, channel: int = Channel.DRAFT) -> torch.Tensor:
        return self.inner.sum_rows(values, channel=channel)

    def argmax_tokens(self, local_max, local_argmax, vocab_offset, *, channel=Channel.DRAFT):  # type: ignore[override]
        return self._perturb(self.inner.argmax_tokens(local_max, local_argmax, vocab_offset, channel=channel))

    def argmax_logits(self, logits, vocab_offset, **kwargs):  # type: ignore[override]
        return self._perturb(self.inner.argmax_logits(logits, vocab_offset, **kwargs))

    def max_logits_keys(self, logits, vocab_offset, **kwargs):  # the LL exchange's keys-only call
        return self._perturb(self.inner.max_logits_keys(logits, vocab_offset, **kwargs))

    def close(self) -> None:
        self.inner.close()


@dataclasses.dataclass
class SuiteContext:
    """What every rank-level check needs. Equal on every rank except ``rank``."""

    rank: int
    world_size: int
    device: torch.device
    group: Any
    quick: bool = False
    seed: int = DEFAULT_SEED
    perturb_rank: int | None = None
    ledger: list[torch.Tensor] = dataclasses.field(default_factory=list)

    @classmethod
    def create(cls, device: str | torch.device = "cpu", *, quick: bool = False, seed: int = DEFAULT_SEED,
               group: Any = None) -> "SuiteContext":
        """Context for the calling rank of ``group`` (default: the TP group, else the default group)."""
        if group is None:
            group = D.tp_group()
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        perturb = os.environ.get(PERTURB_ENV)
        return cls(
            rank=D.group_rank(group),
            world_size=D.group_size(group),
            device=device,
            group=group,
            quick=quick,
            seed=seed,
            perturb_rank=int(perturb) if perturb not in (None, "") else None,
        )

    def wrap(self, exchange: KeyExchange) -> KeyExchange:
        """The exchange the checks use: ``exchange`` itself, or the perturbing test wrapper."""
        if self.perturb_rank is None:
            return exchange
        return PerturbedExchange(exchange, self.perturb_rank)

    def allgather_exchange(self) -> KeyExchange:
        return self.wrap(AllGatherKeyExchange(self.group, device=self.device))

    def ll_exchange(self) -> tuple[KeyExchange | None, str | None]:
        """``(the LL exchange, None)``, or ``(None, why)`` when the group lacks what it needs
        (CUDA, cupy, one node). Collective. A set-up or compile failure raises: a broken
        kernel fails the check that asked for it, never skips it."""
        if self.device.type != "cuda":
            return None, f"the LL exchange needs CUDA (device={self.device.type})"
        require_module("tpspec.exchange.ll")
        from .exchange.factory import ll_unavailable_reason
        from .exchange.ll import LLKeyExchange

        reason = ll_unavailable_reason(self.group, self.device)
        if reason is not None:
            return None, f"LL exchange unavailable here: {reason}"
        return self.wrap(LLKeyExchange(self.group, device=self.device)), None

    def generator(self, salt: int) -> torch.Generator:
        """A CPU generator seeded from the suite seed and ``salt``: the same data on every rank."""
        return torch.Generator().manual_seed((self.seed * 1_000_003 + salt) % 2**63)

    def record(self, tokens: torch.Tensor) -> torch.Tensor:
        """Keep a copy of tokens this rank selected, for the cross-rank comparison (rule 1)."""
        self.ledger.append(tokens.detach().to("cpu", torch.int64).reshape(-1))
        return tokens


# ------------------------------------------------------------------------------ helpers

def require_module(name: str) -> Any:
    """Import ``name``; raise :class:`Skip` when this build does not contain it (an
    existing module that fails to import is an error, not a skip)."""
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:
        spec = None
    if spec is None:
        raise Skip(f"{name} is not in this build")
    return importlib.import_module(name)


def shard_slice(full: torch.Tensor, tp: int, tp_rank: int) -> tuple[torch.Tensor, int]:
    """Rank ``tp_rank``'s zero-padded ``[R, ceil(V / tp)]`` slice of ``full`` and its vocab offset."""
    vocab = full.shape[1]
    offset, width, real = vocab_shard_bounds(vocab, tp, tp_rank)
    local = torch.zeros(full.shape[0], width, dtype=full.dtype, device=full.device)
    local[:, :real] = full[:, offset : offset + real]
    return local, offset


def emulated_tokens(
    full: torch.Tensor,
    tp: int,
    temperature: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """The tokens a TP=``tp`` group would pick from ``full`` (``[R, V]``), computed in one
    process: every shard's row keys (padding included), then the max over shards."""
    return K.unpack_indices(emulated_keys(full, tp, temperature, seeds, offsets))


def emulated_keys(
    full: torch.Tensor,
    tp: int,
    temperature: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """The winning keys (``[R]`` int64) of a TP=``tp`` group, computed in one process."""
    vocab = full.shape[1]
    best = None
    for r in range(tp):
        local, offset = shard_slice(full, tp, r)
        rows = None if temperature is None else K.SamplingRows(temperature, seeds, offsets)
        keys = K.local_row_keys(local, offset, vocab_size=vocab, rows=rows)
        best = keys if best is None else torch.maximum(best, keys)
    return best


def splittable_tp_sizes(vocab: int, sizes: tuple[int, ...]) -> list[int]:
    """The TP sizes of ``sizes`` that can split ``vocab`` columns."""
    ok = []
    for tp in sizes:
        try:
            vocab_shard_bounds(vocab, tp, tp - 1)
        except ValueError:
            continue
        ok.append(tp)
    return ok


def random_streams(gen: torch.Generator, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row 64-bit ``(seeds, offsets)``: any bit pattern, as a user's streams may be."""
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=gen, dtype=torch.int64)
    offsets = torch.randint(0, 2**62, (rows,), generator=gen, dtype=torch.int64)
    return seeds, offsets


def adversarial_logits(tp: int, vocab: int, gen: torch.Generator, random_rows: int) -> torch.Tensor:
    """``[R, vocab]`` float32 rows that break naive selections: ties across every shard
    boundary of TP=``tp`` (and of 1, 2, 4, 8), padding that would win, NaN, ±inf, ±0,
    extreme and subnormal values, heavy ties; then ``random_rows`` Gaussian rows."""
    rows: list[torch.Tensor] = []

    def low() -> torch.Tensor:  # a row of distinct negative values: padding zeros would win
        return -1.0 - torch.rand(vocab, generator=gen)

    boundaries = sorted({r * math.ceil(vocab / t) for t in splittable_tp_sizes(vocab, (tp, *EMULATED_TP_SIZES))
                         for r in range(1, t)})
    for b in boundaries:
        row = low()
        row[b - 1] = row[b] = 3.0  # tie across the boundary: the lower column wins
        rows.append(row)
        row = low()
        row[b] = 3.0
        row[vocab - 1] = 3.0  # tie between a shard's first column and the last real column
        rows.append(row)
    rows.append(low())  # all negative: the zero padding of the last shard must never win
    last = boundaries[-1] if boundaries else vocab // 2
    row = low(); row[last] = float("nan"); row[2] = float("nan"); rows.append(row)  # first NaN
    row = low(); row[1] = float("inf"); row[vocab - 1] = float("nan"); rows.append(row)  # NaN beats +inf
    row = low(); row[last] = float("inf"); row[vocab - 1] = float("inf"); rows.append(row)  # first +inf
    rows.append(torch.full((vocab,), float("-inf")))  # all -inf: column 0
    row = torch.full((vocab,), float("-inf")); row[vocab - 1] = -1e30; rows.append(row)
    row = torch.full((vocab,), float("nan")); rows.append(row)  # all NaN: column 0
    row = low(); row[last] = -0.0; row[vocab - 1] = 0.0; rows.append(row)  # -0.0 == +0.0: lower column
    row = low(); row[1] = 0.0; row[last] = -0.0; rows.append(row)
    rows.append(torch.full((vocab,), -0.0))
    row = low(); row[last] = torch.finfo(torch.float32).max; row[0] = -torch.finfo(torch.float32).max; rows.append(row)
    row = -torch.rand(vocab, generator=gen) * 1e-45; row[last] = 1e-45; rows.append(row)  # subnormals
    rows.append(torch.randint(-2, 2, (vocab,), generator=gen).to(torch.float32))  # many ties
    fixed = torch.stack(rows)
    return torch.cat([fixed, torch.randn(random_rows, vocab, generator=gen) * 3.0])


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float, int]:
    """Pearson's chi-square of observed ``counts`` against ``probs``: ``(statistic, p_value, dof)``.

    Categories whose expected count is below 5 are pooled into one; the p-value is the
    chi-square survival function (regularized upper incomplete gamma), so no scipy needed.
    """
    counts = counts.to(torch.float64)
    n = counts.sum()
    expected = probs.to(torch.float64) * n
    big = expected >= 5
    obs = counts[big]
    exp = expected[big]
    if (~big).any():
        obs = torch.cat([obs, counts[~big].sum().reshape(1)])
        exp = torch.cat([exp, expected[~big].sum().reshape(1)])
    stat = float(((obs - exp) ** 2 / exp.clamp_min(1e-300)).sum())
    dof = max(int(obs.numel()) - 1, 1)
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, p, dof


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _join(details: list[str], limit: int = 3) -> str:
    """The first ``limit`` findings, and how many more there were."""
    text = "; ".join(details[:limit])
    return text + (f"; ... {len(details) - limit} more" if len(details) > limit else "")


def _mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    a, b = a.to("cpu").reshape(-1), b.to("cpu").reshape(-1)
    if a.shape != b.shape:
        return max(a.numel(), b.numel())
    return int((a != b).sum())


# ----------------------------------------------------------------------- rank-level checks
# Each check runs on every rank of the group (SPMD) and returns that rank's CheckResult.

def check_greedy_argmax(ctx: SuiteContext) -> CheckResult:
    """rule 3: greedy tokens (argmax, and temperature-0 sampling) equal ``torch.argmax`` of the
    gathered logits and of the original full logits, in fp32, bf16 and fp16."""
    ex = ctx.allgather_exchange()
    rows = mism = 0
    details = []
    for vocab in ((37, 250) if ctx.quick else (37, 1000, 4099)):
        if not splittable_tp_sizes(vocab, (ctx.world_size,)):
            continue
        full32 = adversarial_logits(ctx.world_size, vocab, ctx.generator(vocab), 16 if ctx.quick else 128)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            full = full32.to(dtype).to(ctx.device)
            local, offset = shard_slice(full, ctx.world_size, ctx.rank)
            sharded = VocabShardedLogits(local, offset, vocab, ex)
            expected = torch.argmax(full, dim=-1)
            gathered = sharded.gather()
            from_gather = torch.argmax(gathered, dim=-1)
            greedy = ctx.record(sharded.argmax())
            zero_t = ctx.record(sharded.sample(0.0))
            for name, got in (("argmax", greedy), ("temperature 0", zero_t), ("gather", from_gather)):
                bad = _mismatches(got, expected)
                if bad:
                    details.append(f"{name} V={vocab} {_dtype_name(dtype)}: {bad} rows")
                mism += bad
                rows += full.shape[0]
            if not torch.equal(gathered.to("cpu").contiguous().view(torch.uint8), full.to("cpu").view(torch.uint8)):
                details.append(f"gather() is not bit-exact (V={vocab}, {_dtype_name(dtype)})")
                mism += 1
    status = PASS if mism == 0 else FAIL
    return CheckResult("greedy_argmax", status, rows, mism, detail=_join(details) or
                       "ties across shards, padding, NaN, ±inf, ±0, subnormals; fp32/bf16/fp16")


def check_seeded_tp_invariant(ctx: SuiteContext) -> CheckResult:
    """rule 4 (TP size): with the same logits and streams, the group's Gumbel tokens equal
    what TP = 1, 2, 4, 8 would pick (emulated in one process), and repeat exactly."""
    ex = ctx.allgather_exchange()
    rows = mism = 0
    details = []
    sizes = ((64, 1000),) if ctx.quick else ((256, 1000), (64, 4099))
    for num_rows, vocab in sizes:
        gen = ctx.generator(10_000 + vocab)
        full32 = torch.randn(num_rows, vocab, generator=gen) * 2.0
        temps = torch.tensor([0.0, 0.5, 1.0, 1.7], dtype=torch.float32).repeat(num_rows // 4)
        seeds, offsets = random_streams(gen, num_rows)
        for dtype in (torch.float32, torch.bfloat16):
            full = full32.to(dtype)
            local, offset = shard_slice(full.to(ctx.device), ctx.world_size, ctx.rank)
            sharded = VocabShardedLogits(local, offset, vocab, ex)
            t, s, o = temps.to(ctx.device), seeds.to(ctx.device), offsets.to(ctx.device)
            got = ctx.record(sharded.sample(t, s, o))
            again = ctx.record(sharded.sample(t, s, o))
            bad = _mismatches(got, again)
            if bad:
                details.append(f"not reproducible: {bad} rows")
            mism += bad
            rows += num_rows
            for tp in splittable_tp_sizes(vocab, EMULATED_TP_SIZES):
                ref = emulated_tokens(full, tp, temps, seeds, offsets)
                bad = _mismatches(got, ref)
                if bad:
                    details.append(f"TP={ctx.world_size} vs TP={tp} V={vocab} {_dtype_name(dtype)}: {bad} rows")
                mism += bad
                rows += num_rows
            # Sanity: the noise is used (sampled rows are not all the argmax).
            sampled = temps > 0
            if torch.equal(got.cpu()[sampled], torch.argmax(full.float(), -1)[sampled]):
                details.append("sampled rows all equal the argmax: the noise is not applied")
                mism += 1
    return CheckResult("seeded_tp_invariant", PASS if mism == 0 else FAIL, rows, mism,
                       detail=_join(details) or f"TP={ctx.world_size} vs emulated TP={list(EMULATED_TP_SIZES)}, "
                       "repeat; fp32/bf16")


def check_gumbel_exact(ctx: SuiteContext) -> CheckResult:
    """rule 5 (Gumbel-max): the group's draws from fixed logits, one row per sample with its
    own stream, follow softmax(logits / T): chi-square p > 0.001 at two temperatures."""
    ex = ctx.allgather_exchange()
    vocab = 37
    samples = 8000 if ctx.quick else 40000
    gen = ctx.generator(20_000)
    logits = torch.randn(vocab, generator=gen) * 1.5
    seeds = torch.full((samples,), ctx.seed, dtype=torch.int64)
    offsets = torch.arange(samples, dtype=torch.int64) * 32  # one 32-wide window per draw
    p_values, tvs = [], []
    for temp in (1.0, 0.6):
        full = logits.expand(samples, vocab).contiguous().to(ctx.device)
        local, offset = shard_slice(full, ctx.world_size, ctx.rank)
        sharded = VocabShardedLogits(local, offset, vocab, ex)
        tokens = ctx.record(sharded.sample(
            torch.full((samples,), temp, device=ctx.device), seeds.to(ctx.device), offsets.to(ctx.device)))
        counts = torch.bincount(tokens.cpu(), minlength=vocab)[:vocab]
        probs = torch.softmax(logits.double() / temp, dim=0)
        _, p, _ = chi_square(counts, probs)
        p_values.append(p)
        tvs.append(0.5 * float((counts.double() / samples - probs).abs().sum()))
    p_min = min(p_values)
    return CheckResult("gumbel_exact", PASS if p_min > P_VALUE_THRESHOLD else FAIL, 2 * samples, 0, p_min,
                       detail=f"V={vocab}, T=1.0/0.6, n={samples} each, TV={max(tvs):.4f}")


def filtered_rows(gen: torch.Generator, full: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-row parameters for ``full``'s rows cycling through every filter and combination
    (top-k at and around the candidate count, top-p from tiny to almost 1, min-p from 1e-9 to
    0.5), greedy rows and rows without a filter among them, with random 64-bit streams."""
    num_rows = full.shape[0]
    cycle = [(0.8, 20, 1.0, 0.0), (1.0, 2**31 - 1, 0.9, 0.0), (0.7, 2**31 - 1, 1.0, 0.05), (0.7, 20, 0.8, 0.0),
             (1.3, 64, 0.5, 0.02), (1.0, 2**31 - 1, 0.3, 1e-9), (0.0, 5, 0.5, 0.1), (0.9, 1, 1.0, 0.0),
             (1.0, 2**31 - 1, 1.0, 0.0), (0.6, 65, 0.999, 0.0), (2.0, 2**31 - 1, 0.05, 0.5)]
    table = [cycle[i % len(cycle)] for i in range(num_rows)]
    seeds, offsets = random_streams(gen, num_rows)
    return {
        "temperature": torch.tensor([r[0] for r in table], dtype=torch.float32),
        "top_k": torch.tensor([r[1] for r in table], dtype=torch.int64),
        "top_p": torch.tensor([r[2] for r in table], dtype=torch.float32),
        "min_p": torch.tensor([r[3] for r in table], dtype=torch.float32),
        "seeds": seeds, "offsets": offsets,
    }


def _sample_filtered_rows(logits: VocabShardedLogits, params: dict[str, torch.Tensor], device: torch.device,
                          stats: Any = None) -> torch.Tensor:
    from .sampling.select import sample_filtered

    rows = K.SamplingRows(*(params[k].to(device) for k in ("temperature", "seeds", "offsets")),
                          **{k: params[k].to(device) for k in ("top_k", "top_p", "min_p")})
    return sample_filtered(logits, rows, stats=stats)


def check_filters_sharded(ctx: SuiteContext) -> CheckResult:
    """Top-k / top-p / min-p rows drawn on the group's shards equal the full-row reference
    (``sampling.ops``) and the same rows at TP = 1, in two batch orders."""
    from .sampling.ops import sample_from_logits
    from .sampling.select import SamplingStats

    ex = ctx.allgather_exchange()
    gen = ctx.generator(70_000)
    vocab = 1000 if ctx.quick else 4099
    full = adversarial_logits(ctx.world_size, vocab, gen, 32 if ctx.quick else 160)
    flat = torch.zeros(4, vocab)  # flat rows: the top-p prefix outruns the candidates -> the fallback
    full = torch.cat([full, flat])
    params = filtered_rows(gen, full)
    num_rows = full.shape[0]
    for i in range(4):  # top-p on the flat rows, so they must gather
        params["top_k"][-1 - i], params["top_p"][-1 - i], params["temperature"][-1 - i] = 2**31 - 1, 0.5, 1.0
    reference = sample_from_logits(full, params["temperature"], params["seeds"], params["offsets"], params["top_k"],
                                   params["top_p"], params["min_p"])
    details, mism = [], 0
    stats = SamplingStats()
    order = torch.randperm(num_rows, generator=gen)
    for name, perm in (("batch order", torch.arange(num_rows)), ("shuffled", order)):
        local, offset = shard_slice(full[perm].to(ctx.device), ctx.world_size, ctx.rank)
        sharded = VocabShardedLogits(local, offset, vocab, ex)
        tokens = ctx.record(_sample_filtered_rows(sharded, {k: v[perm] for k, v in params.items()}, ctx.device,
                                                  stats if name == "batch order" else None))
        bad = _mismatches(tokens, reference[perm])
        if bad:
            details.append(f"TP={ctx.world_size} {name}: {bad} rows differ")
        mism += bad
    single = VocabShardedLogits(full.to(ctx.device), 0, vocab, LocalKeyExchange(ctx.device))
    bad = _mismatches(_sample_filtered_rows(single, params, ctx.device), reference)
    if bad:
        details.append(f"TP=1: {bad} rows differ")
    mism += bad
    bad = _penalised_mismatches(ctx, full[-36:-4], {k: v[-36:-4] for k, v in params.items()}, gen)
    if bad:
        details.append(f"penalised rows: {bad} differ")
    mism += bad
    return CheckResult("filters_sharded", PASS if mism == 0 else FAIL, 3 * num_rows + 32, mism,
                       detail=_join(details) or f"V={vocab}, {num_rows} rows (NaN, ±inf, ties, flat); on shards "
                       f"{stats.rows_sharded}, retried {stats.rows_retried}, gathered {stats.rows_gathered}")


def _penalised_mismatches(ctx: SuiteContext, full: torch.Tensor, params: dict[str, torch.Tensor],
                          gen: torch.Generator) -> int:
    """Rows with repetition / presence / frequency penalties (per-slot counts of a random
    prompt and output) and filters through ``select_tokens`` on the group's shards, against
    the full rows penalised in one process and drawn by the reference."""
    from .sampling.ops import sample_from_logits
    from .sampling.penalties import OccurrenceCounts, RowPenalties, apply_penalties
    from .sampling.select import select_tokens

    num_rows, vocab = full.shape
    slots = torch.arange(num_rows, dtype=torch.int64) % 4
    prompts = [torch.randint(0, vocab, (24,), generator=gen) for _ in range(4)]
    outputs = torch.randint(0, vocab, (4, 12), generator=gen)
    repetition = 1.0 + torch.rand(num_rows, generator=gen)
    presence, frequency = torch.rand(num_rows, generator=gen) - 0.5, torch.rand(num_rows, generator=gen) - 0.5

    def penalties(offset: int, width: int) -> RowPenalties:
        counts = OccurrenceCounts(4, vocab_offset=offset, width=width, device=ctx.device)
        for slot, prompt in enumerate(prompts):
            counts.reset(slot, prompt)
        counts.add(torch.arange(4), outputs)
        return RowPenalties(counts, slots.to(ctx.device), None, repetition.to(ctx.device),
                            presence.to(ctx.device), frequency.to(ctx.device))

    local, offset = shard_slice(full.to(ctx.device), ctx.world_size, ctx.rank)
    rows = K.SamplingRows(*(params[k].to(ctx.device) for k in ("temperature", "seeds", "offsets")),
                          **{k: params[k].to(ctx.device) for k in ("top_k", "top_p", "min_p")},
                          penalties=penalties(offset, local.shape[1]))
    tokens = ctx.record(select_tokens(VocabShardedLogits(local, offset, vocab, ctx.allgather_exchange()), rows))
    whole = penalties(0, vocab)
    penalised = apply_penalties(full.to(ctx.device), vocab_offset=0, counts=whole.counts, slots=whole.slots,
                                drafts=None, repetition=whole.repetition, presence=whole.presence,
                                frequency=whole.frequency)
    reference = sample_from_logits(penalised, params["temperature"], params["seeds"], params["offsets"],
                                   params["top_k"], params["top_p"], params["min_p"])
    return _mismatches(tokens, reference)


def check_filters_exact(ctx: SuiteContext) -> CheckResult:
    """Filtered draws through the group's shards follow the exact truncated distribution
    (softmax over the columns the filters keep): chi-square p > 0.001 for top-k, top-p,
    min-p and all three."""
    from .sampling.ops import keep_mask

    ex = ctx.allgather_exchange()
    vocab = small_vocab(ctx.world_size, 37)
    samples = 8000 if ctx.quick else 40000
    gen = ctx.generator(80_000)
    logits = torch.randn(vocab, generator=gen)
    cases = [(0.8, 6, 1.0, 0.0), (1.2, 2**31 - 1, 0.7, 0.0), (1.0, 2**31 - 1, 1.0, 0.05), (0.9, 10, 0.9, 0.02)]
    p_values = []
    full = logits.expand(samples, vocab).contiguous()
    local, offset = shard_slice(full.to(ctx.device), ctx.world_size, ctx.rank)
    sharded = VocabShardedLogits(local, offset, vocab, ex)
    for i, (t, k, p, m) in enumerate(cases):
        params = {
            "temperature": torch.full((samples,), t), "top_k": torch.full((samples,), k, dtype=torch.int64),
            "top_p": torch.full((samples,), p), "min_p": torch.full((samples,), m),
            "seeds": torch.full((samples,), ctx.seed + i, dtype=torch.int64),
            "offsets": torch.arange(samples, dtype=torch.int64) * 32,
        }
        tokens = ctx.record(_sample_filtered_rows(sharded, params, ctx.device))
        keep = keep_mask(logits.reshape(1, -1), params["temperature"][:1], params["top_k"][:1], params["top_p"][:1],
                         params["min_p"][:1])[0]
        law = torch.softmax((logits.double() / t).masked_fill(~keep, float("-inf")), dim=0)
        counts = torch.bincount(tokens.cpu(), minlength=vocab)[:vocab]
        if int(counts[~keep].sum()):
            p_values.append(0.0)  # a filtered column was drawn
            continue
        p_values.append(chi_square(counts, law)[1])
    p_min = min(p_values)
    return CheckResult("filters_exact", PASS if p_min > P_VALUE_THRESHOLD else FAIL, len(cases) * samples, 0, p_min,
                       detail=f"V={vocab}, top-k / top-p / min-p / all three, n={samples} each")


def check_logprobs_exact(ctx: SuiteContext) -> CheckResult:
    """``VocabShardedLogits.logprobs`` on the group's shards: the token's and the top-20
    logprobs within 1e-5 of float64 ``torch.log_softmax``, the token's rank (vLLM's count), and
    everything bit-identical to TP = 1."""
    ex = ctx.allgather_exchange()
    gen = ctx.generator(90_000)
    vocab = 1000 if ctx.quick else 32003
    num_rows = 32 if ctx.quick else 128
    full = torch.randn(num_rows, vocab, generator=gen) * 4
    full[0] = 0.0
    full[1, 7] = 1e4
    full[2] = full[2].round()
    tokens = torch.randint(0, vocab, (num_rows,), generator=gen)
    local, offset = shard_slice(full.to(ctx.device), ctx.world_size, ctx.rank)
    got = VocabShardedLogits(local, offset, vocab, ex).logprobs(tokens.to(ctx.device), top_n=20)
    single = VocabShardedLogits(full.to(ctx.device), 0, vocab, LocalKeyExchange(ctx.device)).logprobs(
        tokens.to(ctx.device), top_n=20)
    ref = torch.log_softmax(full.double(), dim=1)
    err = max(float((got[0].cpu() - ref.gather(1, tokens.reshape(-1, 1)).reshape(-1)).abs().max()),
              float((got[2].cpu() - torch.topk(ref, 20, dim=1).values).abs().max()))
    # The token's rank: the columns whose logit is at least its own (vLLM's count).
    bad_ranks = int((got[3].cpu() != (full >= full.gather(1, tokens.reshape(-1, 1))).sum(dim=1)).sum())
    differ = sum(int((a.cpu() != b.cpu()).sum()) for a, b in zip(got, single))
    ok = err < 1e-5 and differ == 0 and bad_ranks == 0
    return CheckResult("logprobs_exact", PASS if ok else FAIL, num_rows * 22, differ + bad_ranks,
                       detail=f"V={vocab}, max |error| {err:.1e} (limit 1e-5); {bad_ranks} token ranks wrong; "
                       f"{differ} values differ from TP=1")


def small_vocab(world_size: int, preferred: int = 37) -> int:
    """The smallest vocabulary >= ``preferred`` that ``world_size`` ranks can split."""
    vocab = preferred
    while not splittable_tp_sizes(vocab, (world_size,)):
        vocab += 1
    return vocab


def check_rejection_exact(ctx: SuiteContext) -> CheckResult:
    """rule 5 (rejection sampling): one-model speculative steps through ``SpecWorker`` with
    rejection acceptance on vocab-sharded target logits; each emitted position follows the
    target distribution of that position (chi-square p > 0.001), for drafts drawn from a
    draft distribution q and for deterministic drafts (one-hot q)."""
    require_module("tpspec.speculative")
    from .sampling.params import SamplingParams
    from .speculative import SpecMetadata, SpecWorker

    ex = ctx.allgather_exchange()
    vocab, num_drafts = small_vocab(ctx.world_size), 2
    requests = 6000 if ctx.quick else 12000
    gen = ctx.generator(60_000)
    target_logits = torch.randn(num_drafts + 1, vocab, generator=gen) * 1.5  # p_k, position k
    # q_k close to p_k (as a real drafter's is), so later positions get enough samples too.
    draft_logits = target_logits[:num_drafts] + torch.randn(num_drafts, vocab, generator=gen) * 0.8
    p = torch.softmax(target_logits.double(), dim=-1)
    q = torch.softmax(draft_logits.float(), dim=-1)
    worker = SpecWorker("rejection", forced=None)
    p_values: list[float] = []
    details: list[str] = []
    mean_accepted: list[str] = []
    rows = 0
    for case in ("q", "one-hot q"):
        meta = SpecMetadata(requests, num_drafts, device=ctx.device)
        # Distinct seeds: every request draws from its own stream.
        meta.prepare([(i, i, SamplingParams(temperature=1.0, seed=ctx.seed + 7919 * i), False)
                      for i in range(requests)], num_drafts)
        full = target_logits.repeat(requests, 1)  # rows: request-major, positions 0..D
        local, offset = shard_slice(full.to(ctx.device), ctx.world_size, ctx.rank)
        sharded = VocabShardedLogits(local, offset, vocab, ex)
        if case == "q":
            drafts = torch.stack([torch.multinomial(q[k], requests, replacement=True, generator=gen)
                                  for k in range(num_drafts)], dim=1)
            draft_probs = q.unsqueeze(0).expand(requests, num_drafts, vocab).contiguous().to(ctx.device)
        else:
            drafts = torch.stack([torch.full((requests,), int(torch.argmax(p[k])), dtype=torch.int64)
                                  for k in range(num_drafts)], dim=1)
            draft_probs = None
        out = worker.step(sharded, drafts.to(ctx.device), meta, draft_probs)
        accepted = ctx.record(out.accepted_tokens).cpu().reshape(requests, num_drafts + 1)
        num = out.num_accepted.cpu()
        for pos in range(num_drafts + 1):
            emitted = accepted[num > pos, pos]
            if emitted.numel() < 500:
                continue  # too few samples at this position for a meaningful test
            counts = torch.bincount(emitted, minlength=vocab)[:vocab]
            _, pv, _ = chi_square(counts, p[pos])
            p_values.append(pv)
            rows += int(emitted.numel())
            if pv <= P_VALUE_THRESHOLD:
                details.append(f"{case}, position {pos}: p={pv:.2g}")
        mean_accepted.append(f"{float(num.double().mean()) - 1:.2f}")
    p_min = min(p_values) if p_values else None
    status = PASS if p_values and p_min > P_VALUE_THRESHOLD else FAIL
    return CheckResult("rejection_exact", status, rows, 0, p_min,
                       detail=_join(details) or f"V={vocab}, D={num_drafts}, {requests} requests per draft kind "
                       f"(q / one-hot q: {' / '.join(mean_accepted)} drafts accepted), {len(p_values)} positions")


def _request_logits(tag: int, step: int, position: int, vocab: int) -> torch.Tensor:
    """The logits of one row of a request, a function of (request tag, its own step,
    position) only, so a request sees the same logits whatever batch it runs in."""
    gen = torch.Generator().manual_seed(tag * 1_000_003 + step * 1009 + position)
    return torch.randn(vocab, generator=gen) * 2.0


def check_seeded_streams(ctx: SuiteContext) -> CheckResult:
    """rule 4 (batch, slot history, TP size): a seeded request's tokens, chosen by
    ``select_tokens`` under ``SpecMetadata`` streams, are the same alone in slot 0, in a
    mixed batch at another position in a slot used before, in a batch that takes the
    filtered path (a top-k neighbour), and at TP=1; a different seed changes them. The
    request runs twice: with a temperature only, and with top-k, top-p and min-p."""
    require_module("tpspec.speculative")
    from .sampling.params import SamplingParams
    from .sampling.select import select_tokens
    from .speculative import SpecMetadata

    vocab, draft_len, steps = 1000, 3, 5
    x_params = SamplingParams(temperature=0.9, seed=123456789)
    x_tag = 1

    def run(exchange: KeyExchange, tp: int, rank: int, x_slot: int, history: int, neighbours: list[tuple],
            params: SamplingParams = x_params) -> torch.Tensor:
        """X's tokens over ``steps`` steps; ``history`` earlier steps of another request in X's slot."""
        meta = SpecMetadata(8, draft_len, device=ctx.device)

        def position(t: int) -> int:  # the output position of step t's first token (every draft kept)
            return 0 if t == 0 else 1 + (t - 1) * (draft_len + 1)

        schedule = [[(100, x_slot, SamplingParams(temperature=1.0, seed=5), t == 0, position(t))]
                    for t in range(history)]
        schedule += [[*(n + (position(t),) for n in neighbours), (x_tag, x_slot, params, t == 0, position(t))]
                     for t in range(steps)]
        out = []
        for step, requests in enumerate(schedule):
            meta.prepare(requests, draft_len)
            rows = []
            for rid, _, _, is_ctx, _ in requests:
                own_step = step - history if rid == x_tag else step
                rows += [_request_logits(rid, own_step, i, vocab) for i in range(1 if is_ctx else draft_len + 1)]
            full = torch.stack(rows)
            local, offset = shard_slice(full.to(ctx.device), tp, rank)
            tokens = select_tokens(VocabShardedLogits(local, offset, vocab, exchange), meta)
            if tp == ctx.world_size:
                ctx.record(tokens)
            b = len(requests) - 1  # X is last
            if requests[b][0] == x_tag:
                idx = meta.request_row_index[b, : (1 if requests[b][3] else draft_len + 1)]
                out.append(tokens[idx.to(tokens.device)].cpu())
        return torch.cat(out)

    ex = ctx.allgather_exchange()
    single = LocalKeyExchange(ctx.device)
    mixed = [(10, 0, SamplingParams(temperature=0.7, seed=99), False), (11, 1, None, False),
             (12, 4, SamplingParams(temperature=1.2), False)]
    filtered = [(10, 0, SamplingParams(temperature=0.7, seed=99), False),
                (13, 1, SamplingParams(temperature=1.0, top_k=5, seed=7), False)]
    rows = mism = 0
    details = []
    # X with a temperature only, then with every filter (its rows take the candidate path).
    x_filtered = SamplingParams(temperature=0.9, top_k=20, top_p=0.8, min_p=0.02, seed=123456789)
    for label, params in (("", x_params), ("filtered X, ", x_filtered)):
        alone = run(ex, ctx.world_size, ctx.rank, 0, 0, [], params)
        scenarios = {
            "mixed batch, slot 2 after 3 steps of another request": run(ex, ctx.world_size, ctx.rank, 2, 3, mixed,
                                                                         params),
            "filtered path (top-k neighbour), slot 5": run(ex, ctx.world_size, ctx.rank, 5, 1, filtered, params),
            "TP=1": run(single, 1, 0, 0, 0, [], params),
        }
        for name, tokens in scenarios.items():
            bad = _mismatches(tokens, alone)
            if bad:
                details.append(f"{label}{name}: {bad} of {alone.numel()} tokens differ")
            mism += bad
            rows += alone.numel()
        other = dataclasses.replace(params, seed=987654321)
        if torch.equal(run(ex, ctx.world_size, ctx.rank, 0, 0, [], other), alone):
            details.append(f"{label}a different seed gives the same tokens: the seed is not used")
            mism += 1
    return CheckResult("seeded_streams", PASS if mism == 0 else FAIL, rows, mism,
                       detail=_join(details) or f"{steps} steps x D={draft_len}, X plain and filtered: alone vs "
                       "mixed batch / slot history / filtered path / TP=1")


def check_ll_equals_allgather(ctx: SuiteContext) -> CheckResult:
    """rule 2: the LL exchange and the all-gather exchange pick identical tokens (GPU only)."""
    ll, why = ctx.ll_exchange()
    if ll is None:
        raise Skip(why)
    ag = ctx.allgather_exchange()
    rows = mism = 0
    details = []
    try:
        row_counts = (1, 8, 64) if ctx.quick else (1, 7, 64, 256, 1024)
        for vocab in (1000, 32000):
            gen = ctx.generator(30_000 + vocab)
            adv = adversarial_logits(ctx.world_size, vocab, gen, 0)
            for num_rows in row_counts:
                full = torch.randn(num_rows, vocab, generator=gen) * 2.0
                full = torch.cat([adv, full])[:num_rows] if num_rows >= adv.shape[0] else full
                local, offset = shard_slice(full.to(ctx.device), ctx.world_size, ctx.rank)
                temps = torch.tensor([0.0, 0.8, 1.0, 1.3]).repeat(num_rows)[:num_rows].to(ctx.device)
                seeds, offsets = (t.to(ctx.device) for t in random_streams(gen, num_rows))
                sampling = K.SamplingRows(temps, seeds, offsets)
                for channel in Channel:
                    pairs = [
                        (ll.argmax_logits(local, offset, vocab_size=vocab, channel=channel),
                         ag.argmax_logits(local, offset, vocab_size=vocab, channel=channel), "greedy"),
                        (ll.argmax_logits(local, offset, vocab_size=vocab, rows=sampling, channel=channel),
                         ag.argmax_logits(local, offset, vocab_size=vocab, rows=sampling, channel=channel), "seeded"),
                    ]
                    for a, b, name in pairs:
                        ctx.record(a)
                        bad = _mismatches(a, b)
                        if bad:
                            details.append(f"{name} R={num_rows} V={vocab} ch={int(channel)}: {bad}")
                        mism += bad
                        rows += num_rows
    finally:
        ll.close()
    return CheckResult("ll_equals_allgather", PASS if mism == 0 else FAIL, rows, mism,
                       detail=_join(details) or "greedy + seeded Gumbel, both channels")


def check_cpu_gpu_bits(ctx: SuiteContext) -> CheckResult:
    """rule 7: keys computed on the GPU equal the CPU reference bit for bit, and the group's
    GPU tokens equal the CPU-emulated tokens (GPU only)."""
    if ctx.device.type != "cuda":
        raise Skip("needs CUDA (device=cpu)")
    ex = ctx.allgather_exchange()
    rows = mism = 0
    gen = ctx.generator(40_000)
    num_rows, vocab = (64, 4099) if ctx.quick else (256, 32003)
    full = torch.randn(num_rows, vocab, generator=gen) * 3.0
    temps = torch.tensor([0.0, 0.5, 1.0, 2.0]).repeat(num_rows // 4)
    seeds, offsets = random_streams(gen, num_rows)
    local, offset = shard_slice(full, ctx.world_size, ctx.rank)
    cpu_keys = K.local_row_keys(local, offset, vocab_size=vocab, rows=K.SamplingRows(temps, seeds, offsets))
    device_rows = K.SamplingRows(temps.to(ctx.device), seeds.to(ctx.device), offsets.to(ctx.device))
    gpu_keys = K.local_row_keys(local.to(ctx.device), offset, vocab_size=vocab, rows=device_rows)
    mism += _mismatches(cpu_keys, gpu_keys)
    cols = torch.arange(offset, offset + min(local.shape[1], vocab - offset))
    cpu_scores = K.gumbel_scores(local[:, : cols.numel()], cols, torch.ones(num_rows), seeds, offsets)
    gpu_scores = K.gumbel_scores(local[:, : cols.numel()].to(ctx.device), cols.to(ctx.device),
                                 torch.ones(num_rows, device=ctx.device), seeds.to(ctx.device), offsets.to(ctx.device))
    score_bad = int((cpu_scores.view(torch.int32) != gpu_scores.cpu().view(torch.int32)).sum())
    mism += score_bad
    rows += 2 * num_rows + cpu_scores.numel()
    sharded = VocabShardedLogits(local.to(ctx.device), offset, vocab, ex)
    tokens = ctx.record(sharded.sample(temps.to(ctx.device), seeds.to(ctx.device), offsets.to(ctx.device)))
    reference = emulated_keys(full, ctx.world_size, temps, seeds, offsets)
    mism += _mismatches(tokens, K.unpack_indices(reference))
    rows += num_rows
    # The kernel itself: the LL exchange's winning keys (score bits and column) for the
    # same rows, against the CPU reference.
    ll, why = ctx.ll_exchange()
    if ll is None:
        kernel = f"not run: the LL kernel's keys ({why})"
    else:
        try:
            ll_keys = ll.max_logits_keys(local.to(ctx.device), offset, vocab_size=vocab, rows=device_rows)
            ctx.record(K.unpack_indices(ll_keys))
            kernel_bad = _mismatches(ll_keys, reference)
        finally:
            ll.close()
        mism += kernel_bad
        rows += num_rows
        kernel = f"LL kernel keys ({kernel_bad} of {num_rows} differ)"
    status = FAIL if mism else (PARTIAL if ll is None else PASS)
    return CheckResult("cpu_gpu_bits", status, rows, mism,
                       detail=f"row keys, {cpu_scores.numel()} Gumbel scores ({score_bad} differ), tokens; {kernel}")


def check_cuda_graph(ctx: SuiteContext) -> CheckResult:
    """rule 6: an exchange captured in a CUDA graph and replayed gives the eager tokens,
    including unseeded rows whose step counter advances inside the graph (GPU only)."""
    if ctx.device.type != "cuda":
        raise Skip("CUDA graphs need CUDA (device=cpu)")
    ex, why = ctx.ll_exchange()  # a broken LL set-up fails this check rather than falling back
    if ex is None:
        if D.group_backend(ctx.group) not in (None, "nccl"):
            raise Skip(f"no capturable exchange: the group is not NCCL and {why}")
        ex = ctx.allgather_exchange()
    gen = ctx.generator(50_000)
    num_rows, vocab, steps = 64, 4099, 4
    full = torch.randn(num_rows, vocab, generator=gen) * 2.0
    local, offset = shard_slice(full.to(ctx.device), ctx.world_size, ctx.rank)
    temps = torch.tensor([0.0, 1.0]).repeat(num_rows // 2).to(ctx.device)
    seeds, offsets = (t.to(ctx.device) for t in random_streams(gen, num_rows))

    def step() -> torch.Tensor:
        greedy = ex.argmax_logits(local, offset, vocab_size=vocab, channel=Channel.TARGET)
        seeded = ex.argmax_logits(local, offset, vocab_size=vocab, rows=K.SamplingRows(temps, seeds, offsets),
                                  channel=Channel.TARGET)
        unseeded = ex.argmax_logits(local, offset, vocab_size=vocab, rows=K.SamplingRows(temps),
                                    channel=Channel.TARGET)
        return torch.stack([greedy, seeded, unseeded])

    try:
        start = ex.step_counter.clone()
        eager = [step().clone() for _ in range(steps)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # warm-up outside capture (compiles, allocates)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = step()
        ex.step_counter.copy_(start)
        replayed = []
        for _ in range(steps):
            graph.replay()
            replayed.append(static_out.clone())
        torch.cuda.synchronize()
    finally:
        ex.close()
    mism = sum(_mismatches(a, b) for a, b in zip(eager, replayed))
    for t in replayed:
        ctx.record(t)
    return CheckResult("cuda_graph", PASS if mism == 0 else FAIL, steps * 3 * num_rows, mism,
                       detail=f"{type(getattr(ex, 'inner', ex)).__name__}: greedy, seeded, unseeded x {steps} replays")


DETERMINISTIC_REQUEST = [21, 22, 23, 24, 25, 26, 27]
DETERMINISTIC_NEXT = [51, 387, 487, 12]
DETERMINISTIC_NEIGHBOURS = [[5, 9, 200, 31, 7, 7, 64, 120, 300, 2, 45], [400, 401], [17] * 13]


def _deterministic_scenarios(model: Any) -> dict[str, torch.Tensor]:
    """The request's full logits rows (its prompt's last token, then one per next token) in
    each scenario; collective over the model's TP group."""
    from .model import ForwardBatch

    def batch(seqs: list[tuple[int, int, list[int]]], rows: list[int] | None = None) -> Any:
        toks = [t for _, _, new in seqs for t in new]
        pos = [c + i for _, c, new in seqs for i in range(len(new))]
        # Slot s owns pages (7 - j) * 6 + s, j = 0..7: scattered, in descending order.
        tables = [[(7 - j) * 6 + s for j in range(8)] for s, _, _ in seqs]
        return ForwardBatch(torch.tensor(toks), torch.tensor(pos), tables, [c for _, c, _ in seqs],
                            [len(new) for _, _, new in seqs], None if rows is None else torch.tensor(rows))

    x, nxt, nb = DETERMINISTIC_REQUEST, DETERMINISTIC_NEXT, DETERMINISTIC_NEIGHBOURS
    out: dict[str, torch.Tensor] = {}
    model.allocate_kv_cache(6 * 8, 8)  # 6 slots of 8 pages of 8 tokens
    rows = [model(batch([(0, 0, x)])).gather()[0]]
    rows += [model(batch([(0, len(x) + i, [t])])).gather()[0] for i, t in enumerate(nxt)]
    out["alone, one token a step"] = torch.stack(rows)
    # Mixed batch: the request last among prefills, then first among decodes; slot 1 reused.
    model(batch([(1, 0, nb[2] + nb[0])]))
    rows = [model(batch([(2, 0, nb[0]), (3, 0, nb[1]), (1, 0, x)])).gather()[2]]
    for i, t in enumerate(nxt):
        step = [(1, len(x) + i, [t]), (2, len(nb[0]) + i, [8]), (3, len(nb[1]) + i, [9])]
        rows.append(model(batch(step)).gather()[0])
    out["mixed batches, reused slot"] = torch.stack(rows)
    # Verification: the prompt chunked beside a prefill, then every next token verified at once.
    model(batch([(4, 0, x[:3]), (5, 0, nb[1])]))
    last = model(batch([(4, 3, x[3:])])).gather()[0]
    ver = model(batch([(5, len(nb[1]), [7]), (4, len(x), nxt)], [1 + r for r in range(len(nxt))])).gather()
    out["chunked prefill, verification"] = torch.cat((last[None], ver))
    return out


def check_deterministic_logits(ctx: SuiteContext) -> CheckResult:
    """Deterministic mode: the tiny model's logits of one request are bit-identical alone, in
    mixed batches (reused slot, other positions), chunked and verified K+1 at once, at TP = N
    (this group) and TP = 1 (each rank alone). The default mode's differences are reported."""
    require_module("tpspec.model")
    from .mapping import Mapping
    from .model import check_split, load_model
    from .model.config import ModelConfig
    from .runtime.llm import tiny_model_path

    path = tiny_model_path()
    n = ctx.world_size
    try:
        check_split(ModelConfig.from_pretrained(path), Mapping(n, ctx.rank, n), deterministic=True)
    except ValueError as exc:
        raise Skip(f"deterministic mode cannot run the tiny model at TP={n}: {exc}") from None
    dtype = torch.float32
    single = load_model(path, Mapping(), device=ctx.device, dtype=dtype, deterministic=True)
    reference = _deterministic_scenarios(single)["alone, one token a step"]
    runs = {"TP=1": _deterministic_scenarios(single)}
    if n > 1:
        group_model = load_model(path, Mapping(n, ctx.rank, n), device=ctx.device, dtype=dtype, deterministic=True)
        runs[f"TP={n}"] = _deterministic_scenarios(group_model)
    mism = rows = 0
    bad = []
    for tp_label, scenarios in runs.items():
        for name, logits in scenarios.items():
            rows += logits.shape[0]
            differ = int((logits.view(torch.int32) != reference.view(torch.int32)).any(dim=-1).sum())
            mism += differ
            if differ:
                bad.append(f"{tp_label} {name}: {differ} rows")
    default = _deterministic_scenarios(load_model(path, Mapping(n, ctx.rank, n) if n > 1 else Mapping(),
                                                  device=ctx.device, dtype=dtype))
    base = default["alone, one token a step"]
    default_rows = sum(int((v.view(torch.int32) != base.view(torch.int32)).any(dim=-1).sum()) for v in default.values())
    tps = "TP=1" + (f" and TP={n}" if n > 1 else "")
    detail = (f"{len(next(iter(runs.values())))} scenarios at {tps} vs alone at TP=1; default mode: {default_rows} rows "
              f"differ" if not bad else _join(bad))
    return CheckResult("deterministic_logits", PASS if mism == 0 else FAIL, rows, mism, detail=detail)


def check_ranks_agree(ctx: SuiteContext) -> CheckResult:
    """rule 1: every token any check selected on this rank equals rank 0's (collective)."""
    if ctx.world_size == 1:
        raise Skip("one rank: nothing to agree with (run with --tp 2 or more)")
    mine = torch.cat(ctx.ledger) if ctx.ledger else torch.zeros(0, dtype=torch.int64)
    everyone = D.all_gather_object(mine.numpy(), ctx.group)
    ref = torch.from_numpy(everyone[0])
    mism = 0
    bad_ranks = []
    for r, theirs in enumerate(everyone):
        bad = _mismatches(torch.from_numpy(theirs), ref)
        if bad:
            bad_ranks.append(f"rank {r}: {bad}")
        mism += bad
    detail = (f"{plural(len(ctx.ledger), 'selection')} on {plural(ctx.world_size, 'rank')}"
              if not bad_ranks else "differ from rank 0: " + ", ".join(bad_ranks))
    return CheckResult("ranks_agree", PASS if mism == 0 else FAIL, int(ref.numel()), mism, detail=detail)


RANK_CHECKS: list[Callable[[SuiteContext], CheckResult]] = [
    check_greedy_argmax,
    check_seeded_tp_invariant,
    check_gumbel_exact,
    check_rejection_exact,
    check_seeded_streams,
    check_deterministic_logits,
    check_ll_equals_allgather,
    check_cpu_gpu_bits,
    check_cuda_graph,
    check_filters_sharded,
    check_filters_exact,
    check_logprobs_exact,
]


def _guarded(key: str, fn: Callable[[], CheckResult]) -> CheckResult:
    try:
        return fn()
    except Skip as exc:
        return CheckResult(key, SKIP, detail=str(exc))
    except Exception as exc:  # noqa: BLE001 - an error is a failed property, reported with its cause
        traceback.print_exc(file=sys.stderr)
        return CheckResult(key, FAIL, detail=f"error: {type(exc).__name__}: {exc}")


def _check_key(fn: Callable[..., CheckResult]) -> str:
    return fn.__name__.removeprefix("check_")


def _skipped(key: str) -> CheckResult:
    return CheckResult(key, SKIP, detail="skipped by --skip")


def run_suite(ctx: SuiteContext, skip: frozenset[str] = frozenset()) -> list[CheckResult]:
    """Run every rank-level check on this rank (call it on every rank of ``ctx.group``),
    except those whose key is in ``skip``.

    Returns this rank's results; the ranks-agree row comes last and is computed from the
    tokens every other check recorded. Collective.
    """
    results = [_skipped(_check_key(fn)) if _check_key(fn) in skip else _guarded(_check_key(fn), lambda fn=fn: fn(ctx))
               for fn in RANK_CHECKS]
    results.append(_skipped("ranks_agree") if "ranks_agree" in skip else
                   _guarded("ranks_agree", lambda: check_ranks_agree(ctx)))
    return results


def suite_worker(rank: int, world_size: int, device: str = "cpu", quick: bool = False,
                 seed: int = DEFAULT_SEED, skip: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """``run_ranks`` entry point: the rank-level suite on this rank, as plain dicts."""
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
    ctx = SuiteContext.create(device, quick=quick, seed=seed)
    return [dataclasses.asdict(r) for r in run_suite(ctx, skip)]


# ----------------------------------------------------------------------- driver-level checks

GENERATE_PROMPTS = [
    [5, 17, 42, 99, 5, 17, 42, 99, 5],  # repeats: the n-gram drafter proposes, drafts get accepted
    [300, 301, 302, 303, 300, 301],
    [7],
    [11, 12, 13, 14, 15, 16, 17, 18, 11, 12, 13],
    [200, 100, 200, 100, 200],
]


def _generate(tp: int, launcher: str, device: str, *, max_new_tokens: int, seed: int,
              use_cuda_graphs: bool = True) -> list[list[int]]:
    """Token ids of the tiny model on ``GENERATE_PROMPTS`` (greedy, seeded temperature, seeded
    top-k: the candidate path), n-gram speculation with 3 drafts, 3 slots for 5 requests (so
    slots are reused), float32 so that TP sizes see the same logits."""
    from .runtime import LLM, SpeculativeConfig
    from .sampling.params import SamplingParams

    common = dict(max_tokens=max_new_tokens, ignore_eos=True)
    params = [SamplingParams(temperature=0.0, **common), SamplingParams(temperature=0.8, seed=seed, **common),
              SamplingParams(temperature=1.0, top_k=20, seed=seed + 1, **common),
              SamplingParams(temperature=0.7, seed=seed + 2, **common), SamplingParams(temperature=1.3, **common)]
    backend = {"torchrun": "external_launcher"}.get(launcher, launcher)
    with LLM("tiny", tensor_parallel_size=tp, distributed_executor_backend=backend, device=device, dtype="float32",
             max_num_seqs=3, speculative_config=SpeculativeConfig("ngram", num_speculative_tokens=3),
             enforce_eager=not use_cuda_graphs) as llm:
        outputs = llm.generate(GENERATE_PROMPTS, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _compare_generations(key: str, got: list[list[int]], ref: list[list[int]], label: str) -> CheckResult:
    mism = sum(_mismatches(torch.tensor(a), torch.tensor(b)) for a, b in zip(got, ref))
    rows = sum(len(b) for b in ref)
    bad = [i for i, (a, b) in enumerate(zip(got, ref)) if a != b]
    detail = f"{label}: {plural(len(ref), 'request')}" if not bad else f"{label}: requests {bad} differ"
    return CheckResult(key, PASS if mism == 0 and len(got) == len(ref) else FAIL, rows, mism, detail=detail)


def _require_tiny_split(tp: int) -> None:
    """Skip when the tiny model (the generate checks' model) cannot be laid out over ``tp`` ranks."""
    from .mapping import Mapping
    from .model import ModelConfig, check_split
    from .runtime import tiny_model_path

    config = ModelConfig.from_pretrained(tiny_model_path())
    try:
        for rank in range(tp):
            check_split(config, Mapping(tp, rank, tp))
    except ValueError as exc:
        raise Skip(f"the tiny model cannot be split over TP={tp}: {exc}") from None


def driver_checks(tp: int, device: str, *, quick: bool, seed: int, launcher: str,
                  skip: frozenset[str] = frozenset()) -> list[CheckResult]:
    """Whole-model checks through the runtime (``tpspec.LLM`` on the tiny model):

    * ``generate_tp``: generation at TP=``tp`` under ``launcher`` equals TP=1 (local process);
    * ``cuda_graph`` (GPU): generation with CUDA graphs equals eager generation.

    Under torchrun every rank calls this (the TP=``tp`` runs are collective); the TP=1
    reference runs from rank 0 and the verdict is broadcast, so every rank returns the same.
    """
    def guarded(key: str, fn: Callable[[], CheckResult]) -> CheckResult:
        if key in skip:
            return _skipped(key)
        result = _guarded(key, fn)
        if launcher == "torchrun":
            result = D.broadcast_object(result, src=0)
        return result

    max_new = 12 if quick else 32

    def generate_tp() -> CheckResult:
        require_module("tpspec.runtime")
        if tp == 1:
            raise Skip("TP=1 is the reference itself (run with --tp 2 or more)")
        _require_tiny_split(tp)
        if launcher != "torchrun" and device == "cuda" and torch.cuda.device_count() < tp:
            raise Skip(f"the runtime's {launcher} launcher needs one GPU per rank ({torch.cuda.device_count()} < {tp})")
        got = _generate(tp, launcher, device, max_new_tokens=max_new, seed=seed)
        ref = _generate(1, "mp", device, max_new_tokens=max_new, seed=seed) if D.group_rank() == 0 else got
        return _compare_generations("generate_tp", got, ref, f"tiny model, TP={tp} ({launcher}) vs TP=1, "
                                    "greedy/seeded/top-k/unseeded, n-gram spec")

    def cuda_graph_generate() -> CheckResult:
        if device != "cuda":
            raise Skip("CUDA graphs need CUDA (device=cpu)")
        require_module("tpspec.runtime")
        if launcher != "torchrun" and torch.cuda.device_count() < tp:
            raise Skip(f"generation with graphs vs eager (the runtime's {launcher} launcher needs one GPU per rank, "
                       f"{torch.cuda.device_count()} < {tp})")
        _require_tiny_split(tp)
        graphs = _generate(tp, launcher, device, max_new_tokens=max_new, seed=seed, use_cuda_graphs=True)
        eager = _generate(tp, launcher, device, max_new_tokens=max_new, seed=seed, use_cuda_graphs=False)
        return _compare_generations("cuda_graph", graphs, eager, f"generate TP={tp} graphs vs eager")

    return [guarded("generate_tp", generate_tp), guarded("cuda_graph", cuda_graph_generate)]
