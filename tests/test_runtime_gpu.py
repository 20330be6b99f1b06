"""CUDA-graph generation steps give the tokens of eager steps (GPU; the logic around the
graphs is tested on CPU in test_runtime_graphs.py)."""

from __future__ import annotations

import pytest
import torch

from tpspec import LLM, SamplingParams, SpeculativeConfig
from tpspec.model.tiny import make_tiny_checkpoint

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [100, 200, 300], [42] * 12, [7, 8], [9]]
PARAMS = [SamplingParams(), SamplingParams(temperature=0.8, seed=3), SamplingParams(), SamplingParams(),
          SamplingParams(temperature=1.0, seed=4)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", [None, SpeculativeConfig("ngram", 4)], ids=["plain", "ngram"])
def test_cuda_graphs_match_eager(tmp_path, spec):
    path = make_tiny_checkpoint(tmp_path / "tiny", seed=0)
    results = {}
    for graphs in (False, True):
        # In-process (a single plain process is rank 0 of a TP group of 1): the engine is inspectable.
        with LLM(path, launcher="torchrun", tp_size=1, device="cuda", dtype="float32", speculative=spec,
                 max_batch_size=4, use_cuda_graphs=graphs) as llm:
            greedy = [o.token_ids for o in llm.generate(PROMPTS, max_new_tokens=24)]
            mixed = [o.token_ids for o in llm.generate(PROMPTS, PARAMS, max_new_tokens=24)]
            engine = llm._executor.ctx.state["engine"]  # noqa: SLF001
            if graphs:
                assert engine.graphs is not None and engine.graphs.graphs, "no generation step was graphed"
                assert not engine.graphs.failed, f"captures failed: {engine.graphs.failed}"
            results[graphs] = (greedy, mixed)
    assert results[True] == results[False]
