"""``tpspec bench generate``: end-to-end tokens/s with and without speculation.

Runs ``tpspec.LLM`` (the tiny random Llama or a user checkpoint) at ``--tp N`` on the same
prompts (random token ids, greedy, EOS ignored so every request generates
``--max-new-tokens``) in several configurations:

* ``no-spec``      plain decoding, one token per request per step;
* ``forced=a``     speculation (``--spec``: n-gram by default, ``draft_model`` or ``eagle3``, whose
                   drafter runs its K forwards a step) with ``--draft-len K`` drafts whose acceptance is
                   forced to ``a`` drafts per step (``TPSPEC_FORCE_NUM_ACCEPTED_TOKENS``,
                   see docs/determinism.md), for ``a`` in ``--rates`` (default 0, 1.5, 3): the cost of
                   drafting and verifying K drafts, and the speed-up each acceptance rate buys.

Launchers: ``mp`` starts ``--tp`` local rank processes that each run the engine
in-process (SPMD, exactly as under torchrun) and set the env var themselves before each
configuration; ``torchrun`` runs the same on every rank of the job; ``ray`` drives one
actor per rank and hands the env var to them through Ray's ``runtime_env``. Each
configuration builds a fresh ``LLM``, makes one warm-up call, then the timed ``generate``.
The table reports tokens/s, measured accepted drafts per step (a check that forcing took
effect) and the speed-up over ``no-spec``. On CPU only the ratios mean something.

``--model-shape llama-3-8b | llama-3-70b | llama-3.2-1b | qwen2.5-7b`` runs a real model shape with
random weights built on each rank instead of a checkpoint (``--num-layers`` / ``--vocab-size``
shrink it for quick checks). Its drafter without ``--draft-model``: ``--spec draft_model`` the
Llama 3.2 1B shape for the Llama 3 targets (its layers shrunk in proportion to ``--num-layers``),
``--spec eagle3`` a random EAGLE-3 head of the target shape (``shape-eagle3:NAME``).

``--num-prompts`` takes several batch sizes (``1,8,32``): each configuration builds one ``LLM``
and runs every batch in it (a warm-up ``generate`` of a batch of the same size on other prompts,
then the timed one; no timed prompt is in the prefix cache).
``--rates none`` runs no speculation at all (only ``no-spec``).

``--deterministic`` runs every configuration twice, in the default mode and in deterministic
mode (``LLM(deterministic=True)``, rows suffixed `` det``); ``vs_default`` is a deterministic
row's tokens/s over its default twin's.

``--baseline hf`` adds Hugging Face transformers on the same model shape, device, dtype, prompt
token ids and ``max_new_tokens`` (greedy, EOS ignored), in the same run, after tpspec's
configurations, in a process of its own (:mod:`tpspec.bench.hf_baseline`: a static cache,
compiled by ``generate`` on CUDA; ``--no-hf-compile`` leaves it eager): rows ``hf``, and
``vs_hf`` is a tpspec row's tokens/s over transformers' at the same batch. Without ``--rates`` it
runs no speculation. With a checkpoint (the same weights on both sides) the JSON says whether
the tokens were the same (``hf_tokens_equal``, tpspec's ``no-spec`` row against transformers).
"""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Any, Callable

from . import bench_device, model_shape_path, number_list, report

DEFAULT_RATES = (0.0, 1.5, 3.0)
COLUMNS = ["config", "forced_rate", "draft_len", "requests", "tokens", "wall_s", "tokens_per_s",
           "accepted_per_step", "tokens_per_step", "speedup", "vs_default", "vs_hf"]
BASELINES = ("hf",)


def _prompts(num: int, length: int, vocab: int, *, warmup: bool = False) -> list[list[int]]:
    """The ``num`` random prompts of a batch of ``num``: its own for each batch size, and others
    for its warm-up, so that no timed prompt is in the prefix cache (a cached prompt would skip
    its prefill, and the baseline has no cache)."""
    import torch

    gen = torch.Generator().manual_seed(2 * num + int(warmup))
    return torch.randint(3, vocab, (num, length), generator=gen).tolist()


WARMUP_TOKENS = 16


def measure(cfg: dict) -> list[dict]:
    """One configuration in this process: build the LLM, then for each batch size of
    ``cfg["batches"]`` warm up on that batch for a few tokens and time one ``generate``. Returns
    one result per batch.

    ``cfg``: model, tp, launcher, device, dtype, draft_len (0 = no speculation), batches,
    prompt_len, max_new_tokens, max_batch_size, use_cuda_graphs, deterministic (optional),
    keep_tokens (optional: the generated ids in the result). ``LLM`` reads the forced acceptance
    rate from this process's environment and hands it to every rank.
    """
    from ..runtime import LLM, SpeculativeConfig
    from ..sampling.params import SamplingParams

    spec = None
    if cfg["draft_len"]:
        spec = SpeculativeConfig(cfg["spec"], num_speculative_tokens=cfg["draft_len"], model=cfg["draft_model"])
    backend = {"torchrun": "external_launcher"}.get(cfg["launcher"], cfg["launcher"])
    results = []
    with LLM(cfg["model"], tensor_parallel_size=cfg["tp"], distributed_executor_backend=backend, device=cfg["device"],
             dtype=cfg["dtype"], speculative_config=spec, max_num_seqs=cfg["max_batch_size"],
             enforce_eager=not cfg["use_cuda_graphs"], deterministic=cfg.get("deterministic", False)) as llm:
        for batch in cfg["batches"]:
            prompts = _prompts(batch, cfg["prompt_len"], llm.vocab_size)
            # Warm up on a batch of the same shapes (its CUDA-graph bucket, first-use costs such as
            # Triton's compilations), so the timed call measures steady-state steps.
            warmup = SamplingParams(temperature=0.0, max_tokens=min(WARMUP_TOKENS, cfg["max_new_tokens"]),
                                    ignore_eos=True)
            llm.generate(_prompts(batch, cfg["prompt_len"], llm.vocab_size, warmup=True), warmup, use_tqdm=False)
            timed = SamplingParams(temperature=0.0, max_tokens=cfg["max_new_tokens"], ignore_eos=True)
            outputs = llm.generate(prompts, timed, use_tqdm=False)
            stats = llm.last_stats
            assert stats is not None
            if stats.num_cached_tokens:  # the timed steps would skip prefills the baseline runs
                raise RuntimeError(f"{stats.num_cached_tokens} timed prompt tokens came from the prefix cache")
            results.append({
                "rank": llm.rank,
                "batch": batch,
                "requests": stats.num_requests,
                "tokens": stats.num_generated_tokens,
                "wall_s": stats.wall_s,
                "tokens_per_s": stats.tokens_per_s,
                "accepted_per_step": stats.mean_accepted_drafts_per_step,
                "tokens_per_step": stats.mean_tokens_per_step,
                "token_ids": [o.outputs[0].token_ids for o in outputs] if cfg.get("keep_tokens") else None,
            })
    return results


def _with_forced_rate(rate: float | None, fn: Callable[[], dict]) -> dict:
    """Run ``fn`` with ``TPSPEC_FORCE_NUM_ACCEPTED_TOKENS`` set to ``rate`` (unset for None)
    in this process, where ``LLM`` reads it. Here, in the benchmark, forcing is the point:
    the engine's warning about it is silenced."""
    from ..speculative.forced import FORCE_ENV, ForcedAcceptanceWarning

    saved = os.environ.pop(FORCE_ENV, None)
    try:
        if rate is not None:
            os.environ[FORCE_ENV] = repr(float(rate))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ForcedAcceptanceWarning)
            return fn()
    finally:
        os.environ.pop(FORCE_ENV, None)
        if saved is not None:
            os.environ[FORCE_ENV] = saved


def run_configs(configs: list[tuple[dict, float | None]]) -> list[list[dict]]:
    """Every configuration, in order, in this process (a rank under torchrun or the mp
    launcher, or the Ray driver)."""
    return [_with_forced_rate(rate, lambda cfg=cfg: measure(cfg)) for cfg, rate in configs]


def _spmd_worker(rank: int, world_size: int, configs: list[tuple[dict, float | None]]) -> list[list[dict]]:
    """``--launcher mp``: one of ``tp`` local rank processes (``run_ranks``), each running the
    engine in-process exactly as under torchrun, so the forced rate set here reaches the
    engine (forked workers of a long-lived server would keep the environment it started with)."""
    import torch

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    if configs and configs[0][0]["device"] == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    return run_configs(configs)


def _plot(rows: list[list[Any]]) -> Callable[[Any], None]:
    def draw(ax: Any) -> None:
        labels = [f"{r[0]}\nB={r[3]}" for r in rows]
        values = [r[6] for r in rows]
        colors = ["gray" if r[0].startswith("no-spec") else "tab:orange" if r[0] == "hf" else "tab:blue" for r in rows]
        bars = ax.bar(range(len(rows)), values, color=colors)
        for bar, r in zip(bars, rows):
            ratio = r[9] if r[9] != "-" else r[11]
            ax.annotate(f"{ratio}x" if ratio != "-" else "", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel("generated tokens / s")
        ax.set_title("end-to-end generation: speed-up over no speculation, or over transformers (vs_hf)")

    return draw


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="'tiny' or a Hugging Face model directory")
    parser.add_argument("--tp", type=int, default=2, help="TP size (default 2; torchrun: WORLD_SIZE)")
    parser.add_argument("--launcher", choices=("mp", "torchrun", "ray"), default="mp")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rates", default=None,
                        help="comma-separated forced acceptance rates, or 'none' for no speculation (default 0,1.5,3; "
                             "with --baseline: none)")
    parser.add_argument("--draft-len", type=int, default=3, help="drafts per step when speculating (default 3)")
    parser.add_argument("--spec", choices=("ngram", "draft_model", "eagle3"), default="ngram",
                        help="the drafter of the forced configurations (default ngram)")
    parser.add_argument("--draft-model", default=None, help="draft checkpoint or EAGLE-3 head of --spec draft_model / "
                                                            "eagle3 (default: the tiny one when --model tiny; with "
                                                            "--model-shape a random shape drafter)")
    parser.add_argument("--num-prompts", default=None,
                        help="requests of a batch, or comma-separated batch sizes run one after the other "
                             "(default 8; --quick 2)")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 64; --quick 8)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="tokens per request (default 128; --quick 12)")
    parser.add_argument("--max-batch-size", type=int, default=None,
                        help="requests in flight (default: the largest batch)")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="eager generation steps on GPU")
    parser.add_argument("--deterministic", action="store_true",
                        help="also run every configuration in deterministic mode (rows ' det', ratio vs_default)")
    parser.add_argument("--baseline", choices=BASELINES, default=None,
                        help="hf: Hugging Face transformers on the same shape, prompts and device, in the same run")
    parser.add_argument("--hf-compile", action=argparse.BooleanOptionalAction, default=None,
                        help="let transformers' generate torch.compile its static-cache decoding (default: on "
                             "CUDA; transformers compiles on accelerators only)")
    parser.add_argument("--quick", action="store_true", help="small sizes, seconds per configuration on CPU")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before the run is abandoned")
    add_shape_arguments(parser)


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    from ..model.shape_table import MODEL_SHAPES  # torch-free: --help imports no torch

    parser.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default=None,
                        help="a real model shape with random weights built on each rank (instead of --model)")
    parser.add_argument("--num-layers", type=int, default=None, help="with --model-shape: fewer layers")
    parser.add_argument("--vocab-size", type=int, default=None, help="with --model-shape: another vocabulary size")


def model_argument(args: argparse.Namespace) -> str:
    """``--model``, or the ``shape:`` path of ``--model-shape`` (``SystemExit`` on a bad mix)."""
    path = model_shape_path(args, "tpspec bench generate")
    if path is None and (args.num_layers is not None or args.vocab_size is not None):
        raise SystemExit("tpspec bench generate: --num-layers / --vocab-size need --model-shape")
    return args.model if path is None else path


def default_draft_model(args: argparse.Namespace) -> str:
    """The drafter of ``--spec draft_model`` / ``eagle3`` without ``--draft-model``: the tiny one for
    ``--model tiny``; for ``--model-shape`` the shape's draft-model shape
    (:data:`~tpspec.model.shapes.DRAFT_SHAPES`, with ``--vocab-size``, and ``--num-layers`` scaled by
    its share of the target's layers) or a random EAGLE-3 head of the shape. ``SystemExit`` otherwise."""
    from ..model.shapes import DRAFT_SHAPES, MODEL_SHAPES, eagle3_shape_path, shape_path

    if args.model_shape is None:
        if args.model != "tiny":
            raise SystemExit(f"tpspec bench generate: --spec {args.spec} needs --draft-model DIR with a model "
                             f"other than the tiny one")
        return "tiny"
    if args.spec == "eagle3":
        return eagle3_shape_path(args.model_shape)
    draft = DRAFT_SHAPES.get(args.model_shape)
    if draft is None:
        raise SystemExit(f"tpspec bench generate: --spec draft_model needs --draft-model with --model-shape "
                         f"{args.model_shape} (draft shapes exist for {', '.join(sorted(DRAFT_SHAPES))})")
    layers = None
    if args.num_layers is not None:
        draft_layers = MODEL_SHAPES[draft]["num_hidden_layers"]
        layers = max(1, args.num_layers * draft_layers // MODEL_SHAPES[args.model_shape]["num_hidden_layers"])
    try:
        return shape_path(draft, layers, args.vocab_size)
    except ValueError as exc:
        raise SystemExit(f"tpspec bench generate: {exc}") from None


def run(args: argparse.Namespace) -> int:
    from ..model.shapes import config_from_path
    from ..runtime.llm import resolve_model
    from ..validation import resolve_dtype
    from .hf_baseline import hf_worker, transformers_problem

    device = bench_device(args.device, "tpspec bench generate")
    if args.draft_len < 1:
        raise SystemExit("tpspec bench generate: --draft-len must be >= 1")
    if args.rates == "none" or (args.rates is None and args.baseline is not None):
        rates: list[float] = []
    else:
        rates = number_list(args.rates, DEFAULT_RATES, option="tpspec bench generate: --rates", kind=float, minimum=0)
    tp = int(os.environ.get("WORLD_SIZE", "1")) if args.launcher == "torchrun" else args.tp
    if tp < 1:
        raise SystemExit("tpspec bench generate: --tp must be >= 1")
    draft_model = args.draft_model
    if args.spec == "ngram" and draft_model is not None:
        raise SystemExit("tpspec bench generate: --draft-model needs --spec draft_model or eagle3")
    if args.spec != "ngram" and draft_model is None and rates:
        draft_model = default_draft_model(args)
    hf_compile = device == "cuda" if args.hf_compile is None else args.hf_compile
    if args.baseline is not None:
        if args.launcher != "mp":
            raise SystemExit("tpspec bench generate: --baseline runs with --launcher mp")
        problem = transformers_problem()
        if problem is not None:
            raise SystemExit(f"tpspec bench generate: --baseline hf: {problem}")
        if hf_compile and device != "cuda":
            raise SystemExit("tpspec bench generate: --hf-compile: transformers compiles its static-cache decoding "
                             "on CUDA devices only")
    batches = number_list(args.num_prompts, (2,) if args.quick else (8,), option="tpspec bench generate: --num-prompts")
    try:
        model = resolve_model(model_argument(args))  # "tiny" -> its directory, which transformers loads too
    except ValueError as exc:
        raise SystemExit(f"tpspec bench generate: {exc}") from None
    try:
        dtype = resolve_dtype(args.dtype, device, checkpoint_dtype=config_from_path(model).torch_dtype or "float32")
    except ValueError as exc:
        raise SystemExit(f"tpspec bench generate: --dtype: {exc}") from None
    cfg = {
        "model": model, "tp": tp, "launcher": args.launcher, "device": device, "dtype": dtype, "batches": batches,
        "prompt_len": args.prompt_len or (8 if args.quick else 64),
        "max_new_tokens": args.max_new_tokens or (12 if args.quick else 128),
        "max_batch_size": args.max_batch_size or max(batches), "use_cuda_graphs": not args.no_cuda_graphs,
        "spec": args.spec, "draft_model": draft_model,
    }
    names = ["no-spec"] + [f"forced={rate:g}" for rate in rates]
    configs: list[tuple[dict, float | None]] = [(dict(cfg, draft_len=0, keep_tokens=args.baseline is not None), None)]
    configs += [(dict(cfg, draft_len=args.draft_len), rate) for rate in rates]
    if args.deterministic:
        names += [f"{name} det" for name in names]
        configs += [(dict(c, deterministic=True, keep_tokens=False), rate) for c, rate in configs]
    if args.launcher == "mp":
        from ..testing import rank_backend, run_ranks, shared_gpu_mps

        spmd = [(dict(c, launcher="torchrun"), rate) for c, rate in configs]
        with shared_gpu_mps(device, tp):  # ranks sharing GPUs run concurrently
            per_config = run_ranks(_spmd_worker, tp, spmd, backend=rank_backend(device, tp),
                                   timeout_s=args.timeout)[0]
    else:  # torchrun: every rank runs this; ray: this driver drives the actors
        try:
            per_config = run_configs(configs)
        finally:
            if args.launcher == "torchrun":
                # This command owns the process: its process group goes before the interpreter does (a
                # group left to interpreter exit can abort the process while its threads are torn down).
                from .. import distributed as D

                D.destroy_distributed()
    if per_config[0][0]["rank"] != 0:
        return 0  # rank 0 writes the report
    results = {(name, res["batch"]): (rate, c["draft_len"], res)
               for name, (c, rate), by_batch in zip(names, configs, per_config) for res in by_batch}
    meta = {"command": "tpspec bench generate", **{k: v for k, v in cfg.items()}, "draft_len": args.draft_len,
            "rates": rates, "quick": args.quick, "drafter": args.spec, "deterministic": args.deterministic,
            "baseline": args.baseline,
            "note": "greedy, EOS ignored; accepted_per_step is measured over emitted tokens (forced: min(rate, "
                    "draft_len) expected, less on each request's last step, which the token budget cuts). "
                    "On CPU only ratios are meaningful."}
    if args.baseline is None:
        _write(args.out, names, batches, results, None, meta)
        return 0
    # tpspec's rows first, so a baseline that fails or runs out of time leaves them written.
    _write(args.out, names, batches, results, None, dict(meta, baseline_status="running"))
    vocab = config_from_path(model).vocab_size
    hf_cfg = {"model": model, "device": device, "dtype": dtype, "max_new_tokens": cfg["max_new_tokens"],
              "compile": hf_compile, "prompts": {b: _prompts(b, cfg["prompt_len"], vocab) for b in batches}}
    from ..testing import RankError, rank_backend, run_ranks

    try:
        hf = run_ranks(hf_worker, 1, hf_cfg, backend=rank_backend(device, 1), timeout_s=args.timeout)[0]
    except RankError as exc:
        print(f"error: the transformers baseline failed: {exc}")
        _write(args.out, names, batches, results, None, dict(meta, baseline_status=f"failed: {exc}"))
        return 1
    equal = {}
    if hf["same_weights"]:
        for res in hf["results"]:
            equal[str(res["batch"])] = results[("no-spec", res["batch"])][2]["token_ids"] == res["token_ids"]
    meta.update(baseline_status="done", transformers=hf["transformers"], hf_compile=hf_compile,
                hf_compiled=hf["compiled"], hf_same_weights=hf["same_weights"], hf_tokens_equal=equal or None)
    _write(args.out, names, batches, results, {r["batch"]: r for r in hf["results"]}, meta)
    return 0


def table_rows(names: list[str], batches: list[int], results: dict, hf: dict[int, dict] | None) -> list[list[Any]]:
    """The table: per batch, every configuration's row (``results[(name, batch)] = (rate, draft_len,
    result)``), then transformers' (``hf[batch]``, when run). ``speedup``: over ``no-spec`` (``no-spec
    det`` for deterministic rows); ``vs_default``: a deterministic row over its default twin;
    ``vs_hf``: over transformers at the same batch."""
    rows = []
    for batch in batches:
        per_s = {name: results[(name, batch)][2]["tokens_per_s"] for name in names}
        base_hf = hf[batch]["tokens_per_s"] if hf is not None else 0.0
        for name in names:
            rate, draft_len, res = results[(name, batch)]
            det_mode = name.endswith(" det")
            base = per_s["no-spec det" if det_mode else "no-spec"]
            speedup = res["tokens_per_s"] / base if base > 0 and not name.startswith("no-spec") else None
            twin = per_s.get(name.removesuffix(" det"), 0.0)
            vs_default = res["tokens_per_s"] / twin if det_mode and twin > 0 else None
            vs_hf = res["tokens_per_s"] / base_hf if base_hf > 0 else None
            rows.append([name, "-" if rate is None else rate, draft_len, res["requests"], res["tokens"],
                         round(res["wall_s"], 4), round(res["tokens_per_s"], 2), round(res["accepted_per_step"], 3),
                         round(res["tokens_per_step"], 3), _ratio(speedup), _ratio(vs_default), _ratio(vs_hf)])
        if hf is not None:
            h = hf[batch]
            rows.append(["hf", "-", 0, batch, h["tokens"], round(h["wall_s"], 4), round(h["tokens_per_s"], 2), 0.0,
                         1.0, "-", "-", "-"])
    return rows


def _ratio(value: float | None) -> Any:
    return "-" if value is None else round(value, 4)


def _write(out: str, names: list[str], batches: list[int], results: dict, hf: dict[int, dict] | None,
           meta: dict) -> None:
    rows = table_rows(names, batches, results, hf)
    report.write_report(out, "generate", columns=COLUMNS, rows=rows, meta=meta, plot=_plot(rows))
