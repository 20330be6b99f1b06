"""``tpspec bench attention``: the paged attention backends alone, at a model's attention shapes.

For every backend (``--backends``, default ``torch,triton``), batch size (``--batch``, default
1,8,32,64), context (``--context``, default 1024,4096) and query rows per sequence
(``--query-len``, default 1 = decode; 4 = verification of 3 drafts), one step's attention: every
sequence holds ``context`` tokens in scattered pages of ``--page-size`` tokens, the last
``query_len`` of them this step's new ones (its last row sees all ``context``). The heads are the shape's (``--model-shape``, default
llama-3-8b: 32 query heads, 8 KV heads, head size 128) divided by ``--tp``.

On CUDA each configuration is one CUDA graph of the attention of ``layers`` layers, each over its
own KV pages, enough of them (at most 32) that the step reads more than the L2 cache holds; the
page table is as wide as a graphed engine step's (the next power of two of the pages a sequence
reads). The table reports microseconds per layer, the KV bytes a layer reads over that time
(``kv_GBps``), that as a share of the device-to-device copy bandwidth measured in the same run,
and each row's speed-up over the torch backend's row of the same configuration. ``num_splits``
is the KV splits a query block of the triton backend's launch: its own choice
(:func:`~tpspec.model.paged_attention_triton.plan_launch`), or each of ``--num-splits`` in a row
of its own. On CPU (a smoke run; ``triton`` only under ``TRITON_INTERPRET=1``) the steps run
eagerly and the times mean little.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from . import bench_device, number_list, report, seconds_per_call
from .overrides import add_set_argument, apply_overrides, parse_overrides

if TYPE_CHECKING:
    import torch

COLUMNS = ["backend", "batch", "context", "query_len", "num_splits", "layers", "us_per_layer", "kv_GBps",
           "pct_copy_bw", "speedup_vs_torch"]
L2_BYTES = 256 << 20  # several times the L2 of current GPUs: the layers of one graph read more than this
MAX_LAYERS = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..model.shape_table import MODEL_SHAPES  # torch-free: --help imports no torch

    parser.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="llama-3-8b",
                        help="the attention heads of this shape (default llama-3-8b)")
    parser.add_argument("--tp", type=int, default=1, help="heads of one rank at this TP size (default 1)")
    parser.add_argument("--backends", default="torch,triton",
                        help="comma-separated, of torch, triton, flashinfer (default torch,triton)")
    parser.add_argument("--batch", default=None, help="sequences per step (default 1,8,32,64)")
    parser.add_argument("--context", default=None,
                        help="tokens per sequence, the new ones included (default 1024,4096)")
    parser.add_argument("--query-len", default=None, help="new tokens per sequence (default 1; 4 = 3 drafts)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    parser.add_argument("--iters", type=int, default=20, help="timed graph replays per configuration (default 20)")
    parser.add_argument("--num-splits", default=None,
                        help="comma-separated KV split counts the triton backend launches with, a row each "
                             "(default: its own choice)")
    add_set_argument(parser)


def _step(backend_name: str, *, batch: int, context: int, query_len: int, page_size: int, heads: int,
          kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, iters: int,
          num_splits: int | None = None) -> dict[str, Any]:
    import torch

    from ..model.attention import make_attention_backend, triton_kernels
    from ..model.batch import AttentionMetadata, ForwardBatch, pages_needed
    from ..model.kv_cache import KVPages
    from ..runtime.cuda_graphs import page_bucket

    kv_len = context
    per_seq = pages_needed(kv_len, page_size)
    num_pages = batch * per_seq + 1
    elem = torch.empty((), dtype=dtype).element_size()
    layer_bytes = 2 * batch * kv_len * kv_heads * head_dim * elem  # K and V a layer's step reads
    on_cuda = device.type == "cuda"
    layers = min(MAX_LAYERS, max(2, -(-L2_BYTES // layer_bytes))) if on_cuda else 1
    gen = torch.Generator(device=device).manual_seed(0)
    caches = []
    for _ in range(layers):
        pages = KVPages(num_pages, page_size, kv_heads, head_dim, dtype=dtype, device=device)
        pages.k.normal_(generator=gen)
        pages.v.normal_(generator=gen)
        caches.append(pages)
    # Scattered pages; page 0 is left to the page table's padding, as in the engine.
    order = torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(0)).tolist()
    tables = [[1 + p for p in order[b * per_seq : (b + 1) * per_seq]] for b in range(batch)]
    n = batch * query_len
    fb = ForwardBatch(torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64), tables,
                      [context - query_len] * batch, [query_len] * batch)
    meta = AttentionMetadata.build(fb, device, page_size, kv_pages=page_bucket(per_seq) if on_cuda else None)
    if num_splits is not None and backend_name != "triton":
        raise ValueError(f"num_splits sets the triton backend's launch, not {backend_name!r}'s")
    attn = make_attention_backend(backend_name, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                                  scale=head_dim**-0.5, dtype=dtype, device=device)
    q = torch.randn(n, heads, head_dim, generator=gen, device=device, dtype=torch.float32).to(dtype)
    attn.plan(meta, graph=on_cuda)
    splits = None  # the triton launch's KV splits
    if backend_name == "triton":
        attn.num_splits = num_splits
        splits = triton_kernels().plan_launch(num_tokens=n, num_seqs=batch, q_max=query_len,
                                              kv_pages=meta.page_table.shape[1], page_size=page_size, num_heads=heads,
                                              kv_heads=kv_heads, head_dim=head_dim, device=device,
                                              num_splits=num_splits).num_splits

    def forward() -> None:
        attend = attn.bind(meta)
        for pages in caches:
            attend(q, pages)

    seconds = seconds_per_call(forward, iters, cuda=on_cuda, warmups=2)
    per_layer = seconds / layers
    return dict(backend=backend_name, batch=batch, context=context, query_len=query_len, num_splits=splits,
                layers=layers, us_per_layer=per_layer * 1e6, kv_GBps=layer_bytes / per_layer / 1e9)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..model.attention import ATTENTION_BACKENDS, choose_attention_backend, triton_kernels
    from ..model.shapes import shape_config
    from .exchange import copy_bandwidth_gbps

    overrides = parse_overrides(args.set, option="tpspec bench attention: --set")
    apply_overrides(overrides)
    device = torch.device(bench_device(args.device, "tpspec bench attention"))
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in backends if b not in ATTENTION_BACKENDS or b == "auto"]
    if bad or not backends:
        raise SystemExit(f"tpspec bench attention: --backends: unknown {bad or args.backends!r}; "
                         f"known: {[b for b in ATTENTION_BACKENDS if b != 'auto']}")
    batches = number_list(args.batch, (1, 8, 32, 64), option="--batch")
    contexts = number_list(args.context, (1024, 4096), option="--context")
    query_lens = number_list(args.query_len, (1,), option="--query-len")
    split_counts = number_list(args.num_splits, (), option="--num-splits")
    if split_counts and "triton" not in backends:
        raise SystemExit("tpspec bench attention: --num-splits sets the triton backend's launches; add triton to "
                         "--backends")
    kernels = triton_kernels() if split_counts else None  # None too where triton does not import (refused below)
    if kernels is not None and max(split_counts) > kernels.MAX_SPLITS:
        raise SystemExit(f"tpspec bench attention: --num-splits: at most {kernels.MAX_SPLITS} splits, got "
                         f"{max(split_counts)}")
    if max(query_lens) > min(contexts):
        raise SystemExit(f"tpspec bench attention: --query-len {max(query_lens)} exceeds --context {min(contexts)}")
    cfg = shape_config(args.model_shape)
    if args.tp < 1 or cfg.num_kv_heads % args.tp or cfg.num_heads % args.tp:
        raise SystemExit(f"tpspec bench attention: --tp {args.tp} does not split {cfg.num_heads} query heads and "
                         f"{cfg.num_kv_heads} KV heads")
    heads, kv_heads = cfg.num_heads // args.tp, cfg.num_kv_heads // args.tp
    dtype = getattr(torch, args.dtype)
    if device.type == "cuda" and device.index is None:  # "cuda": the current device, named by its index
        device = torch.device("cuda", torch.cuda.current_device())
    try:
        for name in backends:  # a backend that cannot run here stops the run before any timing
            choose_attention_backend(device, cfg.head_dim, name)
    except ValueError as exc:
        raise SystemExit(f"tpspec bench attention: {exc}") from None
    copy_gbps = copy_bandwidth_gbps(device) if device.type == "cuda" else None
    # (backend, split count): the triton backend once per --num-splits count, else once with its own choice.
    runs = [(name, splits) for name in backends for splits in (split_counts if name == "triton" and split_counts
                                                                else [None])]
    results = []
    for ql in query_lens:
        for ctx in contexts:
            for b in batches:
                base = None
                for name, splits in runs:
                    r = _step(name, batch=b, context=ctx, query_len=ql, page_size=args.page_size, heads=heads,
                              kv_heads=kv_heads, head_dim=cfg.head_dim, dtype=dtype, device=device, iters=args.iters,
                              num_splits=splits)
                    r["pct_copy_bw"] = 100.0 * r["kv_GBps"] / copy_gbps if copy_gbps else None
                    base = r["us_per_layer"] if name == "torch" else base
                    results.append(r)
                for r in results[-len(runs):]:
                    r["speedup_vs_torch"] = base / r["us_per_layer"] if base else None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    rows = [[r[c] if r[c] is not None else "-" for c in COLUMNS] for r in results]
    meta = dict(model_shape=args.model_shape, tp=args.tp, heads=heads, kv_heads=kv_heads, head_dim=cfg.head_dim,
                page_size=args.page_size, dtype=args.dtype, device=str(device), iters=args.iters,
                copy_bandwidth_GBps=copy_gbps, graphs=device.type == "cuda", overrides=overrides)

    def plot(ax: Any) -> None:
        for name, splits in dict.fromkeys(runs):
            for ql in query_lens:
                for ctx in contexts:
                    pts = [(r["batch"], r["us_per_layer"]) for r in results
                           if r["backend"] == name and r["context"] == ctx and r["query_len"] == ql
                           and (splits is None or r["num_splits"] == splits)]
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                            label=f"{name}" + (f" {splits} splits" if splits else "") + f" ctx {ctx}"
                                  + (f" q {ql}" if len(query_lens) > 1 else ""))
        report.log_log_axes(ax, xlabel="batch (sequences)", ylabel="microseconds per layer", legend_fontsize=8,
                            title=f"paged attention, {args.model_shape} heads {heads}/{kv_heads} x {cfg.head_dim}, "
                                  f"{args.dtype}")

    report.write_report(args.out, "attention", columns=COLUMNS, rows=rows, meta=meta, plot=plot)
    return 0
