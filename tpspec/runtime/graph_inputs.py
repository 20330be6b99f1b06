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

from typing import Any, Sequence

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

    def advance(self, accepted: torch.Tensor, num: torch.Tensor, num_padding: int, history: torch.Tensor,
                slot_rows: torch.Tensor, drafter: Any) -> None:
        """Turn the uploaded inputs of a step with drafts into those of the step after it, on the
        device, without a host sync. Each request after the ``num_padding`` padding ones emitted
        the first ``num[b]`` tokens of ``accepted[b]`` (``[batch, num_draft + 1]`` and ``[batch]``
        int64, the step's outputs on the device; counts clamped to ``1 .. num_draft + 1``): they
        join its row ``slot_rows[b]`` (``[batch]`` int64) of ``history`` (``[rows, width]`` int32)
        after its last token (positions past ``width`` are not written), its cached length grows
        by ``num[b]``, its last token is the last one it emitted, and its drafts are ``drafter``'s
        (an ``NgramDrafter``: ``draft_on_device``) over its history. Padding requests keep their
        inputs. The page-table rows must already hold the pages of the new positions
        (:meth:`fill`'s ``reserve``, ``num_draft + 1``). Torch ops: the CPU path, and the
        reference of ``advance_triton.advance``."""
        t = self.tensors
        b, k1, ps = self.batch, self.num_draft + 1, self.page_size
        dev = history.device
        real = (torch.arange(b, device=dev) >= num_padding).reshape(b, 1)
        num = num.clamp(1, k1).reshape(b, 1)
        steps = torch.arange(k1, device=dev).reshape(1, k1)
        # The emitted tokens join the history after the last token (position ``cache_lens``).
        at = t["cache_lens"].reshape(b, 1) + 1 + steps
        inside = at < history.shape[1]
        at = at.clamp(max=history.shape[1] - 1)
        row_index = slot_rows.reshape(b, 1).expand(b, k1)
        history[row_index, at] = torch.where(real & (steps < num) & inside, accepted.to(torch.int32),
                                             history[row_index, at])
        cache_lens = t["cache_lens"].reshape(b, 1) + torch.where(real, num, 0)
        t["cache_lens"].copy_(cache_lens.reshape(b))
        pos = cache_lens + steps
        t["positions"].copy_(pos.reshape(-1))
        t["tok_visible"].copy_((pos + 1).reshape(-1))
        t["write_index"].copy_((t["page_table"].gather(1, pos // ps) * ps + pos % ps).reshape(-1))
        tokens = t["tokens"].view(b, k1)
        emitted = accepted.gather(1, num - 1).clamp(min=0)
        tokens[:, :1].copy_(torch.where(real, emitted, tokens[:, :1]))
        width = min(self.kv_pages * ps, history.shape[1])
        drafted = drafter.draft_on_device(history[slot_rows, :width].to(torch.int64), cache_lens.reshape(b) + 1)
        drafts = torch.where(real, drafted, t["drafts"])
        t["drafts"].copy_(drafts)
        tokens[:, 1:].copy_(drafts)

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
