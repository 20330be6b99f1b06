"""Speculative decoding: n-gram and draft-model drafts, strict and rejection acceptance.

Greedy requests give the tokens of plain decoding (given the same logits: always in deterministic
mode; the tiny model's greedy choices are far from ties); what changes is how many tokens each step
emits. Runs plain decoding first, then each speculative configuration, and
prints whether it emitted plain decoding's tokens and its acceptance statistics.

    python examples/speculative.py              # tiny model + its tiny draft, TP = 2, CPU
    python examples/speculative.py --model DIR --draft-model DRAFT_DIR --device cuda
"""

import argparse

from tpspec import LLM, SamplingParams

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="tiny")
parser.add_argument("--draft-model", default="tiny", help="a smaller checkpoint with the same vocabulary")
parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=2)
parser.add_argument("--device", default="cpu")
parser.add_argument("--k", type=int, default=4, help="draft tokens per step")
args = parser.parse_args()

prompts = ["one two three four one two three four one two", "A B C D A B C D A", "Hello"]
configs = {
    "plain": None,
    "ngram/strict": {"method": "ngram", "num_speculative_tokens": args.k},
    "draft/strict": {"method": "draft_model", "num_speculative_tokens": args.k, "model": args.draft_model},
    "draft/rejection": {"method": "draft_model", "num_speculative_tokens": args.k, "model": args.draft_model,
                        "acceptance": "rejection"},
}
greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
plain_tokens = None  # plain decoding's tokens: what every speculative configuration must emit
print(f"{'config':16} {'same tokens':>11} {'tokens/step':>11} {'acceptance':>10} {'tokens/s':>9}")
for name, spec in configs.items():
    with LLM(args.model, tensor_parallel_size=args.tensor_parallel_size, device=args.device,
             speculative_config=spec) as llm:
        outs = llm.generate(prompts, greedy)
        st = llm.last_stats
    tokens = [o.outputs[0].token_ids for o in outs]
    if spec is None:
        plain_tokens = tokens
        same = "reference"
    else:
        same = str(tokens == plain_tokens)
    print(f"{name:16} {same:>11} {st.mean_tokens_per_step:11.2f} {st.acceptance_rate:10.1%} {st.tokens_per_s:9.1f}")
    if spec is not None:
        print(f"{'':16} accepted drafts per step of request 0: {outs[0].outputs[0].stats.accepted_drafts_per_step[:16]}")
