"""`tpspec check`: the determinism suite passes on CPU at TP=2, and catches a rank that disagrees."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tpspec import check as C
from tpspec.cli import main


def test_check_tp2_mp_cpu_passes(tmp_path, capsys):
    out = tmp_path / "check.json"
    code = main(["check", "--tp", "2", "--launcher", "mp", "--device", "cpu", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    report = json.loads(out.read_text())
    rows = {r["key"]: r for r in report["results"]}
    assert report["passed"] and not report["complete"]  # the CUDA rows cannot run on CPU
    assert [k for k, _ in C.PROPERTIES] == list(rows)[: len(C.PROPERTIES)]
    for key in ("ranks_agree", "greedy_argmax", "seeded_tp_invariant", "seeded_streams", "gumbel_exact",
                "rejection_exact", "deterministic_logits", "generate_tp"):
        assert rows[key]["status"] == C.PASS, rows[key]
        assert rows[key]["rows"] > 0 and rows[key]["mismatches"] == 0
    assert rows["gumbel_exact"]["p_value"] > C.P_VALUE_THRESHOLD
    assert rows["rejection_exact"]["p_value"] > C.P_VALUE_THRESHOLD
    # Rows that cannot apply on CPU are skipped with a reason, never failed.
    for key in ("ll_equals_allgather", "cuda_graph", "cpu_gpu_bits"):
        assert rows[key]["status"] == C.SKIP and "CUDA" in rows[key]["detail"]
    assert "FAIL" not in text


def test_perturbed_rank_fails_the_ranks_agree_row(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(C.PERTURB_ENV, "1")
    out = tmp_path / "check.json"
    code = main(["check", "--tp", "2", "--launcher", "mp", "--device", "cpu", "--quick", "--skip",
                 "generate_tp,rejection_exact", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 1
    rows = {r["key"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["ranks_agree"]["status"] == C.FAIL
    assert rows["ranks_agree"]["mismatches"] > 0 and "rank 1" in rows["ranks_agree"]["detail"]
    # The statistical row does not look at which rank disagrees: it still passes.
    assert rows["gumbel_exact"]["status"] == C.PASS
    assert rows["generate_tp"]["status"] == C.SKIP and "--skip" in rows["generate_tp"]["detail"]
    line = next(line for line in text.splitlines() if line.startswith(C.TITLES["ranks_agree"]))
    assert "FAIL" in line


def test_chi_square_rejects_a_wrong_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    _, p_good, dof = C.chi_square(torch.tensor([5010, 2985, 2005]), probs)
    _, p_bad, _ = C.chi_square(torch.tensor([4700, 3200, 2100]), probs)
    assert dof == 2 and p_good > 0.5 and p_bad < 1e-6


def test_emulated_tp_sizes_agree_on_adversarial_rows():
    gen = torch.Generator().manual_seed(0)
    full = C.adversarial_logits(2, 37, gen, 8)
    expected = torch.argmax(full, dim=-1)
    for tp in C.splittable_tp_sizes(37, C.EMULATED_TP_SIZES):
        assert torch.equal(C.emulated_tokens(full, tp), expected), tp


def test_merge_marks_a_property_failed_when_any_rank_fails():
    per_rank = [
        [C.CheckResult("greedy_argmax", C.PASS, rows=10)],
        [C.CheckResult("greedy_argmax", C.FAIL, rows=10, mismatches=2, detail="boom")],
    ]
    (merged,) = C.merge_rank_results(per_rank)
    assert merged.status == C.FAIL and merged.mismatches == 2 and "rank 1: boom" in merged.detail
    table = C.order_results([merged])
    assert C.exit_code(table) == 1
    assert C.exit_code([C.CheckResult("x", C.SKIP), C.CheckResult("y", C.PASS)]) == 0


def test_a_row_passes_only_when_every_part_ran():
    """Two parts of one row (the exchange-level and the runtime-level CUDA-graph checks): PASS
    needs both; one skipped makes the row PARTIAL, saying what did not run and why; the table,
    the JSON and the pytest tests keep it apart from PASS, and it does not fail the run."""
    ran = C.CheckResult("cuda_graph", C.PASS, rows=768, detail="LLKeyExchange: 4 replays")
    skipped = C.CheckResult("cuda_graph", C.SKIP, detail="generation with graphs vs eager (1 < 2 GPUs)")
    failed = C.CheckResult("cuda_graph", C.FAIL, rows=5, mismatches=1, detail="requests [0] differ")
    for a, b in ((ran, skipped), (skipped, ran)):
        row = C.combine(a, b)
        assert row.status == C.PARTIAL and row.rows == 768
        assert row.detail == "LLKeyExchange: 4 replays; not run: generation with graphs vs eager (1 < 2 GPUs)"
    assert C.combine(ran, ran).status == C.PASS and C.combine(ran, ran).rows == 2 * 768
    assert C.combine(skipped, skipped).status == C.SKIP and C.combine(skipped, skipped).detail == skipped.detail
    assert C.combine(failed, skipped).status == C.FAIL and C.combine(skipped, failed).status == C.FAIL
    assert C.combine(C.combine(ran, skipped), ran).status == C.PARTIAL
    # Ranks that skipped what others ran: PARTIAL too.
    (merged,) = C.merge_rank_results([[ran], [dataclasses.replace(ran, status=C.SKIP)]])
    assert merged.status == C.PARTIAL
    table = C.order_results([C.combine(ran, skipped)])
    text = C.format_results(table)
    assert "PARTIAL" in next(line for line in text.splitlines() if line.startswith(C.TITLES["cuda_graph"]))
    assert "0 passed, 1 partial, 0 failed" in text
    assert C.exit_code(table) == 0


def test_torchrun_launcher_without_environment_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        C.run_torchrun(2, "cpu")


def test_bad_tp_is_a_clear_error():
    with pytest.raises(SystemExit, match="--tp must be >= 1, got 0"):
        main(["check", "--tp", "0", "--device", "cpu"])


def test_unknown_skip_key_is_a_clear_error():
    with pytest.raises(SystemExit, match="unknown --skip"):
        main(["check", "--tp", "2", "--device", "cpu", "--skip", "nonsense"])


def test_tp1_skips_the_rows_that_would_compare_a_run_with_itself(tmp_path, capsys):
    out = tmp_path / "check.json"
    code = main(["check", "--tp", "1", "--launcher", "mp", "--device", "cpu", "--quick", "--skip",
                 "rejection_exact,gumbel_exact", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    rows = {r["key"]: r for r in json.loads(out.read_text())["results"]}
    for key in ("ranks_agree", "generate_tp"):
        assert rows[key]["status"] == C.SKIP and "--tp 2" in rows[key]["detail"], rows[key]
    assert rows["greedy_argmax"]["status"] == C.PASS
