"""The same program on every rank, started by torchrun; rank 0 prints.

    torchrun --standalone --nproc-per-node 2 examples/torchrun_generate.py
    python examples/torchrun_generate.py        # also runs as a single plain process (TP = 1)

Every rank builds the LLM (each loads its own shard) and calls generate with the same
prompts; every rank gets the same outputs.
"""

import os

from tpspec import LLM, SamplingParams, SpeculativeConfig

rank = int(os.environ.get("RANK", "0"))
device = "cuda" if os.environ.get("TPSPEC_DEVICE") == "cuda" else "cpu"
spec = SpeculativeConfig("ngram", num_draft_tokens=4)

with LLM("tiny", launcher="torchrun", device=device, speculative=spec) as llm:  # tp_size = WORLD_SIZE
    outs = llm.generate([[5, 6, 7, 8, 5, 6, 7], [100, 200, 300]], SamplingParams(temperature=0.7, seed=0),
                        max_new_tokens=32)
    if rank == 0:
        for out in outs:
            print(out.token_ids, out.finish_reason, f"acceptance {out.stats.acceptance_rate:.0%}")
        print(f"{llm.last_stats.tokens_per_s:.1f} tokens/s on {llm.config.tp_size} ranks")
