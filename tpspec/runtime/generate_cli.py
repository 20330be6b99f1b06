"""``tpspec generate``: generate with a TP model and print the outputs and a summary.

With no arguments it makes the tiny random model (cached), runs it at TP = 2 on CPU
with local worker processes and n-gram speculation — the README's main job. Under
torchrun (``torchrun --nproc-per-node N -m tpspec generate``) every process is a rank
and rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

DEFAULT_PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Tensor parallelism splits every weight over the ranks of a group.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +",
    "Speculative decoding drafts several tokens and verifies them in one step.",
    "one two three four five six seven eight nine ten one two three",
    "All ranks agree on every token.",
    "A B C D E F G A B C D E F G A B C",
    "Hello, world!",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="Hugging Face checkpoint directory, or 'tiny' (default)")
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default 2; WORLD_SIZE under torchrun)")
    parser.add_argument("--launcher", choices=("mp", "torchrun", "ray"), default=None,
                        help="mp: local worker processes (default); torchrun: this process is a rank "
                             "(chosen automatically under torchrun); ray: one Ray actor per rank")
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu", help="default: cpu")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on cuda, fp32 on cpu), float32, bfloat16, float16")
    parser.add_argument("--attention-dp", action="store_true", help="attention data-parallel over the TP group")
    parser.add_argument("--spec", choices=("ngram", "draft_model", "none"), default="ngram",
                        help="speculative decoding method (default: ngram)")
    parser.add_argument("--draft-model", default=None, help="draft checkpoint for --spec draft_model "
                                                            "(default: the tiny draft when --model tiny)")
    parser.add_argument("--draft-tokens", type=int, default=4, help="draft tokens per step (default 4)")
    parser.add_argument("--acceptance", choices=("strict", "rejection"), default="strict")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--min-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None, help="per-request seed (reproducible sampling)")
    parser.add_argument("--prompt", action="append", default=None,
                        help="a prompt (repeatable); text, or token ids like '1,2,3' for models without a tokenizer")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="how many built-in prompts to run when no --prompt is given (default 8; "
                             "more repeat them)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS token")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="eager generation steps on GPU")
    parser.add_argument("--deterministic", action="store_true",
                        help="fixed-order forward: each request's logits bit-identical in any batch, with or "
                             "without speculation, at every power-of-two TP size (slower)")
    parser.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                        help="progress bar (auto: when stderr is a terminal, on runs longer than 2 s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _parse_prompt(text: str) -> str | list[int]:
    """``'1,2,3'`` / ``'1 2 3'`` -> token ids; anything else stays text."""
    parts = text.replace(",", " ").split()
    if parts and all(p.isdigit() for p in parts):
        return [int(p) for p in parts]
    return text


def _prompts(args: argparse.Namespace, has_tokenizer: bool, vocab_size: int) -> list:
    if args.prompt:
        return [_parse_prompt(p) for p in args.prompt]
    n = args.num_prompts if args.num_prompts is not None else len(DEFAULT_PROMPTS)
    if n < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {n}")
    if has_tokenizer:
        return [DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(n)]
    # No tokenizer: fixed pseudo-random token ids with some repetition (n-gram drafts find it).
    out = []
    for i in range(n):
        base = [(17 * i + 31 * j) % (vocab_size - 3) + 3 for j in range(8)]
        out.append(base + base[:5])
    return out


def _short(values: list[int], limit: int = 16) -> str:
    head = ", ".join(str(v) for v in values[:limit])
    return f"[{head}{', ...' if len(values) > limit else ''}]"


def run(args: argparse.Namespace) -> int:
    from ..sampling.params import SamplingParams
    from .config import SpeculativeConfig
    from .launchers import WorkerError
    from .llm import LLM

    under_torchrun = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    launcher = args.launcher or ("torchrun" if under_torchrun else "mp")
    tp = args.tp
    if tp is None:
        tp = int(os.environ["WORLD_SIZE"]) if launcher == "torchrun" and under_torchrun else 2
    rank0 = launcher != "torchrun" or os.environ.get("RANK", "0") == "0"
    try:
        spec = None
        if args.spec != "none":
            draft = args.draft_model
            if args.spec == "draft_model" and draft is None:
                if args.model != "tiny":
                    raise ValueError("--spec draft_model needs --draft-model DIR (the tiny draft only fits --model tiny)")
                draft = "tiny"
            spec = SpeculativeConfig(method=args.spec, num_draft_tokens=args.draft_tokens, draft_model=draft,
                                     acceptance=args.acceptance)
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                                seed=args.seed)
        use_tqdm = {"auto": None, "on": True, "off": False}[args.progress]
        with LLM(args.model, tp_size=tp, launcher=launcher, device=args.device, dtype=args.dtype,
                 attention_dp=args.attention_dp, speculative=spec, max_batch_size=args.max_batch_size,
                 max_seq_len=args.max_seq_len, use_cuda_graphs=not args.no_cuda_graphs,
                 deterministic=args.deterministic) as llm:
            prompts = _prompts(args, llm.tokenizer is not None, llm.vocab_size)
            outputs = llm.generate(prompts, params, max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos,
                                   use_tqdm=use_tqdm)
            stats = llm.last_stats
            desc = (f"model={args.model} tp={tp} launcher={launcher} device={llm.config.device} "
                    f"dtype={llm.config.dtype} attention_dp={args.attention_dp} "
                    + ("deterministic=True " if args.deterministic else "") +
                    f"spec={args.spec}" + (f"(k={args.draft_tokens}, {args.acceptance})" if spec else ""))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except WorkerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not rank0:
        return 0
    assert stats is not None
    if args.json:
        print(json.dumps({
            "config": desc,
            "outputs": [{"prompt": o.prompt, "prompt_token_ids": o.prompt_token_ids, "token_ids": o.token_ids,
                         "text": o.text, "finish_reason": o.finish_reason, "steps": o.stats.num_steps,
                         "accepted_drafts_per_step": o.stats.accepted_drafts_per_step} for o in outputs],
            "summary": {"requests": stats.num_requests, "generated_tokens": stats.num_generated_tokens,
                        "wall_s": stats.wall_s, "tokens_per_s": stats.tokens_per_s,
                        "mean_tokens_per_step": stats.mean_tokens_per_step,
                        "mean_accepted_drafts_per_step": stats.mean_accepted_drafts_per_step,
                        "acceptance_rate": stats.acceptance_rate},
        }))
        return 0
    print(f"tpspec generate: {desc}")
    for i, o in enumerate(outputs):
        prompt = repr(o.prompt) if o.prompt is not None else _short(o.prompt_token_ids)
        print(f"[{i}] prompt: {prompt[:100]}")
        if o.text is not None:
            print(f"    text:   {o.text[:100]!r}")
        print(f"    tokens: {_short(o.token_ids)} ({len(o.token_ids)}, {o.finish_reason}, "
              f"{o.stats.num_steps} steps, accepted {o.stats.num_accepted_drafts}/{o.stats.num_draft_tokens} drafts)")
    print(f"summary: {stats.num_requests} requests, {stats.num_generated_tokens} tokens in {stats.wall_s:.2f} s "
          f"= {stats.tokens_per_s:.1f} tokens/s")
    if spec is not None:
        print(f"         mean accepted tokens per step {stats.mean_tokens_per_step:.2f} "
              f"({stats.mean_accepted_drafts_per_step:.2f} drafts + 1), "
              f"acceptance rate {stats.acceptance_rate:.1%} of {stats.num_draft_tokens} drafts")
    return 0
