"""``tpspec bench step``: one speculative decode step, sharded selection vs full-logit gather.

On ``--tp N`` rank processes (gloo on CPU; on CUDA, NCCL when every rank has its own GPU,
else gloo with the ranks sharing GPUs under MPS) each rank loads its shard of a model
(the tiny random Llama with ``--vocab-size`` columns, or a user checkpoint), fills the KV
cache of ``B`` requests with ``--context-len`` tokens, then times the verification step of
one-model speculative decoding: a forward of ``B x (D + 1)`` tokens (the last accepted
token plus ``D`` drafts each) and the selection of the target's tokens plus strict
acceptance, two ways:

* ``sharded``  ``SpecWorker.step``: each rank reduces its vocab slice to one key per row
               and the ranks exchange ``[rows]`` int64 keys (tpspec);
* ``gather``   ``VocabShardedLogits.gather()`` of the full ``[rows, vocab]`` logits, then
               argmax / Gumbel sampling on them and the same acceptance (what engines that
               gather the logits do).

Both give the same tokens bit for bit, on every rank (checked: ``tokens_equal`` compares
the accepted tokens and every row's target token of both paths on all ranks). Per
(batch, mode, path) the table reports the medians over ``--iters`` steps of the forward,
the selection and their sum, and the share of the step spent selecting tokens (slowest
rank). On CPU only the ratios mean something; absolute times are meaningful on GPUs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable

import torch

from ..validation import resolve_dtype, torch_dtype
from . import bench_device, number_list, report

DEFAULT_BATCHES = (1, 8, 32)
QUICK_BATCHES = (1, 4)
DEFAULT_VOCAB = 32768
QUICK_VOCAB = 4096
MODES = ("greedy", "sampled")
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
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gather_select(logits: Any, meta: Any, drafts: torch.Tensor, greedy: bool) -> torch.Tensor:
    """The baseline: all-gather the full logits, pick on them, accept strictly. Returns the
    accepted tokens ``[B, D+1]`` flattened, then the target token of every row ``[R]``."""
    from ..sampling.ops import greedy_tokens, sample_from_logits
    from ..speculative import accept_from_targets

    full = logits.gather()
    if greedy:
        rows = greedy_tokens(full)
    else:
        rs = meta.row_sampling()
        rows = sample_from_logits(full, rs.temperature, rs.seeds, rs.offsets, rs.top_k, rs.top_p, rs.min_p)
    index = meta.request_row_index.to(full.device)
    accepted, _ = accept_from_targets(rows[index], drafts, meta.request_draft_len.to(full.device))
    return torch.cat([accepted.reshape(-1), rows])


def _sharded_select(worker: Any, logits: Any, meta: Any, drafts: torch.Tensor) -> torch.Tensor:
    """tpspec's path, returning what :func:`_gather_select` returns (random drafts are
    rarely accepted, so the per-row target tokens carry most of the comparison)."""
    out = worker.step(logits, drafts, meta)
    return torch.cat([out.accepted_tokens.reshape(-1), out.target_tokens])


@torch.inference_mode()
def _step_worker(rank: int, world_size: int, cfg: dict) -> list[dict]:
    from .. import distributed as D
    from ..exchange import make_key_exchange
    from ..mapping import Mapping
    from ..model import ForwardBatch, load_model
    from ..sampling.params import SamplingParams
    from ..speculative import SpecMetadata, SpecWorker

    if cfg["device"] == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dtype = torch_dtype(cfg["dtype"])
    exchange = make_key_exchange(D.tp_group(), prefer=cfg["exchange"], device=device)
    model = load_model(cfg["model"], Mapping(world_size, rank), device=device, dtype=dtype, exchange=exchange)
    vocab = model.config.vocab_size
    draft_len, context_len = cfg["draft_len"], cfg["context_len"]
    max_batch = max(cfg["batches"])
    model.allocate_kv_cache(max_batch, context_len + draft_len + 2)
    gen = torch.Generator().manual_seed(1234)
    worker = SpecWorker("strict", forced=None)
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
                           list(range(batch)), [0] * batch, [context_len] * batch))
        step_tokens = torch.randint(3, vocab, (batch * (draft_len + 1),), generator=gen)
        step = ForwardBatch(step_tokens.to(device),
                            torch.arange(context_len, context_len + draft_len + 1).repeat(batch).to(device),
                            list(range(batch)), [context_len] * batch, [draft_len + 1] * batch,
                            logits_rows=torch.arange(batch * (draft_len + 1)).to(device))
        drafts = torch.randint(3, vocab, (batch, draft_len), generator=gen).to(device)
        for mode in cfg["modes"]:
            greedy = mode == "greedy"
            params = [SamplingParams() if greedy else SamplingParams(temperature=0.8, seed=1000 + i)
                      for i in range(batch)]
            requests = [(i, i, params[i], False) for i in range(batch)]
            for path in PATHS:
                meta = SpecMetadata(batch, draft_len, device=device)
                forward_ms, select_ms, outputs = [], [], []
                for it in range(cfg["warmup"] + cfg["iters"]):
                    meta.prepare(requests, draft_len)  # host bookkeeping both paths share: not timed
                    box: dict[str, Any] = {}
                    f_ms = timed(lambda: box.__setitem__("logits", model(step)))
                    if path == "sharded":
                        s_ms = timed(lambda: box.__setitem__("out", _sharded_select(worker, box["logits"], meta,
                                                                                    drafts)))
                    else:
                        s_ms = timed(lambda: box.__setitem__("out", _gather_select(box["logits"], meta, drafts,
                                                                                   greedy)))
                    if it >= cfg["warmup"]:
                        forward_ms.append(f_ms)
                        select_ms.append(s_ms)
                    if it == 0:
                        outputs.append(box["out"].cpu())
                records.append({
                    "batch": batch, "mode": mode, "path": path, "rows": batch * (draft_len + 1),
                    "forward_ms": statistics.median(forward_ms), "select_ms": statistics.median(select_ms),
                    "first_output": outputs[0],
                })
    exchange.close()
    return records


# --------------------------------------------------------------------------- summary

def summarize(per_rank: list[list[dict]], draft_len: int) -> tuple[list[list[Any]], dict]:
    """Table rows (slowest rank per cell) and a dict of ``tokens_equal`` per (batch, mode)."""
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
        by_cell[(rec["batch"], rec["mode"], rec["path"])] = {"forward": forward, "select": select,
                                                            "out": rec["first_output"], "rows": rec["rows"]}
    for (batch, mode, path), cell in by_cell.items():
        other = by_cell[(batch, mode, "gather" if path == "sharded" else "sharded")]
        step = cell["forward"] + cell["select"]
        speedup = other["select"] / cell["select"] if path == "sharded" and cell["select"] > 0 else None
        rows.append([batch, draft_len, cell["rows"], mode, path, round(cell["forward"], 4), round(cell["select"], 4),
                     round(step, 4), round(100.0 * cell["select"] / step, 2) if step > 0 else 0.0,
                     round(speedup, 3) if speedup is not None else "-"])
        # Both paths, on every rank: the same accepted tokens and per-row target tokens.
        equal[f"B={batch} {mode}"] = all(torch.equal(cell["out"], out) for out in outputs[(batch, mode)])
    return rows, equal


COLUMNS = ["batch", "draft_len", "rows", "mode", "path", "forward_ms", "select_ms", "step_ms", "select_share_%",
           "select_speedup"]


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
    parser.add_argument("--modes", default="greedy,sampled", help="greedy, sampled (temperature 0.8, seeded)")
    parser.add_argument("--exchange", choices=("auto", "ll", "allgather"), default="auto")
    parser.add_argument("--iters", type=int, default=None,
                        help="timed steps per cell (default 20 on cuda, 5 on cpu; --quick 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; --quick 1)")
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds on CPU")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks are killed")


def run(args: argparse.Namespace) -> int:
    from ..testing import rank_backend, run_ranks, shared_gpu_mps

    device = bench_device(args.device, "tpspec bench step")
    if args.tp < 1 or args.draft_len < 1:
        raise SystemExit("tpspec bench step: --tp and --draft-len must be >= 1")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise SystemExit(f"tpspec bench step: --modes must name some of {MODES}, got {args.modes!r}")
    try:
        dtype = resolve_dtype(args.dtype, device)
    except ValueError as exc:
        raise SystemExit(f"tpspec bench step: --dtype: {exc}") from None
    vocab = args.vocab_size or (QUICK_VOCAB if args.quick else DEFAULT_VOCAB)
    cfg = {
        "model": resolve_model(args.model, vocab),
        "device": device,
        "dtype": dtype,
        "batches": number_list(args.batch, QUICK_BATCHES if args.quick else DEFAULT_BATCHES,
                               option="tpspec bench step: --batch"),
        "draft_len": args.draft_len,
        "context_len": args.context_len or (16 if args.quick else 128),
        "modes": modes,
        "exchange": args.exchange,
        # The CPU reference of the Gumbel noise is slow (Philox in int64 tensor ops): fewer steps there.
        "iters": args.iters or (3 if args.quick else (20 if device == "cuda" else 5)),
        "warmup": args.warmup if args.warmup is not None else (1 if args.quick else 3),
    }
    backend = rank_backend(device, args.tp)
    with shared_gpu_mps(device, args.tp) as mps_note:
        per_rank = run_ranks(_step_worker, args.tp, cfg, backend=backend, timeout_s=args.timeout)
    rows, equal = summarize(per_rank, args.draft_len)
    from ..model.config import ModelConfig

    meta = {
        "command": "tpspec bench step", "tp": args.tp, "device": device, "dtype": dtype, "model": args.model,
        "model_path": cfg["model"], "vocab_size": ModelConfig.from_pretrained(cfg["model"]).vocab_size,
        "draft_len": args.draft_len, "context_len": cfg["context_len"], "iters": cfg["iters"],
        "warmup": cfg["warmup"], "backend": backend, "exchange": args.exchange, "quick": args.quick,
        "tokens_equal": equal, "mps": mps_note or ("running" if device == "cuda" and backend == "gloo" else None),
        "note": "medians over iters, slowest rank; select = token selection + strict acceptance. "
                "On CPU only ratios are meaningful.",
    }
    report.write_report(args.out, "step", columns=COLUMNS, rows=rows, meta=meta, plot=_plot(rows))
    if not all(equal.values()):
        print(f"error: sharded and gather paths picked different tokens: {equal}")
        return 1
    return 0
