"""The prompts of ``tpspec bench serve``: vLLM's ``random`` and ``prefix-repetition`` datasets.

Every prompt is made of random token ids, in one of two forms:

* **text**, with a tokenizer (``tokenizers.Tokenizer``, the library behind Hugging Face's fast
  tokenizers; no torch): the ids are decoded, the text re-encoded, and the ids trimmed or topped
  up with fresh random ones, a few rounds, until the text encodes to the wanted number of
  tokens — so the server counts what the dataset says (as vLLM does). The tokenizer's special
  tokens are never drawn. Works with the completions and the chat endpoints.
* **token ids**, without one: ids drawn from ``[0, vocab_size)`` sent as a list of ints (the
  completions API accepts one), exactly as many tokens as asked. The model's special tokens
  may be among them (they are unknown without its tokenizer).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

FIT_ROUNDS = 10  # decode / re-encode rounds before a text prompt keeps the length it has


@dataclass(frozen=True)
class SampleRequest:
    """One request of a dataset: ``prompt`` (text, or token ids), ``prompt_len`` (the tokens
    the server should count for it, special tokens its tokenizer adds included) and
    ``output_len`` (its ``max_tokens``)."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int


def load_tokenizer(name: str) -> Any:
    """A ``tokenizers.Tokenizer`` for ``name``: ``"tiny"`` (the embedded tiny model's; locating
    or making that model imports torch), a checkpoint directory holding ``tokenizer.json``, a
    ``tokenizer.json`` file, or a Hugging Face Hub id. ``ValueError`` saying why when it does
    not load."""
    from tokenizers import Tokenizer

    if name == "tiny":
        from ..runtime.llm import tiny_model_path

        name = tiny_model_path()
    if os.path.isdir(name):
        path = os.path.join(name, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(f"{name!r} has no tokenizer.json (a fast tokenizer is needed)")
        name = path
    try:
        if os.path.isfile(name):
            return Tokenizer.from_file(name)
        return Tokenizer.from_pretrained(name)
    except Exception as exc:  # noqa: BLE001 - any loader failure becomes one clear error
        raise ValueError(f"the tokenizer {name!r} does not load: {type(exc).__name__}: {exc}") from None


class PromptMaker:
    """Turns random token ids into prompts, as text through ``tokenizer`` or, when it is None,
    as token-id lists over ``[0, vocab_size)``.

    Attributes: ``allowed`` (the ids drawn from), ``num_special`` (tokens the tokenizer adds
    to every text it encodes, e.g. a BOS; 0 for token ids), ``text`` (whether prompts are text).
    """

    def __init__(self, tokenizer: Any = None, *, vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.text = tokenizer is not None
        if tokenizer is not None:
            special = {i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special}
            vocab = tokenizer.get_vocab_size(with_added_tokens=True)
            self.allowed = np.array([i for i in range(vocab) if i not in special], dtype=np.int64)
            self.num_special = (len(tokenizer.encode("a", add_special_tokens=True).ids)
                                - len(tokenizer.encode("a", add_special_tokens=False).ids))
        else:
            if vocab_size is None or vocab_size < 1:
                raise ValueError("token-id prompts need a vocabulary size >= 1")
            self.allowed = np.arange(vocab_size, dtype=np.int64)
            self.num_special = 0
        if len(self.allowed) == 0:
            raise ValueError("the tokenizer has no ordinary tokens to draw prompts from")

    def random_ids(self, rng: np.random.Generator, n: int) -> list[int]:
        """``n`` ids drawn uniformly (with replacement) from ``allowed``."""
        return self.allowed[rng.integers(0, len(self.allowed), size=n)].tolist()

    def fit(self, rng: np.random.Generator, ids: list[int]) -> list[int]:
        """Ids whose text encodes back to themselves and, after at most ``FIT_ROUNDS`` rounds, to
        ``len(ids)`` tokens (token-id prompts: ``ids`` unchanged)."""
        if not self.text:
            return list(ids)
        target = len(ids)
        for _ in range(FIT_ROUNDS):
            ids = self._reencode(ids)
            if len(ids) == target:
                break
            ids = ids[:target] if len(ids) > target else ids + self.random_ids(rng, target - len(ids))
        return self._reencode(ids)

    def prompt(self, ids: list[int]) -> tuple[str | list[int], int]:
        """The prompt of ``ids`` and the tokens the server will count for it."""
        if not self.text:
            return list(ids), len(ids)
        text = self.tokenizer.decode(ids)
        return text, len(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def _reencode(self, ids: list[int]) -> list[int]:
        return list(self.tokenizer.encode(self.tokenizer.decode(ids), add_special_tokens=False).ids)


def _length_range(length: int, range_ratio: float, low_at_least: int) -> tuple[int, int]:
    return max(math.floor(length * (1 - range_ratio)), low_at_least), max(math.ceil(length * (1 + range_ratio)),
                                                                         low_at_least)


def random_dataset(maker: PromptMaker, rng: np.random.Generator, num_prompts: int, *, input_len: int,
                   output_len: int, range_ratio: float = 0.0, prefix_len: int = 0) -> list[SampleRequest]:
    """vLLM's ``random`` dataset: ``num_prompts`` prompts of random tokens, each a shared random
    prefix of ``prefix_len`` tokens then its own tokens; input and output lengths drawn
    uniformly from ``[floor(L·(1-r)), ceil(L·(1+r))]`` for ``L`` = ``input_len`` (less the
    tokenizer's special tokens) and ``output_len`` (at least 1), ``r`` = ``range_ratio`` in [0, 1)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if output_len < 1 or input_len < 0 or prefix_len < 0:
        raise ValueError("--random-output-len must be >= 1 and --random-input-len, --random-prefix-len >= 0")
    real_input = max(0, input_len - maker.num_special)
    in_low, in_high = _length_range(real_input, range_ratio, 0)
    if prefix_len + in_low < 1:
        raise ValueError(f"--random-input-len {input_len} leaves prompts without tokens (the tokenizer adds "
                         f"{maker.num_special} special token(s)); ask for more")
    out_low, out_high = _length_range(output_len, range_ratio, 1)
    input_lens = rng.integers(in_low, in_high + 1, size=num_prompts)
    output_lens = rng.integers(out_low, out_high + 1, size=num_prompts)
    prefix = maker.random_ids(rng, prefix_len)
    requests = []
    for n_in, n_out in zip(input_lens.tolist(), output_lens.tolist()):
        ids = maker.fit(rng, prefix + maker.random_ids(rng, n_in))
        prompt, prompt_len = maker.prompt(ids)
        requests.append(SampleRequest(prompt, prompt_len, n_out))
    return requests


def prefix_repetition_dataset(maker: PromptMaker, rng: np.random.Generator, num_prompts: int, *, prefix_len: int,
                              suffix_len: int, num_prefixes: int, output_len: int) -> list[SampleRequest]:
    """vLLM's ``prefix-repetition`` dataset: ``num_prefixes`` random prefixes of ``prefix_len``
    tokens, each shared by ``num_prompts / num_prefixes`` prompts (request ``i`` takes prefix
    ``i % num_prefixes``, so every one of the ``num_prompts`` is made) that end in their own
    random suffix of ``suffix_len`` tokens; shuffled; ``output_len`` tokens each."""
    if num_prefixes < 1 or num_prompts < num_prefixes:
        raise ValueError(f"--prefix-repetition-num-prefixes must be in [1, --num-prompts], got {num_prefixes} "
                         f"for {num_prompts} prompts")
    if prefix_len < 0 or suffix_len < 0 or prefix_len + suffix_len < 1 or output_len < 1:
        raise ValueError("--prefix-repetition-prefix-len and -suffix-len must be >= 0 with a positive sum, "
                         "--prefix-repetition-output-len >= 1")
    prefixes = [maker.fit(rng, maker.random_ids(rng, prefix_len)) for _ in range(num_prefixes)]
    requests = []
    for i in range(num_prompts):
        ids = prefixes[i % num_prefixes] + maker.fit(rng, maker.random_ids(rng, suffix_len))
        prompt, prompt_len = maker.prompt(ids)
        requests.append(SampleRequest(prompt, prompt_len, output_len))
    order = rng.permutation(num_prompts)
    return [requests[i] for i in order.tolist()]
