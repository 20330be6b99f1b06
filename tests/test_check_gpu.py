"""`tpspec check` on CUDA: the LL, CUDA-graph and CPU==GPU rows run and pass (skipped without a GPU);
a row of which a part cannot run on this machine reads PARTIAL, never PASS."""

from __future__ import annotations

import json

import pytest
import torch

from tpspec import check as C
from tpspec.cli import main
from tpspec.exchange import cuda_module

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_check_tp2_cuda_quick_passes(tmp_path, capsys):
    out = tmp_path / "check.json"
    code = main(["check", "--tp", "2", "--device", "cuda", "--quick", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    rows = {r["key"]: r for r in json.loads(out.read_text())["results"]}
    if torch.cuda.device_count() >= 2:  # the runtime's half (one GPU a rank) runs too
        assert rows["cuda_graph"]["status"] == C.PASS, rows["cuda_graph"]
        assert rows["generate_tp"]["status"] == C.PASS, rows["generate_tp"]
    else:  # one GPU: the exchange-level half passes, the runtime's cannot run
        assert rows["cuda_graph"]["status"] == C.PARTIAL, rows["cuda_graph"]
        assert "not run: generation with graphs vs eager" in rows["cuda_graph"]["detail"], rows["cuda_graph"]
        assert rows["generate_tp"]["status"] == C.SKIP, rows["generate_tp"]
    if cuda_module.cupy_or_none() is None:  # no cupy: the LL rows may only skip, and say why
        assert rows["ll_equals_allgather"]["status"] == C.SKIP, rows["ll_equals_allgather"]
        assert "cupy" in rows["ll_equals_allgather"]["detail"]
        assert rows["cpu_gpu_bits"]["status"] == C.PARTIAL, rows["cpu_gpu_bits"]
    else:  # with cupy the kernel must run: a compile or set-up failure is a FAIL, never a SKIP
        assert rows["ll_equals_allgather"]["status"] == C.PASS, rows["ll_equals_allgather"]
        assert rows["cpu_gpu_bits"]["status"] == C.PASS, rows["cpu_gpu_bits"]
        assert "LL kernel keys (0 of" in rows["cpu_gpu_bits"]["detail"], rows["cpu_gpu_bits"]
        assert rows["cuda_graph"]["detail"].startswith("LLKeyExchange"), rows["cuda_graph"]
