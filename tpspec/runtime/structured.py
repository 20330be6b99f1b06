"""Structured outputs and token masks with llguidance: the driver compiles and checks each
request's grammar; every rank keeps each request's grammar state and computes its token
bitmask rows.

Driver (:func:`compile_grammar`, :func:`bad_words_token_ids`): a request's
:class:`~tpspec.sampling.params.StructuredOutputsParams` becomes llguidance's serialized grammar,
checked against the model's tokenizer, so a bad schema, regex or grammar is a ``ValueError``
before any rank sees the request; ``bad_words`` become token-id sequences (vLLM's rule).

Ranks (:class:`TokenConstraints`, one per constrained sequence): a grammar matcher advanced over
the sequence's committed tokens (every rank commits the same tokens, so every rank's matcher
agrees), the request's allowed tokens and bad words. :meth:`TokenConstraints.mask` gives the
bitmask of the position after the committed tokens and some drafts (the matcher consumes the
drafts, fills the mask, then rolls them back). The ranks build their llguidance tokenizer from
the checkpoint's tokenizer files (:func:`ll_tokenizer`, the same as the driver's); they never
tokenize text.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Sequence

import numpy as np

from ..sampling.controls import BITS_PER_WORD, bitmask_words
from ..sampling.params import StructuredOutputsParams

LL_LOG_LEVEL = 0  # llguidance's own stderr warnings off: errors are read back with get_error()


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # a dependency of tpspec: only a broken install lacks it
        raise ValueError("structured outputs need the llguidance package (a dependency of tpspec: "
                         "`pip install llguidance`)") from exc
    return llguidance


def ll_tokenizer(hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int] = ()) -> Any:
    """llguidance's tokenizer for a Hugging Face fast tokenizer: ``max(vocab_size, len(tokenizer))``
    tokens (token ids past the model's vocabulary are never chosen), EOS = ``eos_token_ids`` (the
    tokenizer's own when empty): a grammar that can end allows them. ``ValueError`` for a tokenizer
    llguidance cannot use (a slow tokenizer)."""
    _llguidance()
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=max(vocab_size, len(hf_tokenizer)),
                                            eos_token=list(eos_token_ids) or None)
    except Exception as exc:  # noqa: BLE001 - any failure here means: no structured outputs with it
        raise ValueError(f"structured outputs cannot use this tokenizer: {type(exc).__name__}: {exc}") from exc


def _closed_objects(schema: Any) -> Any:
    """A copy of ``schema`` where every object schema that lists properties and says nothing of
    ``additionalProperties`` gets ``additionalProperties: false``."""
    if isinstance(schema, list):
        return [_closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed_objects(v) for k, v in schema.items()}
    if ("properties" in schema or "patternProperties" in schema) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _json_schema(text_or_dict: str | dict, what: str) -> Any:
    if isinstance(text_or_dict, dict):
        return copy.deepcopy(text_or_dict)
    try:
        return json.loads(text_or_dict)
    except json.JSONDecodeError as exc:
        raise ValueError(f"structured_outputs.{what} is not valid JSON: {exc}") from None


def _json_options(so: StructuredOutputsParams) -> dict[str, Any]:
    """llguidance's JSON options of ``so`` (the schema's own ``x-guidance`` goes over them)."""
    options: dict[str, Any] = {"whitespace_flexible": not so.disable_any_whitespace}
    if so.whitespace_pattern is not None:
        options["whitespace_pattern"] = so.whitespace_pattern
    return options


def _json_grammar(ll: Any, schema: Any, so: StructuredOutputsParams) -> str:
    if so.disable_additional_properties:
        schema = _closed_objects(schema)
    return ll.LLMatcher.grammar_from_json_schema(schema, defaults=_json_options(so))


def _structural_tag_grammar(ll: Any, so: StructuredOutputsParams) -> str:
    spec = _json_schema(so.structural_tag, "structural_tag")
    if not isinstance(spec, dict) or not isinstance(spec.get("structures"), list) or not isinstance(
            spec.get("triggers"), list):
        raise ValueError('structured_outputs.structural_tag must hold "structures" (a list of {"begin", "schema", '
                         '"end"}) and "triggers" (a list of strings)')
    tags = []
    for i, item in enumerate(spec["structures"]):
        if not isinstance(item, dict) or not all(isinstance(item.get(k), str) for k in ("begin", "end")):
            raise ValueError(f"structured_outputs.structural_tag structure {i} needs string 'begin' and 'end'")
        trigger = next((t for t in spec["triggers"] if isinstance(t, str) and t and item["begin"].startswith(t)),
                       None)
        if trigger is None:
            raise ValueError(f"structured_outputs.structural_tag: no trigger starts structure {i}'s begin "
                             f"{item['begin']!r}")
        schema = item.get("schema", {})
        if not isinstance(schema, dict):
            raise ValueError(f"structured_outputs.structural_tag structure {i}'s schema must be a JSON object")
        if so.disable_additional_properties:
            schema = _closed_objects(schema)
        # The tag embeds the schema itself (%json), its options in its own "x-guidance".
        schema = dict(schema, **{"x-guidance": {**_json_options(so), **schema.get("x-guidance", {})}})
        tags.append(ll.StructTag(trigger=trigger, begin=item["begin"], grammar=schema, end=item["end"]))
    if not tags:
        raise ValueError("structured_outputs.structural_tag has no structures")
    return ll.StructTag.to_grammar(tags)


def compile_grammar(so: StructuredOutputsParams, tokenizer: Any) -> str:
    """llguidance's serialized grammar for ``so``, checked against ``tokenizer`` (an
    :func:`ll_tokenizer`). Raises ``ValueError`` naming the problem (invalid JSON or schema, a bad
    regex or grammar)."""
    ll = _llguidance()
    kind = so.kind
    try:
        if kind == "json":
            grammar = _json_grammar(ll, _json_schema(so.json, "json"), so)
        elif kind == "json_object":
            grammar = _json_grammar(ll, {"type": "object"}, so)
        elif kind == "regex":
            grammar = ll.grammar_from("regex", so.regex)
        elif kind == "choice":
            grammar = ll.grammar_from("choice", list(so.choice))
        elif kind == "grammar":
            grammar = ll.grammar_from("grammar", so.grammar)
        else:
            grammar = _structural_tag_grammar(ll, so)
    except ValueError as exc:
        raise ValueError(f"structured_outputs.{kind}: {exc}") from None
    except (TypeError, KeyError, AssertionError) as exc:
        raise ValueError(f"structured_outputs.{kind} is malformed: {exc}") from None
    error = ll.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise ValueError(f"structured_outputs.{kind} is invalid: {error.strip()}")
    return grammar


def bad_words_token_ids(words: Sequence[str], tokenizer: Any, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of ``bad_words``: each word (leading spaces stripped) as written, and
    with one leading space when that gives a different first token and as many tokens (the word
    inside a text); ``ValueError`` for a word without tokens or tokens past ``vocab_size``."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise ValueError(f"bad_words: {word!r} has no tokens")
        out.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    bad = sorted({t for seq in out for t in seq if not 0 <= t < vocab_size})
    if bad:
        raise ValueError(f"bad_words tokenize to ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return tuple(dict.fromkeys(out))


class TokenConstraints:
    """One sequence's token masks on a rank: its grammar (``grammar``, a :func:`compile_grammar`
    result, matched with ``tokenizer``), ``allowed`` token ids and ``bad_words`` token-id
    sequences (each optional). ``vocab_size``: the model's; masks are ``[words]`` int32 over it
    (:data:`~tpspec.sampling.controls.BITS_PER_WORD` columns a word). ``eos_token_ids``: what an
    empty mask falls back to (below).

    The matcher follows the committed tokens (:meth:`commit`); :meth:`mask` never moves it.
    """

    def __init__(self, vocab_size: int, *, grammar: str | None = None, tokenizer: Any = None,
                 allowed: Sequence[int] | None = None, bad_words: Sequence[Sequence[int]] = (),
                 eos_token_ids: Sequence[int] = ()) -> None:
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self.matcher = None
        if grammar is not None:
            ll = _llguidance()
            self.matcher = ll.LLMatcher(tokenizer, grammar, log_level=LL_LOG_LEVEL)
            if self.matcher.is_error():
                raise RuntimeError(f"the grammar does not load on this rank: {self.matcher.get_error()}")
            self._scratch = np.zeros((1, bitmask_words(tokenizer.vocab_size)), np.int32)
        self.allowed = None
        if allowed is not None:
            self.allowed = self._bits(allowed)
        self.bad_words = tuple(tuple(int(t) for t in w) for w in bad_words)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.eos = self._bits(eos_token_ids) if eos_token_ids else None
        self.outputs: list[int] = []

    def _bits(self, token_ids: Sequence[int]) -> np.ndarray:
        """``[words]`` uint32 with exactly ``token_ids`` (those inside the vocabulary) set."""
        bits = np.zeros(self.words * BITS_PER_WORD, dtype=np.uint8)
        ids = np.asarray([t for t in token_ids if 0 <= t < self.vocab_size], dtype=np.int64)
        bits[ids] = 1
        return np.packbits(bits, bitorder="little").view(np.uint32).copy()

    @property
    def finished(self) -> bool:
        """The grammar can take no token but EOS: the output is complete."""
        return self.matcher is not None and self.matcher.is_stopped()

    def commit(self, token: int) -> None:
        """``token`` joins the output (the same on every rank). An EOS token the grammar does not
        take (an empty mask's fallback) finishes it; any other token it rejects is a
        ``RuntimeError`` (a token outside its mask was chosen: never, unless something is broken)."""
        self.outputs.append(int(token))
        if self.matcher is None or self.matcher.is_stopped():
            return
        if not self.matcher.consume_token(int(token)) and int(token) not in self.eos_token_ids:
            raise RuntimeError(f"token {token} breaks the request's grammar: {self.matcher.get_error()}")

    def mask(self, drafts: Sequence[int] = ()) -> np.ndarray:
        """``[words]`` int32: the tokens allowed after the committed output and ``drafts``.

        The grammar's allowed tokens (after consuming ``drafts``; a finished grammar allows EOS),
        among ``allowed``, minus the bad words whose other tokens end ``output + drafts`` (a
        one-token word: always). A row no token survives allows the EOS tokens (the request has
        nothing it may say). A draft the grammar rejects makes every later row all ones: such a
        row is never used (the draft is rejected where it is verified, by that row's mask)."""
        bits = np.full(self.words, 0xFFFFFFFF, dtype=np.uint32)
        if self.matcher is not None:
            from llguidance.numpy import fill_next_token_bitmask

            consumed = self.matcher.try_consume_tokens(list(drafts)) if drafts else 0
            if consumed < len(drafts):
                self.matcher.rollback(consumed)
                return bits.view(np.int32)
            fill_next_token_bitmask(self.matcher, self._scratch, 0)
            if consumed:
                self.matcher.rollback(consumed)
            bits = self._scratch[0, :self.words].view(np.uint32).copy()
            spare = self.words * BITS_PER_WORD - self.vocab_size
            if spare:  # columns past the model's vocabulary
                bits[-1] &= np.uint32((1 << (BITS_PER_WORD - spare)) - 1)
        if self.allowed is not None:
            bits &= self.allowed
        if self.bad_words:
            history = self.outputs + list(drafts)
            for word in self.bad_words:
                prefix = list(word[:-1])
                if len(history) >= len(prefix) and history[len(history) - len(prefix):] == prefix:
                    last = word[-1]
                    bits[last >> 5] &= np.uint32(~(1 << (last & 31)) & 0xFFFFFFFF)
        if not bits.any() and self.eos is not None:
            bits = self.eos.copy()
        return bits.view(np.int32)
