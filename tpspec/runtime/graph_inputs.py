"""The per-step inputs of one captured generation step, packed in one buffer.

A graphed step of a :class:`~tpspec.runtime.cuda_graphs.StepKey` feeds ``Bp`` requests
(padding first) ``K + 1`` tokens each: the last committed token and the ``K`` drafts. Its
varying inputs are a handful of small integer arrays — token ids, positions, each token's KV
write row and visible length, each request's cached length, the page table and the drafts —
all derived from ``(tokens, cache_len, pages)`` of every request. :class:`GraphInputs`
keeps them in one int64 host buffer (pinned on CUDA) and one device buffer of the same
layout, whose slices *are* the graph's static input tensors: a step fills the host buffer
with numpy and moves it with one copy, instead of building tensors on the host one by one.
The causal mask the torch attention reads is recomputed inside the graph from the cached
lengths (:meth:`GraphInputs.refresh_mask`).

The values equal what :meth:`~tpspec.model.batch.AttentionMetadata.build` gives the same batch
with the key's page-table width (``tests/test_runtime_graphs.py`` checks it).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..model.batch import causal_mask, page_table_rows, pages_needed, write_rows


class GraphInputs:
    """Packed static inputs of ``batch`` requests of ``num_draft + 1`` rows each, page tables
    ``kv_pages`` wide (pages of ``page_size`` tokens), on ``device``.

    ``tensors``: the device views a graph captures — ``tokens``, ``positions``,
    ``write_index``, ``tok_visible`` ``[batch * (num_draft + 1)]``; ``cache_lens``
    ``[batch]``; ``page_table`` ``[batch, kv_pages]``; ``drafts`` ``[batch, num_draft]``
    (None without drafts). All int64, contiguous slices of one buffer.
    """

    def __init__(self, *, batch: int, num_draft: int, kv_pages: int, page_size: int,
                 device: torch.device) -> None:
        self.batch, self.num_draft, self.kv_pages, self.page_size = batch, num_draft, kv_pages, page_size
        rows = batch * (num_draft + 1)
        sizes = {"tokens": rows, "positions": rows, "write_index": rows, "tok_visible": rows, "cache_lens": batch,
                 "page_table": batch * kv_pages, "drafts": batch * num_draft}
        total = sum(sizes.values())
        self.host = torch.zeros(total, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.device_buffer = torch.zeros(total, dtype=torch.int64, device=device)
        host = self.host.numpy()
        self._host: dict[str, np.ndarray] = {}
        self.tensors: dict[str, torch.Tensor | None] = {}
        offset = 0
        for name, size in sizes.items():
            self._host[name] = host[offset:offset + size]
            self.tensors[name] = self.device_buffer[offset:offset + size]
            offset += size
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None
        self.tensors["page_table"] = self.tensors["page_table"].view(batch, kv_pages)
        self.tensors["drafts"] = self.tensors["drafts"].view(batch, num_draft) if num_draft else None

    def fill(self, last_tokens: Sequence[int], drafts: Sequence[Sequence[int]], cache_lens: Sequence[int],
             tables: Sequence[Sequence[int]], *, reserve: int = 0) -> None:
        """Write one step into the host buffer: per request (``batch`` of them, in batch order)
        its last committed token, its ``num_draft`` drafts, its cached length (the position of
        its last token) and its pages (at least those its ``cache_len + num_draft + 1 + reserve``
        tokens need: ``reserve`` more tokens a request for :meth:`advance`, whose page-table rows
        then hold those pages too). ``ValueError`` when a request does not fit the key's
        page-table width."""
        b, k1, ps = self.batch, self.num_draft + 1, self.page_size
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the last upload has read the host buffer
        if not len(last_tokens) == len(drafts) == len(cache_lens) == len(tables) == b:
            raise ValueError(f"GraphInputs.fill: expected {b} requests, got {len(last_tokens)} tokens, "
                             f"{len(drafts)} draft lists, {len(cache_lens)} lengths, {len(tables)} tables")
        clens = np.asarray(cache_lens, dtype=np.int64)
        used = [pages_needed(c + k1 + reserve, ps) for c in cache_lens]
        if max(used) > self.kv_pages:
            raise ValueError(f"GraphInputs.fill: a request needs {max(used)} pages, the key holds {self.kv_pages}")
        if any(len(t) < n for t, n in zip(tables, used)):
            raise ValueError("GraphInputs.fill: a block table does not cover its request's tokens")
        tokens = self._host["tokens"].reshape(b, k1)
        tokens[:, 0] = last_tokens
        if self.num_draft:
            tokens[:, 1:] = drafts
            self._host["drafts"].reshape(b, self.num_draft)[:] = tokens[:, 1:]
        self._host["cache_lens"][:] = clens
        pos = clens[:, None] + np.arange(k1, dtype=np.int64)[None, :]  # [b, K + 1]
        self._host["positions"][:] = pos.reshape(-1)
        self._host["tok_visible"][:] = (pos + 1).reshape(-1)
        table = page_table_rows(tables, used, self._host["page_table"].reshape(b, self.kv_pages))
        self._host["write_index"][:] = write_rows(table, np.repeat(np.arange(b), k1), pos.reshape(-1), ps)

    def upload(self) -> None:
        """Copy the host buffer to the device buffer, on the stream (asynchronous on CUDA: the
        buffer is pinned; the next :meth:`fill` waits until this copy has read it)."""
        self.device_buffer.copy_(self.host, non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()

    def advance(self, accepted: torch.Tensor, num: torch.Tensor, num_padding: int,
                draft: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        """Turn the uploaded inputs of a step into those of the step after it, on the device,
        without a host sync: each request after the ``num_padding`` padding ones emitted its first
        ``num[b]`` tokens of ``accepted[b]`` (``[batch, num_draft + 1]`` int64 and ``[batch]``
        int64, the step's outputs on the device; clamped here to a token id and to
        ``1 .. num_draft + 1``), so its cached length grows by ``num[b]``, its last token is the
        last one it emitted, and its drafts are ``draft(lengths)`` (``[batch]`` the new token
        counts, ``cache_len + 1``; returns ``[batch, num_draft]`` int64; None without drafts).
        Padding requests keep their inputs. The page-table rows must already hold the pages of the
        new positions (:meth:`fill`'s ``reserve``, ``num_draft + 1``)."""
        t = self.tensors
        b, k1, ps = self.batch, self.num_draft + 1, self.page_size
        dev = t["cache_lens"].device
        real = torch.arange(b, device=dev) >= num_padding
        num = num.clamp(1, k1)
        grow = torch.where(real, num, 0)
        cache_lens = t["cache_lens"] + grow
        t["cache_lens"].copy_(cache_lens)
        pos = cache_lens.reshape(b, 1) + torch.arange(k1, device=dev).reshape(1, k1)
        t["positions"].copy_(pos.reshape(-1))
        t["tok_visible"].copy_((pos + 1).reshape(-1))
        page = t["page_table"].gather(1, pos // ps)
        t["write_index"].copy_((page * ps + pos % ps).reshape(-1))
        tokens = t["tokens"].view(b, k1)
        emitted = accepted.gather(1, (num - 1).reshape(b, 1)).reshape(b).clamp(min=0)
        tokens[:, 0].copy_(torch.where(real, emitted, tokens[:, 0]))
        if self.num_draft:
            drafts = torch.where(real.reshape(b, 1), draft(cache_lens + 1), t["drafts"])
            t["drafts"].copy_(drafts)
            tokens[:, 1:].copy_(drafts)

    def advance_with_ngram(self, accepted: torch.Tensor, num: torch.Tensor, num_padding: int,
                           history: torch.Tensor, slot_rows: torch.Tensor, drafter: Any) -> None:
        """:meth:`advance` with ``drafter``'s (an ``NgramDrafter``) drafts over each request's tokens
        on the device, after writing the tokens each real request emitted into ``history``
        (``[rows, width]`` int32, the positions after its last token; request ``b`` owns row
        ``slot_rows[b]``, ``[batch]`` int64; positions past ``width`` are not written). Torch ops
        without a host sync: the CPU path, and the reference of ``advance_triton.advance``."""
        b, k1 = self.batch, self.num_draft + 1
        dev = history.device
        real = (torch.arange(b, device=dev) >= num_padding).reshape(b, 1)
        emitted = torch.arange(k1, device=dev).reshape(1, k1) < num.clamp(1, k1).reshape(b, 1)
        at = self.tensors["cache_lens"].reshape(b, 1) + 1 + torch.arange(k1, device=dev).reshape(1, k1)
        inside = at < history.shape[1]
        at = at.clamp(max=history.shape[1] - 1)
        row_index = slot_rows.reshape(b, 1).expand(b, k1)
        kept = history[row_index, at]
        history[row_index, at] = torch.where(real & emitted & inside, accepted.to(torch.int32), kept)
        width = min(self.kv_pages * self.page_size, history.shape[1])
        self.advance(accepted, num, num_padding,
                     lambda lengths: drafter.draft_on_device(history[slot_rows, :width].to(torch.int64), lengths))

    def refresh_mask(self, meta: Any) -> None:
        """Recompute ``meta.mask`` in place from the cached lengths (inside a captured step, so
        each replay masks with its own lengths)."""
        meta.mask.copy_(causal_mask(self.tensors["cache_lens"], meta.q_max, meta.kv_len)[:, None])

    def adopt(self, batch: Any, meta: Any) -> None:
        """Make a step's static ``ForwardBatch`` and ``AttentionMetadata`` (built from the same
        requests as the last :meth:`fill`) read this buffer's device views."""
        batch.token_ids, batch.positions = self.tensors["tokens"], self.tensors["positions"]
        for name in ("write_index", "tok_visible", "page_table"):
            setattr(meta, name, self.tensors[name])
