"""Fused elementwise kernels of a decoder layer in Triton: RMSNorm (with the residual add),
rotary embedding with the KV-cache write, SwiGLU's ``silu(gate) * up``, and what a step runs once:
the token embedding's lookup and the rotary ``cos`` and ``sin`` (bit for bit on CUDA, which calls the
``cosf``/``sinf`` torch's kernels call).

Each kernel replaces a chain of small torch kernels and rounds exactly where that chain does
(intermediate results in the tensors' dtype, the norm's statistics in float32), so a layer gives
the torch path's values: bit for bit for the rotary and the residual add (only products and
sums of two, rounded once each), within a few float32 ulps for the norm (its sum of squares is
reduced in another order) and for ``silu`` (another ``exp``). Floating-point contraction is off
(``enable_fp_fusion=False``): a fused multiply-add would round once where torch rounds twice.

Launches depend only on the tensors' shapes (one program per row, or per row and head), never on
their values, and allocate only outputs of those shapes: a step that runs them can be captured
in a CUDA graph. Where :func:`tpspec.model.dependent_launch.use_pdl` says so the layer kernels launch
with programmatic dependent launch, waiting before their first memory access.

This module imports ``triton``. Triton's interpreter (``TRITON_INTERPRET=1`` set before
``triton`` is imported) runs the same kernels on CPU tensors, which is how the CPU tests check
them (:data:`INTERPRETED` says which mode this import got). Whether a model uses them is
:func:`tpspec.model.layers.use_fused_kernels`'s decision.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime.interpreter import InterpretedFunction

from .dependent_launch import pdl_args

MAX_HIDDEN = 65536  # the widest row one norm program holds
SILU_BLOCK = 1024  # intermediate features per silu_mul program
EMBED_BLOCK = 1024  # hidden features per embed program


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, hidden, hidden_f, eps, stride_x, stride_r, stride_o,
                     stride_ro, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    if PDL:  # tpspec.model.dependent_launch: nothing is read or written before the kernel before has finished
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        # The sum of two values of the dtype, rounded once to it (what torch's ``x + r`` gives).
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=ok)
    h = x.to(tl.float32)
    mean_sq = tl.math.div_rn(tl.sum(h * h, axis=0), hidden_f)
    normed = (h * tl.math.rsqrt(mean_sq + eps)).to(dtype)  # transformers casts back before the weight
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(dtype), mask=ok)


@triton.jit
def _rotary_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, index_ptr, q_ptr, k_ptr, v_ptr, num_rows, stride_t, stride_c,
                      stride_s, stride_qt, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh,
                      NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                      HALF_PAD: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # [0, NUM_HEADS): a query head; [NUM_HEADS, NUM_HEADS + NUM_KV_HEADS): a KV head
    HALF: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HALF_PAD)
    ok = d < HALF
    base = qkv_ptr + t * stride_t + head * HEAD_DIM  # q heads, then k heads: the fused projection's order
    x1 = tl.load(base + d, mask=ok, other=0.0)
    x2 = tl.load(base + HALF + d, mask=ok, other=0.0)
    dtype = x1.dtype
    c1 = tl.load(cos_ptr + t * stride_c + d, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_c + HALF + d, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_s + d, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_s + HALF + d, mask=ok, other=0.0).to(tl.float32)
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    # apply_rotary: x * cos + cat(-x2, x1) * sin, each product and the sum rounded to the dtype.
    lo = ((a1 * c1).to(dtype).to(tl.float32) + ((-a2) * s1).to(dtype).to(tl.float32)).to(dtype)
    hi = ((a2 * c2).to(dtype).to(tl.float32) + (a1 * s2).to(dtype).to(tl.float32)).to(dtype)
    if head < NUM_HEADS:
        out = q_ptr + t * stride_qt + head * stride_qh
        tl.store(out + d, lo, mask=ok)
        tl.store(out + HALF + d, hi, mask=ok)
    else:
        kv = head - NUM_HEADS
        row = tl.load(index_ptr + t).to(tl.int64)
        if (row >= 0) & (row < num_rows):
            out = k_ptr + row * stride_kr + kv * stride_kh
            tl.store(out + d, lo, mask=ok)
            tl.store(out + HALF + d, hi, mask=ok)
            vin = qkv_ptr + t * stride_t + (NUM_HEADS + NUM_KV_HEADS + kv) * HEAD_DIM
            vout = v_ptr + row * stride_vr + kv * stride_vh
            tl.store(vout + d, tl.load(vin + d, mask=ok), mask=ok)
            tl.store(vout + HALF + d, tl.load(vin + HALF + d, mask=ok), mask=ok)


@triton.jit
def _cos_sin_kernel(pos_ptr, inv_freq_ptr, cos_ptr, sin_ptr, n, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                    BLOCK_T: tl.constexpr, ACCURATE: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < n
    j = tl.arange(0, HALF_PAD)
    j_ok = j < HALF
    pos = tl.load(pos_ptr + t, mask=t_ok, other=0).to(tl.float32)
    inv_freq = tl.load(inv_freq_ptr + j, mask=j_ok, other=0.0)
    angles = pos[:, None] * inv_freq[None, :]  # RotaryEmbedding.forward's float32 products
    if ACCURATE:  # libdevice's cosf and sinf, what torch's cos and sin call (the interpreter has no libdevice)
        c = libdevice.cos(angles)
        s = libdevice.sin(angles)
    else:
        c = tl.cos(angles)
        s = tl.sin(angles)
    dtype = cos_ptr.dtype.element_ty
    at = t[:, None].to(tl.int64) * (2 * HALF) + j[None, :]
    ok = t_ok[:, None] & j_ok[None, :]
    tl.store(cos_ptr + at, c.to(dtype), mask=ok)
    tl.store(cos_ptr + at + HALF, c.to(dtype), mask=ok)
    tl.store(sin_ptr + at, s.to(dtype), mask=ok)
    tl.store(sin_ptr + at + HALF, s.to(dtype), mask=ok)


@triton.jit
def _embed_kernel(ids_ptr, weight_ptr, out_ptr, offset, real_width, hidden, stride_w, stride_o, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    local = tl.zeros([BLOCK], tl.int64) + (tl.load(ids_ptr + t).to(tl.int64) - offset)  # the id, on every lane
    valid = (local >= 0) & (local < real_width)
    x = tl.load(weight_ptr + tl.where(valid, local, 0) * stride_w + cols, mask=ok & valid, other=0.0)
    tl.store(out_ptr + t * stride_o + cols, x, mask=ok)


@triton.jit
def silu_mul_values(gate, up, ACCURATE_EXP: tl.constexpr):
    """``F.silu(gate) * up`` of two tiles in their dtype: ``silu`` in float32 rounded to the dtype,
    then the product rounded (what torch's two ops give). ``ACCURATE_EXP``: CUDA's ``expf``, what
    torch's silu calls (``tl.exp`` is the fast ``ex2`` approximation); off under the interpreter
    (numpy's ``exp``). :func:`tpspec.model.gemv_triton.silu_mul_linear` forms its input with it too."""
    dtype = gate.dtype
    g = gate.to(tl.float32)
    if ACCURATE_EXP:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    act = tl.math.div_rn(g, 1.0 + e).to(dtype)  # F.silu in the dtype
    return (act.to(tl.float32) * up.to(tl.float32)).to(dtype)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, ACCURATE_EXP: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, silu_mul_values(gate, up, ACCURATE_EXP), mask=ok)


INTERPRETED = isinstance(_rms_norm_kernel, InterpretedFunction)
"""Whether this import got Triton's interpreter (``TRITON_INTERPRET=1``): kernels on CPU tensors."""


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [N, features], got shape {tuple(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    x = _rows(x, "x")
    n, hidden = x.shape
    if weight.shape != (hidden,) or weight.dtype != x.dtype:
        raise ValueError(f"weight must be [{hidden}] in {x.dtype}, got {tuple(weight.shape)} in {weight.dtype}")
    if hidden > MAX_HIDDEN:
        raise ValueError(f"rows of {hidden} features exceed the norm kernel's {MAX_HIDDEN}")
    out = torch.empty_like(x)
    new_res = torch.empty_like(x) if residual is not None else out
    res = x
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual must match x ({tuple(x.shape)}, {x.dtype}), got "
                             f"{tuple(residual.shape)}, {residual.dtype}")
        res = _rows(residual, "residual")
    if n:
        block = triton.next_power_of_2(hidden)
        pdl = pdl_args(x.device)
        _rms_norm_kernel[(n,)](x, res, weight.contiguous(), out, new_res, hidden, float(hidden), float(eps),
                               x.stride(0), res.stride(0), out.stride(0), new_res.stride(0),
                               HAS_RESIDUAL=residual is not None, BLOCK=block,
                               num_warps=min(16, max(1, block // 512)), enable_fp_fusion=False, **pdl)
    return out, new_res


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers computes it: ``weight * (x32 * rsqrt(mean(x32**2) + eps)).to(dtype)``
    with ``x32`` the float32 copy of ``x`` and the product in ``x``'s dtype.

    ``x`` ``[N, hidden]`` (float32, float16 or bfloat16; hidden at most ``MAX_HIDDEN``), ``weight``
    ``[hidden]`` in ``x``'s dtype. Returns a new ``[N, hidden]`` tensor in that dtype. ``ValueError``
    on mismatched shapes or dtypes."""
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(h, weight, eps), h)`` with ``h = x + residual`` rounded to their dtype (what
    ``x + residual`` gives in torch), in one pass. ``x``, ``residual``: ``[N, hidden]`` of one
    dtype; see :func:`rms_norm` for the rest. Neither input is modified."""
    return _norm(x, residual, weight, eps)


def embed(ids: torch.Tensor, weight: torch.Tensor, offset: int, real_width: int) -> torch.Tensor:
    """The rows of ``weight`` (``[width, hidden]``, its last dimension contiguous) at ``ids - offset``
    for the ids in ``[offset, offset + real_width)``, ``+0.0`` rows for every other id, in one
    launch: ``[N, hidden]`` in ``weight``'s dtype (``ids``: ``[N]`` integer on its device). A
    rank's part of :class:`~tpspec.model.layers.VocabParallelEmbedding`: its rows copied as they
    are."""
    if ids.dim() != 1 or weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"ids must be [N] and weight [width, hidden] with a contiguous last dimension, got "
                         f"{tuple(ids.shape)} and {tuple(weight.shape)}")
    n, hidden = ids.shape[0], weight.shape[1]
    out = torch.empty((n, hidden), dtype=weight.dtype, device=weight.device)
    if n and hidden:
        _embed_kernel[(n, triton.cdiv(hidden, EMBED_BLOCK))](ids.contiguous(), weight, out, offset, real_width, hidden,
                                                             weight.stride(0), out.stride(0), BLOCK=EMBED_BLOCK,
                                                             num_warps=4, enable_fp_fusion=False)
    return out


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of the rotary angles ``positions[:, None] * inv_freq[None, :]`` (float32),
    each ``[N, 2 * len(inv_freq)]`` in ``dtype`` with the half-split layout (both halves alike),
    in one launch: :class:`~tpspec.model.layers.RotaryEmbedding`'s values (on CUDA, CUDA's
    ``cosf``/``sinf`` as torch's ``cos``/``sin``; under the interpreter numpy's). ``positions``:
    ``[N]`` integer on ``inv_freq``'s device; ``inv_freq``: ``[head_dim / 2]`` float32."""
    if positions.dim() != 1 or inv_freq.dim() != 1 or inv_freq.dtype != torch.float32:
        raise ValueError(f"positions must be [N] and inv_freq [head_dim / 2] float32, got {tuple(positions.shape)} "
                         f"and {tuple(inv_freq.shape)} {inv_freq.dtype}")
    n, half = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty((n, 2 * half), dtype=dtype, device=inv_freq.device)
    sin = torch.empty_like(cos)
    if n:
        block_t = 4
        _cos_sin_kernel[(triton.cdiv(n, block_t),)](
            positions.contiguous(), inv_freq.contiguous(), cos, sin, n, HALF=half,
            HALF_PAD=triton.next_power_of_2(half), BLOCK_T=block_t, ACCURATE=not INTERPRETED, num_warps=1,
            enable_fp_fusion=False)
    return cos, sin


def rotary_and_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, write_index: torch.Tensor,
                        k_pages: torch.Tensor, v_pages: torch.Tensor, num_heads: int, num_kv_heads: int,
                        head_dim: int) -> torch.Tensor:
    """Rotate q and k of the fused projection ``qkv`` and store k and v in the KV pages.

    Parameters
    ----------
    qkv : ``[N, (num_heads + 2 * num_kv_heads) * head_dim]``: q heads, k heads, v heads.
    cos, sin : ``[N, head_dim]`` in ``qkv``'s dtype (:class:`~tpspec.model.layers.RotaryEmbedding`).
    write_index : ``[N]`` integer: the flat cache row ``page * page_size + offset`` of each token.
        Every row must lie in ``[0, num_pages * page_size)`` (the attention metadata's are); a row
        outside is skipped, never written out of bounds.
    k_pages, v_pages : ``[num_pages, page_size, num_kv_heads, head_dim]`` in ``qkv``'s dtype (one
        layer of :class:`~tpspec.model.kv_cache.KVPages`), written in place.

    Returns q ``[N, num_heads, head_dim]``, contiguous, rotated exactly as
    :func:`~tpspec.model.layers.apply_rotary` rotates it (half-split layout, every product and sum
    rounded to the dtype); the pages get the same k as ``apply_rotary`` + :meth:`KVPages.write`
    and the untouched v. ``ValueError`` on shapes that do not fit.
    """
    qkv = _rows(qkv, "qkv")
    n = qkv.shape[0]
    if head_dim % 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not hold {num_heads} + 2 x {num_kv_heads} heads of an even "
                         f"head_dim {head_dim}")
    want = (num_kv_heads, head_dim)
    if k_pages.shape[2:] != want or v_pages.shape != k_pages.shape:
        raise ValueError(f"K/V pages {tuple(k_pages.shape)} / {tuple(v_pages.shape)} must be "
                         f"[num_pages, page_size, {num_kv_heads}, {head_dim}]")
    if not qkv.dtype == cos.dtype == sin.dtype == k_pages.dtype == v_pages.dtype:
        raise ValueError(f"qkv, cos, sin and the pages must share a dtype, got {qkv.dtype}, {cos.dtype}, "
                         f"{sin.dtype}, {k_pages.dtype}, {v_pages.dtype}")
    if cos.shape != (n, head_dim) or sin.shape != (n, head_dim) or write_index.shape != (n,):
        raise ValueError(f"cos and sin must be [{n}, {head_dim}] and write_index [{n}], got {tuple(cos.shape)}, "
                         f"{tuple(sin.shape)}, {tuple(write_index.shape)}")
    k_rows = k_pages.view(-1, num_kv_heads, head_dim)  # flat rows, as KVPages.write addresses them
    v_rows = v_pages.view(-1, num_kv_heads, head_dim)
    if k_rows.stride(-1) != 1 or v_rows.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("the pages, cos and sin need a contiguous last dimension")
    q = torch.empty((n, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if n:
        pdl = pdl_args(qkv.device)
        _rotary_kv_kernel[(n, num_heads + num_kv_heads)](
            qkv, cos, sin, write_index, q, k_rows, v_rows, k_rows.shape[0], qkv.stride(0), cos.stride(0),
            sin.stride(0), q.stride(0), q.stride(1), k_rows.stride(0), k_rows.stride(1), v_rows.stride(0),
            v_rows.stride(1), NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            HALF_PAD=triton.next_power_of_2(head_dim // 2), num_warps=1 if head_dim <= 128 else 2,
            enable_fp_fusion=False, **pdl)
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` for ``gate_up = cat(gate, up)`` ``[N, 2 * I]``, each step rounded to the
    input's dtype as torch rounds it (``silu`` computed in float32). Returns a new ``[N, I]``."""
    gate_up = _rows(gate_up, "gate_up")
    n, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up must have an even number of features, got {width}")
    inter = width // 2
    out = torch.empty((n, inter), dtype=gate_up.dtype, device=gate_up.device)
    if n and inter:
        pdl = pdl_args(gate_up.device)
        _silu_mul_kernel[(n, triton.cdiv(inter, SILU_BLOCK))](
            gate_up, out, inter, gate_up.stride(0), out.stride(0), ACCURATE_EXP=not INTERPRETED, BLOCK=SILU_BLOCK,
            num_warps=4, enable_fp_fusion=False, **pdl)
    return out
