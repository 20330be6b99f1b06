"""Generate with a tensor-parallel model: the smallest complete program.

    python examples/generate.py                 # the tiny embedded model, TP = 2, CPU
    python examples/generate.py --model DIR     # any Llama-family HF checkpoint
"""

import argparse

from tpspec import LLM, SamplingParams

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="tiny")
parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=2)
parser.add_argument("--device", default="cpu")
args = parser.parse_args()

prompts = ["The capital of France is", "def add(a, b):", {"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7]}]
params = [SamplingParams(temperature=0, max_tokens=24),                   # greedy
          SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=24),   # two seeded samples
          SamplingParams(top_k=1, max_tokens=24)]                         # top_k=1 is greedy too

with LLM(args.model, tensor_parallel_size=args.tensor_parallel_size, device=args.device) as llm:
    for out in llm.generate(prompts, params):
        print(f"prompt {out.prompt or out.prompt_token_ids!r}")
        for sample in out.outputs:
            print(f"  [{sample.index}] {sample.text!r}")
            print(f"      tokens {sample.token_ids}, finish: {sample.finish_reason}, steps: {sample.stats.num_steps}")
