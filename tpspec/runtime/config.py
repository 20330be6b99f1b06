"""What the runtime is asked to do: the user-facing speculative config, the engine config
every rank receives, and one request as the workers see it. Plain, picklable data."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..sampling.params import SamplingParams

SPEC_METHODS = ("ngram", "draft_model")
ACCEPTANCE_MODES = ("strict", "rejection")
LAUNCHERS = ("mp", "torchrun", "ray")


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """How draft tokens are proposed and verified (familiar to vLLM users on purpose).

    ``method``: ``"ngram"`` (prompt lookup on the request's own tokens, no model) or
    ``"draft_model"`` (a smaller checkpoint of the same family at ``draft_model``, TP-sharded
    like the target). ``num_draft_tokens``: K drafts verified per generation step.
    ``acceptance``: ``"strict"`` (a draft is kept while it equals the target's own choice)
    or ``"rejection"`` (Leviathan et al. rejection sampling; lossless for sampled requests).
    ``max_ngram``/``min_ngram``: the n-gram lengths prompt lookup tries (longest first).
    Raises ``ValueError`` naming the bad field.
    """

    method: str = "ngram"
    num_draft_tokens: int = 4
    draft_model: str | None = None
    acceptance: str = "strict"
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"SpeculativeConfig.method must be one of {SPEC_METHODS}, got {self.method!r}")
        _positive_int("SpeculativeConfig.num_draft_tokens", self.num_draft_tokens)
        if self.acceptance not in ACCEPTANCE_MODES:
            raise ValueError(
                f"SpeculativeConfig.acceptance must be one of {ACCEPTANCE_MODES}, got {self.acceptance!r}"
            )
        if self.method == "draft_model" and not self.draft_model:
            raise ValueError("SpeculativeConfig(method='draft_model') needs draft_model=PATH (or 'tiny')")
        if self.method == "ngram" and self.draft_model:
            raise ValueError("SpeculativeConfig.draft_model is only used with method='draft_model'")
        _positive_int("SpeculativeConfig.max_ngram", self.max_ngram)
        _positive_int("SpeculativeConfig.min_ngram", self.min_ngram)
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"SpeculativeConfig.min_ngram={self.min_ngram} exceeds max_ngram={self.max_ngram}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything a rank needs to build its :class:`~tpspec.runtime.engine.Engine`; the same
    on every rank. Paths are resolved (no ``"tiny"``), dtype is a torch dtype name."""

    model_path: str
    tp_size: int
    device: str  # "cpu" or "cuda"
    dtype: str  # "float32", "bfloat16", "float16"
    attention_dp: bool = False
    speculative: SpeculativeConfig | None = None
    draft_model_path: str | None = None
    max_batch_size: int = 8
    max_seq_len: int = 512
    max_num_tokens: int = 512
    use_cuda_graphs: bool = True
    exchange: str = "auto"
    progress_interval_s: float = 0.25
    deterministic: bool = False  # fixed-order forward: batch- and TP-invariant logits

    def __post_init__(self) -> None:
        # LLM checks this for its users; the engine relies on it (a generation step of a full
        # batch must fit, else padding rows of a graphed step could take a prefilling slot).
        step = self.max_batch_size * (self.num_draft_tokens + 1)
        if self.max_num_tokens < step:
            raise ValueError(f"max_num_tokens={self.max_num_tokens} cannot hold a full generation step: "
                             f"max_batch_size * (num_draft_tokens + 1) = {step}")

    @property
    def num_draft_tokens(self) -> int:
        return 0 if self.speculative is None else self.speculative.num_draft_tokens


@dataclass(frozen=True)
class Request:
    """One request as the ranks see it. ``request_id`` is unique over the life of an ``LLM``
    (the per-slot random streams restart when a new id takes a slot)."""

    request_id: int
    prompt: tuple[int, ...]
    sampling: SamplingParams
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class RequestStats:
    """How one request was generated.

    ``num_steps``: engine steps that emitted tokens for it (the context step included).
    ``accepted_drafts_per_step``: accepted draft tokens of each generation step: the
    tokens it emitted beyond the one every step emits. A step cut short by the request's
    end (``max_new_tokens``, ``max_seq_len``, a stop token) counts only what it emitted,
    so ``1 + mean accepted drafts`` is exactly the generated tokens per generation step.
    """

    num_prompt_tokens: int = 0
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
class RequestOutput:
    """The result of one prompt.

    ``token_ids``: the generated ids only (a stop/EOS token that ended the request is
    included). ``text``: their decoding when the checkpoint has a tokenizer, else None.
    ``finish_reason``: ``"stop"`` (EOS or a stop token) or ``"length"`` (max_new_tokens
    or max_seq_len reached). ``stats``: :class:`RequestStats`.
    """

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    stats: RequestStats
    text: str | None = None
    prompt: str | None = None

    def __repr__(self) -> str:
        text = "" if self.text is None else f", text={self.text!r}"
        return (
            f"RequestOutput(request_id={self.request_id}, token_ids={self.token_ids}{text}, "
            f"finish_reason={self.finish_reason!r}, steps={self.stats.num_steps})"
        )
