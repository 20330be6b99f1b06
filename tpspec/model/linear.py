"""The decoder's matrix-vector products: ``F.linear``, or the Triton GEMV where one rule says.

:func:`linear` is what the column- and row-parallel linears and the vocabulary-parallel LM head
call outside deterministic mode. :func:`use_triton_linear` is the one rule that sends a call to
:func:`tpspec.model.gemv_triton.linear`: one row (a decode step of one request), and the ``N <= K``
linears of two to four rows (its verification step), read at the weights' memory bandwidth;
everything else, and everything while ``TRITON_GEMV`` is off, runs ``F.linear``. Where the rule
takes a linear that follows an RMSNorm (q/k/v and gate/up of a fused
layer), :func:`use_triton_norm_linear` also puts the norm in front of the GEMV, in one kernel
(:func:`tpspec.model.gemv_triton.norm_linear`); :func:`use_triton_silu_linear` decides the same for
SwiGLU's ``silu(gate) * up`` before the down projection, and :func:`use_triton_linear_silu_mul`
after the gate/up projection. This module imports no ``triton``: the
kernels' module is imported on the first call the rule accepts.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch
import torch.nn.functional as F

TRITON_GEMV = True
"""Whether the linears :func:`use_triton_linear` takes run the Triton GEMV (at one row with the norm
before q/k/v and gate/up fused in). On: a GPU run of ``tests/test_gemv_triton.py``'s ``gpu`` tests
passed, the fused norm included, and ``tpspec bench gemv`` reads these linears faster than cuBLAS
(``docs/benchmarks.md``)."""

TRITON_GEMV_ROWS = 32
"""The most rows of ``x`` the rule sends to the Triton GEMV (more go to ``F.linear``). Up to four
rows: a verification step of one request (three drafts), whose rows the few-rows kernels read as
one row is read. From five rows the GEMV's ``tl.dot`` kernels take only the linears
``ROWS_MIN_WIDENING`` admits (gate/up and the LM head): on an H100 the steps of 8 and 32 requests,
and the verification of 8, took 2.3-4 % less time with them there than in cuBLAS
(``docs/benchmarks.md``, "Gate/up and the LM head from five rows"). 32: the rows those steps
measured; 4 keeps every linear of five rows and more in cuBLAS."""

ROWS_MIN_WIDENING = 4
"""From five rows on (where ``TRITON_GEMV_ROWS`` reaches), the rule takes only the linears with at
least this many times as many output features as inputs: gate/up (7) and the LM head (31) at the
Llama 3 8B shape. At 32 rows on an H100 the ``tl.dot`` kernels read gate/up faster than cuBLAS and
q/k/v (1.5), o_proj (1) and down_proj (0.29) slower (``docs/benchmarks.md``, "The weight tile on
the left"). 0: every linear."""

_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def gemv_kernels() -> Any:
    """:mod:`tpspec.model.gemv_triton`, or None where ``triton`` does not import."""
    try:
        return importlib.import_module(f"{__package__}.gemv_triton")
    except ImportError:
        return None


TRITON_SILU_DOWN = True
"""Whether a one-row down projection runs :func:`tpspec.model.gemv_triton.silu_mul_linear` (SwiGLU's
``silu(gate) * up`` formed inside the GEMV, no kernel of its own) instead of the ``silu_mul`` kernel
and cuBLAS. On: a GPU run of ``tests/test_gemv_triton.py``'s ``gpu`` tests passed (the bits of
``silu_mul`` and the GEMV), and one-request decode steps took less time with it
(``docs/benchmarks.md``)."""


TRITON_GATE_UP_SILU = True
"""Whether a gate/up projection of two rows or more that the rule sends to the Triton GEMV forms
SwiGLU's ``silu(gate) * up`` as it stores its output (:func:`use_triton_linear_silu_mul`): no
``silu_mul`` kernel runs, and the intermediate is written and read once at half its width. The rule
takes gate/up (``N > K``) from five rows on, up to ``TRITON_GEMV_ROWS``; at one row ``silu`` goes
inside the down projection instead (``TRITON_SILU_DOWN``). On: its GPU test gives the bits of
``linear`` and ``silu_mul``, and the steps of 8 and 32 requests took about 0.06 ms less with it
(``docs/benchmarks.md``)."""


FUSED_INPUT_ROWS = 1
"""The most rows for which the norm before q/k/v and gate/up, and ``silu(gate) * up`` before the
down projection, run inside the GEMV (:func:`use_triton_norm_linear`, :func:`use_triton_silu_linear`).
Inside it every program forms the input of its whole contraction, each element once for every
thread that holds its column: at one row that costs less than the kernel it saves (measured); at
several rows the norm and ``silu`` kernels run before the GEMV (``docs/benchmarks.md``). The
few-rows kernels (two to four rows) take them inside only with ``FUSED_FEW_ROWS``."""

FUSED_FEW_ROWS = False
"""Whether two to four rows (the few-rows kernels), where ``FUSED_INPUT_ROWS`` reaches them, take the
norm and ``silu`` inside too: off, a verification step of one request took almost twice as long with
them inside (``docs/benchmarks.md``, "Two to four rows")."""

_FEW_ROWS = 4  # gemv_triton.FEW_ROWS (this module does not import it): the few-rows kernels' most rows


def _dot_rows_take(rows: int, n: int, k: int) -> bool:
    """The rule's part from five rows on (the ``tl.dot`` kernels): an ``[n, k]`` weight at least
    ``ROWS_MIN_WIDENING`` times as wide as its input; True for fewer rows, whose parts are the callers'."""
    return rows <= _FEW_ROWS or n >= ROWS_MIN_WIDENING * k


def _fused_input(rows: int) -> bool:
    """Whether a call of ``rows`` rows takes the norm or ``silu`` inside the GEMV (the rule's part on rows)."""
    return rows <= FUSED_INPUT_ROWS and (rows == 1 or rows > _FEW_ROWS or FUSED_FEW_ROWS)


def use_triton_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`linear` runs the Triton GEMV for these tensors.

    Yes when ``TRITON_GEMV`` is on; ``x`` is ``[M, K]`` with ``M`` at most ``TRITON_GEMV_ROWS``
    (four: a decode step of one request, or its verification step), and ``weight`` a contiguous
    ``[N, K]`` with ``N >= K`` at one row, ``N <= K`` at two to four rows and ``N >= ROWS_MIN_WIDENING
    * K`` at five and more (``tpspec bench gemv``: at one row the GEMV reads q/k/v, o_proj, gate/up and
    the LM head faster than cuBLAS, and down_proj runs with ``silu`` inside,
    :func:`use_triton_silu_linear`; at four rows it reads o_proj and down_proj faster, where cuBLAS
    leaves bandwidth unused, and q/k/v, gate/up and the LM head slower),
    ``K`` a multiple of 8, 16-byte aligned (whole 16-byte loads of every row); ``x``, ``weight``
    and ``bias`` share a dtype of float32, float16, bfloat16 and a device; nothing needs
    gradients; and the kernels can run there: CUDA with ``triton`` compiled, or CPU under Triton's
    interpreter (``TRITON_INTERPRET=1``; not bfloat16 there). Reads only shapes, dtypes, devices
    and pointers: no host synchronization, the same answer on every rank of a TP group.
    """
    if not TRITON_GEMV or weight.dim() != 2 or x.dim() != 2:
        return False
    n, k = weight.shape
    rows = x.shape[0]
    if rows == 1:
        if k > n:
            return False
    elif rows <= _FEW_ROWS:
        if n > k:
            return False
    elif not _dot_rows_take(rows, n, k):
        return False
    return _gemv_runs(x, weight, bias, k)


def use_triton_silu_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether a SwiGLU down projection of ``gate_up`` ``[M, 2 K]`` (``cat(gate, up)``) by ``weight``
    ``[N, K]`` runs as one kernel, :func:`tpspec.model.gemv_triton.silu_mul_linear`: where
    ``TRITON_GEMV`` and ``TRITON_SILU_DOWN`` are on, ``gate_up`` has at most ``TRITON_GEMV_ROWS``
    and ``FUSED_INPUT_ROWS`` rows (two to four only with ``FUSED_FEW_ROWS``), and the tensors meet
    :func:`use_triton_linear`'s other conditions (any ``N`` and ``K`` up to four rows; from five rows
    ``N >= ROWS_MIN_WIDENING * K``). The same answer on every rank."""
    if not (TRITON_GEMV and TRITON_SILU_DOWN) or weight.dim() != 2 or gate_up.dim() != 2:
        return False
    rows = gate_up.shape[0]
    if not _fused_input(rows) or not _dot_rows_take(rows, *weight.shape):
        return False
    return _gemv_runs(gate_up, weight, bias, 2 * weight.shape[1])


def use_triton_linear_silu_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether SwiGLU's gate/up projection of ``x`` ``[M, K]`` by ``weight`` ``[2 I, K]``
    (``cat(gate, up)``) runs as :func:`tpspec.model.gemv_triton.linear_silu_mul`, returning
    ``silu(gate) * up`` ``[M, I]``: where ``TRITON_GATE_UP_SILU`` is on, ``M >= 2`` (one row: the
    down projection takes ``silu`` inside), ``weight`` has an even number of rows and
    :func:`use_triton_linear` takes the linear. The same answer on every rank."""
    if not TRITON_GATE_UP_SILU or x.dim() != 2 or x.shape[0] < 2 or weight.dim() != 2 or weight.shape[0] % 2:
        return False
    return use_triton_linear(x, weight, bias)


def _gemv_runs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, width: int) -> bool:
    """The GEMV's conditions on ``x`` ``[M, width]`` (``M <= TRITON_GEMV_ROWS``, and at most the kernels'
    ``MAX_ROWS``) and ``weight`` ``[N, K]``."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= TRITON_GEMV_ROWS or x.shape[1] != width:
        return False
    k = weight.shape[1]
    if k % 8 or not weight.is_contiguous() or weight.data_ptr() % 16:
        return False
    if x.dtype not in _TRITON_DTYPES or weight.dtype != x.dtype or x.device != weight.device:
        return False
    if bias is not None and (bias.dtype != x.dtype or bias.device != x.device or not bias.is_contiguous()):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False  # the kernel has no backward
    if x.device.type not in ("cuda", "cpu"):
        return False
    kernels = gemv_kernels()
    if kernels is None or kernels.INTERPRETED != (x.device.type == "cpu") or x.shape[0] > kernels.MAX_ROWS:
        return False
    return not (kernels.INTERPRETED and x.dtype == torch.bfloat16)  # the interpreter's tl.dot has none


def use_triton_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                           weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether the RMSNorm of ``x + residual`` (``x`` when ``residual`` is None) and the linear
    after it run as one kernel (:func:`tpspec.model.gemv_triton.norm_linear`): where
    :func:`use_triton_linear` takes the linear, ``x`` has at most ``FUSED_INPUT_ROWS`` rows, and
    ``residual`` and ``norm_weight`` are ``x``'s
    shape and ``[K]``, in its dtype and on its device. The same answer on every rank."""
    if not use_triton_linear(x, weight, bias) or not _fused_input(x.shape[0]):
        return False
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.device != x.device):
        return False
    return (norm_weight.shape == (x.shape[1],) and norm_weight.dtype == x.dtype and norm_weight.device == x.device
            and norm_weight.is_contiguous())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: through the Triton GEMV where :func:`use_triton_linear`
    says so (float32 accumulation, one rounding to ``x``'s dtype), else ``F.linear`` itself."""
    if use_triton_linear(x, weight, bias):
        return gemv_kernels().linear(x, weight, bias)
    return F.linear(x, weight, bias)
