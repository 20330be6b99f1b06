"""``tpspec generate``: generate with a TP model and print the outputs and a summary.

With no arguments it makes the tiny random model (cached), runs it at TP = 2 (on the GPUs
when there are any, else on CPU) with local worker processes and n-gram speculation — the
README's main job. Under
torchrun (``torchrun --nproc-per-node N -m tpspec generate``) every process is a rank
and rank 0 prints.
"""

from __future__ import annotations

import dataclasses

import argparse
import json
import os
import re
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
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                        help="TP ranks (default 2; WORLD_SIZE under torchrun)")
    parser.add_argument("--distributed-executor-backend", choices=("mp", "ray", "external_launcher"), default=None,
                        help="mp: local worker processes (default); external_launcher: this process is a rank "
                             "(chosen automatically under torchrun); ray: one Ray actor per rank")
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto",
                        help="default: auto (cuda when a GPU is visible, else cpu)")
    parser.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16, float16")
    parser.add_argument("--attention-dp", action="store_true", help="attention data-parallel over the TP group")
    parser.add_argument("--attention-backend", default="auto",
                        help="paged attention: auto (default: triton on CUDA, torch elsewhere), torch, "
                             "triton (CUDA; CPU only with TRITON_INTERPRET=1), flashinfer (CUDA)")
    parser.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4}',
                        help="JSON of LLM(speculative_config=...), or 'none' (default: n-gram, 4 tokens; "
                             "with --model tiny, methods draft_model and eagle3 default to the tiny draft / head)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None, help="per-request seed (reproducible sampling)")
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--stop", action="append", default=None,
                        help="a stop string (repeatable); the escapes \\n, \\t, \\r and \\\\ mean a newline, a tab, "
                             "a carriage return and a backslash, so --stop \"\\n\" stops at a line's end")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0; 1 = off (default)")
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]; 0 = off (default)")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2]; 0 = off (default)")
    parser.add_argument("--logprobs", type=int, default=None,
                        help="N in [0, 20]: report each token's logprob and the top N (in --json output)")
    parser.add_argument("--prompt", action="append", default=None,
                        help="a prompt (repeatable); text, or token ids like '1,2,3'")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="how many built-in prompts to run when no --prompt is given (default 8; "
                             "more repeat them)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS token")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: eager generation steps on GPU")
    parser.add_argument("--deterministic", action="store_true",
                        help="fixed-order forward: each request's logits bit-identical in any batch, with or "
                             "without speculation, at every power-of-two TP size (slower)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV pages of cached prompt prefixes (default on; --no-enable-prefix-caching "
                             "turns it off)")
    parser.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                        help="progress bar (auto: when stderr is a terminal, on runs longer than 2 s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def unescape(text: str) -> str:
    """A command-line stop string with its escapes turned into characters: ``\\n``, ``\\t``,
    ``\\r``, ``\\\\`` (a shell passes ``"\\n"`` as a backslash and an ``n``); any other
    backslash stays as it is."""
    return re.sub(r"\\([ntr\\])", lambda m: ESCAPES[m.group(1)], text)


def _parse_prompt(text: str) -> str | list[int]:
    """``'1,2,3'`` / ``'1 2 3'`` -> token ids (a negative one too, which ``LLM`` then
    refuses by name); anything else stays text."""
    parts = text.replace(",", " ").split()
    if parts and all(re.fullmatch(r"[+-]?\d+", p) for p in parts):
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


def _speculative_config(text: str, model: str) -> dict | None:
    if text.strip().lower() == "none":
        return None
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"--speculative-config must be a JSON object or 'none', got {text!r}")
    if spec.get("method") in ("draft_model", "eagle3") and not spec.get("model"):
        if model != "tiny":
            raise ValueError(f"--speculative-config method {spec['method']} needs \"model\" (the tiny draft and "
                             f"head only fit --model tiny)")
        spec["model"] = "tiny"
    return spec


def run(args: argparse.Namespace) -> int:
    from .llm import under_torchrun

    backend = args.distributed_executor_backend or ("external_launcher" if under_torchrun() else "mp")
    tp = args.tensor_parallel_size
    if tp is None:
        tp = int(os.environ["WORLD_SIZE"]) if backend == "external_launcher" and under_torchrun() else 2
    rank0 = backend != "external_launcher" or os.environ.get("RANK", "0") == "0"
    try:
        return _generate(args, backend, tp, rank0)
    finally:
        if backend == "external_launcher":
            # This command owns the process: its process group goes before the interpreter does (a
            # group left to interpreter exit can abort the process while its threads are torn down).
            from .. import distributed as D

            D.destroy_distributed()


def _generate(args: argparse.Namespace, backend: str, tp: int, rank0: bool) -> int:
    from ..log import plural
    from ..model.tiny import TINY_DESCRIPTION
    from ..sampling.params import SamplingParams
    from .launchers import WorkerError
    from .llm import LLM

    try:
        spec = _speculative_config(args.speculative_config, args.model)
        params = SamplingParams(n=args.n, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens,
                                stop=[unescape(s) for s in args.stop] if args.stop else None,
                                ignore_eos=args.ignore_eos, repetition_penalty=args.repetition_penalty,
                                presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                                logprobs=args.logprobs)
        use_tqdm = {"auto": None, "on": True, "off": False}[args.progress]
        with LLM(args.model, tensor_parallel_size=tp, distributed_executor_backend=backend, device=args.device,
                 dtype=args.dtype, attention_dp=args.attention_dp, speculative_config=spec,
                 max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                 enforce_eager=args.enforce_eager, deterministic=args.deterministic,
                 attention_backend=args.attention_backend,
                 enable_prefix_caching=args.enable_prefix_caching) as llm:
            prompts = _prompts(args, llm.tokenizer is not None, llm.vocab_size)
            outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
            stats = llm.last_stats
            spec_desc = "none" if llm.config.speculative is None else (
                f"{llm.config.speculative.method}(k={llm.config.speculative.num_speculative_tokens}, "
                f"{llm.config.speculative.acceptance})")
            desc = (f"model={args.model} tp={tp} backend={backend} device={llm.config.device} "
                    f"dtype={llm.config.dtype} attention_dp={args.attention_dp} spec={spec_desc}"
                    + (" deterministic" if args.deterministic else ""))
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
            "outputs": [{"prompt": o.prompt, "prompt_token_ids": o.prompt_token_ids,
                         "outputs": [{"index": c.index, "token_ids": c.token_ids, "text": c.text,
                                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                                      "steps": c.stats.num_steps,
                                      "accepted_drafts_per_step": c.stats.accepted_drafts_per_step,
                                      **({"logprobs": [{t: dataclasses.asdict(lp) for t, lp in e.items()} for e in c.logprobs]}
                                         if c.logprobs is not None else {})}
                                     for c in o.outputs]} for o in outputs],
            "summary": {"requests": stats.num_requests, "generated_tokens": stats.num_generated_tokens,
                        "wall_s": stats.wall_s, "tokens_per_s": stats.tokens_per_s,
                        "mean_tokens_per_step": stats.mean_tokens_per_step,
                        "mean_accepted_drafts_per_step": stats.mean_accepted_drafts_per_step,
                        "acceptance_rate": stats.acceptance_rate,
                        "forced_acceptance_rate": stats.forced_acceptance_rate,
                        "num_cached_tokens": stats.num_cached_tokens, "num_preemptions": stats.num_preemptions},
        }))
        return 0
    print(f"tpspec generate: {desc}")
    if args.model == "tiny":
        print(f"model: {TINY_DESCRIPTION}")
    if spec is not None and spec.get("method") == "eagle3" and spec.get("model") == "tiny":
        print("note: the tiny EAGLE-3 head is random (nobody trained one for the tiny model): its drafts are almost "
              "never accepted, so an acceptance rate near 0 % is expected here")
    for i, o in enumerate(outputs):
        prompt = repr(o.prompt) if o.prompt is not None else _short(o.prompt_token_ids)
        print(f"[{i}] prompt: {prompt[:100]}")
        for c in o.outputs:
            label = f"    [{c.index}] " if len(o.outputs) > 1 else "    "
            if llm.tokenizer is not None:
                print(f"{label}text:   {c.text[:100]!r}")
            print(f"{label}tokens: {_short(c.token_ids)} ({len(c.token_ids)}, {c.finish_reason}, "
                  f"{plural(c.stats.num_steps, 'step')}, accepted {c.stats.num_accepted_drafts}/"
                  f"{plural(c.stats.num_draft_tokens, 'draft')})")
    print(f"summary: {plural(stats.num_requests, 'request')}, {plural(stats.num_generated_tokens, 'token')} in "
          f"{stats.wall_s:.2f} s = {stats.tokens_per_s:.1f} tokens/s")
    print(f"         prefix cache {'on' if args.enable_prefix_caching else 'off'}: {stats.num_cached_tokens} of "
          f"{plural(stats.num_prompt_tokens, 'prompt token')} cached; {plural(stats.num_preemptions, 'preemption')}")
    if stats.forced_acceptance_rate is not None:
        print(f"warning: acceptance was forced at {stats.forced_acceptance_rate:g} drafts a step "
              f"(TPSPEC_FORCE_NUM_ACCEPTED_TOKENS is set): these are not the model's tokens")
    if spec is not None:
        print(f"         mean accepted tokens per step {stats.mean_tokens_per_step:.2f} "
              f"({stats.mean_accepted_drafts_per_step:.2f} drafts + 1), "
              f"acceptance rate {stats.acceptance_rate:.1%} of {plural(stats.num_draft_tokens, 'draft')}")
    return 0
