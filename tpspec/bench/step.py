"""``tpspec bench step``: one speculative decode step, sharded selection vs full-logit gather.

On ``--tp N`` rank processes (gloo on CPU; on CUDA, NCCL when every rank has its own GPU,
else gloo with the ranks sharing GPUs under MPS) each rank loads its shard of a model
(the tiny random Llama with ``--vocab-size`` columns, or a user checkpoint), fills the KV
cache of ``B`` requests with ``--context-len`` tokens, then times the verification step of
one-model speculative decoding: a forward of ``B x (D + 1)`` tokens (the last accepted
token plus ``D`` drafts each) and the selection of the target's tokens plus strict
acceptance, two ways:

* ``sharded``  ``SpecWorker.step``: each rank reduces its vocab slice to one key per row
               and the ranks exchange ``[rows]`` int64 keys; rows with filters exchange
               their certified candidates, gathering a row only when they cannot decide it
               (tpspec);
* ``gather``   ``VocabShardedLogits.gather()`` of the full ``[rows, vocab]`` logits, then
               the full-row sampler (``sampling.ops``) on them and the same acceptance (what
               engines that gather the logits do).

Modes (``--modes``): ``greedy``; ``sampled`` (temperature 0.8, seeded); ``top_p``
(Llama-3.1-Instruct's T = 0.6, top-p 0.9); ``defaults`` (Qwen2.5-Instruct's T = 0.7, top-p 0.8,
top-k 20, repetition penalty 1.05, every request's prompt counted for the penalty); ``rejection``
(the ``sampled`` requests verified by rejection sampling instead of strict acceptance: on the
shards, vs the same arithmetic on the gathered rows).

Both give the same tokens bit for bit, on every rank (checked: ``tokens_equal`` compares
the accepted tokens and every row's target token of both paths on all ranks). Per
(batch, mode, path) the table reports the medians over ``--iters`` steps of the forward,
the selection and their sum, the share of the step spent selecting tokens (slowest
rank), and for the sharded path the share of rows that fell back to gathering. On CPU only
the ratios mean something; absolute times are meaningful on GPUs.

Roofline (``step_roofline.json``/``.png``, :mod:`tpspec.bench.roofline`): the runtime's own
``Engine.step()`` — decode steps in greedy, ``defaults`` and ``logprobs=5`` columns, and
verification steps — at contexts ``--contexts`` and batches ``--roofline-batch`` /
``--verify-batch``, per attention backend of ``--attention-backends``, beside its floor
``(weight bytes of the rank + KV bytes the step reads) / measured copy bandwidth``, with PASS/FAIL
against the targets. ``--roofline-only`` skips the sharded-vs-gather table; ``--no-roofline`` the
roofline. The table runs in one set of rank processes, then each attention backend's roofline in
rank processes of its own (the JSON is rewritten after each; a backend that fails is named there).

``--model-shape llama-3-8b | llama-3-70b | qwen2.5-7b`` runs a real model shape with random
weights built on each rank (its shard only; bf16 on GPU); ``--num-layers`` and
``--vocab-size`` shrink it for quick checks on CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable

from . import bench_device, model_shape_path, number_list, report, roofline
from .overrides import add_set_argument, apply_overrides, parse_overrides
from .roofline import PAGE_SIZE, QWEN25_DEFAULTS

if TYPE_CHECKING:
    import torch

DEFAULT_BATCHES = (1, 8, 32)
QUICK_BATCHES = (1, 4)
DEFAULT_VOCAB = 32768
QUICK_VOCAB = 4096
MODES = ("greedy", "sampled", "top_p", "defaults", "rejection")
PATHS = ("sharded", "gather")


# ----------------------------------------------------------------------------- model

def bench_model_path(vocab_size: int) -> str:
    """The tiny random Llama of the runtime with ``vocab_size`` columns, made once in the
    tpspec cache (deterministic, no download)."""
    from ..model.tiny import make_tiny_checkpoint
    from ..runtime.llm import cache_dir

    path = os.path.join(cache_dir(), f"bench-tiny-v{vocab_size}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    make_tiny_checkpoint(tmp, seed=0, vocab_size=vocab_size, tokenizer=False)
    try:
        os.rename(tmp, path)
    except OSError:  # another process made it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path


def resolve_model(model: str, vocab_size: int) -> str:
    if model == "tiny":
        return bench_model_path(vocab_size)
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise SystemExit(f"tpspec bench step: {model!r} is not a Hugging Face model directory (no config.json)")
    return model


# ---------------------------------------------------------------------------- worker

def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mode_params(mode: str, index: int) -> Any:
    """The ``SamplingParams`` of request ``index`` under ``mode`` (see the module docstring)."""
    from ..sampling.params import SamplingParams

    seed = 1000 + index
    if mode == "greedy":
        return SamplingParams(temperature=0.0)
    if mode in ("sampled", "rejection"):
        return SamplingParams(temperature=0.8, seed=seed)
    if mode == "top_p":
        return SamplingParams(temperature=0.6, top_p=0.9, seed=seed)
    return SamplingParams(**QWEN25_DEFAULTS, seed=seed)


def _gather_select(logits: Any, meta: Any, drafts: torch.Tensor, greedy: bool) -> torch.Tensor:
    """The baseline: all-gather the full logits (penalised first where asked), pick on them,
    accept strictly. Returns the accepted tokens ``[B, D+1]`` flattened, then the target
    token of every row ``[R]``."""
    import torch

    from ..sampling.ops import greedy_tokens, sample_from_logits
    from ..sampling.penalties import penalized_logits
    from ..speculative import accept_from_targets

    rs = meta.row_sampling(draft_tokens=drafts)
    full = penalized_logits(logits, rs.penalties).gather()
    if greedy:
        rows = greedy_tokens(full)
    else:
        rows = sample_from_logits(full, rs.temperature, rs.seeds, rs.offsets, rs.top_k, rs.top_p, rs.min_p)
    index = meta.request_row_index.to(full.device)
    accepted, _ = accept_from_targets(rows[index], drafts, meta.request_draft_len.to(full.device))
    return torch.cat([accepted.reshape(-1), rows])


def _gather_reject(logits: Any, meta: Any, drafts: torch.Tensor) -> torch.Tensor:
    """The rejection baseline: all-gather the full logits, then the same rejection sampling on
    the whole rows locally. Returns the accepted tokens ``[B, D+1]`` flattened, then their counts."""
    import torch

    from ..exchange.local import LocalKeyExchange
    from ..speculative import sharded_rejection_sample
    from ..vocab_parallel import VocabShardedLogits

    full = logits.gather()
    whole = VocabShardedLogits(full, 0, logits.vocab_size, LocalKeyExchange(full.device))
    offsets = meta.request_offsets
    accepted, num = sharded_rejection_sample(
        whole, meta.request_row_index.to(full.device), meta.request_sampling(offsets).temperature, drafts,
        meta.request_draft_len, meta.request_seeds, offsets)
    return torch.cat([accepted.reshape(-1), num])


def _sharded_select(worker: Any, logits: Any, meta: Any, drafts: torch.Tensor) -> torch.Tensor:
    """tpspec's path, returning what :func:`_gather_select` (or :func:`_gather_reject`) returns
    (random drafts are rarely accepted, so the per-row target tokens carry most of the comparison)."""
    import torch

    out = worker.step(logits, drafts, meta)
    return torch.cat([out.accepted_tokens.reshape(-1),
                      out.target_tokens if worker.acceptance == "strict" else out.num_accepted])


def _step_worker(rank: int, world_size: int, cfg: dict) -> list[dict]:
    """On every rank: the sharded-vs-gather table (its own model), then the roofline cells (the
    runtime's engines, built after that model is gone)."""
    import torch

    apply_overrides(cfg["overrides"])  # before anything reads them (this is a fresh process)
    if cfg["device"] == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    records = []
    if cfg["step_table"]:
        with torch.inference_mode():
            records = _step_table(rank, world_size, cfg, device)
    cells = roofline.roofline_cells(rank, world_size, cfg, device) if cfg["roofline"] else []
    return records + cells


def _step_table(rank: int, world_size: int, cfg: dict, device: torch.device) -> list[dict]:
    """The sharded-vs-gather cells of this rank (run under ``torch.inference_mode``)."""
    import torch

    from .. import distributed as D
    from ..exchange import make_key_exchange
    from ..mapping import Mapping
    from ..model import ForwardBatch, load_model
    from ..sampling.penalties import OccurrenceCounts
    from ..sampling.select import SamplingStats
    from ..speculative import RequestEntry, SpecMetadata, SpecWorker
    from ..validation import torch_dtype

    dtype = torch_dtype(cfg["dtype"])
    exchange = make_key_exchange(D.tp_group(), prefer=cfg["exchange"], device=device)
    model = load_model(cfg["model"], Mapping(world_size, rank), device=device, dtype=dtype, exchange=exchange)
    vocab = model.config.vocab_size
    draft_len, context_len = cfg["draft_len"], cfg["context_len"]
    max_batch = max(cfg["batches"])
    per_seq = -(-(context_len + draft_len + 1) // PAGE_SIZE)
    model.allocate_kv_cache(max_batch * per_seq, PAGE_SIZE)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(max_batch)]
    gen = torch.Generator().manual_seed(1234)
    workers = {"strict": SpecWorker("strict", forced=None), "rejection": SpecWorker("rejection", forced=None)}
    records: list[dict] = []

    def timed(fn: Callable[[], Any]) -> float:
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        return (time.perf_counter() - start) * 1e3

    for batch in cfg["batches"]:
        # Fill every request's cache with its context (one prefill forward, not timed).
        prompt = torch.randint(3, vocab, (batch * context_len,), generator=gen)
        model(ForwardBatch(prompt.to(device), torch.arange(context_len).repeat(batch).to(device),
                           tables[:batch], [0] * batch, [context_len] * batch))
        step_tokens = torch.randint(3, vocab, (batch * (draft_len + 1),), generator=gen)
        step = ForwardBatch(step_tokens.to(device),
                            torch.arange(context_len, context_len + draft_len + 1).repeat(batch).to(device),
                            tables[:batch], [context_len] * batch, [draft_len + 1] * batch,
                            logits_rows=torch.arange(batch * (draft_len + 1)).to(device))
        drafts = torch.randint(3, vocab, (batch, draft_len), generator=gen).to(device)
        head = model.lm_head
        counts = OccurrenceCounts(batch, vocab_offset=head.vocab_offset, width=head.shard_width, device=device)
        for slot in range(batch):  # the penalties of the defaults mode count each request's prompt
            counts.reset(slot, prompt[slot * context_len:(slot + 1) * context_len])
        for mode in cfg["modes"]:
            greedy = mode == "greedy"
            requests = [RequestEntry(i, i, mode_params(mode, i), False) for i in range(batch)]
            worker = workers["rejection" if mode == "rejection" else "strict"]
            for path in PATHS:
                meta = SpecMetadata(batch, draft_len, device=device, occurrences=counts)
                worker.sampling_stats = SamplingStats()
                forward_ms, select_ms, outputs = [], [], []
                for it in range(cfg["warmup"] + cfg["iters"]):
                    meta.prepare(requests, draft_len)  # host bookkeeping both paths share: not timed
                    box: dict[str, Any] = {}
                    f_ms = timed(lambda: box.__setitem__("logits", model(step)))
                    if path == "sharded":
                        s_ms = timed(lambda: box.__setitem__("out", _sharded_select(worker, box["logits"], meta,
                                                                                    drafts)))
                    elif mode == "rejection":
                        s_ms = timed(lambda: box.__setitem__("out", _gather_reject(box["logits"], meta, drafts)))
                    else:
                        s_ms = timed(lambda: box.__setitem__("out", _gather_select(box["logits"], meta, drafts,
                                                                                   greedy)))
                    if it >= cfg["warmup"]:
                        forward_ms.append(f_ms)
                        select_ms.append(s_ms)
                    if it == 0:
                        outputs.append(box["out"].cpu())
                st = worker.sampling_stats
                drawn = st.rows_sharded + st.rows_gathered
                records.append({
                    "batch": batch, "mode": mode, "path": path, "rows": batch * (draft_len + 1),
                    "forward_ms": statistics.median(forward_ms), "select_ms": statistics.median(select_ms),
                    "first_output": outputs[0],
                    "gathered_pct": 100.0 if path == "gather" else (100.0 * st.rows_gathered / drawn if drawn else 0.0),
                })
    exchange.close()
    return [dict(r, kind="step") for r in records]


# --------------------------------------------------------------------------- summary

def summarize(per_rank: list[list[dict]], draft_len: int) -> tuple[list[list[Any]], dict]:
    """Table rows (slowest rank per cell) and a dict of ``tokens_equal`` per (batch, mode)."""
    import torch

    per_rank = [[r for r in records if r.get("kind", "step") == "step"] for records in per_rank]
    rows: list[list[Any]] = []
    equal: dict[str, bool] = {}
    by_cell: dict[tuple, dict] = {}
    outputs: dict[tuple[int, str], list[torch.Tensor]] = {}
    for records in per_rank:
        for rec in records:
            outputs.setdefault((rec["batch"], rec["mode"]), []).append(rec["first_output"])
    for i, rec in enumerate(per_rank[0]):
        forward = max(r[i]["forward_ms"] for r in per_rank)
        select = max(r[i]["select_ms"] for r in per_rank)
        gathered = max(r[i].get("gathered_pct", 0.0) for r in per_rank)
        by_cell[(rec["batch"], rec["mode"], rec["path"])] = {"forward": forward, "select": select, "gathered": gathered,
                                                            "out": rec["first_output"], "rows": rec["rows"]}
    for (batch, mode, path), cell in by_cell.items():
        other = by_cell[(batch, mode, "gather" if path == "sharded" else "sharded")]
        step = cell["forward"] + cell["select"]
        speedup = other["select"] / cell["select"] if path == "sharded" and cell["select"] > 0 else None
        rows.append([batch, draft_len, cell["rows"], mode, path, round(cell["forward"], 4), round(cell["select"], 4),
                     round(step, 4), round(100.0 * cell["select"] / step, 2) if step > 0 else 0.0,
                     round(speedup, 3) if speedup is not None else "-", round(cell["gathered"], 2)])
        # Both paths, on every rank: the same accepted tokens and per-row target tokens.
        equal[f"B={batch} {mode}"] = all(torch.equal(cell["out"], out) for out in outputs[(batch, mode)])
    return rows, equal


COLUMNS = ["batch", "draft_len", "rows", "mode", "path", "forward_ms", "select_ms", "step_ms", "select_share_%",
           "select_speedup", "gathered_rows_%"]


def _plot(rows: list[list[Any]]) -> Callable[[Any], None]:
    def draw(ax: Any) -> None:
        labels, forward, select, colors = [], [], [], []
        for r in rows:
            labels.append(f"B={r[0]}\n{r[3]}\n{r[4]}")
            forward.append(r[5])
            select.append(r[6])
            colors.append("tab:green" if r[4] == "sharded" else "tab:red")
        x = range(len(rows))
        ax.bar(x, forward, color="lightgray", label="forward")
        ax.bar(x, select, bottom=forward, color=colors, label="token selection (green: sharded, red: gather)")
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel("ms per step (median, slowest rank)")
        ax.set_title("one speculative decode step: sharded selection vs full-logit gather")
        ax.legend(fontsize=8)

    return draw


# ------------------------------------------------------------------------------- CLI

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="'tiny' (random Llama, --vocab-size columns) or a HF directory")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help=f"vocabulary of the tiny model (default {DEFAULT_VOCAB}; --quick {QUICK_VOCAB})")
    parser.add_argument("--tp", type=int, default=2, help="rank processes (default 2)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    parser.add_argument("--dtype", default="auto", help="auto (bfloat16 on cuda, float32 on cpu), float32, bfloat16")
    parser.add_argument("--batch", default=None, help=f"comma-separated request counts (default {DEFAULT_BATCHES})")
    parser.add_argument("--draft-len", type=int, default=3, help="drafts per request (default 3)")
    parser.add_argument("--context-len", type=int, default=None, help="tokens already cached per request")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated: greedy, sampled (T=0.8), top_p (T=0.6, top-p 0.9), defaults (Qwen2.5's "
                             "T=0.7, top-p 0.8, top-k 20, repetition penalty 1.05), rejection (the sampled requests "
                              "verified by rejection sampling); default all")
    parser.add_argument("--exchange", choices=("auto", "ll", "allgather"), default="auto")
    parser.add_argument("--iters", type=int, default=None,
                        help="timed steps per cell (default 20 on cuda, 5 on cpu; --quick 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; --quick 1)")
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds on CPU")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks are killed")
    add_roofline_arguments(parser)
    add_set_argument(parser)


def run(args: argparse.Namespace) -> int:
    from ..testing import rank_backend, run_ranks, shared_gpu_mps
    from ..validation import resolve_dtype

    overrides = parse_overrides(args.set, option="tpspec bench step: --set")
    apply_overrides(overrides)
    device = bench_device(args.device, "tpspec bench step")
    if args.tp < 1 or args.draft_len < 1:
        raise SystemExit("tpspec bench step: --tp and --draft-len must be >= 1")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise SystemExit(f"tpspec bench step: --modes must name some of {MODES}, got {args.modes!r}")
    if args.roofline_only and args.no_roofline:
        raise SystemExit("tpspec bench step: --roofline-only and --no-roofline leave nothing to run")
    if args.profile and args.no_roofline:
        raise SystemExit("tpspec bench step: --profile profiles the roofline's cells; it cannot go with --no-roofline")
    try:
        dtype = resolve_dtype(args.dtype, device)
    except ValueError as exc:
        raise SystemExit(f"tpspec bench step: --dtype: {exc}") from None
    vocab = args.vocab_size or (QUICK_VOCAB if args.quick else DEFAULT_VOCAB)
    cfg = {
        "model": _model_path(args, vocab),
        "device": device,
        "dtype": dtype,
        "step_table": not args.roofline_only,
        "batches": number_list(args.batch, QUICK_BATCHES if args.quick else DEFAULT_BATCHES,
                               option="tpspec bench step: --batch"),
        "draft_len": args.draft_len,
        "context_len": args.context_len or (16 if args.quick else 128),
        "modes": modes,
        "exchange": args.exchange,
        # The CPU reference of the Gumbel noise is slow (Philox in int64 tensor ops): fewer steps there.
        "iters": args.iters or (3 if args.quick else (20 if device == "cuda" else 5)),
        "warmup": args.warmup if args.warmup is not None else (1 if args.quick else 3),
        "overrides": overrides,
        **roofline_config(args, device),
    }
    if cfg["iters"] < 1 or cfg["warmup"] < 0:
        raise SystemExit("tpspec bench step: --iters must be >= 1 and --warmup >= 0")
    from ..model.shapes import config_from_path

    model_config = config_from_path(cfg["model"])
    if cfg["roofline"]:
        longest = max(cfg["contexts"]) + 2 + (roofline.cell_steps(cfg) + 1) * (args.draft_len + 1)
        if longest > model_config.max_position_embeddings:
            raise SystemExit(f"tpspec bench step: --contexts up to {max(cfg['contexts'])} need {longest} positions, "
                             f"the model has {model_config.max_position_embeddings}")
    backend = rank_backend(device, args.tp)
    meta = {
        "command": "tpspec bench step", "tp": args.tp, "device": device, "dtype": dtype, "model": args.model,
        "model_path": cfg["model"], "vocab_size": model_config.vocab_size,
        "draft_len": args.draft_len, "iters": cfg["iters"], "warmup": cfg["warmup"], "backend": backend,
        "exchange": args.exchange, "quick": args.quick, "overrides": overrides,
    }
    equal: dict[str, bool] = {}
    failed: dict[str, str] = {}
    with shared_gpu_mps(device, args.tp) as mps_note:
        meta["mps"] = mps_note or ("running" if device == "cuda" and backend == "gloo" else None)
        if cfg["step_table"]:
            per_rank = run_ranks(_step_worker, args.tp, dict(cfg, roofline=False), backend=backend,
                                 timeout_s=args.timeout)
            rows, equal = summarize(per_rank, args.draft_len)
            table_meta = dict(meta, context_len=cfg["context_len"], tokens_equal=equal,
                              note="medians over iters, slowest rank; select = token selection + strict acceptance "
                                   "(rejection mode: rejection sampling). On CPU only ratios are meaningful.")
            report.write_report(args.out, "step", columns=COLUMNS, rows=rows, meta=table_meta, plot=_plot(rows))
        if cfg["roofline"]:
            failed = _run_roofline(args, cfg, meta, backend)
    if not all(equal.values()):
        print(f"error: sharded and gather paths picked different tokens: {equal}")
        return 1
    if failed:
        print(f"error: the roofline failed for attention backend(s) {', '.join(failed)} (see the JSON's 'failed')")
        return 1
    return 0


def _run_roofline(args: argparse.Namespace, cfg: dict, meta: dict, backend: str) -> dict[str, str]:
    """The roofline, one attention backend after the other, each in rank processes of its own (a
    backend that fails, even with a broken CUDA context, leaves the others' rows), the JSON
    rewritten after each. Returns ``{backend: error}`` of those that failed."""
    from ..testing import RankError, run_ranks

    per_rank: list[list[dict]] = [[] for _ in range(args.tp)]
    failed: dict[str, str] = {}
    for name in cfg["attention_backends"]:
        one = dict(cfg, step_table=False, attention_backends=[name])
        try:
            results = run_ranks(_step_worker, args.tp, one, backend=backend, timeout_s=args.timeout)
        except RankError as exc:
            failed[name] = str(exc)
            print(f"attention backend {name!r}: the roofline failed: {exc}")
        else:
            per_rank = [mine + new for mine, new in zip(per_rank, results)]
        roofline_meta = dict(meta, contexts=cfg["contexts"], roofline_batches=cfg["roofline_batches"],
                             verify_batches=cfg["verify_batches"], columns=list(cfg["columns"]),
                             attention_backends=cfg["attention_backends"], cuda_graphs=cfg["graphs"], failed=failed,
                             profile_dir=cfg["profile_dir"])
        roofline.write_roofline_report(args.out, roofline.roofline_rows(per_rank), roofline_meta)
    return failed


# -------------------------------------------------------------------------- roofline

def add_roofline_arguments(parser: argparse.ArgumentParser) -> None:
    from ..model.shape_table import MODEL_SHAPES  # torch-free: --help imports no torch

    def listed(values: tuple) -> str:
        return ",".join(map(str, values))

    parser.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default=None,
                        help="a real model shape with random weights built on each rank (instead of --model)")
    parser.add_argument("--num-layers", type=int, default=None, help="with --model-shape: fewer layers (quick checks)")
    parser.add_argument("--contexts", default=None,
                        help=f"roofline contexts: cached tokens a request (default {listed(roofline.ROOFLINE_CONTEXTS)}"
                             f"; --quick {listed(roofline.QUICK_ROOFLINE_CONTEXTS)})")
    parser.add_argument("--roofline-batch", default=None,
                        help=f"roofline decode batch sizes (default {listed(roofline.ROOFLINE_BATCHES)}; --quick "
                             f"{listed(roofline.QUICK_ROOFLINE_BATCHES)})")
    parser.add_argument("--verify-batch", default=None,
                        help=f"roofline verification batch sizes, --draft-len drafts a request (default "
                             f"{listed(roofline.VERIFY_BATCHES)}; --quick {listed(roofline.QUICK_VERIFY_BATCHES)}; "
                             f"'none': no verification rows)")
    parser.add_argument("--roofline-columns", default=",".join(roofline.COLUMNS),
                        help="roofline decode columns: greedy, defaults (Qwen2.5's sampling defaults on every "
                             "request), logprobs (greedy, logprobs=5); default all")
    parser.add_argument("--attention-backends", default="auto",
                        help="comma-separated attention backends the roofline runs side by side (any the runtime's "
                             "attention_backend accepts; default auto: the runtime's pick)")
    parser.add_argument("--roofline-only", action="store_true", help="skip the sharded-vs-gather table")
    parser.add_argument("--no-roofline", action="store_true", help="skip the roofline table")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="roofline engines without CUDA graphs")
    parser.add_argument("--profile", action="store_true",
                        help=f"after each roofline cell's timed steps, run {roofline.PROFILE_STEPS} more under "
                             "torch.profiler: every rank writes each kernel's device time a step (on CPU: each "
                             "operator's CPU time) to OUT/profile/rank<R>-<backend>-<step>-c<context>-b<batch>-"
                             "<column>.json and its largest to a .txt beside it")


def _model_path(args: argparse.Namespace, vocab: int) -> str:
    path = model_shape_path(args, "tpspec bench step")
    if path is None and args.num_layers is not None:
        raise SystemExit("tpspec bench step: --num-layers needs --model-shape")
    return resolve_model(args.model, vocab) if path is None else path


def roofline_config(args: argparse.Namespace, device: str) -> dict:
    """The roofline part of the rank config (``SystemExit`` naming a bad option)."""
    columns = [c.strip() for c in args.roofline_columns.split(",") if c.strip()]
    if not columns or any(c not in roofline.COLUMNS for c in columns) or len(set(columns)) != len(columns):
        raise SystemExit(f"tpspec bench step: --roofline-columns must name some of {roofline.COLUMNS}, "
                         f"got {args.roofline_columns!r}")
    backends = [b.strip() for b in args.attention_backends.split(",") if b.strip()]
    if not backends or len(set(backends)) != len(backends):
        raise SystemExit(f"tpspec bench step: --attention-backends: expected distinct names, got "
                         f"{args.attention_backends!r}")
    for name in backends:
        error = roofline.attention_backend_error(name, device)
        if error is not None:
            raise SystemExit(f"tpspec bench step: --attention-backends: {error}")
    if args.verify_batch == "none":
        verify: list[int] = []
    else:
        verify = number_list(args.verify_batch, roofline.QUICK_VERIFY_BATCHES if args.quick
                             else roofline.VERIFY_BATCHES, option="tpspec bench step: --verify-batch")
    return {
        "roofline": not args.no_roofline,
        "roofline_batches": number_list(args.roofline_batch, roofline.QUICK_ROOFLINE_BATCHES if args.quick
                                        else roofline.ROOFLINE_BATCHES, option="tpspec bench step: --roofline-batch"),
        "verify_batches": verify,
        "contexts": number_list(args.contexts, roofline.QUICK_ROOFLINE_CONTEXTS if args.quick
                                else roofline.ROOFLINE_CONTEXTS, option="tpspec bench step: --contexts"),
        "columns": [c for c in roofline.COLUMNS if c in columns],
        "attention_backends": backends,
        "graphs": device == "cuda" and not args.no_cuda_graphs,
        "profile_dir": os.path.join(args.out, "profile") if args.profile else None,
    }
