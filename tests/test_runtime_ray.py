"""The Ray launcher (a local Ray on CPU, one actor per rank) gives the tokens of the mp launcher."""

from __future__ import annotations

import pytest

from tpspec import LLM, SamplingParams, SpeculativeConfig
from tpspec.model.tiny import make_tiny_checkpoint

ray = pytest.importorskip("ray")

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [100, 200, 300], [42] * 12]
SEEDED = [SamplingParams(temperature=0.8, seed=7, max_tokens=20), SamplingParams(temperature=1.0, seed=8, max_tokens=20),
          SamplingParams(temperature=0.0, max_tokens=20)]


def _run(path: str, launcher: str) -> tuple[list, list]:
    spec = SpeculativeConfig("ngram", num_speculative_tokens=4)
    kwargs = {"ray_init_kwargs": {"num_cpus": 2}} if launcher == "ray" else {}
    with LLM(path, tensor_parallel_size=2, distributed_executor_backend=launcher, speculative_config=spec,
             max_num_seqs=4, **kwargs) as llm:
        greedy = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20))]
        sampled = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SEEDED)]
    return greedy, sampled


def test_ray_launcher_matches_mp(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "tiny", seed=0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TPSPEC_NUM_THREADS", "1")
        mp_greedy, mp_sampled = _run(path, "mp")
        ray_greedy, ray_sampled = _run(path, "ray")
    assert not ray.is_initialized()  # the LLM stopped the Ray it started
    assert ray_greedy == mp_greedy
    assert ray_sampled == mp_sampled
    assert mp_sampled[2] == mp_greedy[2]  # the greedy request in the sampled batch
