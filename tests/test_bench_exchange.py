"""``tpspec bench exchange --device cpu --quick`` runs on a CPU machine and writes valid JSON + PNG."""

from __future__ import annotations

import json

from tpspec.cli import main


def test_bench_exchange_cpu_quick(tmp_path, capsys):
    out = tmp_path / "bench"
    rc = main(["bench", "exchange", "--device", "cpu", "--quick", "--tp", "2", "--out", str(out),
               "--rows", "1,4", "--widths", "256"])
    assert rc == 0
    data = json.loads((out / "exchange.json").read_text())
    assert data["benchmark"] == "exchange" and data["meta"]["tp"] == 2
    variants = {row[4] for row in data["rows"]}
    assert {"local_torch", "ag_max_keys (gloo)", "ag_keys (gloo)", "ag_logits (gloo)"} <= variants
    assert all(isinstance(row[6], float) and row[6] > 0 for row in data["rows"])
    assert {row[1] for row in data["rows"]} == {1, 4}
    png = (out / "exchange.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    assert "us_per_call" in capsys.readouterr().out
