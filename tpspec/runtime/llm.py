"""``tpspec.LLM``: the user's entry point (familiar to vLLM users on purpose).

    from tpspec import LLM, SamplingParams, SpeculativeConfig
    with LLM("tiny", tp_size=2, speculative=SpeculativeConfig("ngram", num_draft_tokens=4)) as llm:
        for out in llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.8, seed=1), max_new_tokens=32):
            print(out.token_ids, out.finish_reason, out.stats.acceptance_rate)

The driver validates every request before anything reaches the workers (a bad request
raises ``ValueError`` and leaves the LLM usable), turns prompts into token ids, runs
the requests on the launcher's ranks and turns rank 0's results into
:class:`RequestOutput` objects in prompt order.
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..sampling.params import SamplingParams
from .config import LAUNCHERS, EngineConfig, Request, RequestOutput, SpeculativeConfig
from .launchers import Executor, make_executor

TINY = "tiny"


def cache_dir() -> str:
    """Where generated models live: ``$TPSPEC_CACHE_DIR`` or ``~/.cache/tpspec``."""
    return os.environ.get("TPSPEC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tpspec")


def tiny_model_path(kind: str = "target") -> str:
    """Path of the tiny random Llama (``kind="target"``) or its smaller draft
    (``kind="draft"``), created on first use from a fixed seed (deterministic; no download).
    Safe when several processes create it at once (write to a temp dir, then rename)."""
    import hashlib

    from ..model import tiny
    from ..model.tiny import make_tiny_checkpoint

    if kind not in ("target", "draft"):
        raise ValueError(f"kind must be 'target' or 'draft', got {kind!r}")
    # Keyed by the generator's source: a changed tiny model never reuses a stale cache.
    with open(tiny.__file__, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    name = f"tiny-{digest}" if kind == "target" else f"tiny-draft-{digest}"
    path = os.path.join(cache_dir(), name)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    make_tiny_checkpoint(tmp, **_tiny_kwargs(kind))
    try:
        os.rename(tmp, path)
    except OSError:  # another process won the race: keep its copy
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _tiny_kwargs(kind: str) -> dict[str, Any]:
    """The target and its draft share the vocabulary; the draft is a smaller net."""
    if kind == "target":
        return {"seed": 0}
    return {"seed": 0, "draft": True}


def resolve_model(model: str | os.PathLike, kind: str = "target") -> str:
    """``"tiny"`` -> the cached tiny checkpoint; anything else must be a Hugging Face model
    directory (``config.json`` + safetensors). Raises ``ValueError`` otherwise."""
    if str(model) == TINY:
        return tiny_model_path(kind)
    path = os.fspath(model)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model {path!r} is not a Hugging Face model directory (no config.json); "
                         f"pass a checkpoint directory or 'tiny'")
    from ..model.loader import INDEX_FILE

    # Checked here so the user gets a ValueError, not a worker's traceback.
    if not os.path.isfile(os.path.join(path, INDEX_FILE)) and not glob.glob(os.path.join(path, "*.safetensors")):
        found = sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "*.bin")))
        hint = f" (found {found}: PyTorch .bin checkpoints are not supported)" if found else ""
        raise ValueError(f"model {path!r} has no safetensors weights{hint}")
    return path


def load_tokenizer(path: str) -> Any:
    """The checkpoint's tokenizer (``tokenizers`` from ``tokenizer.json``, else transformers'
    ``AutoTokenizer``), or ``None`` when it has none or neither library is installed."""
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        try:
            from tokenizers import Tokenizer

            return _HFTokenizers(Tokenizer.from_file(os.path.join(path, "tokenizer.json")))
        except Exception:  # noqa: BLE001 - fall through to transformers
            pass
    if any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer_config.json", "tokenizer.model")):
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(path)
        except Exception:  # noqa: BLE001
            return None
    return None


class _HFTokenizers:
    """The two calls the LLM needs, on a ``tokenizers.Tokenizer``."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@dataclass
class GenerateStats:
    """Summary of one :meth:`LLM.generate` call (as measured by the driver)."""

    num_requests: int
    num_prompt_tokens: int
    num_generated_tokens: int
    wall_s: float
    num_generation_steps: int  # summed over requests
    num_draft_tokens: int
    num_accepted_drafts: int

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        """Tokens a request gains per generation step: 1 + mean accepted drafts."""
        steps = self.num_generation_steps
        return 1.0 + self.num_accepted_drafts / steps if steps else 1.0

    @property
    def mean_accepted_drafts_per_step(self) -> float:
        steps = self.num_generation_steps
        return self.num_accepted_drafts / steps if steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_drafts / self.num_draft_tokens if self.num_draft_tokens else 0.0


class LLM:
    """A TP model behind one of three launchers.

    ``model``: a Hugging Face checkpoint directory or ``"tiny"`` (a small random Llama made
    on first use, see :func:`tiny_model_path`). ``tp_size``: ranks of the TP group (default
    1; under torchrun, ``WORLD_SIZE``). ``launcher``: ``"mp"`` (local worker processes),
    ``"torchrun"`` (this process is a rank: every rank runs the same program), ``"ray"``
    (one actor per rank). ``device``: ``"auto"`` (cuda when available), ``"cuda"``, ``"cpu"``.
    ``dtype``: ``"auto"`` (bfloat16 on cuda, float32 on cpu) or a dtype name.
    ``attention_dp``: attention data-parallel (each rank runs its own requests).
    ``speculative``: a :class:`SpeculativeConfig` (or a dict of its fields) or None.
    ``max_batch_size``: requests running at once (per rank under attention DP).
    ``max_seq_len``: prompt + generated tokens of a request (default: the model's
    ``max_position_embeddings``, at most 2048). ``max_num_tokens``: tokens one step feeds
    (context chunks fill what generation leaves). ``use_cuda_graphs``: capture generation
    steps on GPU (eager when False). ``init_timeout_s`` / ``step_timeout_s``: how long the
    driver waits for start-up / for the next step before it raises. ``deterministic``: run the
    model with fixed reduction orders (see ``docs/determinism.md``): a request's logits, hence its
    logprobs and tokens, are bit-identical alone or in any batch, with or without speculation, and
    at every power-of-two TP size; slower, no CUDA graphs, no attention DP, and a TP size that is
    not a power of two (or does not split the model's contractions along their trees) raises
    ``ValueError``.

    Use as a context manager or call :meth:`shutdown`.
    """

    def __init__(
        self,
        model: str | os.PathLike = TINY,
        *,
        tp_size: int | None = None,
        launcher: str = "mp",
        device: str = "auto",
        dtype: str = "auto",
        attention_dp: bool = False,
        speculative: SpeculativeConfig | dict | None = None,
        max_batch_size: int = 8,
        max_seq_len: int | None = None,
        max_num_tokens: int | None = None,
        use_cuda_graphs: bool = True,
        exchange: str = "auto",
        init_timeout_s: float = 300.0,
        step_timeout_s: float = 120.0,
        ray_init_kwargs: dict | None = None,
        deterministic: bool = False,
    ) -> None:
        from ..model.config import ModelConfig

        self._executor: Executor | None = None
        if launcher not in LAUNCHERS:
            raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")
        if tp_size is None:
            tp_size = int(os.environ.get("WORLD_SIZE", "1")) if launcher == "torchrun" else 1
        _check_positive("tp_size", tp_size)
        _check_positive("max_batch_size", max_batch_size)
        for name, flag in (("attention_dp", attention_dp), ("use_cuda_graphs", use_cuda_graphs),
                           ("deterministic", deterministic)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be a bool, got {flag!r}")
        if isinstance(speculative, dict):
            try:
                speculative = SpeculativeConfig(**speculative)
            except TypeError as exc:  # an unknown key
                known = ", ".join(f.name for f in dataclasses.fields(SpeculativeConfig))
                raise ValueError(f"bad speculative config {speculative!r}: {exc} (known keys: {known})") from None
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise ValueError(f"speculative must be a SpeculativeConfig, a dict or None, got {type(speculative).__name__}")
        device = _resolve_device(device)
        dtype = _resolve_dtype(dtype, device)
        if exchange not in ("auto", "ll", "allgather"):
            raise ValueError(f"exchange must be 'auto', 'll' or 'allgather', got {exchange!r}")
        if exchange == "ll" and device != "cuda":
            raise ValueError(f"exchange='ll' needs device='cuda' (CUDA IPC), got device={device!r}")

        self.model_path = resolve_model(model)
        self.model_config = ModelConfig.from_pretrained(self.model_path)
        _check_layout(self.model_config, tp_size, attention_dp, self.model_path, deterministic)
        draft_path = None
        if speculative is not None and speculative.method == "draft_model":
            draft_path = resolve_model(speculative.draft_model, kind="draft")
            draft_cfg = ModelConfig.from_pretrained(draft_path)
            if draft_cfg.vocab_size != self.model_config.vocab_size:
                raise ValueError(f"the draft model's vocab_size {draft_cfg.vocab_size} differs from the target's "
                                 f"{self.model_config.vocab_size}")
            _check_layout(draft_cfg, tp_size, attention_dp, draft_path, deterministic)
        k = speculative.num_draft_tokens if speculative is not None else 0
        if max_seq_len is None:
            max_seq_len = min(self.model_config.max_position_embeddings, 2048)
        _check_positive("max_seq_len", max_seq_len)
        if max_seq_len < 2:
            raise ValueError("max_seq_len must be >= 2 (one prompt token and one generated token)")
        if max_num_tokens is None:
            max_num_tokens = max(512, max_batch_size * (k + 1))
        _check_positive("max_num_tokens", max_num_tokens)
        if max_num_tokens < max_batch_size * (k + 1):
            raise ValueError(f"max_num_tokens={max_num_tokens} cannot hold a full generation step: "
                             f"max_batch_size * (num_draft_tokens + 1) = {max_batch_size * (k + 1)}")

        self.config = EngineConfig(
            model_path=self.model_path, tp_size=tp_size, device=device, dtype=dtype, attention_dp=attention_dp,
            speculative=speculative, draft_model_path=draft_path, max_batch_size=max_batch_size,
            max_seq_len=max_seq_len, max_num_tokens=max_num_tokens, use_cuda_graphs=use_cuda_graphs,
            exchange=exchange, deterministic=deterministic,
        )
        self.launcher = launcher
        self.tokenizer = load_tokenizer(self.model_path)
        self.last_stats: GenerateStats | None = None
        self._ids = itertools.count()
        timeouts: dict[str, Any] = {}
        if launcher != "torchrun":
            timeouts = {"init_timeout_s": init_timeout_s, "step_timeout_s": step_timeout_s}
        if launcher == "ray" and ray_init_kwargs:
            timeouts["ray_init_kwargs"] = ray_init_kwargs
        executor = make_executor(launcher, self.config, **timeouts)
        try:
            executor.start()
        except BaseException:
            executor.shutdown()
            raise
        self._executor = executor

    # ------------------------------------------------------------------ public
    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def rank(self) -> int:
        """This process's rank under torchrun; 0 for the driver of mp/ray."""
        return getattr(self._executor, "local_rank", None) or 0

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        max_new_tokens: int | Sequence[int] = 64,
        *,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; one :class:`RequestOutput` per prompt, in order.

        ``prompts``: strings (needs a tokenizer) or token-id lists; a single string or id
        list is one prompt. ``sampling_params``: one for all, or one per prompt (default
        greedy). ``max_new_tokens``: one for all, or one per prompt. Generation stops at
        EOS (unless ``ignore_eos``), at any of ``stop_token_ids``, after ``max_new_tokens``
        or at ``max_seq_len``. ``use_tqdm``: progress bar (default: when stderr is a
        terminal; it appears only on runs longer than a couple of seconds).

        Raises ``ValueError`` naming the bad prompt/parameter before any work starts (the
        LLM stays usable), and :class:`~tpspec.runtime.launchers.WorkerError` when a worker
        dies or hangs (the LLM is unusable afterwards).
        """
        if self._executor is None:
            raise RuntimeError("this LLM is shut down")
        texts, token_lists = self._prompts(prompts)
        n = len(token_lists)
        params = self._sampling_list(sampling_params, n)
        budgets = self._budget_list(max_new_tokens, n)
        stops = self._stop_ids(stop_token_ids, ignore_eos)
        requests = [
            Request(request_id=next(self._ids), prompt=tuple(toks), sampling=sp, max_new_tokens=mx,
                    stop_token_ids=stops)
            for toks, sp, mx in zip(token_lists, params, budgets)
        ]
        bar = _ProgressBar(sum(budgets), use_tqdm, enabled=self.rank == 0)
        start = time.perf_counter()
        try:
            results = self._executor.run(requests, bar.update) if requests else []
        finally:
            bar.close()
        wall = time.perf_counter() - start
        outputs = []
        for req, res, text in zip(requests, results, texts):
            out_text = None
            if self.tokenizer is not None:
                out_text = self.tokenizer.decode(res.token_ids, skip_special_tokens=True)
            outputs.append(RequestOutput(request_id=req.request_id, prompt_token_ids=list(req.prompt),
                                         token_ids=list(res.token_ids), finish_reason=res.finish_reason,
                                         stats=res.stats, text=out_text, prompt=text))
        self.last_stats = GenerateStats(
            num_requests=n,
            num_prompt_tokens=sum(len(r.prompt) for r in requests),
            num_generated_tokens=sum(len(o.token_ids) for o in outputs),
            wall_s=wall,
            num_generation_steps=sum(len(o.stats.accepted_drafts_per_step) for o in outputs),
            num_draft_tokens=sum(o.stats.num_draft_tokens for o in outputs),
            num_accepted_drafts=sum(o.stats.num_accepted_drafts for o in outputs),
        )
        return outputs

    def shutdown(self) -> None:
        """End the workers (idempotent)."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001
            pass

    # ------------------------------------------------------------------ validation
    def _prompts(self, prompts: Any) -> tuple[list[str | None], list[list[int]]]:
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and all(_is_int(t) for t in prompts)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a string, a token-id list, or a list of those; got "
                             f"{type(prompts).__name__}")
        texts: list[str | None] = []
        token_lists: list[list[int]] = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError(f"prompt {i} is text but the model at {self.model_path!r} has no tokenizer; "
                                     f"pass token-id lists")
                toks = list(self.tokenizer.encode(p))
                texts.append(p)
            elif isinstance(p, torch.Tensor) and p.dim() == 1 and not p.is_floating_point():
                toks = [int(t) for t in p.tolist()]
                texts.append(None)
            elif isinstance(p, (list, tuple)) and all(_is_int(t) for t in p):
                toks = [int(t) for t in p]
                texts.append(None)
            else:
                raise ValueError(f"prompt {i} must be a string or a list of token ids, got {type(p).__name__}")
            if not toks:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in toks if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.vocab_size}): {bad[:5]}")
            if len(toks) >= self.config.max_seq_len:
                raise ValueError(f"prompt {i} has {len(toks)} tokens; max_seq_len={self.config.max_seq_len} "
                                 f"leaves no room to generate (prompts must be shorter than max_seq_len)")
            token_lists.append(toks)
        return texts, token_lists

    @staticmethod
    def _sampling_list(sampling_params: Any, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if isinstance(sampling_params, dict):
            return [_params_from_dict(sampling_params)] * n
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != n:
                raise ValueError(f"got {len(sampling_params)} sampling_params for {n} prompts")
            out = []
            for i, sp in enumerate(sampling_params):
                if isinstance(sp, dict):
                    sp = _params_from_dict(sp, f"sampling_params[{i}]")
                if not isinstance(sp, SamplingParams):
                    raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got {type(sp).__name__}")
                out.append(sp)
            return out
        raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got "
                         f"{type(sampling_params).__name__}")

    @staticmethod
    def _budget_list(max_new_tokens: Any, n: int) -> list[int]:
        values = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * n
        if len(values) != n:
            raise ValueError(f"got {len(values)} max_new_tokens for {n} prompts")
        for v in values:
            if not _is_int(v) or v < 1:
                raise ValueError(f"max_new_tokens must be a positive int, got {v!r}")
        return [int(v) for v in values]

    def _stop_ids(self, stop_token_ids: Any, ignore_eos: bool) -> tuple[int, ...]:
        stops = [] if ignore_eos else list(self.model_config.eos_token_ids)
        if stop_token_ids is not None and not isinstance(stop_token_ids, (list, tuple, set, frozenset)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {type(stop_token_ids).__name__}")
        for t in stop_token_ids or ():
            if not _is_int(t) or not 0 <= t < self.vocab_size:
                raise ValueError(f"stop token id {t!r} is outside [0, {self.vocab_size})")
            stops.append(int(t))
        return tuple(sorted(set(stops)))


class _ProgressBar:
    """tqdm over generated tokens when installed (shown after 2 s), else a plain line every
    5 s on long runs. Never shown when disabled."""

    def __init__(self, total: int, use_tqdm: bool | None, enabled: bool) -> None:
        if use_tqdm is None:
            use_tqdm = sys.stderr.isatty()
        self.enabled = enabled and use_tqdm
        self.bar = None
        self.total = total
        self.start = self.last_print = time.monotonic()
        self.done = 0
        if not self.enabled:
            return
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="tok", desc="generate", delay=2.0, leave=False)
        except ImportError:
            self.bar = None

    def update(self, steps: int, tokens: int) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(max(0, tokens - self.done))
        elif time.monotonic() - self.last_print >= 5.0:
            self.last_print = time.monotonic()
            print(f"generate: {tokens}/{self.total} tokens, {steps} steps", file=sys.stderr, flush=True)
        self.done = tokens

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _params_from_dict(values: dict, name: str = "sampling_params") -> SamplingParams:
    """``SamplingParams(**values)``; an unknown key is a ``ValueError`` naming it."""
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(str(k) for k in values if k not in known)
    if unknown:
        raise ValueError(f"{name} has unknown key(s) {unknown}; known: {sorted(known)}")
    return SamplingParams(**values)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_positive(name: str, value: object) -> None:
    if not _is_int(value) or value < 1:  # type: ignore[operator]
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_layout(config: Any, tp_size: int, attention_dp: bool, path: str, deterministic: bool = False) -> None:
    """The model splits over ``tp_size`` ranks (checked here, before any worker starts)."""
    from ..mapping import Mapping
    from ..model.llama import check_split

    for rank in range(tp_size):
        try:
            check_split(config, Mapping(tp_size, rank, tp_size, attention_dp), deterministic=deterministic)
        except ValueError as exc:
            raise ValueError(f"{path} cannot run at tp_size={tp_size}: {exc}") from None


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available")
    return device


def _resolve_dtype(dtype: str | torch.dtype, device: str) -> str:
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).replace("torch.", "")
    if dtype == "auto":
        return "bfloat16" if device == "cuda" else "float32"
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}
    dtype = aliases.get(dtype, dtype)
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    return dtype
