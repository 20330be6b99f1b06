"""CUDA-graph generation steps give the tokens of eager steps (GPU; the logic around the
graphs is tested on CPU in test_runtime_graphs.py)."""

from __future__ import annotations

import pytest
import torch

from tpspec import LLM, SamplingParams, SpeculativeConfig
from tpspec.model.tiny import make_tiny_checkpoint

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [100, 200, 300], [42] * 12, [7, 8], [9]]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=24), SamplingParams(temperature=0.8, seed=3, max_tokens=24),
          SamplingParams(temperature=0.0, max_tokens=24), SamplingParams(temperature=0.0, max_tokens=24),
          SamplingParams(temperature=1.0, seed=4, max_tokens=24)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", [None, SpeculativeConfig("ngram", 4)], ids=["plain", "ngram"])
def test_cuda_graphs_match_eager(tmp_path, spec):
    path = make_tiny_checkpoint(tmp_path / "tiny", seed=0)
    results = {}
    for graphs in (False, True):
        # In-process (a single plain process is rank 0 of a TP group of 1): the engine is inspectable.
        with LLM(path, distributed_executor_backend="external_launcher", tensor_parallel_size=1, device="cuda",
                 dtype="float32", speculative_config=spec, max_num_seqs=4, enforce_eager=not graphs) as llm:
            greedy = _tokens(llm.generate(PROMPTS, GREEDY))
            mixed = _tokens(llm.generate(PROMPTS, PARAMS))
            engine = llm._executor.ctx.state["engine"]  # noqa: SLF001
            if graphs:
                assert engine.graphs is not None and engine.graphs.graphs, "no generation step was graphed"
                assert not engine.graphs.failed, f"captures failed: {engine.graphs.failed}"
            results[graphs] = (greedy, mixed)
    assert results[True] == results[False]
