"""Logit controls on a GPU: masked and biased rows drawn through the LL exchange (two rank
processes sharing one GPU, MPS) equal the CPU full-row reference; structured outputs through
``LLM`` on CUDA validate, their steps run eagerly while the other steps stay graphed."""

from __future__ import annotations

import pytest
import torch

from tpspec.testing import run_ranks

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def mps():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from tpspec.testing import MPSDaemon

    daemon = MPSDaemon()
    reason = daemon.start()
    if reason is not None:
        pytest.fail(f"CUDA is available but NVIDIA MPS did not start ({reason}); ranks sharing a GPU need it")
    yield daemon
    daemon.stop()


def test_masked_draws_through_the_ll_exchange_equal_the_reference(mps):
    from test_sampling_controls import VOCAB, _controls, _references, masked_draws_worker
    from test_sampling_sharded import adversarial_batch

    batch = adversarial_batch(seed=5)
    controls, _ = _controls(batch["logits"].shape[0], VOCAB, seed=2)
    reference = _references(batch, controls)
    for res in run_ranks(masked_draws_worker, 2, "cuda", timeout_s=600):
        for kind in ("filtered", "temperature", "greedy"):
            assert torch.equal(res[kind], reference[kind]), kind


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_structured_outputs_on_cuda_validate_beside_graphed_steps():
    from tpspec import LLM, SamplingParams

    try:  # on a CUDA machine a missing test dependency fails the test instead of skipping it
        import jsonschema  # noqa: F401 - test_runtime_structured validates the JSON outputs with it
    except ImportError:
        pytest.fail("jsonschema (the dev extra) is not installed: the structured outputs cannot be validated")

    from test_runtime_structured import check_output, structured_batch

    prompts, params, checks = structured_batch(28, seed=1)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    with LLM("tiny", distributed_executor_backend="external_launcher", tensor_parallel_size=1, device="cuda",
             dtype="float32", max_num_seqs=8, speculative_config=spec) as llm:
        for out, check in zip(llm.generate(prompts, params), checks):
            assert out.outputs[0].finish_reason == "stop"
            check_output(out.outputs[0].text, check)
        llm.generate(["The cat sat"] * 4, SamplingParams(temperature=0, max_tokens=24))
        engine = llm._executor.ctx.state["engine"]  # noqa: SLF001
        assert engine.graphs is not None and engine.graphs.graphs and not engine.graphs.failed
