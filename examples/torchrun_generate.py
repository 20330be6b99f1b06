"""The same program on every rank, started by torchrun; rank 0 prints.

    torchrun --standalone --nproc-per-node 2 examples/torchrun_generate.py
    torchrun --standalone --nproc-per-node 8 examples/torchrun_generate.py --device cuda
    python examples/torchrun_generate.py        # also runs as a single plain process (TP = 1)

Every rank builds the LLM (each loads its own shard) and calls generate with the same
prompts; every rank gets the same outputs.
"""

import argparse
import os

from tpspec import LLM, SamplingParams
from tpspec import distributed as D

parser = argparse.ArgumentParser()
parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
args = parser.parse_args()
rank = int(os.environ.get("RANK", "0"))
spec = {"method": "ngram", "num_speculative_tokens": 4}

# tensor_parallel_size = WORLD_SIZE
with LLM("tiny", distributed_executor_backend="external_launcher", device=args.device, speculative_config=spec) as llm:
    outs = llm.generate(["The cat sat on the mat.", [100, 200, 300]], SamplingParams(temperature=0.7, seed=0, max_tokens=32))
    everyone = D.all_gather_object([o.outputs[0].token_ids for o in outs])  # each rank's tokens
    if rank == 0:
        print(f"every rank got the same tokens: {all(tokens == everyone[0] for tokens in everyone)}")
        for out in outs:
            sample = out.outputs[0]
            print(repr(sample.text), sample.finish_reason, f"acceptance {sample.stats.acceptance_rate:.0%}")
        print(f"{llm.last_stats.tokens_per_s:.1f} tokens/s on {llm.config.tp_size} ranks")
# The process group is this script's to close (the LLM joined torchrun's): closing it before exit stops
# gloo's threads cleanly.
D.destroy_distributed()
