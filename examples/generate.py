"""Generate with a tensor-parallel model: the smallest complete program.

    python examples/generate.py                 # tiny random model, TP = 2, CPU
    python examples/generate.py --model DIR     # any Llama-family HF checkpoint
"""

import argparse

from tpspec import LLM, SamplingParams

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="tiny")
parser.add_argument("--tp", type=int, default=2)
parser.add_argument("--device", default="cpu")
args = parser.parse_args()

prompts = ["The capital of France is", "def add(a, b):", [5, 6, 7, 8, 5, 6, 7]]  # text or token ids
params = [SamplingParams(), SamplingParams(temperature=0.8, seed=1), SamplingParams(top_k=1)]

with LLM(args.model, tp_size=args.tp, device=args.device) as llm:
    for out in llm.generate(prompts, params, max_new_tokens=24):
        print(f"prompt {out.prompt or out.prompt_token_ids!r}")
        print(f"  -> {out.token_ids}")
        if out.text is not None:
            print(f"  -> {out.text!r}")
        print(f"  finish: {out.finish_reason}, steps: {out.stats.num_steps}")
