"""Drafters: where speculative decoding's guesses come from.

* :class:`NgramDrafter` — prompt lookup on the host: find the latest earlier occurrence
  of the history's last n tokens and propose what followed it. No model, no device.
* :class:`DraftModel` — a smaller checkpoint of the same family and vocabulary, TP-sharded
  like the target. Its vocab-sharded head yields greedy drafts through the key exchange's
  draft channel: ``draft(batch).argmax(channel=Channel.DRAFT)``.
"""

from __future__ import annotations

import os

import numpy as np
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
        hist = np.asarray(token_history, dtype=np.int64)
        length = hist.shape[0]
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            suffix = hist[length - n :]
            # Windows starting at 0 .. length-n-1: every earlier occurrence with a token after it.
            windows = np.lib.stride_tricks.sliding_window_view(hist[: length - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return hist[start : start + self.num_draft_tokens].tolist()
        return []


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

