"""The launch plan of the LL exchange's fused kernel: which kernel, what grid, which split.

:func:`plan` is the one place that decides how a fused call (``argmax_logits`` /
``max_logits_keys`` on the LL path) runs: from the call's shape, dtype and mode and the SMs
the rank plans for, it picks the kernel of ``csrc/ll_exchange/ll_exchange.cu``, how each row
is split into chunks over blocks, the grid and the dynamic shared memory, and names the
routes the kernel then takes inside (see :class:`Plan`). It is pure: plain numbers and
names in, a frozen :class:`Plan` out; no torch tensor, cupy or GPU is needed to call it.

No plan changes a key: every kernel and every split gives the same keys bit for bit
(``launch/ll_kernel_check.py`` checks it on a GPU). The plan decides speed only; the rules
and the measurements behind them are in ``docs/kernel-design.md``.

Constants the kernels share with the host come from ``csrc/ll_exchange/ll_constants.h``
(:func:`kernel_constants`); the ones here are host-side choices of the planner.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..validation import check_int
from . import cuda_module

MODES = ("greedy", "sampled")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_KERNEL_PREFIX = {"float32": "ll_argmax_logits_f32", "bfloat16": "ll_argmax_logits_bf16",
                  "float16": "ll_argmax_logits_f16"}

GREEDY_BLOCKS_PER_SM = 2  # the most a greedy call plans: two an SM keep HBM busy
SAMPLED_BLOCKS_PER_SM = 4  # the most a sampled call plans (when only they fit a chunk in one tile)
SAMPLED_BLOCKS_PER_SM_FIRST = 2  # what a sampled call plans otherwise
MIN_CHUNK = 1024  # the fewest columns of a chunk, unless a column or two a thread is planned
DEFAULT_DYNAMIC_SHARED_LIMIT = 48 * 1024  # what a launch may ask for without opting in


@dataclass(frozen=True)
class KernelConstants:
    """The constants of ``ll_constants.h`` the host needs (see there)."""

    threads: int  # LL_THREADS: threads of every block
    max_world: int  # LL_MAX_WORLD
    ctrl_bytes: int  # LL_CTRL_BYTES: a channel's control block
    line_bytes: int  # LL_LINE_BYTES: one LL line (slot or block line)
    host_error_bytes: int  # LL_HOST_ERROR_BYTES: a channel's host-mapped error record
    greedy_unroll: int  # GREEDY_UNROLL: 16-byte packs a greedy thread loads together
    sampled_packs: int  # SAMPLED_PACKS: 16-byte packs a sampled thread holds per tile
    pruned_quads_max: int  # PRUNED_QUADS_MAX: most quads a thread of pruned_quads
    row_gather_max_chunks: int  # ROW_GATHER_MAX_CHUNKS
    columns_gather_max_chunks: int  # COLUMNS_GATHER_MAX_CHUNKS


@functools.cache
def kernel_constants() -> KernelConstants:
    """The shared constants, read from ``ll_constants.h`` once per process."""
    c = cuda_module.shared_constants()
    return KernelConstants(
        threads=int(c["LL_THREADS"]),
        max_world=int(c["LL_MAX_WORLD"]),
        ctrl_bytes=int(c["LL_CTRL_BYTES"]),
        line_bytes=int(c["LL_LINE_BYTES"]),
        host_error_bytes=int(c["LL_HOST_ERROR_BYTES"]),
        greedy_unroll=int(c["GREEDY_UNROLL"]),
        sampled_packs=int(c["SAMPLED_PACKS"]),
        pruned_quads_max=int(c["PRUNED_QUADS_MAX"]),
        row_gather_max_chunks=int(c["ROW_GATHER_MAX_CHUNKS"]),
        columns_gather_max_chunks=int(c["COLUMNS_GATHER_MAX_CHUNKS"]),
    )


@dataclass(frozen=True)
class Plan:
    """How one fused call runs.

    ``kernel``: the entry point; ``blocks`` (``rows * chunks``) blocks of ``threads``;
    block ``w - 1`` reduces work item ``w``: chunk ``w % chunks`` of row ``w // chunks``,
    columns ``[chunk * (w % chunks), ...)``; work item 0, the collector, runs in the last
    block. ``block_budget``: the blocks the planner allowed (a row gets
    ``block_budget // rows`` of them, at least one). ``shared_bytes``: the launch's dynamic
    shared memory.

    The routes the kernel takes inside, decided by the same numbers:
    ``sampled_route`` (sampled calls; ``None`` for greedy ones): ``"columns"`` (a column or
    two a thread, each scored exactly), ``"pruned_quads"`` (a quad or two a thread, pruned
    within each warp), ``"one_tile"`` (one tile a block, pruned against the block's bound)
    or ``"tiles"`` (a loop of tiles); rows whose slice is not 16-byte aligned, or starts off
    a multiple of 4 columns, fall back to scoring column by column (the kernel sees that at
    run time). ``per_thread``: columns a thread on the ``"columns"`` route, quads a thread on
    ``"pruned_quads"``, else 0. ``gather``: how the collector reads the other blocks' lines:
    ``"row_warps"`` (a warp per row, straight into the row's maximum) or ``"block_lines"``
    (every line into shared memory, then a reduction over each row's chunks).
    """

    kernel: str
    rows: int
    chunk: int
    chunks: int
    blocks: int
    threads: int
    block_budget: int
    shared_bytes: int
    sampled_route: str | None
    per_thread: int
    gather: str


def _dtype_name(dtype: object) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    return name


def _positive_int(name: str, value: object, minimum: int) -> int:
    return check_int(name, value, low=minimum)


def sampled_tile_columns(elem_bytes: int) -> int:
    """Columns one tile of a sampled row covers: every thread of a block, ``SAMPLED_PACKS``
    16-byte packs each."""
    c = kernel_constants()
    return c.threads * (16 // elem_bytes) * c.sampled_packs


def greedy_group_bytes() -> int:
    """Bytes a greedy block loads together: every thread, ``GREEDY_UNROLL`` packs each."""
    c = kernel_constants()
    return c.threads * c.greedy_unroll * 16


def greedy_blocks(nbytes: int, sms: int) -> int:
    """Blocks for a greedy call reading ``nbytes`` of logits on ``sms`` SMs: a block per
    group while that fits one block an SM (at least half the SMs, so small calls still read
    from many SMs); one block an SM until blocks would read more than two groups each; then
    ``GREEDY_BLOCKS_PER_SM`` an SM."""
    group = greedy_group_bytes()
    groups = -(-nbytes // group)
    if groups <= sms:
        return max(sms // 2, groups)
    if nbytes <= 2 * group * sms:
        return sms
    return GREEDY_BLOCKS_PER_SM * sms


def columns_chunk(rows: int, width: int, sms: int) -> int:
    """The chunk of a sampled call on the ``_columns`` kernels: a column a thread, else two,
    whichever first keeps the grid within one block an SM and a row within the collector's
    quick gather (``COLUMNS_GATHER_MAX_CHUNKS``); 0 when neither does."""
    c = kernel_constants()
    for chunk in (c.threads, 2 * c.threads):
        chunks = -(-max(width, 1) // chunk)
        if chunks <= c.columns_gather_max_chunks and rows * chunks <= sms:
            return chunk
    return 0


def _split(rows: int, width: int, elem_bytes: int, budget: int, sms: int, sampled: bool) -> tuple[int, int]:
    """``(chunk, chunks)`` of a row for a budget of ``budget`` blocks: the row's share of the
    budget (rounded down: a second, mostly idle wave never starts), at least ``MIN_CHUNK``
    columns a chunk, in whole warps of 16-byte loads (greedy chunks above a pack a thread:
    whole groups); sampled calls take :func:`columns_chunk` where it applies."""
    vec = 16 // elem_bytes
    per_row = max(1, budget // rows)
    chunk = (columns_chunk(rows, width, sms) if sampled else 0) or max(-(-max(width, 1) // per_row), MIN_CHUNK)
    quantum = 32 * vec
    if not sampled and chunk * elem_bytes > 16 * kernel_constants().threads:
        quantum = greedy_group_bytes() // elem_bytes
    chunk = -(-chunk // quantum) * quantum
    return chunk, max(1, -(-width // chunk))


def plan(rows: int, width: int, dtype: object, mode: str, sms: int) -> Plan:
    """The plan of a fused call of ``rows`` rows of ``width`` real columns (the slice's
    columns below the vocabulary size) of ``dtype`` (``"float32"``, ``"bfloat16"``,
    ``"float16"``, or a torch dtype of those) in ``mode`` (``"greedy"``: no temperature;
    ``"sampled"``: the call has temperatures) on ``sms`` SMs (the rank's share of its GPU).

    Greedy calls take :func:`greedy_blocks` blocks. Sampled calls take
    ``SAMPLED_BLOCKS_PER_SM_FIRST`` blocks an SM, or ``SAMPLED_BLOCKS_PER_SM`` when those
    make every chunk fit one tile and the first budget does not; small sampled calls take a
    column or two a thread (:func:`columns_chunk`). The kernel: the dtype's; for a sampled
    call its ``_columns`` twin when chunks hold at most two columns a thread, else its
    ``_one_tile`` twin when every chunk fits one tile. Raises ``ValueError`` on bad input."""
    rows = _positive_int("rows", rows, 1)
    width = _positive_int("width", width, 0)
    sms = _positive_int("sms", sms, 1)
    name = _dtype_name(dtype)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    c = kernel_constants()
    elem = DTYPE_BYTES[name]
    kernel = _KERNEL_PREFIX[name]
    route: str | None = None
    per_thread = 0
    if mode == "greedy":
        budget = greedy_blocks(rows * max(width, 1) * elem, sms)
        chunk, chunks = _split(rows, width, elem, budget, sms, sampled=False)
    else:
        tile = sampled_tile_columns(elem)
        budget = SAMPLED_BLOCKS_PER_SM_FIRST * sms
        chunk, chunks = _split(rows, width, elem, budget, sms, sampled=True)
        if chunk > tile:
            more = _split(rows, width, elem, SAMPLED_BLOCKS_PER_SM * sms, sms, sampled=True)
            if more[0] <= tile:
                budget, (chunk, chunks) = SAMPLED_BLOCKS_PER_SM * sms, more
        if chunk <= 2 * c.threads:
            kernel, route, per_thread = kernel + "_columns", "columns", -(-chunk // c.threads)
        elif chunk <= tile:
            kernel += "_one_tile"
            if chunk <= 4 * c.pruned_quads_max * c.threads:
                route, per_thread = "pruned_quads", -(-chunk // (4 * c.threads))
            else:
                route = "one_tile"
        else:
            route = "tiles"
    quick = c.columns_gather_max_chunks if route == "columns" else c.row_gather_max_chunks
    gather = "row_warps" if rows <= c.threads // 32 and chunks <= quick else "block_lines"
    return Plan(kernel=kernel, rows=rows, chunk=chunk, chunks=chunks, blocks=rows * chunks, threads=c.threads,
                block_budget=budget, shared_bytes=fused_shared_bytes(rows, chunks), sampled_route=route,
                per_thread=per_thread, gather=gather)


def fused_shared_bytes(rows: int, chunks: int) -> int:
    """Dynamic shared memory of a fused launch: a key per row, and in the collector a key
    per block when rows span several blocks."""
    return 8 * rows * (1 + chunks if chunks > 1 else 1)


def max_grid_blocks(max_rows: int, sms: int) -> int:
    """The most blocks a fused call of up to ``max_rows`` rows plans on ``sms`` SMs (what
    the block lines of a channel must hold): no budget exceeds ``SAMPLED_BLOCKS_PER_SM``
    an SM, and a row never gets less than a block."""
    return max(max_rows, SAMPLED_BLOCKS_PER_SM * max(1, sms))


def gather_rows_kernel(world: int) -> str:
    """The ``gather_rows`` / ``sum_rows`` kernel for a world size (the same polling widths as
    :func:`exchange_keys_kernel`)."""
    return "ll_gather_rows_1" if world <= 2 else ("ll_gather_rows_4" if world <= 5 else "ll_gather_rows_8")


def exchange_keys_kernel(world: int) -> str:
    """The ``max_keys`` / ``argmax_tokens`` kernel for a world size: each polls as many peer
    lines at once as the world needs (1 for 1-2 ranks, 4 for 3-5, 8 beyond), and each world
    runs only its own wait loop."""
    return "ll_exchange_keys_1" if world <= 2 else ("ll_exchange_keys_4" if world <= 5 else "ll_exchange_keys_8")
