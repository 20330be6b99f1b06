"""``tpspec.LLM``: the user's entry point, with vLLM's argument and output shapes.

    from tpspec import LLM, SamplingParams
    with LLM("tiny", tensor_parallel_size=2,
             speculative_config={"method": "ngram", "num_speculative_tokens": 4}) as llm:
        for out in llm.generate(["The cat"], SamplingParams(temperature=0.8, seed=1, max_tokens=32)):
            print(out.outputs[0].text, out.outputs[0].finish_reason)

The driver validates every request before anything reaches the workers (a bad request
raises ``ValueError`` and leaves the LLM usable), turns prompts into token ids, expands
each request into its ``n`` samples, runs them on the executor's ranks and turns rank 0's
tokens into :class:`RequestOutput` objects in prompt order (detokenized, stop strings
applied).
"""

from __future__ import annotations

import atexit
import dataclasses
import glob
import itertools
import os
import sys
import threading
import time
import warnings
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from ..log import get_logger
from ..model.loader import CheckpointReader, check_draft_vocab_map, verify_checkpoint
from ..sampling.logprobs import Logprob
from ..sampling.params import SamplingParams
from ..speculative.forced import read_forced_rate
from ..validation import check_bool, check_int, check_real, is_int, resolve_device, resolve_dtype
from .config import (DEFAULT_MAX_BATCH_SIZE, LAUNCHERS, CompletionOutput, EngineConfig, Request, RequestMetrics,
                     RequestOutput, RequestStats, SpeculativeConfig, default_max_num_tokens)
from .engine import Engine, SequenceResult, SequenceUpdate
from .kv_sizing import KVPlan
from .launchers import Executor, GroupSpec, RankContext, make_executor
from .tokenizer import IncrementalDetokenizer, at_least_tokens, check_text, load_tokenizer, longest_token_chars

TINY = "tiny"


def cache_dir() -> str:
    """Where generated models live: ``$TPSPEC_CACHE_DIR`` or ``~/.cache/tpspec``."""
    return os.environ.get("TPSPEC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tpspec")


def tiny_model_path(kind: str = "target") -> str:
    """Path of the embedded tiny model (``kind="target"``: a small Llama trained for a few
    seconds on text shipped with tpspec, see :func:`~tpspec.model.tiny.make_trained_tiny_checkpoint`),
    its one-layer draft (``kind="draft"``) or a random EAGLE-3 head for it (``kind="eagle3"``,
    :func:`~tpspec.model.tiny.make_tiny_eagle3_head`), made on first use into :func:`cache_dir` and
    reused after (no download). Safe when several processes create it at once (each writes a
    temporary directory, then renames it)."""
    import shutil

    from ..model import tiny

    if kind not in ("target", "draft", "eagle3"):
        raise ValueError(f"kind must be 'target', 'draft' or 'eagle3', got {kind!r}")
    key = tiny.trained_tiny_key()
    if kind == "eagle3":
        import hashlib
        import inspect

        # Keyed by the target and the head's generator: a changed one never reuses a stale head.
        head_key = hashlib.sha256((key + inspect.getsource(tiny.make_tiny_eagle3_head)).encode()).hexdigest()[:12]
        head = os.path.join(cache_dir(), f"tiny-eagle3-{head_key}")
        if not os.path.isfile(os.path.join(head, "config.json")):
            target = tiny_model_path("target")
            tmp = f"{head}.tmp-{os.getpid()}"
            tiny.make_tiny_eagle3_head(tmp, target)
            try:
                os.rename(tmp, head)
            except OSError:  # another process won the race: keep its copy
                shutil.rmtree(tmp, ignore_errors=True)
        return head
    target, draft = (os.path.join(cache_dir(), f"{name}-{key}") for name in ("tiny", "tiny-draft"))
    path = target if kind == "target" else draft
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = f"{target}.tmp-{os.getpid()}"
    show = os.environ.get("RANK", "0") == "0"  # under torchrun every rank makes it; rank 0 says so
    if show:
        print(f"tpspec: training the tiny model once, on first use ({tiny.TRAIN_STEPS} small steps on the CPU); "
              f"later runs load it from {target}", file=sys.stderr, flush=True)
    tiny.make_trained_tiny_checkpoint(tmp, draft_path=f"{tmp}-draft", steps=tiny.TRAIN_STEPS, progress=show)
    for made, final in ((f"{tmp}-draft", draft), (tmp, target)):
        try:
            os.rename(made, final)
        except OSError:  # another process won the race: keep its copy
            shutil.rmtree(made, ignore_errors=True)
    return path


def resolve_model(model: str | os.PathLike, kind: str = "target") -> str:
    """``"tiny"`` -> the cached tiny checkpoint; ``"shape:NAME[,num_layers=N,vocab_size=V]"`` -> a real
    model shape with random weights (:mod:`tpspec.model.shapes`, no checkpoint); with
    ``kind="eagle3"`` also ``"shape-eagle3:NAME[,draft_vocab_size=V]"`` -> a random EAGLE-3 head for
    that shape; anything else must be a
    Hugging Face model directory (``config.json`` + safetensors). Raises ``ValueError`` otherwise."""
    from ..model.shapes import config_from_path, eagle3_shape_config, is_eagle3_shape_path, is_shape_path

    if str(model) == TINY:
        return tiny_model_path(kind)
    if is_shape_path(model):
        config_from_path(model)  # a bad name raises here
        return model
    if is_eagle3_shape_path(model):
        if kind != "eagle3":
            raise ValueError(f"model {model!r} is a random EAGLE-3 head: it drafts with method 'eagle3' only")
        eagle3_shape_config(model)  # a bad name raises here
        return model
    path = os.fspath(model)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model {path!r} is not a Hugging Face model directory (no config.json); "
                         f"pass a checkpoint directory or 'tiny'")
    from ..model.loader import INDEX_FILE

    # Checked here so the user gets a ValueError, not a worker's traceback.
    if not os.path.isfile(os.path.join(path, INDEX_FILE)) and not glob.glob(os.path.join(path, "*.safetensors")):
        found = sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "*.bin")))
        hint = f" (found {found}: PyTorch .bin checkpoints are not supported" if found else ""
        if found and kind == "eagle3":
            hint += "; `tpspec convert-eagle3 IN OUT` converts an EAGLE-3 head"
        hint += ")" if found else ""
        raise ValueError(f"model {path!r} has no safetensors weights{hint}")
    return path


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
    forced_acceptance_rate: float | None = None  # set: acceptance counts were forced (a benchmark knob)
    num_cached_tokens: int = 0  # prompt tokens the prefix cache gave (RequestOutput.num_cached_tokens summed)
    num_preemptions: int = 0  # summed over samples

    @classmethod
    def of(cls, outputs: list[RequestOutput], wall_s: float,
           forced_acceptance_rate: float | None = None) -> "GenerateStats":
        samples = [c for o in outputs for c in o.outputs]
        return cls(
            num_requests=len(outputs),
            num_prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
            num_generated_tokens=sum(len(c.token_ids) for c in samples),
            wall_s=wall_s,
            num_generation_steps=sum(len(c.stats.accepted_drafts_per_step) for c in samples),
            num_draft_tokens=sum(c.stats.num_draft_tokens for c in samples),
            num_accepted_drafts=sum(c.stats.num_accepted_drafts for c in samples),
            forced_acceptance_rate=forced_acceptance_rate,
            num_cached_tokens=sum(o.num_cached_tokens for o in outputs),
            num_preemptions=sum(c.stats.num_preemptions for c in samples),
        )

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


@dataclass
class EngineCounters:
    """Counters over the life of an ``LLM`` (vLLM's ``prefix_cache_queries``, ``prefix_cache_hits``,
    ``num_preemptions``, ``prompt_tokens`` and ``generation_tokens``), counted by the driver from its
    samples as they start and run: ``prefix_cache_queries`` the prompt tokens of the samples that
    looked in the prefix cache (all of them while it is on, but those asking ``prompt_logprobs``),
    ``prefix_cache_hits`` the prompt tokens found there, ``num_preemptions`` how often a running
    sample was preempted, ``prompt_tokens`` the prompt tokens of the samples that started (each
    sample of an ``n > 1`` request counts its prompt), ``generation_tokens`` the tokens the samples
    returned (an aborted sample's up to its abort)."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class LLM:
    """A TP model behind one of three executors; vLLM's ``LLM`` arguments.

    ``model``: a Hugging Face checkpoint directory or ``"tiny"`` (a small Llama trained on
    text shipped with the package, made on first use, see :func:`tiny_model_path`).
    ``tensor_parallel_size``: ranks of the TP group (default 1; under torchrun, ``WORLD_SIZE``).
    ``dtype``: ``"auto"`` (the checkpoint's ``torch_dtype``; float32 when it names none) or
    ``float32``/``bfloat16``/``float16``. ``seed``: when an int, requests without their own
    seed get one derived from it and their order, so a script reproduces its samples.
    ``max_model_len``: prompt + generated tokens of a request (default: the model's
    ``max_position_embeddings``). ``gpu_memory_utilization``: on CUDA, the share of the GPU
    the engine may use (None = 0.9): weights and a profiled step first, the rest to KV pages.
    ``speculative_config``: a dict (vLLM's keys: ``method``, ``num_speculative_tokens``,
    ``model``, ``prompt_lookup_max``, ``prompt_lookup_min``; tpspec adds ``acceptance``) or a
    :class:`SpeculativeConfig`, or None. ``generation_config``: ``"auto"`` applies the
    checkpoint's ``generation_config.json`` sampling defaults (temperature, top_p, top_k,
    min_p, max_new_tokens -> max_tokens) when ``generate`` gets no sampling params, and its
    EOS ids; ``"vllm"`` ignores the file; a directory reads that directory's file.
    ``max_num_seqs``: sequences running at once (per rank under attention DP; default 256, as
    vLLM). ``max_num_batched_tokens``: tokens one step feeds (context chunks fill what generation
    leaves; default ``max(2048, max_num_seqs * (num_speculative_tokens + 1))``).
    ``enforce_eager``: no CUDA graphs. ``distributed_executor_backend``: ``"mp"`` (local worker
    processes), ``"ray"`` (one actor per rank) or ``"external_launcher"`` (this process is a rank,
    started by torchrun: every rank runs the same program); default ``"external_launcher"`` in a
    process torchrun started, else ``"mp"``.

    tpspec's own options: ``device`` (``"auto"``: cuda when available), ``attention_dp``
    (attention data-parallel: each rank runs its own requests), ``exchange`` (``"auto"``,
    ``"ll"``, ``"allgather"``), ``init_timeout_s`` / ``step_timeout_s`` (how long the driver
    waits for start-up / for the next step before it raises), ``ray_init_kwargs``.

    KV cache (paged): ``page_size`` tokens a page (default 16); ``kv_cache_bytes``: bytes of
    pages per rank (any device; ``gpu_memory_utilization`` then has no effect, nor on CPU: a
    warning says so); on CPU without it, pages for ``min(max_num_seqs, 8)`` requests of
    ``max_model_len`` (at most 4 GiB). ``kv_cache_tokens``: the tokens the cache holds per
    rank (``num_kv_pages`` pages of ``page_size``), known once the engine is up. A request starts
    (in order) when the pages of its prompt are free and takes pages as it grows; when they run
    out, the newest running request is preempted and later recomputed, with the same tokens
    (README, "KV cache"). A prompt of ``max_model_len`` tokens or more raises ``ValueError``.
    ``enable_prefix_caching`` (default True, as vLLM): a request reuses the KV pages of the
    longest cached run of its prompt's full pages (``RequestOutput.num_cached_tokens``;
    :attr:`counters` counts queries, hits and preemptions). ``attention_backend``:
    ``"auto"`` (on CUDA ``AUTO_CUDA_ATTENTION`` of :mod:`tpspec.model.attention`, the Triton
    kernels, or the torch path where ``triton`` cannot run; the torch path elsewhere),
    ``"torch"``, ``"triton"`` (CUDA with ``triton``; on CPU only under Triton's interpreter) or
    ``"flashinfer"`` (CUDA with ``flashinfer``, only when named);
    one that cannot run here raises ``ValueError`` before a worker starts.

    ``deterministic``: run the model with fixed reduction orders (``docs/determinism.md``): a
    request's logits, hence its logprobs and tokens, are bit-identical alone or in any batch,
    with or without speculation, and at every power-of-two TP size up to 8. Slower (on CUDA
    with ``triton`` the linears run a fixed-order segment GEMM); CUDA graphs only where its
    attention backend can run under them; no attention DP, ``attention_backend`` must stay
    ``"auto"``; a TP size that is not a power of two, or that does not split the model's
    contractions along their fixed trees, raises ``ValueError``.

    Every argument is checked before a worker starts (``ValueError`` naming it). Use as a
    context manager or call :meth:`shutdown`; an ``LLM`` still running when the interpreter
    exits (or when it is garbage collected) shuts its workers down then. One ``LLM`` may be
    shared between threads: ``generate``, ``chat``, streams and the step-by-step calls may run
    in any mix, each caller getting exactly its own outputs. Engine steps run one at a time
    (a lock); a stream or a ``generate`` that meets requests already running joins them and
    steps with them, so streams of several threads advance together.
    """

    def __init__(
        self,
        model: str | os.PathLike = TINY,
        *,
        tensor_parallel_size: int | None = None,
        dtype: str | torch.dtype = "auto",
        seed: int | None = None,
        max_model_len: int | None = None,
        gpu_memory_utilization: float | None = None,
        speculative_config: SpeculativeConfig | dict | None = None,
        generation_config: str = "auto",
        max_num_seqs: int = DEFAULT_MAX_BATCH_SIZE,
        max_num_batched_tokens: int | None = None,
        enforce_eager: bool = False,
        distributed_executor_backend: str | None = None,
        device: str = "auto",
        attention_dp: bool = False,
        exchange: str = "auto",
        init_timeout_s: float = 300.0,
        step_timeout_s: float = 120.0,
        ray_init_kwargs: dict | None = None,
        page_size: int = 16,
        kv_cache_bytes: int | None = None,
        attention_backend: str = "auto",
        deterministic: bool = False,
        enable_prefix_caching: bool = True,
    ) -> None:
        from ..model.attention import choose_attention_backend
        from ..model.shapes import config_from_path, is_eagle3_shape_path, is_shape_path

        self._executor: Executor | None = None
        self._lock = threading.Lock()
        backend = distributed_executor_backend
        if backend is None:
            backend = "external_launcher" if under_torchrun() else "mp"
        if backend not in LAUNCHERS:
            raise ValueError(f"distributed_executor_backend must be one of {LAUNCHERS}, got {backend!r}")
        tp_size = tensor_parallel_size
        if tp_size is None:
            tp_size = int(os.environ.get("WORLD_SIZE", "1")) if backend == "external_launcher" else 1
        tp_size = check_int("tensor_parallel_size", tp_size, low=1)
        max_num_seqs = check_int("max_num_seqs", max_num_seqs, low=1)
        check_bool("attention_dp", attention_dp)
        check_bool("enforce_eager", enforce_eager)
        check_bool("deterministic", deterministic)
        check_bool("enable_prefix_caching", enable_prefix_caching)
        if seed is not None:
            seed = check_int("seed", seed, low=0, below=2**64)
        if gpu_memory_utilization is not None and not 0 < check_real("gpu_memory_utilization",
                                                                     gpu_memory_utilization) <= 1:
            raise ValueError(f"gpu_memory_utilization must be None or in (0, 1], got {gpu_memory_utilization!r}")
        if isinstance(speculative_config, dict):
            speculative_config = SpeculativeConfig.from_dict(speculative_config)
        if speculative_config is not None and not isinstance(speculative_config, SpeculativeConfig):
            raise ValueError(f"speculative_config must be a dict, a SpeculativeConfig or None, got "
                             f"{type(speculative_config).__name__}")
        spec = speculative_config
        device = resolve_device(device)
        if exchange not in ("auto", "ll", "allgather"):
            raise ValueError(f"exchange must be 'auto', 'll' or 'allgather', got {exchange!r}")
        if exchange == "ll" and device != "cuda":
            raise ValueError(f"exchange='ll' needs device='cuda' (CUDA IPC), got device={device!r}")

        self.model_path = resolve_model(model)
        if not is_shape_path(self.model_path):
            verify_checkpoint(self.model_path)  # a corrupt or truncated file: a ValueError here, not in a worker
        self.model_config = config_from_path(self.model_path)
        dtype = resolve_dtype(dtype, device, checkpoint_dtype=self.model_config.torch_dtype or "float32")
        _check_layout(self.model_config, tp_size, attention_dp, self.model_path, deterministic)
        # An attention backend this host cannot run: a ValueError here, not in a worker.
        choose_attention_backend(device, self.model_config.head_dim, attention_backend, deterministic=deterministic)
        self.generation_defaults, gen_eos = _generation_config(generation_config, self.model_path)
        draft_path = None
        if spec is not None and spec.method == "draft_model":
            draft_path = resolve_model(spec.model, kind="draft")
            if not is_shape_path(draft_path):
                verify_checkpoint(draft_path)
            draft_cfg = config_from_path(draft_path)
            if draft_cfg.vocab_size != self.model_config.vocab_size:
                raise ValueError(f"the draft model's vocab_size {draft_cfg.vocab_size} differs from the target's "
                                 f"{self.model_config.vocab_size}")
            _check_layout(draft_cfg, tp_size, attention_dp, draft_path, deterministic)
        elif spec is not None and spec.method == "eagle3":
            from ..model.eagle3 import Eagle3Config

            draft_path = resolve_model(spec.model, kind="eagle3")
            head_cfg = Eagle3Config.from_pretrained(draft_path, self.model_config)  # CheckpointError before any worker
            if not is_eagle3_shape_path(draft_path):  # a corrupt file, a bad d2t / t2d: before any worker too
                verify_checkpoint(draft_path)
                with CheckpointReader(draft_path) as reader:
                    check_draft_vocab_map(reader, head_cfg.draft_vocab_size, head_cfg.target_vocab_size)
            _check_layout(head_cfg, tp_size, attention_dp, draft_path, deterministic)
            draft_cfg = head_cfg.layer  # its one decoder layer's KV shares the pages
        k = spec.num_speculative_tokens if spec is not None else 0
        if max_model_len is None:
            max_model_len = self.model_config.max_position_embeddings
        max_model_len = check_int("max_model_len", max_model_len, low=2)  # a prompt token and a generated one
        if max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                             f"{self.model_config.max_position_embeddings} (positions past it were never trained)")
        if max_num_batched_tokens is None:
            max_num_batched_tokens = default_max_num_tokens(max_num_seqs, k)

        memory_share = gpu_memory_utilization
        if memory_share is not None and (device != "cuda" or kv_cache_bytes is not None):
            # vLLM scripts pass it everywhere; it sizes nothing without a GPU or beside kv_cache_bytes.
            why = "kv_cache_bytes sizes the cache" if kv_cache_bytes is not None else f"device={device!r}"
            get_logger(__name__).warning("gpu_memory_utilization=%s has no effect (%s)", memory_share, why)
            memory_share = None
        self.config = EngineConfig(
            model_path=self.model_path, tp_size=tp_size, device=device, dtype=dtype, attention_dp=attention_dp,
            speculative=spec, draft_model_path=draft_path, max_batch_size=max_num_seqs,
            max_seq_len=max_model_len, max_num_tokens=max_num_batched_tokens, use_cuda_graphs=not enforce_eager,
            exchange=exchange, gpu_memory_utilization=memory_share, page_size=page_size,
            kv_cache_bytes=kv_cache_bytes, attention_backend=attention_backend, deterministic=deterministic,
            enable_prefix_caching=enable_prefix_caching,
            forced_acceptance_rate=read_forced_rate() if spec is not None else None,
            eos_token_ids=tuple(sorted(set(self.model_config.eos_token_ids) | set(gen_eos))),
        )
        if kv_cache_bytes is not None:
            _check_kv_fits(self.config, [self.model_config] + ([draft_cfg] if draft_path else []))
        self.seed = seed
        self.distributed_executor_backend = backend
        self.tokenizer = None if is_shape_path(self.model_path) else load_tokenizer(self.model_path)
        self._longest_token = None if self.tokenizer is None else longest_token_chars(self.tokenizer)
        self.eos_token_ids = self.config.eos_token_ids
        self._ll_tokenizer = None  # llguidance's, built on the first request with structured outputs
        self.last_stats: GenerateStats | None = None
        self.counters = EngineCounters()
        """Prefix-cache queries and hits and preemptions so far (:class:`EngineCounters`)."""
        self._sequence_ids = itertools.count()
        self._request_ids = itertools.count()
        # Requests driven step by step (add_request / step, streams): live requests by id, the
        # (request id, sample index) of each engine sequence, what the next step adds / aborts.
        # A request's outputs go to its owner: the stream (or generate call) that made it, or
        # step()'s caller for add_request. Streams dropped in any thread leave their ids in
        # _dropped (no lock taken there: a garbage-collected stream may be finalized while this
        # thread holds it); the next call under the lock aborts them.
        self._live: dict[str, _Live] = {}
        self._seq_owner: dict[int, tuple[str, int]] = {}
        self._new: list[Request] = []
        self._aborts: list[int] = []
        self._dropped: deque[str] = deque()
        self._unclaimed: list[RequestOutput] = []  # add_request outputs a stream's step produced
        options: dict[str, Any] = {}
        if backend != "external_launcher":
            options = {"init_timeout_s": init_timeout_s, "timeout_s": step_timeout_s}
        if backend == "ray" and ray_init_kwargs:
            options["ray_init_kwargs"] = ray_init_kwargs
        if backend == "external_launcher" and not under_torchrun() and tp_size > 1:
            raise ValueError(f"distributed_executor_backend='external_launcher' with tensor_parallel_size={tp_size} "
                             f"needs a process started by torchrun (RANK and WORLD_SIZE are not set); use 'mp' "
                             f"to start local ranks")
        spec_of_group = GroupSpec(world_size=tp_size, device=device, tp_size=tp_size, attention_dp=attention_dp)
        executor = make_executor(backend, spec_of_group, **options)
        try:
            executor.start()
            if getattr(executor, "num_nodes", 1) > 1:  # the LL exchange is one node only
                self.config = dataclasses.replace(self.config, exchange="allgather")
            kv = next(r for r in executor.call(_start_engine, self.config, timeout_s=init_timeout_s) if r is not None)
        except BaseException:
            executor.shutdown()
            raise
        self._executor = executor
        self.num_kv_pages: int = kv.num_pages
        """KV pages each rank holds for requests (vLLM's ``num_gpu_blocks``), of ``page_size`` tokens."""
        self.kv_cache_tokens: int = kv.num_tokens
        """Tokens the KV cache holds per rank: ``num_kv_pages * page_size``."""
        # When the LLM is collected, or at interpreter exit, the workers end cleanly: no
        # resource-tracker warning about their semaphores. Registered with atexit here, after
        # multiprocessing's own exit handler, so it runs before that handler kills the workers.
        # Holds the executor, not self.
        self._finalizer = weakref.finalize(self, executor.shutdown)
        atexit.register(self._finalizer)

    # ------------------------------------------------------------------ public
    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def rank(self) -> int:
        """This process's rank under ``external_launcher`` (torchrun); 0 for the driver of mp/ray."""
        return getattr(self._executor, "local_rank", None) or 0

    def get_tokenizer(self) -> Any:
        """The checkpoint's Hugging Face tokenizer (None when the checkpoint has none)."""
        return self.tokenizer

    def tokenize(self, text: str, what: str = "prompt") -> list[int]:
        """The token ids of a text prompt, as :meth:`generate` encodes it. Raises ``ValueError``
        naming ``what`` when the model has no tokenizer, the text is not valid Unicode, or its
        length alone proves it no shorter than ``max_model_len`` tokens (then it is not encoded:
        a huge prompt costs no tokenizer time). Uses only the tokenizer: safe from any thread."""
        if self.tokenizer is None:
            raise ValueError(f"{what} is text but the model at {self.model_path!r} has no tokenizer; pass token ids")
        return self._encode(text, what, add_special_tokens=True)

    def _encode(self, text: str, what: str, *, add_special_tokens: bool) -> list[int]:
        check_text(text, what)
        limit = self.config.max_seq_len
        if self._longest_token is not None and len(text) >= limit * self._longest_token:
            least = at_least_tokens(self.tokenizer, text, self._longest_token)
            if least >= limit:
                raise ValueError(f"{what} has at least {least} tokens ({len(text)} characters, at most "
                                 f"{self._longest_token} a token); max_model_len={limit} leaves no room to generate "
                                 f"(prompts must be shorter than max_model_len)")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the checkpoint's ``generation_config.json`` defaults applied
        (what :meth:`generate` uses when it gets no sampling params)."""
        return SamplingParams(**self.generation_defaults)

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        stream: bool = False,
    ) -> list[RequestOutput] | Iterator[RequestOutput]:
        """Generate for every prompt; one :class:`RequestOutput` per prompt, in order, each with
        ``n`` :class:`CompletionOutput` samples.

        ``prompts``: a string, a token-id list, ``{"prompt": str}`` or
        ``{"prompt_token_ids": [...]}``, or a list of those. ``sampling_params``: one for all, or
        one per prompt (default :meth:`get_default_sampling_params`). ``use_tqdm``: progress bar
        (default: when stderr is a terminal; it appears only on runs longer than a couple of
        seconds).

        ``stream=True`` returns an iterator instead: after every engine step it yields one
        ``RequestOutput`` per request that changed, whose samples hold only what the step added
        (``text``, ``token_ids`` and ``logprobs`` are deltas, ``cumulative_logprob`` the sum so
        far; a sample appears once more, possibly empty, when it finishes; ``finished`` is set on
        a request's last output). Joining each sample's deltas gives exactly the non-streamed
        output.

        Raises ``ValueError`` naming the bad prompt/parameter before any work starts (the LLM
        stays usable), and :class:`~tpspec.runtime.launchers.WorkerError` when a worker dies
        or hangs (the LLM is unusable afterwards).

        Safe from several threads at once: a stream yields only its own requests' outputs, and a
        call made while other requests run joins them step by step (its outputs are the same).
        """
        with self._lock:
            self._check_open()
            self._drop_abandoned()
            defaults = sampling_params is None
            batch = self._make_requests(prompts, sampling_params, defaults=defaults)
            if not stream and not self._live:  # nothing else runs: the whole batch on the ranks at once
                if self._aborts:  # sequences of an abandoned stream still sit in the engines: drop them first
                    aborts, self._aborts = self._aborts, []
                    self._executor.call(_step_on_rank, [], aborts)
                return self._generate(batch, use_tqdm)
            inbox = _Inbox()
            lives = [self._register(entry, inbox) for entry in batch]
        outputs = self._stream(inbox)
        if stream:
            return outputs
        return self._joined(lives, outputs)

    def _generate(self, batch: list["_Entry"], use_tqdm: bool | None) -> list[RequestOutput]:
        requests = [r for entry in batch for r in entry.requests]
        bar = _ProgressBar(sum(r.max_new_tokens for r in requests), use_tqdm, enabled=self.rank == 0)
        start = time.perf_counter()
        try:
            results: list[SequenceResult] = []
            if requests:
                results = self._executor.call(_generate_on_rank, requests, on_progress=bar.update)[self.rank]
        except KeyboardInterrupt:
            warnings.warn("generate was interrupted: the ranks were stopped mid-step, so this LLM cannot generate "
                          "again (calls raise WorkerError); create a new LLM", RuntimeWarning, stacklevel=3)
            raise
        finally:
            bar.close()
        wall = time.perf_counter() - start
        by_seq = {r.request_id: res for r, res in zip(requests, results)}
        now = time.time()
        outputs = []
        for entry in batch:
            samples = []
            prompt_logprobs = None
            for i, req in enumerate(entry.requests):
                res = by_seq[req.request_id]
                state = _Sample(i, req, entry.params, self.tokenizer)
                state.feed(res.token_ids)
                state.finish(res.finish_reason)
                self.counters.generation_tokens += len(state.token_ids)
                samples.append(state.output(res.stats, res.logprobs))
                if res.prompt_logprobs is not None:
                    prompt_logprobs = state.decoded(res.prompt_logprobs)
                self._count(req, res.stats.num_cached_tokens, res.stats.num_preemptions)
            entry.metrics.first_token_time = entry.metrics.last_token_time = entry.metrics.finished_time = now
            outputs.append(RequestOutput(request_id=entry.request_id, prompt=entry.prompt_text,
                                         prompt_token_ids=list(entry.prompt_ids), outputs=samples,
                                         finished=True, metrics=entry.metrics, prompt_logprobs=prompt_logprobs,
                                         num_cached_tokens=max(c.stats.num_cached_tokens for c in samples)))
        self.last_stats = GenerateStats.of(outputs, wall, self.config.forced_acceptance_rate)
        return outputs

    def _stream(self, inbox: "_Inbox") -> Iterator[RequestOutput]:
        """The outputs of ``inbox``'s requests, as steps produce them. Steps run under the lock,
        the caller reads between them (outside it): a step another thread runs fills this inbox
        too, so every stream advances whoever steps."""
        try:
            while True:
                with self._lock:
                    self._drop_abandoned()
                    inbox.pending.intersection_update(self._live)  # aborted meanwhile
                    if not inbox.outputs and inbox.pending:
                        unowned = self._step()
                        self._unclaimed.extend(unowned)
                    ready, inbox.outputs = inbox.outputs, []
                    done = not inbox.pending
                yield from ready
                if done:
                    return
        finally:  # finished, or the caller stopped reading: its requests leave the batch
            if inbox.pending:
                self._dropped.extend(inbox.pending)

    def _joined(self, lives: list["_Live"], outputs: Iterator[RequestOutput]) -> list[RequestOutput]:
        """Run a stream to its end and join its deltas: the outputs a whole-batch generate gives."""
        start = time.perf_counter()
        logprobs: dict[tuple[str, int], list] = {}
        for out in outputs:
            for c in out.outputs:
                if c.logprobs is not None:
                    logprobs.setdefault((out.request_id, c.index), []).extend(c.logprobs)
        results = []
        for live in lives:
            entry = live.entry
            wants = entry.params.logprobs is not None
            samples = [s.output(live.stats[i], logprobs.get((entry.request_id, i), []) if wants else None)
                       for i, s in enumerate(live.samples)]
            results.append(RequestOutput(request_id=entry.request_id, prompt=entry.prompt_text,
                                         prompt_token_ids=list(entry.prompt_ids), outputs=samples, finished=True,
                                         metrics=entry.metrics))
        self.last_stats = GenerateStats.of(results, time.perf_counter() - start, self.config.forced_acceptance_rate)
        return results

    # ------------------------------------------------------------------ step by step
    def add_request(self, prompt: Any, sampling_params: SamplingParams | None = None) -> str:
        """Queue one request (a prompt as :meth:`generate` takes it); it joins the running batch at
        the next :meth:`step`, whose caller receives its outputs. Returns its ``request_id``.
        Validation as in :meth:`generate`."""
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        with self._lock:
            self._check_open()
            self._drop_abandoned()
            entry = self._make_requests([prompt], sampling_params, defaults=sampling_params is None)[0]
            self._register(entry, None)
        return entry.request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a running request (its samples leave the batch at the next step); unknown ids are
        ignored."""
        with self._lock:
            self._abort_request(request_id)

    def _abort_request(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is None:
            return
        if live.inbox is not None:
            live.inbox.pending.discard(request_id)
        for req, sample in zip(live.entry.requests, live.samples):
            self._seq_owner.pop(req.request_id, None)
            if sample.finish_reason is None:
                self._aborts.append(req.request_id)
        self._new = [r for r in self._new if r.request_id not in {q.request_id for q in live.entry.requests}]

    def _drop_abandoned(self) -> None:
        """Abort the requests of streams dropped since the last call (under the lock)."""
        while self._dropped:
            self._abort_request(self._dropped.popleft())

    def _check_open(self) -> None:
        if self._executor is None:
            raise RuntimeError("this LLM is shut down")

    def check_health(self) -> None:
        """Raise :class:`~tpspec.runtime.launchers.WorkerError` when a rank is known to be dead
        (one empty call on every rank)."""
        with self._lock:
            self._check_open()
            self._executor.call(_noop_on_rank)

    def num_requests(self) -> tuple[int, int]:
        """``(running, waiting)`` over the requests driven step by step (:meth:`add_request`,
        streams, a server's): running, those with a sample that has produced a token and not
        finished; waiting, the others (queued, or still in their prompt's prefill). Read without
        the lock (a monitoring thread never waits for a step): a snapshot, possibly a step old."""
        running = waiting = 0
        for live in list(self._live.values()):
            started = any(c is not None and s.finish_reason is None for c, s in zip(live.cached, live.samples))
            if started:
                running += 1
            elif all(s.finish_reason is None for s in live.samples):
                waiting += 1
        return running, waiting

    def has_unfinished_requests(self) -> bool:
        """Whether requests added with :meth:`add_request` are still running (a stream's or
        another ``generate`` call's requests are theirs, not counted here)."""
        with self._lock:
            self._drop_abandoned()
            return bool(self._unclaimed) or any(live.inbox is None for live in self._live.values())

    def step(self) -> list[RequestOutput]:
        """One engine step over every running request (the requests added since the last step
        join the batch). Returns one delta ``RequestOutput`` per request of :meth:`add_request`
        that changed (as ``generate(stream=True)`` yields them); a finished request is then
        forgotten. Requests of streams and ``generate`` calls advance too; their outputs go to
        their own callers."""
        with self._lock:
            self._check_open()
            self._drop_abandoned()
            ready, self._unclaimed = self._unclaimed + self._step(), []
            return ready

    def _step(self) -> list[RequestOutput]:
        """One step under the lock: outputs of stream-owned requests go to their inboxes; the
        others (add_request's) are returned."""
        self._check_open()
        new, self._new = self._new, []
        aborts, self._aborts = self._aborts, []
        updates = self._executor.call(_step_on_rank, new, aborts)[self.rank]
        now = time.time()
        changed: dict[str, list[CompletionOutput]] = {}
        prompt_logprobs: dict[str, list] = {}
        for u in updates:
            owner = self._seq_owner.get(u.request_id)
            if owner is None:  # aborted meanwhile
                continue
            live = self._live[owner[0]]
            sample = live.samples[owner[1]]
            if sample.finish_reason is not None:
                continue
            if live.cached[owner[1]] is None:  # its first update: it has started
                self._count(sample.req, u.num_cached_tokens, 0)
                live.cached[owner[1]] = u.num_cached_tokens
            self.counters.num_preemptions += u.num_preemptions - live.preemptions[owner[1]]
            live.preemptions[owner[1]] = u.num_preemptions
            if u.prompt_logprobs is not None:
                prompt_logprobs[owner[0]] = sample.decoded(u.prompt_logprobs)
            kept, text = sample.feed(u.new_token_ids)
            self.counters.generation_tokens += len(kept)
            if sample.finish_reason is not None and u.finish_reason is None:  # a stop string: leave the batch
                self._aborts.append(u.request_id)
            if u.finish_reason is not None:
                text += sample.finish(u.finish_reason)
            if u.stats is not None:
                live.stats[owner[1]] = u.stats
            logprobs = None if u.new_logprobs is None else sample.decoded(u.new_logprobs[:len(kept)])
            if logprobs is not None:
                sample.add_logprobs(logprobs, kept)
            changed.setdefault(owner[0], []).append(CompletionOutput(
                index=sample.index, text=text, token_ids=kept, cumulative_logprob=sample.cumulative_logprob,
                logprobs=logprobs, finish_reason=sample.finish_reason, stop_reason=sample.stop_reason,
                stats=live.stats[owner[1]]))
        unowned = []
        for rid, deltas in changed.items():
            live = self._live[rid]
            metrics = live.entry.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            finished = all(s.finish_reason is not None for s in live.samples)
            if finished:
                metrics.finished_time = now
                del self._live[rid]
                for req in live.entry.requests:
                    self._seq_owner.pop(req.request_id, None)
            out = RequestOutput(request_id=rid, prompt=live.entry.prompt_text,
                                prompt_token_ids=list(live.entry.prompt_ids),
                                outputs=sorted(deltas, key=lambda c: c.index), finished=finished, metrics=metrics,
                                prompt_logprobs=prompt_logprobs.get(rid),
                                num_cached_tokens=max((c for c in live.cached if c is not None), default=0))
            if live.inbox is None:
                unowned.append(out)
            else:
                live.inbox.outputs.append(out)
                if finished:
                    live.inbox.pending.discard(rid)
        return unowned

    def _count(self, req: Request, num_cached_tokens: int, num_preemptions: int) -> None:
        """A sample started (``num_cached_tokens`` of its prompt cached) and was preempted
        ``num_preemptions`` times so far: into :attr:`counters`."""
        self.counters.prompt_tokens += len(req.prompt)
        if self.config.enable_prefix_caching and req.sampling.prompt_logprobs is None:
            self.counters.prefix_cache_queries += len(req.prompt)
            self.counters.prefix_cache_hits += num_cached_tokens
        self.counters.num_preemptions += num_preemptions

    def _register(self, entry: "_Entry", inbox: "_Inbox | None") -> "_Live":
        live = _Live(entry, [_Sample(i, req, entry.params, self.tokenizer) for i, req in enumerate(entry.requests)],
                     [RequestStats() for _ in entry.requests], [None] * len(entry.requests),
                     [0] * len(entry.requests), inbox)
        self._live[entry.request_id] = live
        if inbox is not None:
            inbox.pending.add(entry.request_id)
        for i, req in enumerate(entry.requests):
            self._seq_owner[req.request_id] = (entry.request_id, i)
        self._new.extend(entry.requests)
        return live

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` dicts) or a
        list of conversations, rendered with the checkpoint's chat template (or
        ``chat_template``). Otherwise as :meth:`generate`."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for c in conversations:
            text, ids = self.render_chat(c, chat_template=chat_template, add_generation_prompt=add_generation_prompt)
            prompts.append({"prompt_token_ids": ids, "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat_prompt_ids(self, conversation: Sequence[dict], *, chat_template: str | None = None,
                        add_generation_prompt: bool = True) -> list[int]:
        """The token ids of one conversation rendered by the chat template (``ValueError`` when
        the checkpoint has no tokenizer or no template, or a message is malformed)."""
        return self.render_chat(conversation, chat_template=chat_template,
                                add_generation_prompt=add_generation_prompt)[1]

    def render_chat(self, conversation: Sequence[dict], *, chat_template: str | None = None,
                    add_generation_prompt: bool = True) -> tuple[str, list[int]]:
        """One conversation rendered by the chat template: ``(text, token ids)`` (the text is what
        a chat output's ``prompt`` holds). Errors as :meth:`chat_prompt_ids`. Uses only the
        tokenizer: safe from any thread."""
        if self.tokenizer is None:
            raise ValueError(f"chat needs a tokenizer; the model at {self.model_path!r} has none")
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise ValueError("a conversation must be a non-empty list of {'role', 'content'} messages")
        for i, m in enumerate(conversation):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"message {i} must be a dict with string 'role' and 'content', got {m!r}")
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ValueError(f"the tokenizer of {self.model_path!r} has no chat template; pass chat_template=")
        text = self.tokenizer.apply_chat_template(list(conversation), tokenize=False, chat_template=template,
                                                  add_generation_prompt=add_generation_prompt)
        return text, self._encode(text, "the conversation", add_special_tokens=False)

    def shutdown(self) -> None:
        """End the workers (idempotent; waits for a call another thread is running)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            self._finalizer()  # executor.shutdown, once
            atexit.unregister(self._finalizer)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ requests
    def _make_requests(self, prompts: Any, sampling_params: Any, *, defaults: bool = False) -> list["_Entry"]:
        """Validate every prompt and parameter, then make one :class:`Request` per sample.
        ``defaults``: the parameters are the checkpoint's defaults, whose ``max_tokens`` is cut
        to the room a prompt leaves (a ``max_tokens`` the caller set must fit it)."""
        parsed = self._prompts(prompts)
        params = self._sampling_list(sampling_params, len(parsed))
        if self.config.attention_dp and any(p.has_penalties or p.logprobs is not None or p.prompt_logprobs is not None
                                            for p in params):
            raise ValueError("penalties and logprobs are not supported with attention DP")
        if self.config.attention_dp and any(p.has_logit_controls for p in params):
            raise ValueError("logit controls (structured outputs, logit_bias, allowed_token_ids, bad_words) are not "
                             "supported with attention DP")
        controls = [self._logit_controls(sp) for sp in params]  # every grammar compiled before any request runs
        for i, ((_, ids), sp) in enumerate(zip(parsed, params)):
            if sp.n > self.config.max_batch_size:
                raise ValueError(f"n={sp.n} is more than max_num_seqs={self.config.max_batch_size}, the sequences "
                                 f"that run at once")
            if sp.max_tokens is not None and not defaults:
                where = f"prompt {i}: " if len(parsed) > 1 else ""
                check_context_length(len(ids), sp.max_tokens, self.config.max_seq_len, where)
        entries = []
        for (text, ids), sp, (grammar, bad_words) in zip(parsed, params, controls):
            stops = self._stop_ids(sp)
            room = self.config.max_seq_len - len(ids)
            budget = room if sp.max_tokens is None else min(sp.max_tokens, room)
            user_index = next(self._request_ids)
            base_seed = sp.seed
            if base_seed is None and self.seed is not None:
                base_seed = _mix_seed(self.seed, user_index)
            requests = []
            for i in range(sp.n):
                seed = base_seed if base_seed is None or i == 0 else _mix_seed(base_seed, i)
                # The samples share their prompt: the first one scores it.
                scored = sp.prompt_logprobs if i == 0 else None
                requests.append(Request(request_id=next(self._sequence_ids), prompt=tuple(ids),
                                        sampling=dataclasses.replace(sp, n=1, seed=seed, prompt_logprobs=scored),
                                        max_new_tokens=budget, stop_token_ids=stops, grammar=grammar,
                                        bad_words_token_ids=bad_words))
            entries.append(_Entry(str(user_index), text, ids, sp, requests, RequestMetrics(time.time())))
        return entries

    def _prompts(self, prompts: Any) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                and all(is_int(t) for t in prompts)):
            prompts = [prompts]
        if isinstance(prompts, (torch.Tensor, np.ndarray)) and prompts.ndim == 1:
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a string, a token-id list, a dict with 'prompt' or "
                             f"'prompt_token_ids', or a list of those; got {type(prompts).__name__}")
        out: list[tuple[str | None, list[int]]] = []
        for i, p in enumerate(prompts):
            text = None
            if isinstance(p, dict):
                unknown = sorted(set(p) - {"prompt", "prompt_token_ids"})
                if unknown or ("prompt" not in p and "prompt_token_ids" not in p):
                    raise ValueError(f"prompt {i}: a dict prompt has 'prompt' (text) or 'prompt_token_ids', "
                                     f"got keys {sorted(p)}")
                if p.get("prompt_token_ids") is not None:
                    text, p = p.get("prompt"), p["prompt_token_ids"]
                else:
                    p = p["prompt"]
            if isinstance(p, str):
                toks = self.tokenize(p, f"prompt {i}")
                text = p
            elif isinstance(p, (torch.Tensor, np.ndarray)) and p.ndim == 1 and _integer_array(p):
                toks = [int(t) for t in p.tolist()]
            elif isinstance(p, (list, tuple)) and all(is_int(t) for t in p):
                toks = [int(t) for t in p]
            else:
                raise ValueError(f"prompt {i} must be a string or a list of token ids, got {type(p).__name__}")
            self.config.check_prompt_len(len(toks), f"prompt {i}")
            bad = [t for t in toks if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.vocab_size}): {bad[:5]}")
            out.append((text, toks))
        return out

    def _sampling_list(self, sampling_params: Any, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != n:
                raise ValueError(f"got {len(sampling_params)} sampling_params for {n} prompts")
            for i, sp in enumerate(sampling_params):
                if not isinstance(sp, SamplingParams):
                    raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got {type(sp).__name__}")
            return list(sampling_params)
        raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got "
                         f"{type(sampling_params).__name__}")

    def _logit_controls(self, sp: SamplingParams) -> tuple[str | None, tuple[tuple[int, ...], ...]]:
        """``(grammar, bad words token ids)`` of one request's logit controls, every token id checked
        against the vocabulary (``ValueError`` naming the field; the ranks see nothing of a bad one)."""
        from . import structured

        for field, ids in (("logit_bias", sp.logit_bias or ()), ("allowed_token_ids", sp.allowed_token_ids or ())):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"{field}: token ids outside [0, {self.vocab_size}): {bad[:5]}")
        needs = [name for name, on in (("structured_outputs", sp.structured_outputs is not None),
                                       ("bad_words", sp.bad_words is not None)) if on]
        if needs and self.tokenizer is None:
            raise ValueError(f"{' and '.join(needs)} need a tokenizer; the model at {self.model_path!r} has none")
        bad_words = ()
        if sp.bad_words is not None:
            bad_words = structured.bad_words_token_ids(sp.bad_words, self.tokenizer, self.vocab_size)
        grammar = None
        if sp.structured_outputs is not None:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = structured.ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
            grammar = structured.compile_grammar(sp.structured_outputs, self._ll_tokenizer)
        return grammar, bad_words

    def _stop_ids(self, sp: SamplingParams) -> tuple[int, ...]:
        for t in sp.stop_token_ids:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"stop_token_ids: {t} is outside [0, {self.vocab_size})")
        stops = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            stops.update(self.eos_token_ids)
        return tuple(sorted(stops))


@dataclass
class _Entry:
    """One user request of a generate call: its prompt, parameters and one Request per sample."""

    request_id: str
    prompt_text: str | None
    prompt_ids: list[int]
    params: SamplingParams
    requests: list[Request]
    metrics: RequestMetrics


@dataclass
class _Inbox:
    """Where a stream's outputs wait for their reader: the outputs of steps run by any thread,
    and the ids of its requests still running."""

    outputs: list[RequestOutput] = dataclasses.field(default_factory=list)
    pending: set[str] = dataclasses.field(default_factory=set)


@dataclass
class _Live:
    """A request driven step by step: its entry, its samples and their engine statistics, and
    its owner (a stream's inbox; None: :meth:`LLM.step`'s caller)."""

    entry: _Entry
    samples: list["_Sample"]
    stats: list[RequestStats]
    cached: list[int | None]  # each sample's cached prompt tokens, once it has started
    preemptions: list[int]  # each sample's preemptions counted so far
    inbox: _Inbox | None = None


class _Sample:
    """The driver's view of one sample: its tokens and text as they arrive, and how it ended.
    A stop string ends it at the token that completes the string (later tokens are dropped),
    whatever the engine emitted after it."""

    def __init__(self, index: int, req: Request, params: SamplingParams, tokenizer: Any) -> None:
        self.index = index
        self.req = req
        self.params = params
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # The streamed deltas' running sum (the whole output sums its list, in the same order).
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.detok = None
        if tokenizer is not None:
            self.detok = IncrementalDetokenizer(tokenizer, req.prompt, stop=params.stop,
                                                include_stop=params.include_stop_str_in_output,
                                                skip_special_tokens=params.skip_special_tokens,
                                                min_tokens=params.min_tokens)

    @property
    def text(self) -> str:
        return self.detok.text if self.detok is not None else ""

    def feed(self, tokens: Sequence[int]) -> tuple[list[int], str]:
        """Take a step's new tokens; return the ones kept and the new text."""
        if self.finish_reason is not None:
            return [], ""
        before = len(self.text)
        kept = []
        for t in tokens:
            kept.append(int(t))
            self.token_ids.append(int(t))
            if self.detok is not None and self.detok.add(t):
                self.finish_reason, self.stop_reason = "stop", self.detok.stop_reason
                break
        return kept, self.text[before:]

    def add_logprobs(self, logprobs: list[dict[int, Logprob]], token_ids: list[int]) -> None:
        """Add the logprobs of ``token_ids`` (a delta's, in order) to :attr:`cumulative_logprob`."""
        if self.cumulative_logprob is not None:
            for entry, t in zip(logprobs, token_ids):
                self.cumulative_logprob += entry[t].logprob

    def finish(self, engine_reason: str) -> str:
        """The engine ended the sample (``"stop"`` or ``"length"``); return the text it adds."""
        if self.finish_reason is not None:
            return ""
        tail = self.detok.flush() if self.detok is not None else ""
        self.finish_reason = engine_reason
        last = self.token_ids[-1] if self.token_ids else None
        if engine_reason == "stop" and last in self.params.stop_token_ids:
            self.stop_reason = last
        return tail

    def decoded(self, logprobs: list) -> list:
        """``logprobs`` (``{token id: Logprob}`` per position, or None for a position without)
        with each entry's ``decoded_token`` (each id decoded alone, as vLLM does; left None
        without a tokenizer)."""
        if self.tokenizer is None:
            return logprobs
        return [None if entry is None else
                {t: dataclasses.replace(lp, decoded_token=self.tokenizer.decode([t])) for t, lp in entry.items()}
                for entry in logprobs]

    def output(self, stats: RequestStats, logprobs: list[dict[int, Logprob]] | None = None) -> CompletionOutput:
        """The sample as it stands; ``logprobs`` (one dict per engine token) is cut to the kept tokens."""
        cumulative = None
        if logprobs is not None:
            logprobs = self.decoded(logprobs[:len(self.token_ids)])
            cumulative = sum(entry[t].logprob for entry, t in zip(logprobs, self.token_ids))
        return CompletionOutput(index=self.index, text=self.text, token_ids=list(self.token_ids),
                                cumulative_logprob=cumulative, logprobs=logprobs, finish_reason=self.finish_reason,
                                stop_reason=self.stop_reason, stats=stats)


def _mix_seed(seed: int, index: int) -> int:
    """A 64-bit seed for stream ``index`` of ``seed`` (splitmix64 finalizer): distinct
    streams for distinct indices, the same on every run."""
    z = (seed + 0x9E3779B97F4A7C15 * (index + 1)) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
"""``generation_config.json`` keys applied as sampling defaults -> the ``SamplingParams`` field."""


def _generation_config(choice: Any, model_path: str) -> tuple[dict[str, Any], list[int]]:
    """(sampling defaults, EOS ids) from a ``generation_config.json``: ``"auto"`` reads the
    model's, ``"vllm"`` none, a directory that directory's."""
    from ..model.config import read_json

    if choice == "vllm":
        return {}, []
    if choice == "auto":
        folder = model_path
    elif isinstance(choice, (str, os.PathLike)) and os.path.isdir(choice):
        folder = os.fspath(choice)
    else:
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory, got {choice!r}")
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return {}, []
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise ValueError(f"{path} holds a JSON {type(raw).__name__}, not an object")
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    defaults = {field: raw[key] for key, field in GENERATION_CONFIG_FIELDS.items()
                if raw.get(key) is not None and field in known}
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ValueError(f"{path} has sampling defaults tpspec cannot use: {exc}") from None
    eos = raw.get("eos_token_id")
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return defaults, eos_ids

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


def check_context_length(num_prompt_tokens: int, max_tokens: int, max_model_len: int, where: str = "") -> None:
    """``ValueError`` (vLLM's wording, after ``where``) when a prompt of ``num_prompt_tokens``
    plus ``max_tokens`` generated tokens does not fit ``max_model_len``."""
    if num_prompt_tokens + max_tokens > max_model_len:
        raise ValueError(f"{where}'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
                         f"maximum context length is {max_model_len} tokens and your request has "
                         f"{num_prompt_tokens} input tokens ({max_tokens} > {max_model_len} - {num_prompt_tokens}).")


def under_torchrun() -> bool:
    """Whether this process is a rank that torchrun started (``RANK`` and ``WORLD_SIZE`` set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _integer_array(values: torch.Tensor | np.ndarray) -> bool:
    if isinstance(values, torch.Tensor):
        return not values.is_floating_point() and not values.is_complex() and values.dtype != torch.bool
    return values.dtype.kind in "iu"


def _start_engine(ctx: RankContext, config: EngineConfig) -> KVPlan:
    """On every rank: build the rank's engine (loads its shard of the weights); its KV plan (the
    same on every rank)."""
    engine = Engine(config, ctx.mapping, ctx.device)
    ctx.state["engine"] = engine
    return engine.kv


def _noop_on_rank(ctx: RankContext) -> None:
    """On every rank: nothing (a liveness check of the ranks)."""


def _step_on_rank(ctx: RankContext, new_requests: list[Request], aborts: list[int]) -> list[SequenceUpdate]:
    """On every rank: add the new sequences, drop the aborted ones, run one step (none when
    nothing is left). Every rank gets the same commands in the same order and returns the same
    updates."""
    engine = ctx.state["engine"]
    engine.add_requests(new_requests)
    engine.abort(aborts)
    return engine.step() if engine.has_unfinished else []


def _generate_on_rank(ctx: RankContext, requests: list[Request]) -> list[SequenceResult]:
    """On every rank: run the requests; every rank returns the same results."""
    return ctx.state["engine"].generate(requests, ctx.report)


def _check_layout(config: Any, tp_size: int, attention_dp: bool, path: str, deterministic: bool = False) -> None:
    """The model (a :class:`ModelConfig`) or EAGLE-3 head (an :class:`Eagle3Config`) splits over
    ``tp_size`` ranks (checked here, before any worker starts)."""
    from ..mapping import Mapping
    from ..model.eagle3 import Eagle3Config
    from ..model.llama import check_split

    for rank in range(tp_size):
        mapping = Mapping(tp_size, rank, tp_size, attention_dp)
        try:
            if isinstance(config, Eagle3Config):
                config.check_split(mapping, deterministic=deterministic)
            else:
                check_split(config, mapping, deterministic=deterministic)
        except ValueError as exc:
            raise ValueError(f"{path} cannot run at tensor_parallel_size={tp_size}: {exc}") from None


def _check_kv_fits(config: EngineConfig, model_configs: list[Any]) -> None:
    """With ``kv_cache_bytes``, the page count is known here: a request of ``max_model_len``
    tokens must fit it (``ValueError`` before any worker starts)."""
    from ..mapping import Mapping
    from ..model.batch import pages_needed
    from ..model.kv_cache import page_bytes
    from ..model.layers import split_heads
    from .kv_sizing import scratch_pages

    mapping = Mapping(config.tp_size, 0, config.tp_size, config.attention_dp)
    per_page = sum(page_bytes(c.num_layers, config.page_size,
                              split_heads(c, mapping.attention_tp_size, 0).kv_heads, c.head_dim,
                              getattr(torch, config.dtype)) for c in model_configs)
    pages = config.kv_cache_bytes // per_page - scratch_pages(config)
    need = pages_needed(config.max_seq_len - 1 + config.num_draft_tokens, config.page_size)
    if need > pages:
        raise ValueError(f"kv_cache_bytes={config.kv_cache_bytes} holds {max(pages, 0)} KV pages of {config.page_size} "
                         f"tokens ({per_page} bytes each) per rank; a request of max_model_len={config.max_seq_len} "
                         f"needs {need}: raise kv_cache_bytes or lower max_model_len")
