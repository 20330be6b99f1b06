"""What the tests of CUDA-graph generation steps share (``test_runtime_graphs.py`` on CPU,
``test_runtime_gpu.py`` on GPU): the prompts, Qwen2.5's sampling defaults, every speculative
configuration a graphed step runs with, the models behind them, and how two runs' outputs compare."""

from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path

import torch

from tpspec import SamplingParams, SpeculativeConfig
from tpspec.model.tiny import make_tiny_checkpoint, make_tiny_eagle3_head

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [100, 200, 300], [42] * 12, [7, 8], [9], [11, 12, 13]]
QWEN = dict(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)  # Qwen2.5's generation defaults
# "plain": no speculation; else the method, with "-rejection" for rejection sampling (strict otherwise).
SPECS = ["plain", "ngram", "ngram-rejection", "draft_model", "draft_model-rejection", "eagle3", "eagle3-rejection"]


def every_step_shape(max_tokens: tuple[int, int, int, int, int, int]) -> list[SamplingParams]:
    """One request of each graphed step shape, with these token budgets (unequal ones shrink the
    batch through the buckets): penalties with logprobs, Qwen's defaults with logprobs=5,
    temperature only, min-p only, top-p only, and a flat top-p row (T 3, p 0.99: its nucleus
    outgrows the candidates, so its steps are repeated eagerly)."""
    shapes = [dict(temperature=0.0, repetition_penalty=0.7, presence_penalty=-0.5, logprobs=3),
              dict(QWEN, seed=1, logprobs=5), dict(temperature=0.9, seed=2, logprobs=0),
              dict(temperature=1.0, min_p=0.2, seed=3), dict(temperature=1.0, top_p=0.9, seed=4),
              dict(temperature=3.0, top_p=0.99, seed=5)]
    return [SamplingParams(**shape, max_tokens=n) for shape, n in zip(shapes, max_tokens, strict=True)]


def make_models(root: Path) -> dict[str, str]:
    """The tiny target, its draft model and a random EAGLE-3 head for it, written under ``root``."""
    target = make_tiny_checkpoint(root / "tiny", seed=0)
    return {"target": str(target), "draft_model": str(make_tiny_checkpoint(root / "draft", seed=0, draft=True)),
            "eagle3": str(make_tiny_eagle3_head(root / "head", target))}


def spec_config(name: str, models: dict[str, str]) -> SpeculativeConfig | None:
    """The speculative config of a name of :data:`SPECS` (3 drafts)."""
    if name == "plain":
        return None
    method, _, acceptance = name.partition("-")
    return SpeculativeConfig(method, 3, model=models.get(method), acceptance=acceptance or "strict")


def first_outputs(outs) -> tuple[list[list[int]], list]:
    """The token ids and the logprobs of each ``RequestOutput``'s first sample."""
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


def assert_logprobs_close(got, ref, *, abs_tol: float, same_ranks: bool = True) -> None:
    """The same tokens in every step's dict, values within ``abs_tol`` (padding a batch to its
    bucket may move the logits' last bits, not the tokens), and the same ranks when asked."""
    for g, r in zip(got, ref):
        assert (g is None) == (r is None)
        for dg, dr in zip(g or [], r or []):
            assert list(dg) == list(dr)
            assert all(math.isclose(dg[t].logprob, dr[t].logprob, abs_tol=abs_tol) for t in dr)
            assert not same_ranks or all(dg[t].rank == dr[t].rank for t in dr)


# Checks that read values of CPU tensors only (a device tensor is not checked): (file, function).
CPU_ONLY_CHECKS = {("tpspec/model/batch.py", "check_token_range"), ("tpspec/model/batch.py", "validate")}
HOST_SYNCS = ("item", "tolist", "cpu", "numpy", "nonzero", "__int__", "__float__", "__bool__", "__index__")


@contextlib.contextmanager
def refusing_host_syncs():
    """Inside, the tensor methods that read a value on the host (:data:`HOST_SYNCS`: what CUDA
    graph capture forbids on the device) raise ``AssertionError``: on CPU, a step function that
    calls one would fail its capture on a GPU."""
    saved = {name: getattr(torch.Tensor, name) for name in HOST_SYNCS}

    def refuse(name):
        def method(*args, **kwargs):
            code = sys._getframe(1).f_code  # noqa: SLF001
            if not any(code.co_filename.endswith(f) and code.co_name == fn for f, fn in CPU_ONLY_CHECKS):
                raise AssertionError(f"Tensor.{name} in {code.co_name}: a host sync inside a step a CUDA graph "
                                     f"captures")
            return saved[name](*args, **kwargs)
        return method

    try:
        for name in HOST_SYNCS:
            setattr(torch.Tensor, name, refuse(name))
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
