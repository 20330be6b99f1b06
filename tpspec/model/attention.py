"""Paged attention: each sequence's queries against only the pages it uses.

Backends behind one rule (:func:`choose_attention_backend`):

* ``"torch"``: gathers the pages a step reads and runs masked SDPA (CPU and CUDA).
* ``"triton"``: :mod:`tpspec.model.paged_attention_triton`, paged decode / verification /
  prefill kernels that read each KV page once per KV head (CUDA with ``triton``; on CPU only
  under Triton's interpreter, ``TRITON_INTERPRET=1``, which is how the CPU tests run it).
* ``"flashinfer"``: FlashInfer's paged prefill/decode kernels (CUDA with ``flashinfer``).
* ``"deterministic"``: deterministic mode's fixed-order path (:class:`DeterministicPagedAttention`).

``"auto"`` picks ``AUTO_CUDA_ATTENTION`` on CUDA and ``"torch"`` elsewhere; ``auto`` only ever
names a backend a GPU run has checked, so FlashInfer runs only when asked for by name. All
backends treat grouped-query heads without copying keys or values per query head, and all
give token ``i`` of a sequence the keys ``[0, cache_len + i]``.

A backend says whether its ``attend`` can be captured in a CUDA graph (``supports_graphs``)
and whether it plans on the host from the step's page lists (``plans_on_host``: FlashInfer
only), and is used in two steps: ``plan(meta)`` once per step (host work: FlashInfer's
schedule; nothing for the others) and ``bind(meta)``, once per forward, returning
``attend(q, pages) -> out`` that every layer calls. Under a CUDA graph the plan happens
before capture and before every replay, ``bind`` and ``attend`` inside the graph; a backend
that does not plan on the host reads only the metadata's device tensors, which a replay
refreshes in place.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import deterministic as det
from .batch import AttentionMetadata
from .kv_cache import KVPages

# SDPA backends the torch path may use. Not cuDNN attention: it builds an execution plan
# per new shape, and eager decode steps change shape every step (the KV length grows). The
# same list serves eager steps and CUDA graphs, so both compute the same logits.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")
# What ``attention_backend="auto"`` runs on CUDA. Only a backend whose kernels a GPU run has
# checked (tests/test_paged_attention_triton.py's ``gpu`` tests for "triton") may stand here.
AUTO_CUDA_ATTENTION = "triton"
FLASHINFER_HEAD_DIMS = (64, 128, 256)
FLASHINFER_WORKSPACE_BYTES = 128 * 1024 * 1024

AttendFn = Callable[[torch.Tensor, KVPages], torch.Tensor]

FUSED_ROTARY = False
"""Whether the Triton backend runs rotary and the K/V write inside its attention kernel for steps
whose sequences' rows fit one query block (decode and verification;
:func:`paged_attention_triton.paged_attention_qkv`): one kernel a layer fewer, the same bits in
float16 and bfloat16. Off until a GPU run has checked its values and timed the steps."""


def flashinfer_available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def triton_kernels() -> Any:
    """:mod:`tpspec.model.paged_attention_triton`, or None where ``triton`` does not import."""
    try:
        return importlib.import_module(f"{__package__}.paged_attention_triton")
    except ImportError:
        return None


def _triton_unusable(device: torch.device) -> str | None:
    """Why the Triton backend cannot run on ``device`` (None when it can)."""
    kernels = triton_kernels()
    if kernels is None:
        return "it needs the triton package (pip install triton; torch's CUDA wheels bring it)"
    if device.type == "cuda" and kernels.INTERPRETED:
        return "Triton's interpreter is on (TRITON_INTERPRET=1): it runs kernels on CPU tensors only"
    if device.type not in ("cuda", "cpu") or (device.type == "cpu" and not kernels.INTERPRETED):
        return (f"it runs on CUDA, and on CPU only under Triton's interpreter (set TRITON_INTERPRET=1 before "
                f"triton is imported); device is {device}")
    version, need = kernels.triton_version(), kernels.INTERPRETER_MIN_TRITON
    if device.type == "cpu" and version < need:
        return (f"on CPU it needs the interpreter of Triton {'.'.join(map(str, need))} or later (its loops run over "
                f"bounds read from tensors); this is Triton {'.'.join(map(str, version))}")
    return None


def choose_attention_backend(device: torch.device | str, head_dim: int, prefer: str = "auto", *,
                             deterministic: bool = False) -> str:
    """The attention backend a model on ``device`` runs.

    ``prefer="auto"``: ``AUTO_CUDA_ATTENTION`` on CUDA (``"triton"``; ``"torch"`` when it cannot
    run here, e.g. without the ``triton`` package), ``"torch"`` elsewhere. ``"torch"``,
    ``"triton"`` or ``"flashinfer"`` force one; ``ValueError`` when it cannot run here
    (``"triton"``: CUDA with ``triton``, or CPU under Triton's interpreter; ``"flashinfer"``:
    CUDA, the ``flashinfer`` package and a ``head_dim`` it supports).
    ``deterministic``: ``"deterministic"`` (``prefer`` must stay ``"auto"``: no other backend
    keeps a row's result independent of its batch)."""
    if prefer not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {prefer!r}")
    if deterministic:
        if prefer != "auto":
            raise ValueError(f"deterministic mode uses its own fixed-order attention; attention_backend must be "
                             f"'auto', got {prefer!r}")
        return "deterministic"
    device = torch.device(device)
    if prefer == "auto":
        prefer = AUTO_CUDA_ATTENTION if device.type == "cuda" else "torch"
        if prefer == "triton" and _triton_unusable(device) is not None:
            prefer = "torch"
    if prefer == "flashinfer":
        if not (device.type == "cuda" and flashinfer_available() and head_dim in FLASHINFER_HEAD_DIMS):
            raise ValueError(f"attention_backend='flashinfer' needs CUDA, the flashinfer package and a head_dim in "
                             f"{FLASHINFER_HEAD_DIMS} (device {device}, head_dim {head_dim})")
    elif prefer == "triton":
        why = _triton_unusable(device)
        if why is not None:
            raise ValueError(f"attention_backend='triton' cannot run here: {why}")
    return prefer


def make_attention_backend(name: str, *, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                           dtype: torch.dtype, device: torch.device) -> Any:
    """The backend object one model's layers share (all layers have the same heads)."""
    cls = {"flashinfer": FlashInferPagedAttention, "deterministic": DeterministicPagedAttention,
           "triton": TritonPagedAttention}.get(name, TorchPagedAttention)
    return cls(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scale=scale, dtype=dtype,
               device=device)


class TorchPagedAttention:
    """Gathers the pages each sequence uses (``[B, kv_pages * page_size]`` rows, the batch's
    longest sequence, never the whole cache) and runs one masked SDPA call. Grouped-query
    heads fold into the query rows: the ``group`` query heads of a KV head become
    ``group * q_max`` rows against that head's keys, so keys and values are never repeated."""

    name = "torch"
    supports_graphs = True
    plans_on_host = False

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.group = num_heads // num_kv_heads

    def plan(self, meta: AttentionMetadata, *, graph: bool = False) -> None:
        """Nothing to plan: the torch path reads the metadata's tensors directly."""

    def bind(self, meta: AttentionMetadata) -> AttendFn:
        b, g, q_max = meta.num_seqs, self.group, meta.q_max
        # [B, 1, q_max, L] -> [B, 1, g * q_max, L]: the same causal row for every head of a group.
        mask = meta.mask if g == 1 else meta.mask.expand(b, g, q_max, meta.kv_len).reshape(b, 1, g * q_max, meta.kv_len)
        return lambda q, pages: self._attend(q, pages, meta, mask)

    def _attend(self, q: torch.Tensor, pages: KVPages, meta: AttentionMetadata, mask: torch.Tensor) -> torch.Tensor:
        if meta.num_tokens == 0:
            return q
        b, g, q_max, hd, kvh = meta.num_seqs, self.group, meta.q_max, self.head_dim, self.num_kv_heads
        rows = meta.kv_len
        keys = pages.k[meta.page_table].view(b, rows, kvh, hd).transpose(1, 2)  # [B, kv, L, hd]
        values = pages.v[meta.page_table].view(b, rows, kvh, hd).transpose(1, 2)
        if b == 1:
            padded = q[None]  # one sequence: no padding needed
        else:
            padded = q.new_zeros(b, q_max, self.num_heads, hd)
            padded[meta.tok_seq, meta.tok_qi] = q
        # [B, q_max, kv * g, hd] -> [B, kv, g * q_max, hd] (head h = kv_head * g + j)
        queries = padded.view(b, q_max, kvh, g, hd).permute(0, 2, 3, 1, 4).reshape(b, kvh, g * q_max, hd)
        with sdpa_kernel(SDPA_BACKENDS):
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=self.scale)
        out = out.view(b, kvh, g, q_max, hd).permute(0, 3, 1, 2, 4).reshape(b, q_max, self.num_heads, hd)
        return out[0] if b == 1 else out[meta.tok_seq, meta.tok_qi]


class TritonPagedAttention:
    """:func:`paged_attention_triton.paged_attention` over the step's page table: every query
    block of a sequence (decode, verification, a prefill chunk) with the query heads of one KV
    head in one program, KV splits for small batches, float32 accumulation. ``bind`` finds each
    sequence's first row on the device (no host sync); launch sizes come from the metadata's
    sizes (tokens, sequences, ``q_max``, ``kv_pages``), so a CUDA graph captures it."""

    name = "triton"
    supports_graphs = True
    plans_on_host = False

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.dtype = dtype
        why = _triton_unusable(torch.device(device))
        if why is not None:
            raise ValueError(f"attention_backend='triton' cannot run here: {why}")
        self.kernels = triton_kernels()
        self.num_splits: int | None = None  # KV splits of every launch (None: plan_launch's choice)

    def plan(self, meta: AttentionMetadata, *, graph: bool = False) -> None:
        """Nothing to plan on the host: the kernels read the metadata's device tensors."""

    def bind(self, meta: AttentionMetadata) -> AttendFn:
        """``attend(q, pages)``; where :meth:`rotary_inside` takes the step, the returned callable
        also has ``rotary_and_attend(qkv, cos, sin, pages)`` (the fused projection in, rotary and
        the K/V write inside the kernel), else that attribute is None."""
        if meta.num_tokens == 0:
            return _TritonAttend(None, meta, self, None)
        starts = self.kernels.sequence_starts(meta.tok_seq, meta.num_seqs)
        return _TritonAttend(starts, meta, self, self.rotary_inside(meta))

    def rotary_inside(self, meta: AttentionMetadata) -> bool:
        """Whether this step's layers run rotary and the K/V write inside the attention kernel:
        ``FUSED_ROTARY`` on, every sequence's rows in one query block, an even head size, and
        float16 or bfloat16 on CUDA (in float32 the separate rotary kernel's unfused products
        decide the bits; any of the three under Triton's interpreter). The same answer on every rank."""
        return (FUSED_ROTARY and self.head_dim % 2 == 0 and meta.num_tokens > 0
                and (self.dtype in (torch.float16, torch.bfloat16) or self.kernels.INTERPRETED)
                and self.kernels.fits_one_query_block(q_max=meta.q_max, num_heads=self.num_heads,
                                                      kv_heads=self.num_kv_heads))


class _TritonAttend:
    """:meth:`TritonPagedAttention.bind`'s callable: ``attend(q, pages)``, and ``rotary_and_attend``
    (None where the step keeps rotary outside the kernel)."""

    def __init__(self, starts: torch.Tensor | None, meta: AttentionMetadata, backend: TritonPagedAttention,
                 rotary: bool | None) -> None:
        self.starts, self.meta, self.backend = starts, meta, backend
        self.rotary_and_attend = self._rotary_and_attend if rotary else None

    def __call__(self, q: torch.Tensor, pages: KVPages) -> torch.Tensor:
        if self.starts is None:  # an empty step
            return q
        b, meta = self.backend, self.meta
        return b.kernels.paged_attention(q, pages.k, pages.v, meta.page_table, self.starts, meta.tok_visible, b.scale,
                                         q_max=meta.q_max, num_splits=b.num_splits)

    def _rotary_and_attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           pages: KVPages) -> torch.Tensor:
        b, meta = self.backend, self.meta
        return b.kernels.paged_attention_qkv(qkv, cos, sin, pages.k, pages.v, meta.page_table, self.starts,
                                             meta.tok_visible, b.scale, num_heads=b.num_heads, q_max=meta.q_max,
                                             num_splits=b.num_splits)


class DeterministicPagedAttention:
    """Deterministic mode: every query row's result depends only on that row and the
    keys/values it sees, in a fixed order, whatever the batch, the number of query rows of its
    sequence or the pages the step reads.

    On CUDA with Triton: :func:`deterministic_attention_cuda.paged_attention` (fixed splits of
    the KV axis by absolute position, merged by a fixed tree over splits; launches sized by
    the metadata, no host sync, so ``supports_graphs`` is ``True``). Elsewhere (CPU, or CUDA without
    Triton): each sequence alone by :func:`det.attend_sequence` over the cache rows its pages
    hold, a loop on the host (``supports_graphs`` is ``False``). The two paths' bits differ;
    each is invariant on its own."""

    name = "deterministic"
    plans_on_host = False

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.cuda_kernels = det.attention_kernels(torch.device(device))
        self.supports_graphs = self.cuda_kernels is not None

    def plan(self, meta: AttentionMetadata, *, graph: bool = False) -> None:
        """Nothing to plan; ``graph`` needs the CUDA path (a graph cannot hold the host loop)."""
        if graph and not self.supports_graphs:
            raise RuntimeError("deterministic attention runs under CUDA graphs only on CUDA with triton installed")

    def bind(self, meta: AttentionMetadata) -> AttendFn:
        return lambda q, pages: self._attend(q, pages, meta)

    def _attend(self, q: torch.Tensor, pages: KVPages, meta: AttentionMetadata) -> torch.Tensor:
        if q.is_cuda and self.cuda_kernels is not None:
            return self.cuda_kernels.paged_attention(q, pages.k, pages.v, meta.page_table, meta.tok_seq,
                                                     meta.tok_visible, self.scale)
        out = torch.empty_like(q)
        page_size, kvh, hd = meta.page_size, self.num_kv_heads, self.head_dim
        flat_k, flat_v = pages.k.view(-1, kvh, hd), pages.v.view(-1, kvh, hd)
        offsets = torch.arange(page_size, device=q.device)
        start = 0
        for b, (qn, kv_len) in enumerate(zip(meta.query_lens, meta.kv_lens)):
            used = -(-kv_len // page_size)
            rows = (meta.page_table[b, :used, None] * page_size + offsets).reshape(-1)[:kv_len]
            out[start : start + qn] = det.attend_sequence(q[start : start + qn], flat_k.index_select(0, rows),
                                                          flat_v.index_select(0, rows), kv_len - qn, self.scale)
            start += qn
        return out


class FlashInferPagedAttention:
    """FlashInfer's paged kernels: the decode wrapper when every sequence feeds one token,
    the prefill (append) wrapper otherwise — context chunks, speculative verification and
    mixed batches. Causal masking is bottom-right aligned, which is exactly "token ``i`` sees
    ``[0, cache_len + i]``". CUDA-graph steps get their own wrapper with fixed buffers,
    planned before every replay."""

    name = "flashinfer"
    supports_graphs = True
    plans_on_host = True

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, dtype: torch.dtype,
                 device: torch.device) -> None:
        import flashinfer

        self.fi = flashinfer
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.dtype = dtype
        # FlashInfer wants its float workspace zeroed before the first use.
        self.workspace = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=True)

    def _graph_wrapper(self, meta: AttentionMetadata, decode: bool) -> Any:
        b, cap = meta.num_seqs, meta.num_seqs * meta.kv_pages
        dev = self.workspace.device
        indptr = torch.zeros(b + 1, dtype=torch.int32, device=dev)
        indices = torch.zeros(max(cap, 1), dtype=torch.int32, device=dev)
        last = torch.zeros(b, dtype=torch.int32, device=dev)
        if decode:
            return self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=indptr,
                paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last)
        return self.fi.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=torch.zeros(b + 1, dtype=torch.int32, device=dev),
            paged_kv_indptr_buf=indptr, paged_kv_indices_buf=indices, paged_kv_last_page_len_buf=last)

    def plan(self, meta: AttentionMetadata, *, graph: bool = False) -> None:
        """Plan the step's kernels on the host; ``graph``: with the graph's own wrapper, made
        on the first call for this metadata and reused before every replay."""
        decode = meta.q_max == 1
        state = meta.backend_state
        wrapper = state.get("graph_wrapper")
        if wrapper is None:
            wrapper = self._graph_wrapper(meta, decode) if graph else (self.decode if decode else self.prefill)
            if graph:
                state["graph_wrapper"] = wrapper
        if meta.num_tokens == 0:
            state["planned"] = None
            return
        if decode:
            wrapper.plan(meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, self.num_heads, self.num_kv_heads,
                         self.head_dim, meta.page_size, sm_scale=self.scale, q_data_type=self.dtype,
                         kv_data_type=self.dtype)
        else:
            wrapper.plan(meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, self.num_heads,
                         self.num_kv_heads, self.head_dim, meta.page_size, causal=True, sm_scale=self.scale,
                         q_data_type=self.dtype, kv_data_type=self.dtype)
        state["planned"] = wrapper

    def bind(self, meta: AttentionMetadata) -> AttendFn:
        if "planned" not in meta.backend_state:
            self.plan(meta)
        wrapper = meta.backend_state["planned"]
        if wrapper is None:
            return lambda q, pages: q
        return lambda q, pages: wrapper.run(q, (pages.k, pages.v))
