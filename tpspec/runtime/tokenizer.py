"""The checkpoint's tokenizer (Hugging Face ``transformers``' ``AutoTokenizer``), incremental
detokenization and stop-string matching.

The driver alone tokenizes and detokenizes; the ranks only ever see token ids.
:class:`IncrementalDetokenizer` turns one sample's tokens into text as they arrive (a
token that ends inside a multi-byte character waits for the next one) and reports the
first stop string, at the token that completes it — so the output does not depend on how
many tokens a speculative step happened to emit.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(path: str) -> Any:
    """``AutoTokenizer.from_pretrained(path)`` when the checkpoint has tokenizer files, else None.

    Raises ``ValueError`` when the files are there but do not load (a broken tokenizer is
    reported, never silently taken for a missing one)."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - every loader failure becomes one clear error
        raise ValueError(f"the tokenizer of {path!r} does not load: {type(exc).__name__}: {exc}") from exc


def check_text(text: str, what: str) -> None:
    """``ValueError`` naming ``what`` when ``text`` is not valid Unicode (a lone surrogate, as a
    JSON ``\\ud800`` escape gives): no tokenizer can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid Unicode text: a lone surrogate {text[exc.start]!r} at character "
                         f"{exc.start}") from None


def longest_token_chars(tokenizer: Any) -> int | None:
    """The most characters of text that one token can stand for, or None when the tokenizer
    gives no such bound.

    A fast tokenizer with a BPE model emits only vocabulary entries, and an entry of k
    characters covers at most k characters of the normalized text (byte-level BPE: k bytes,
    so at most k characters; added tokens are in the vocabulary too). So a text of c
    normalized characters has at least ``ceil(c / longest)`` tokens (:func:`at_least_tokens`).
    A BPE model that fuses runs of unknown characters into one token has no bound."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = getattr(backend, "model", None)
    if type(model).__name__ != "BPE":
        return None
    if getattr(model, "fuse_unk", False) and not getattr(model, "byte_fallback", False):
        return None
    return max((len(t) for t in tokenizer.get_vocab()), default=None)


def at_least_tokens(tokenizer: Any, text: str, longest: int) -> int:
    """A lower bound on the number of tokens ``text`` encodes to, without encoding it:
    its characters after the tokenizer's normalizer, over ``longest``
    (:func:`longest_token_chars`), rounded up. Linear in the text."""
    normalizer = getattr(getattr(tokenizer, "backend_tokenizer", None), "normalizer", None)
    chars = len(normalizer.normalize_str(text)) if normalizer is not None else len(text)
    return -(-chars // longest)


class IncrementalDetokenizer:
    """Text of one sample, built token by token.

    ``tokenizer``: a Hugging Face tokenizer. ``prompt_ids``: the prompt (its last tokens give
    the first generated token its context, e.g. a leading space). ``stop``: stop strings;
    ``include_stop``: keep the matched stop string in the text. ``min_tokens``: stop strings
    are not matched before this many tokens.
    """

    # How many prompt tokens give context to the first generated token's decoding.
    CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], *, stop: Sequence[str] = (),
                 include_stop: bool = False, skip_special_tokens: bool = True, min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.include_stop = include_stop
        self.skip_special = skip_special_tokens
        self.min_tokens = min_tokens
        self.ids: list[int] = list(prompt_ids[-self.CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.num_tokens = 0
        self.text = ""
        self.stop_reason: str | None = None

    def add(self, token_id: int) -> bool:
        """Append one token; return True when a stop string has just completed (the text is then
        final: cut before the match, or after it with ``include_stop``)."""
        if self.stop_reason is not None:
            raise RuntimeError("the sample already stopped")
        self.ids.append(int(token_id))
        self.num_tokens += 1
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip_special)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        else:  # a partial multi-byte character: wait for the token that completes it
            new = ""
        if not new:
            return False
        start = len(self.text)
        self.text += new
        if self.stop and self.num_tokens > self.min_tokens:
            longest = max(len(s) for s in self.stop)
            window_start = max(0, start - longest + 1)
            hits = [(self.text.find(s, window_start), s) for s in self.stop]
            hits = [(pos, s) for pos, s in hits if pos >= 0]
            if hits:
                pos, s = min(hits)
                self.text = self.text[:pos + len(s)] if self.include_stop else self.text[:pos]
                self.stop_reason = s
                return True
        return False

    def flush(self) -> str:
        """Text still held back (an incomplete character at the end) decoded as it is."""
        if self.stop_reason is None and self.read_offset < len(self.ids):
            decode = self.tokenizer.decode
            prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special)
            full = decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip_special)
            tail = full[len(prefix):]
            self.read_offset = len(self.ids)
            self.text += tail
            return tail
        return ""
