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

``--deterministic`` runs every configuration twice, in the default mode and in deterministic
mode (``LLM(deterministic=True)``, rows suffixed `` det``); ``vs_default`` is a deterministic
row's tokens/s over its default twin's.
"""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Any, Callable

import torch

from ..speculative.forced import FORCE_ENV, ForcedAcceptanceWarning
from . import bench_device, model_shape_path, number_list, report

DEFAULT_RATES = (0.0, 1.5, 3.0)
COLUMNS = ["config", "forced_rate", "draft_len", "requests", "tokens", "wall_s", "tokens_per_s",
           "accepted_per_step", "tokens_per_step", "speedup", "vs_default"]


def _prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (num, length), generator=gen).tolist()


WARMUP_TOKENS = 16


def measure(cfg: dict) -> dict:
    """One configuration in this process: build the LLM, warm up on the same batch for a few
    tokens, time one ``generate``.

    ``cfg``: model, tp, launcher, device, dtype, draft_len (0 = no speculation), prompts
    (count, length), max_new_tokens, max_batch_size, use_cuda_graphs, deterministic (optional).
    ``LLM`` reads the forced acceptance rate from this process's environment and hands it to
    every rank.
    """
    from ..runtime import LLM, SpeculativeConfig
    from ..sampling.params import SamplingParams

    spec = None
    if cfg["draft_len"]:
        spec = SpeculativeConfig(cfg["spec"], num_speculative_tokens=cfg["draft_len"], model=cfg["draft_model"])
    backend = {"torchrun": "external_launcher"}.get(cfg["launcher"], cfg["launcher"])
    with LLM(cfg["model"], tensor_parallel_size=cfg["tp"], distributed_executor_backend=backend, device=cfg["device"],
             dtype=cfg["dtype"], speculative_config=spec, max_num_seqs=cfg["max_batch_size"],
             enforce_eager=not cfg["use_cuda_graphs"], deterministic=cfg.get("deterministic", False)) as llm:
        prompts = _prompts(cfg["num_prompts"], cfg["prompt_len"], llm.vocab_size)
        # Warm up on the timed batch itself (its CUDA-graph bucket, first-use costs of its shapes),
        # so the timed call measures steady-state steps.
        warmup = SamplingParams(temperature=0.0, max_tokens=min(WARMUP_TOKENS, cfg["max_new_tokens"]), ignore_eos=True)
        llm.generate(prompts, warmup, use_tqdm=False)
        timed = SamplingParams(temperature=0.0, max_tokens=cfg["max_new_tokens"], ignore_eos=True)
        llm.generate(prompts, timed, use_tqdm=False)
        stats = llm.last_stats
        rank = llm.rank
    assert stats is not None
    return {
        "rank": rank,
        "requests": stats.num_requests,
        "tokens": stats.num_generated_tokens,
        "wall_s": stats.wall_s,
        "tokens_per_s": stats.tokens_per_s,
        "accepted_per_step": stats.mean_accepted_drafts_per_step,
        "tokens_per_step": stats.mean_tokens_per_step,
    }


def _with_forced_rate(rate: float | None, fn: Callable[[], dict]) -> dict:
    """Run ``fn`` with ``TPSPEC_FORCE_NUM_ACCEPTED_TOKENS`` set to ``rate`` (unset for None)
    in this process, where ``LLM`` reads it. Here, in the benchmark, forcing is the point:
    the engine's warning about it is silenced."""
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


def run_configs(configs: list[tuple[dict, float | None]]) -> list[dict]:
    """Every configuration, in order, in this process (a rank under torchrun or the mp
    launcher, or the Ray driver)."""
    return [_with_forced_rate(rate, lambda cfg=cfg: measure(cfg)) for cfg, rate in configs]


def _spmd_worker(rank: int, world_size: int, configs: list[tuple[dict, float | None]]) -> list[dict]:
    """``--launcher mp``: one of ``tp`` local rank processes (``run_ranks``), each running the
    engine in-process exactly as under torchrun, so the forced rate set here reaches the
    engine (forked workers of a long-lived server would keep the environment it started with)."""
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    if configs and configs[0][0]["device"] == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    return run_configs(configs)


def _plot(rows: list[list[Any]]) -> Callable[[Any], None]:
    def draw(ax: Any) -> None:
        labels = [r[0] for r in rows]
        values = [r[6] for r in rows]
        colors = ["gray" if r[0].startswith("no-spec") else "tab:blue" for r in rows]
        bars = ax.bar(range(len(rows)), values, color=colors)
        for bar, r in zip(bars, rows):
            ax.annotate(f"{r[9]}x" if r[9] != "-" else "", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels)
        ax.set_ylabel("generated tokens / s")
        ax.set_title("end-to-end generation: no speculation vs forced acceptance rates")

    return draw


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="'tiny' or a Hugging Face model directory")
    parser.add_argument("--tp", type=int, default=2, help="TP size (default 2; torchrun: WORLD_SIZE)")
    parser.add_argument("--launcher", choices=("mp", "torchrun", "ray"), default="mp")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rates", default=None, help="comma-separated forced acceptance rates (default 0,1.5,3)")
    parser.add_argument("--draft-len", type=int, default=3, help="drafts per step when speculating (default 3)")
    parser.add_argument("--spec", choices=("ngram", "draft_model", "eagle3"), default="ngram",
                        help="the drafter of the forced configurations (default ngram)")
    parser.add_argument("--draft-model", default=None, help="draft checkpoint or EAGLE-3 head of --spec draft_model / "
                                                            "eagle3 (default: the tiny one when --model tiny; with "
                                                            "--model-shape a random shape drafter)")
    parser.add_argument("--num-prompts", type=int, default=None, help="requests (default 8; --quick 2)")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 64; --quick 8)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="tokens per request (default 128; --quick 12)")
    parser.add_argument("--max-batch-size", type=int, default=None, help="requests in flight (default: all)")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="eager generation steps on GPU")
    parser.add_argument("--deterministic", action="store_true",
                        help="also run every configuration in deterministic mode (rows ' det', ratio vs_default)")
    parser.add_argument("--quick", action="store_true", help="small sizes, seconds per configuration on CPU")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before the run is abandoned")
    add_shape_arguments(parser)


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    from ..model.shapes import MODEL_SHAPES

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
    device = bench_device(args.device, "tpspec bench generate")
    if args.draft_len < 1:
        raise SystemExit("tpspec bench generate: --draft-len must be >= 1")
    rates = number_list(args.rates, DEFAULT_RATES, option="tpspec bench generate: --rates", kind=float, minimum=0)
    tp = int(os.environ.get("WORLD_SIZE", "1")) if args.launcher == "torchrun" else args.tp
    if tp < 1:
        raise SystemExit("tpspec bench generate: --tp must be >= 1")
    draft_model = args.draft_model
    if args.spec == "ngram" and draft_model is not None:
        raise SystemExit("tpspec bench generate: --draft-model needs --spec draft_model or eagle3")
    if args.spec != "ngram" and draft_model is None:
        draft_model = default_draft_model(args)
    num_prompts = args.num_prompts or (2 if args.quick else 8)
    cfg = {
        "model": model_argument(args), "tp": tp, "launcher": args.launcher, "device": device, "dtype": args.dtype,
        "num_prompts": num_prompts, "prompt_len": args.prompt_len or (8 if args.quick else 64),
        "max_new_tokens": args.max_new_tokens or (12 if args.quick else 128),
        "max_batch_size": args.max_batch_size or num_prompts, "use_cuda_graphs": not args.no_cuda_graphs,
        "spec": args.spec, "draft_model": draft_model,
    }
    names = ["no-spec"] + [f"forced={rate:g}" for rate in rates]
    configs: list[tuple[dict, float | None]] = [(dict(cfg, draft_len=0), None)]
    configs += [(dict(cfg, draft_len=args.draft_len), rate) for rate in rates]
    if args.deterministic:
        names += [f"{name} det" for name in names]
        configs += [(dict(c, deterministic=True), rate) for c, rate in configs]
    if args.launcher == "mp":
        from ..testing import rank_backend, run_ranks, shared_gpu_mps

        spmd = [(dict(c, launcher="torchrun"), rate) for c, rate in configs]
        with shared_gpu_mps(device, tp):  # ranks sharing GPUs run concurrently
            per_config = run_ranks(_spmd_worker, tp, spmd, backend=rank_backend(device, tp),
                                   timeout_s=args.timeout)[0]
    else:  # torchrun: every rank runs this; ray: this driver drives the actors
        per_config = run_configs(configs)
    results = [(name, rate, c["draft_len"], res) for name, (c, rate), res in zip(names, configs, per_config)]
    tokens_per_s = {name: res["tokens_per_s"] for name, _, _, res in results}
    rows = []
    for name, rate, draft_len, res in results:
        det_mode = name.endswith(" det")
        base = tokens_per_s["no-spec det" if det_mode else "no-spec"]
        speedup = res["tokens_per_s"] / base if base > 0 and not name.startswith("no-spec") else "-"
        twin = tokens_per_s.get(name.removesuffix(" det"), 0.0)
        vs_default = round(res["tokens_per_s"] / twin, 4) if det_mode and twin > 0 else "-"
        rows.append([name, "-" if rate is None else rate, draft_len, res["requests"], res["tokens"],
                     round(res["wall_s"], 4), round(res["tokens_per_s"], 2), round(res["accepted_per_step"], 3),
                     round(res["tokens_per_step"], 3), round(speedup, 3) if speedup != "-" else "-", vs_default])
    if results[0][3]["rank"] != 0:
        return 0  # rank 0 writes the report
    meta = {"command": "tpspec bench generate", **{k: v for k, v in cfg.items()}, "draft_len": args.draft_len,
            "rates": rates, "quick": args.quick, "drafter": args.spec, "deterministic": args.deterministic,
            "note": "greedy, EOS ignored; accepted_per_step is measured over emitted tokens (forced: min(rate, "
                    "draft_len) expected, less on each request's last step, which the token budget cuts). "
                    "On CPU only ratios are meaningful."}
    report.write_report(args.out, "generate", columns=COLUMNS, rows=rows, meta=meta, plot=_plot(rows))
    return 0
