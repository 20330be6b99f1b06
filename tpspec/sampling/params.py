"""Per-request sampling parameters (vLLM's ``SamplingParams`` fields) and their normalization.

A request says how many samples it wants (``n``), how its tokens are drawn
(``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``) and when it ends
(``max_tokens``, ``min_tokens``, ``stop``, ``stop_token_ids``, ``ignore_eos``). The
parameters are validated when the object is built and normalized once, so the batch
code sees plain numbers. Penalties (``repetition_penalty``, ``presence_penalty``,
``frequency_penalty``), ``logprobs`` and the logit controls (``structured_outputs`` with
:class:`StructuredOutputsParams`, ``logit_bias``, ``allowed_token_ids``, ``bad_words``) follow
vLLM's meaning too.

* the default is vLLM's: ``temperature=1.0`` (sampled); greedy when ``temperature`` is 0
  (or below the greedy threshold) or ``top_k == 1``. A greedy request gets the sentinel
  temperature :data:`GREEDY_SENTINEL_TEMPERATURE` (below ``GREEDY_TEMPERATURE_THRESHOLD``,
  so every kernel takes the argmax and never divides by it);
* a disabled top-k (0 or -1) becomes :data:`TOP_K_DISABLED` (INT32_MAX);
* neutral top-p is 1.0 and neutral min-p is 0.0.
"""

from __future__ import annotations

import json as _json
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..keys import GREEDY_TEMPERATURE_THRESHOLD
from ..validation import is_int, is_real
from ..vocab_parallel import MAX_TOP_LOGPROBS

TOP_K_DISABLED = 2**31 - 1
"""Normalized top-k of a request that does not filter by rank (INT32_MAX)."""

GREEDY_SENTINEL_TEMPERATURE = 1e-6
"""Normalized temperature of greedy requests: below the greedy threshold (1e-5)."""

SEED_RANGE = (0, 2**64)
"""User seeds are integers in ``[0, 2**64)``; they are used as a 64-bit Philox key."""

FLOAT32_MAX = 3.4028234663852886e38  # temperatures above it become inf in the kernels' float32
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32: a top_p below it would round to 0

assert GREEDY_SENTINEL_TEMPERATURE < GREEDY_TEMPERATURE_THRESHOLD


MAX_LOGPROBS = MAX_TOP_LOGPROBS
"""The most top-N logprobs a request may ask for (what ``VocabShardedLogits.logprobs`` returns)."""

LOGIT_BIAS_RANGE = (-100.0, 100.0)
"""``logit_bias`` values, as OpenAI's API takes them."""

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
"""The constraint fields of :class:`StructuredOutputsParams`: exactly one is set."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's ``StructuredOutputsParams``); exactly one constraint.

    ``json``: a JSON schema (a dict, or its JSON text). ``regex``: a regular expression the
    whole output matches. ``choice``: a list of strings, the output is one of them.
    ``grammar``: a context-free grammar in Lark or GBNF syntax (llguidance's). ``json_object``:
    True: any JSON object. ``structural_tag``: vLLM's structural tag (its JSON text or a dict:
    ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``): free text in which each
    ``begin`` is followed by JSON of its schema and ``end``.

    Options: ``disable_any_whitespace`` (JSON without whitespace between tokens; default: any
    JSON whitespace), ``disable_additional_properties`` (objects of the schema that do not say
    otherwise get ``additionalProperties: false``), ``whitespace_pattern`` (a regex for the
    whitespace JSON may hold; with ``json`` / ``json_object`` only).

    Checked here for its shape (``ValueError`` naming the field); the grammar itself is
    compiled and checked against the model's tokenizer by ``LLM`` before any rank sees the
    request. Equal parameters hash equal (a schema dict by its canonical JSON).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | dict | None = None

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams needs exactly one of {', '.join(STRUCTURED_KINDS)}; "
                             f"got {', '.join(given) if given else 'none'}")
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, dict)):
                raise ValueError(f"StructuredOutputsParams.{name} must be a dict or its JSON text, got "
                                 f"{type(value).__name__}")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"StructuredOutputsParams.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if (isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) for c in self.choice)):
                raise ValueError(f"StructuredOutputsParams.choice must be a non-empty list of strings, got "
                                 f"{self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"StructuredOutputsParams.json_object must be True (or left out), got "
                             f"{self.json_object!r}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"StructuredOutputsParams.{name} must be a bool, got {getattr(self, name)!r}")
        if self.whitespace_pattern is not None and self.kind not in ("json", "json_object"):
            raise ValueError("StructuredOutputsParams.whitespace_pattern applies to json and json_object only")

    @property
    def kind(self) -> str:
        """The constraint given: one of :data:`STRUCTURED_KINDS`."""
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) is not None)

    @property
    def spec(self) -> Any:
        """The constraint's value (a schema dict or text, a regex, the choices, a grammar...)."""
        return getattr(self, self.kind)

    def _key(self) -> tuple:
        spec = self.spec
        if isinstance(spec, dict):
            spec = _json.dumps(spec, sort_keys=True, default=str)
        return (self.kind, spec, self.disable_any_whitespace, self.disable_additional_properties,
                self.whitespace_pattern)

    def __hash__(self) -> int:
        return hash(self._key())


def _real_in(name: str, value: object, low: float, high: float, what: str) -> float:
    """``value`` as a Python float when it is a real number (numpy scalars included) in ``what``."""
    if not is_real(value):  # numpy's bool_ is not a real number
        raise ValueError(f"SamplingParams.{name} must be a float {what}, got {value!r}")
    v = float(value)
    if not (math.isfinite(v) and low <= v <= high):
        raise ValueError(f"SamplingParams.{name} must be a float {what}, got {value!r}")
    return v + 0.0  # -0.0 -> +0.0: a neutral penalty leaves every logit's bits alone


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples its tokens and when it ends (vLLM's fields). Immutable, hashable.

    ``n``: samples of the prompt (each its own output; sample ``i > 0`` of a seeded request
    uses a seed derived from ``seed`` and ``i``, so every sample is reproducible and distinct).
    ``temperature``: a finite float >= 0 (default 1.0; 0 = greedy).
    ``top_p``: a float in (0, 1] (1 = no nucleus filter).
    ``top_k``: an int >= -1 (0 or -1 = no rank filter, 1 = greedy).
    ``min_p``: a float in [0, 1] (0 = no filter; keeps tokens with ``p >= min_p * p_max``).
    ``seed``: None (the request draws from the engine's stream) or an int in ``[0, 2**64)``:
    the request's own stream. Given identical logits the request draws the same tokens
    whatever its batch, batch position, KV slot history or TP size; the default model forward
    does not promise identical logits across batches or TP sizes (``LLM(deterministic=True)``
    does).
    ``max_tokens``: most tokens to generate (default 16; None = up to the model length).
    ``min_tokens``: before this many tokens, EOS, ``stop_token_ids`` and ``stop`` strings do not
    end the request.
    ``stop``: strings that end the output (matched on the detokenized text; the text is cut
    before the match unless ``include_stop_str_in_output``).
    ``stop_token_ids``: token ids that end the output (the token is kept in ``token_ids``).
    ``ignore_eos``: do not stop at the model's EOS tokens.
    ``skip_special_tokens``: leave special tokens out of the text.
    ``repetition_penalty``: a float > 0 (1 = off): a logit of a token seen in the prompt or
    the output is divided by it when positive, multiplied by it otherwise.
    ``presence_penalty``: a float in [-2, 2] (0 = off), subtracted once from the logit of a
    token seen in the output. ``frequency_penalty``: a float in [-2, 2] (0 = off),
    subtracted once per occurrence in the output. Penalties apply to the raw logits before
    temperature and filters, greedy requests included (``tpspec.sampling.penalties``).
    ``logprobs``: None, or N in [0, 20]: report, for every generated token, its logprob and
    the N most likely tokens' (log-softmax of the raw logits, before penalties and
    temperature). ``prompt_logprobs``: None, or N in [0, 20]: the same for every prompt token
    after the first (``RequestOutput.prompt_logprobs``).

    Logit controls (vLLM's; applied on each rank's vocabulary slice, see
    ``docs/determinism.md``): ``structured_outputs``: a :class:`StructuredOutputsParams` (JSON
    schema, regex, choice, grammar, any JSON object, structural tag): every token keeps the
    output a prefix of a match, and the request ends (``finish_reason="stop"``) when the
    grammar can go no further. ``logit_bias``: ``{token id: bias}``, each bias a float in
    [-100, 100] added to that token's logit (OpenAI's). ``allowed_token_ids``: a non-empty list
    of token ids: only these may be generated. ``bad_words``: a list of non-empty strings that
    never appear in the output's tokens: a word's last token is banned where the tokens before
    it were just generated (each word tokenized as written and with a leading space, vLLM's
    rule). Token ids are checked against the model's vocabulary by ``LLM``. Logprobs stay those
    of the raw logits: bias and masks do not change them.

    Raises ``ValueError`` naming the bad field. The normalized values are properties
    (:attr:`is_greedy`, :attr:`norm_temperature`, :attr:`norm_top_k`, ...).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Logit controls: compared, not hashed (a dict is not hashable); equal parameters still hash equal.
    structured_outputs: StructuredOutputsParams | None = field(default=None, hash=False)
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    allowed_token_ids: Sequence[int] | None = field(default=None, hash=False)
    bad_words: Sequence[str] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an int >= 1, got {self.n!r}")
        self._check_penalties_and_logprobs()
        self._check_logit_controls()
        t = self.temperature
        # Values are checked as the float32 the kernels will hold, not only as Python floats.
        if not is_real(t) or not math.isfinite(t) or t < 0 or t > FLOAT32_MAX:
            raise ValueError(f"SamplingParams.temperature must be a finite float32 >= 0, got {t!r}")
        k = self.top_k
        if not is_int(k) or k < -1:
            raise ValueError(f"SamplingParams.top_k must be an int >= -1 (0 or -1 disables it), got {k!r}")
        if k > TOP_K_DISABLED:
            raise ValueError(f"SamplingParams.top_k={k} exceeds INT32_MAX")
        p = self.top_p
        if not is_real(p) or not (FLOAT32_TINY <= p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1] (at least {FLOAT32_TINY:g} "
                             f"as float32), got {p!r}")
        m = self.min_p
        if not is_real(m) or not (0.0 <= m <= 1.0):
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {m!r}")
        s = self.seed
        if s is not None and (not is_int(s) or not SEED_RANGE[0] <= s < SEED_RANGE[1]):
            raise ValueError(f"SamplingParams.seed must be None or an int in [0, 2**64), got {s!r}")
        mx = self.max_tokens
        if mx is not None and (not is_int(mx) or mx < 1):
            raise ValueError(f"SamplingParams.max_tokens must be None or an int >= 1, got {mx!r}")
        mn = self.min_tokens
        if not is_int(mn) or mn < 0:
            raise ValueError(f"SamplingParams.min_tokens must be an int >= 0, got {mn!r}")
        if mx is not None and mn > mx:
            raise ValueError(f"SamplingParams.min_tokens={mn} exceeds max_tokens={mx}")
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, (list, tuple)) and all(isinstance(x, str) for x in stop):
            stop = tuple(stop)
        else:
            raise ValueError(f"SamplingParams.stop must be None, a string or a list of strings, got {stop!r}")
        if any(not x for x in stop):
            raise ValueError("SamplingParams.stop strings must be non-empty")
        object.__setattr__(self, "stop", stop)
        ids = self.stop_token_ids
        if ids is None:
            ids = ()
        elif isinstance(ids, (list, tuple)) and all(is_int(x) and x >= 0 for x in ids):
            ids = tuple(int(x) for x in ids)
        else:
            raise ValueError(f"SamplingParams.stop_token_ids must be None or a list of ints >= 0, got {ids!r}")
        object.__setattr__(self, "stop_token_ids", ids)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SamplingParams.{name} must be a bool, got {getattr(self, name)!r}")

        # numpy scalars are accepted and stored as Python numbers (exact, hashable alike).
        for name, kind in (("temperature", float), ("top_k", int), ("top_p", float), ("min_p", float), ("seed", int)):
            value = getattr(self, name)
            if value is not None and type(value) is not kind:
                object.__setattr__(self, name, kind(value))

    def _check_penalties_and_logprobs(self) -> None:
        # Stored as Python numbers (numpy scalars accepted) so equal parameters hash equal.
        r = _real_in("repetition_penalty", self.repetition_penalty, FLOAT32_TINY, FLOAT32_MAX,
                     "> 0 (1 = off)")
        object.__setattr__(self, "repetition_penalty", r)
        for name in ("presence_penalty", "frequency_penalty"):
            object.__setattr__(self, name, _real_in(name, getattr(self, name), -2.0, 2.0, "in [-2, 2] (0 = off)"))
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None:
                if not is_int(n) or not 0 <= int(n) <= MAX_LOGPROBS:
                    raise ValueError(f"SamplingParams.{name} must be None or an int in [0, {MAX_LOGPROBS}], got {n!r}")
                object.__setattr__(self, name, int(n))

    def _check_logit_controls(self) -> None:
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"SamplingParams.structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(so).__name__}")
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict):
                raise ValueError(f"SamplingParams.logit_bias must be a dict {{token id: bias}}, got "
                                 f"{type(bias).__name__}")
            low, high = LOGIT_BIAS_RANGE
            clean: dict[int, float] = {}
            for token, value in bias.items():
                if not is_int(token) or token < 0:
                    raise ValueError(f"SamplingParams.logit_bias keys must be token ids (ints >= 0), got {token!r}")
                if not is_real(value) or not low <= float(value) <= high:
                    raise ValueError(f"SamplingParams.logit_bias values must be floats in [{low:g}, {high:g}], "
                                     f"got {value!r} for token {token}")
                clean[int(token)] = float(value) + 0.0
            object.__setattr__(self, "logit_bias", clean or None)
        ids = self.allowed_token_ids
        if ids is not None:
            if (isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)) or not ids
                    or not all(is_int(t) and t >= 0 for t in ids)):
                raise ValueError(f"SamplingParams.allowed_token_ids must be a non-empty list of token ids "
                                 f"(ints >= 0), got {ids!r}")
            object.__setattr__(self, "allowed_token_ids", tuple(sorted({int(t) for t in ids})))
        words = self.bad_words
        if words is not None:
            if isinstance(words, str) or not isinstance(words, (list, tuple)) or not all(
                    isinstance(w, str) and w.strip() for w in words):
                raise ValueError(f"SamplingParams.bad_words must be a list of non-empty strings, got {words!r}")
            object.__setattr__(self, "bad_words", tuple(dict.fromkeys(words)) or None)

    @property
    def has_logit_controls(self) -> bool:
        """True when structured outputs, a logit bias, allowed token ids or bad words change the logits."""
        return (self.structured_outputs is not None or self.logit_bias is not None
                or self.allowed_token_ids is not None or self.bad_words is not None)

    @property
    def has_penalties(self) -> bool:
        """True when a repetition, presence or frequency penalty changes the logits."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    # -- normalization ---------------------------------------------------------------
    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax: temperature 0 (below the threshold) or top_k == 1."""
        return self.temperature < GREEDY_TEMPERATURE_THRESHOLD or self.top_k == 1

    @property
    def norm_temperature(self) -> float:
        """The temperature kernels use: the greedy sentinel for greedy requests."""
        return GREEDY_SENTINEL_TEMPERATURE if self.is_greedy else float(self.temperature)  # type: ignore[arg-type]

    @property
    def norm_top_k(self) -> int:
        """Top-k the kernels use: INT32_MAX when disabled (0 or -1) or greedy."""
        if self.is_greedy or self.top_k <= 0:
            return TOP_K_DISABLED
        return int(self.top_k)

    @property
    def norm_top_p(self) -> float:
        return 1.0 if self.is_greedy else float(self.top_p)

    @property
    def norm_min_p(self) -> float:
        return 0.0 if self.is_greedy else float(self.min_p)

    @property
    def is_temperature_only(self) -> bool:
        """True when the request can be drawn on vocab shards by Gumbel-max: greedy, or a
        temperature with no top-k/top-p/min-p filter (after normalization)."""
        return self.is_greedy or (
            self.norm_top_k == TOP_K_DISABLED and self.norm_top_p >= 1.0 and self.norm_min_p <= 0.0
        )

    @property
    def is_seeded(self) -> bool:
        return self.seed is not None

    @property
    def seed_int64(self) -> int | None:
        """The seed as the signed int64 with the same 64 bits (what the Philox tensors hold)."""
        if self.seed is None:
            return None
        return self.seed - 2**64 if self.seed >= 2**63 else self.seed

    def normalized(self) -> tuple[float, int, float, float]:
        """``(temperature, top_k, top_p, min_p)`` after normalization."""
        return self.norm_temperature, self.norm_top_k, self.norm_top_p, self.norm_min_p


GREEDY = SamplingParams(temperature=0.0)
"""Greedy, unseeded (what padding rows and requests without parameters use inside the engine)."""
