"""Drafters: where speculative decoding's guesses come from.

* :class:`NgramDrafter` — prompt lookup: find the latest earlier occurrence of the history's
  last n tokens and propose what followed it. No model: on the host for one history, or on the
  device for a batch of them (the same drafts), which lets a verification step's successor start
  before its tokens reach the host.
* :class:`DraftModel` — a smaller checkpoint of the same family and vocabulary, TP-sharded
  like the target. Its vocab-sharded head yields greedy drafts through the key exchange's
  draft channel: ``draft(batch).argmax(channel=Channel.DRAFT)``.
"""

from __future__ import annotations

import os

import torch

from ..exchange.base import KeyExchange
from ..mapping import Mapping
from .config import ModelConfig
from .llama import TPLlamaForCausalLM
from .loader import load_weights
from .shapes import config_from_path, fill_random, is_shape_path

class NgramDrafter:
    """Prompt-lookup drafting: for ``n`` from ``max_ngram`` down to ``min_ngram``, match the
    last ``n`` tokens of the history against earlier positions; on the latest match,
    propose the up-to-``num_draft_tokens`` tokens that followed it.

    Deterministic and rank-independent (every rank proposes the same drafts from the
    same history). Raises ``ValueError`` for invalid sizes.
    """

    def __init__(self, num_draft_tokens: int, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.num_draft_tokens = num_draft_tokens
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, token_history: list[int]) -> list[int]:
        """Up to ``num_draft_tokens`` draft tokens continuing ``token_history`` (empty when no
        n-gram of the allowed sizes reappears)."""
        hist = token_history if isinstance(token_history, list) else list(token_history)
        length = len(hist)
        top = min(self.max_ngram, length - 1)
        if top < self.min_ngram:
            return []
        # Every earlier position holding the last token ends a candidate match (list.index scans
        # in C: one pass over the history, no copy of it). Walking them latest first, a match of
        # ``top`` tokens wins at once; otherwise the latest match of each shorter length is kept.
        last, ends, at = hist[-1], [], -1
        try:
            while True:
                at = hist.index(last, at + 1, length - 1)
                ends.append(at)
        except ValueError:
            pass
        latest: dict[int, int] = {}
        for end in reversed(ends):
            n = 1
            while n < top and end >= n and hist[end - n] == hist[length - 1 - n]:
                n += 1
            if n == top:
                return [int(t) for t in hist[end + 1:end + 1 + self.num_draft_tokens]]
            for size in range(self.min_ngram, n + 1):
                latest.setdefault(size, end)
        for size in range(top - 1, self.min_ngram - 1, -1):
            if size in latest:
                end = latest[size]
                return [int(t) for t in hist[end + 1:end + 1 + self.num_draft_tokens]]
        return []

    def draft(self, token_history: list[int]) -> list[int]:
        """Exactly ``num_draft_tokens`` drafts: :meth:`propose`, padded with its last token (with
        the history's last token when it proposes none). Any token verifies correctly; a padded
        one is just less likely kept."""
        d = self.propose(token_history)
        return d + [d[-1] if d else int(token_history[-1])] * (self.num_draft_tokens - len(d))

    def draft_on_device(self, history: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """:meth:`draft` of a batch, on ``history``'s device, without a host sync: row ``b``'s
        drafts continue the history ``history[b, :lengths[b]]``.

        ``history``: ``[B, W]`` int64 (columns from ``lengths[b]`` on are ignored); ``lengths``:
        ``[B]`` int64, ``1 <= lengths[b] <= W``. Returns ``[B, num_draft_tokens]`` int64: for every
        row, the tokens :meth:`draft` gives ``history[b, :lengths[b]].tolist()``.
        """
        rows, width = history.shape
        dev = history.device
        col = torch.arange(width, device=dev).reshape(1, -1)
        last = (lengths - 1).reshape(-1, 1)
        # An earlier position e < last ends a match of n tokens when hist[e - j] == hist[last - j]
        # for j < n, n <= max_ngram (and so n <= e + 1 <= last: propose's rule). Every e at once:
        run = (history == history.gather(1, last)) & (col < last)
        size = run.to(torch.int64)
        for j in range(1, self.max_ngram):
            earlier = torch.nn.functional.pad(history[:, :width - j], (j, 0))  # hist[e - j]
            run = run & (col >= j) & (earlier == history.gather(1, (last - j).clamp(min=0)))
            size += run.to(torch.int64)
        # The longest match wins, the latest among equals; one below min_ngram does not count.
        score = torch.where(size >= self.min_ngram, size * width + col, -1)
        best, end = score.max(dim=1, keepdim=True)
        start = torch.where(best >= 0, end + 1, last)  # no match: the last token, repeated
        steps = torch.arange(self.num_draft_tokens, device=dev).reshape(1, -1)
        return history.gather(1, torch.minimum(start + steps, last))


class DraftModel(TPLlamaForCausalLM):
    """A draft checkpoint loaded as a TP-sharded model (same API as the target:
    ``allocate_kv_cache``, ``forward(ForwardBatch) -> VocabShardedLogits``). A ``"shape:..."``
    path builds a real model shape with random weights instead (:mod:`tpspec.model.shapes`,
    ``load_stats`` None).

    ``target_config``: when given, the draft's vocabulary must match it (``ValueError``
    otherwise). Pass the target's ``exchange`` to share it; picks of draft tokens use
    channel ``Channel.DRAFT``.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        mapping: Mapping | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        exchange: KeyExchange | None = None,
        target_config: ModelConfig | None = None,
        attention_backend: str = "auto",
        deterministic: bool = False,
    ) -> None:
        config = config_from_path(os.fspath(path))
        if target_config is not None and config.vocab_size != target_config.vocab_size:
            raise ValueError(
                f"draft model {os.fspath(path)!r} has vocab_size={config.vocab_size}, "
                f"the target has {target_config.vocab_size}: a draft must share the target's vocabulary"
            )
        super().__init__(config, mapping, device=device, dtype=dtype, exchange=exchange,
                         attention_backend=attention_backend, deterministic=deterministic)
        if is_shape_path(os.fspath(path)):
            fill_random(self, seed=1)
            self.load_stats = None
        else:
            self.load_stats = load_weights(self, path)
        self.path = os.fspath(path)

