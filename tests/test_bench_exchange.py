"""``tpspec bench exchange --device cpu --quick`` runs on a CPU machine and writes valid JSON + PNG."""

from __future__ import annotations

import json

from tpspec.bench.exchange import exchange_means, greedy_costs, gumbel_costs, torch_max_speedups
from tpspec.cli import main


def test_bench_exchange_cpu_quick(tmp_path, capsys):
    out = tmp_path / "bench"
    rc = main(["bench", "exchange", "--device", "cpu", "--quick", "--tp", "2", "--out", str(out),
               "--rows", "1,4", "--widths", "256"])
    assert rc == 0
    data = json.loads((out / "exchange.json").read_text())
    assert data["benchmark"] == "exchange" and data["meta"]["tp"] == 2
    variants = {row[4] for row in data["rows"]}
    assert {"local_torch", "local_torch_max", "ag_max_keys (gloo)", "ag_keys (gloo)", "ag_logits (gloo)"} <= variants
    assert {row[3] for row in data["rows"] if row[4] == "local_torch_max"} == {"greedy"}
    assert all(isinstance(row[6], float) and row[6] > 0 for row in data["rows"])
    assert {row[1] for row in data["rows"]} == {1, 4}
    png = (out / "exchange.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    assert "us_per_call" in capsys.readouterr().out


def test_gumbel_costs_are_ratios_to_the_greedy_call_of_the_same_shape():
    def row(variant, rows, width, mode, us):
        return {(variant, "graph", rows, width, mode): {"us": us}}

    merged = {}
    for part in (row("local_fused", 8, 1024, "greedy", 4.0), row("local_fused", 8, 1024, "gumbel", 7.0),
                 row("local_philox_floor", 8, 1024, "gumbel", 5.0), row("local_fused", 256, 1024, "greedy", 10.0),
                 row("local_fused", 256, 1024, "gumbel", 30.0), row("local_fused", 1, 1024, "greedy", 3.0),
                 row("ll_fused", 8, 1024, "gumbel", 99.0)):
        merged.update(part)
    costs = gumbel_costs(merged)
    assert [(c["rows"], c["gumbel_vs_greedy"], c["floor_vs_greedy"]) for c in costs] == [(8, 1.75, 1.25),
                                                                                          (256, 3.0, None)]
    assert gumbel_costs({}) == []


def test_greedy_costs_compare_the_call_with_the_read_only_launch_of_the_same_shape():
    merged = {
        ("local_fused", "graph", 256, 65536, "greedy"): {"us": 12.0, "hbm_pct": 66.0},
        ("local_read_floor", "graph", 256, 65536, "greedy"): {"us": 10.0, "hbm_pct": 79.2},
        ("local_fused", "graph", 8, 65536, "greedy"): {"us": 4.0, "hbm_pct": 5.0},  # no floor timed
        ("local_read_floor", "graph", 1, 16384, "greedy"): {"us": 2.0},  # no call timed
    }
    costs = greedy_costs(merged)
    assert [(c["rows"], c["width"], c["greedy_vs_floor"], c["greedy_pct"], c["floor_pct"]) for c in costs] == [
        (256, 65536, 1.2, 66.0, 79.2)]
    assert greedy_costs({}) == []


def test_torch_max_speedups_compare_the_greedy_call_with_torch_max_of_the_same_shape():
    merged = {
        ("local_fused", "graph", 1, 16384, "greedy"): {"us": 3.0},
        ("local_torch_max", "graph", 1, 16384, "greedy"): {"us": 6.3},
        ("local_fused", "graph", 8, 16384, "greedy"): {"us": 3.5},  # no torch.max timed
        ("local_fused", "graph", 1, 16384, "gumbel"): {"us": 5.5},
        ("local_torch_max", "eager", 8, 16384, "greedy"): {"us": 50.0},  # eager rows are not compared
    }
    assert [(s["rows"], s["width"], s["speedup"]) for s in torch_max_speedups(merged)] == [(1, 16384, 2.1)]
    assert torch_max_speedups({}) == []


def test_exchange_means_flag_an_uneven_exchange_from_the_slowest_ranks():
    def row(rank_us, rank_mean, variant="ll_argmax_tokens", rows=1):
        return dict(variant=variant, how="graph", rows=rows, width=0, mode="-", us=rank_us, us_mean=rank_mean)

    per_rank = [
        [row(2.3, 2.4), row(2.2, 2.3, "ll_max_keys"), row(2.5, 2.6, rows=8), dict(variant="local_fused", us=3.0)],
        [row(2.4, 7.5), row(2.1, 2.2, "ll_max_keys"), row(2.6, 2.7, rows=8)],  # a window of rank 1 waited at 1 row
    ]
    means = exchange_means(per_rank)
    assert [(m["variant"], m["rows"], m["median_us"], m["mean_us"], m["uneven"]) for m in means] == [
        ("ll_argmax_tokens", 1, 2.4, 7.5, True), ("ll_max_keys", 1, 2.2, 2.3, False),
        ("ll_argmax_tokens", 8, 2.6, 2.7, False)]
    assert exchange_means([[dict(variant="ag_keys", us=5.0)]]) == []
