"""What the runtime is asked to do: the user-facing speculative config, the engine config
every rank receives, and one request as the workers see it. Plain, picklable data."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..sampling.logprobs import Logprob
from ..model.attention import ATTENTION_BACKENDS
from ..sampling.params import SamplingParams
from ..validation import check_bool, check_int, is_real

SPEC_METHODS = ("ngram", "draft_model", "eagle3")
DEFAULT_MAX_BATCH_SIZE = 256
"""Sequences running at once by default (vLLM's ``max_num_seqs``)."""
MIN_DEFAULT_MAX_NUM_TOKENS = 2048
"""The default token budget of a step is at least this (context chunks fill what generation leaves)."""
ACCEPTANCE_MODES = ("strict", "rejection")
LAUNCHERS = ("mp", "external_launcher", "ray")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How draft tokens are proposed and verified; ``LLM(speculative_config=...)`` takes it or a
    dict of its fields (vLLM's keys).

    ``method``: ``"ngram"`` (prompt lookup on the request's own tokens, no model),
    ``"draft_model"`` (a smaller checkpoint of the same family at ``model``, TP-sharded like
    the target) or ``"eagle3"`` (an EAGLE-3 head at ``model`` that drafts from the target's
    hidden states; see :mod:`tpspec.model.eagle3`); None picks ``"draft_model"`` when ``model``
    is given, else ``"ngram"``. ``num_speculative_tokens``: K drafts verified per generation step.
    ``acceptance``: ``"strict"`` (a draft is kept while it equals the target's own choice)
    or ``"rejection"`` (Leviathan et al. rejection sampling; lossless for sampled requests).
    ``prompt_lookup_max``/``prompt_lookup_min``: the n-gram lengths prompt lookup tries
    (longest first). Raises ``ValueError`` naming the bad field.
    """

    method: str | None = None
    num_speculative_tokens: int = 4
    model: str | None = None
    acceptance: str = "strict"
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1

    def __post_init__(self) -> None:
        if self.method is None:
            object.__setattr__(self, "method", "draft_model" if self.model else "ngram")
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config method must be one of {SPEC_METHODS}, got {self.method!r}")
        check_int("speculative_config num_speculative_tokens", self.num_speculative_tokens, low=1)
        if self.acceptance not in ACCEPTANCE_MODES:
            raise ValueError(
                f"speculative_config acceptance must be one of {ACCEPTANCE_MODES}, got {self.acceptance!r}"
            )
        if self.method in ("draft_model", "eagle3") and not self.model:
            raise ValueError(f"speculative_config method={self.method!r} needs model=PATH (or 'tiny')")
        if self.method == "ngram" and self.model:
            raise ValueError("speculative_config model is only used with method='draft_model' or 'eagle3'")
        check_int("speculative_config prompt_lookup_max", self.prompt_lookup_max, low=1)
        check_int("speculative_config prompt_lookup_min", self.prompt_lookup_min, low=1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min={self.prompt_lookup_min} exceeds "
                             f"prompt_lookup_max={self.prompt_lookup_max}")

    @classmethod
    def from_dict(cls, values: dict) -> "SpeculativeConfig":
        """``SpeculativeConfig(**values)``; an unknown key is a ``ValueError`` naming it."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(k) for k in values if k not in known)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}; known: {known}")
        return cls(**values)


@dataclass(frozen=True)
class EngineConfig:
    """Everything a rank needs to build its :class:`~tpspec.runtime.engine.Engine`; the same
    on every rank. Paths are resolved (no ``"tiny"``), dtype is a torch dtype name.

    ``max_batch_size``: sequences running at once (default 256); ``max_num_tokens``: tokens one
    step feeds (default: ``max(2048, max_batch_size * (num_draft_tokens + 1))``, so a full
    generation step always fits).

    KV cache: pages of ``page_size`` tokens. ``kv_cache_bytes`` (any device): bytes of pages
    per rank, all paged models together (it overrides ``gpu_memory_utilization``). Else on
    CUDA ``gpu_memory_utilization`` (None = 0.9; not used on CPU): the share of the GPU the
    engine may use (split between ranks sharing a GPU); what weights and a profiled step
    leave goes to pages. Else (CPU): pages for ``min(max_batch_size, 8)`` requests of
    ``max_seq_len`` tokens, at most 4 GiB. ``enable_prefix_caching``: a request reuses the
    pages of the longest cached run of its prompt's full pages (:mod:`tpspec.runtime.pages`).
    ``attention_backend``: one of :data:`~tpspec.model.attention.ATTENTION_BACKENDS` (``"auto"``:
    see :func:`~tpspec.model.attention.choose_attention_backend`).
    """

    model_path: str
    tp_size: int
    device: str  # "cpu" or "cuda"
    dtype: str  # "float32", "bfloat16", "float16"
    attention_dp: bool = False
    speculative: SpeculativeConfig | None = None
    draft_model_path: str | None = None
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_seq_len: int = 512
    max_num_tokens: int | None = None  # None: see default_max_num_tokens
    use_cuda_graphs: bool = True
    exchange: str = "auto"
    page_size: int = 16
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    attention_backend: str = "auto"
    forced_acceptance_rate: float | None = None  # benchmarks only: TPSPEC_FORCE_NUM_ACCEPTED_TOKENS, read by LLM
    deterministic: bool = False  # fixed-order forward: batch- and TP-invariant logits
    enable_prefix_caching: bool = True  # full KV pages of known token runs are reused (pages.py)
    eos_token_ids: tuple[int, ...] = ()  # the driver's EOS ids (a grammar that can end allows them); () = the model's

    def __post_init__(self) -> None:
        check_int("max_batch_size", self.max_batch_size, low=1)
        if self.max_num_tokens is None:
            object.__setattr__(self, "max_num_tokens", default_max_num_tokens(self.max_batch_size,
                                                                              self.num_draft_tokens))
        for name in ("tp_size", "max_batch_size", "max_num_tokens", "page_size"):
            check_int(name, getattr(self, name), low=1)
        check_int("max_seq_len", self.max_seq_len, low=2)  # one prompt token and one generated token
        check_bool("attention_dp", self.attention_dp)
        check_bool("use_cuda_graphs", self.use_cuda_graphs)
        check_bool("deterministic", self.deterministic)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        if self.kv_cache_bytes is not None:
            check_int("kv_cache_bytes", self.kv_cache_bytes, low=1)
        util = self.gpu_memory_utilization
        if util is not None:
            if not is_real(util) or not 0 < util <= 1:
                raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {util!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.deterministic and self.attention_backend != "auto":
            raise ValueError(f"deterministic mode uses its own fixed-order attention; attention_backend must be "
                             f"'auto', got {self.attention_backend!r}")
        # The engine relies on this: a generation step of a full batch must fit, else
        # padding rows of a graphed step could take a prefilling slot.
        step = self.max_batch_size * (self.num_draft_tokens + 1)
        if self.max_num_tokens < step:
            raise ValueError(f"max_num_tokens={self.max_num_tokens} cannot hold a full generation step: "
                             f"max_batch_size * (num_draft_tokens + 1) = {step} (in LLM's terms: "
                             f"max_num_batched_tokens must be at least max_num_seqs * (num_speculative_tokens + 1))")

    @property
    def num_draft_tokens(self) -> int:
        return 0 if self.speculative is None else self.speculative.num_speculative_tokens

    def check_prompt_len(self, num_tokens: int, what: str = "prompt") -> None:
        """``ValueError`` naming ``what`` unless a prompt of ``num_tokens`` leaves room to
        generate (shorter than ``max_seq_len``) and is not empty."""
        if num_tokens < 1:
            raise ValueError(f"{what} is empty")
        if num_tokens >= self.max_seq_len:
            raise ValueError(f"{what} has {num_tokens} tokens; max_model_len={self.max_seq_len} leaves no room to "
                             f"generate (prompts must be shorter than max_model_len)")


def default_max_num_tokens(max_batch_size: int, num_draft_tokens: int) -> int:
    """The default token budget of a step: at least ``MIN_DEFAULT_MAX_NUM_TOKENS``, and a full
    generation step (``max_batch_size * (num_draft_tokens + 1)`` tokens) always fits."""
    return max(MIN_DEFAULT_MAX_NUM_TOKENS, max_batch_size * (num_draft_tokens + 1))


@dataclass(frozen=True)
class Request:
    """One sequence as the ranks see it (one sample of a user request). ``request_id`` is
    unique over the life of an ``LLM``. ``max_new_tokens`` and ``stop_token_ids`` are resolved by the driver
    (the model's EOS ids included unless ``ignore_eos``); before ``sampling.min_tokens``
    tokens, stop tokens do not end it. ``grammar``: the compiled, checked llguidance grammar of
    ``sampling.structured_outputs`` (None without); ``bad_words_token_ids``: ``sampling.bad_words``
    as token-id sequences (``tpspec.runtime.structured``): the ranks never tokenize."""

    request_id: int
    prompt: tuple[int, ...]
    sampling: SamplingParams
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    grammar: str | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    @property
    def has_token_mask(self) -> bool:
        """Whether the request's tokens are masked (a grammar, allowed token ids or bad words)."""
        return (self.grammar is not None or self.sampling.allowed_token_ids is not None
                or bool(self.bad_words_token_ids))


@dataclass
class RequestStats:
    """How one request was generated.

    ``num_steps``: engine steps that emitted tokens for it (the context step included).
    ``accepted_drafts_per_step``: accepted draft tokens of each generation step: the
    tokens it emitted beyond the one every step emits. A step cut short by the request's
    end (``max_new_tokens``, ``max_seq_len``, a stop token) counts only what it emitted,
    so ``1 + mean accepted drafts`` is exactly the generated tokens per generation step.
    ``num_cached_tokens``: prompt tokens whose KV the prefix cache gave when the request started
    (vLLM's ``num_cached_tokens``; they were not computed). ``num_preemptions``: times the
    request left the batch because KV pages ran out (it was then recomputed from its tokens).
    """

    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_drafts: int = 0
    accepted_drafts_per_step: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts (0.0 without speculation)."""
        return self.num_accepted_drafts / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        """Tokens emitted per generation step (1 + accepted drafts on average)."""
        steps = len(self.accepted_drafts_per_step)
        return 1.0 + self.num_accepted_drafts / steps if steps else 1.0


@dataclass
class CompletionOutput:
    """One sample of a request (vLLM's ``CompletionOutput``).

    ``index``: the sample's index in ``[0, n)``. ``token_ids``: the generated ids (a stop token
    or EOS that ended the sample is included). ``text``: their decoding (cut before a matched
    stop string unless ``include_stop_str_in_output``; ``""`` without a tokenizer).
    ``finish_reason``: ``"stop"`` (EOS, a stop token or a stop string), ``"length"``
    (``max_tokens`` or the model length reached), or None while the sample runs.
    ``stop_reason``: the stop string or stop token id that ended it (None for EOS or length).
    ``logprobs``: None unless the request asked (``SamplingParams(logprobs=N)``); then one
    ``{token id: Logprob}`` per generated token (vLLM's ``Logprob(logprob, rank,
    decoded_token)``, ``tpspec.Logprob``): the token's own and its row's N most likely tokens'
    (log-softmax of the raw logits, before penalties and temperature; the token first, then the
    N ranked 1 .. N), and ``cumulative_logprob`` is the sum of the generated tokens' logprobs. ``stats``: tpspec's speculative
    decoding statistics of this sample (:class:`RequestStats`).
    In a stream, ``text`` and ``token_ids`` hold only what the last step added.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stats: RequestStats = field(default_factory=RequestStats)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Driver-side times of one request (``time.time()`` seconds)."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The result of one prompt (vLLM's ``RequestOutput``): ``n`` samples in ``outputs``.

    ``request_id``: a string unique over the life of the ``LLM``. ``prompt``: the prompt text
    (None when given as token ids). ``prompt_token_ids``: what the model saw. ``finished``:
    every sample has ended. ``metrics``: :class:`RequestMetrics`. ``prompt_logprobs``: None
    unless the request asked (``SamplingParams(prompt_logprobs=N)``); then vLLM's list: None for
    the first prompt token, then one ``{token id: Logprob}`` per prompt token (its own entry, then
    the N most likely at that position), as for generated tokens; in a stream, on the first output
    of the request only. ``num_cached_tokens``: prompt tokens whose KV came from the prefix cache
    (vLLM's; the most of any of its samples; 0 until a sample has started).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
