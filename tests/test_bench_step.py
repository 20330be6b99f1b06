"""`tpspec bench step --device cpu --quick` writes a valid JSON and PNG, and both selection
paths pick identical tokens."""

from __future__ import annotations

import json

import pytest

from tpspec.bench import roofline, step
from tpspec.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_bench_step_quick_cpu_writes_json_and_png(tmp_path):
    out = tmp_path / "bench"
    assert main(["bench", "step", "--device", "cpu", "--quick", "--out", str(out)]) == 0
    report = json.loads((out / "step.json").read_text())
    assert report["benchmark"] == "step" and report["columns"] == step.COLUMNS
    meta = report["meta"]
    assert meta["tp"] == 2 and meta["device"] == "cpu" and meta["vocab_size"] == step.QUICK_VOCAB
    assert meta["tokens_equal"] and all(meta["tokens_equal"].values())
    rows = [dict(zip(report["columns"], r)) for r in report["rows"]]
    # one row per (batch, mode, path)
    cells = {(r["batch"], r["mode"], r["path"]) for r in rows}
    assert cells == {(b, m, p) for b in step.QUICK_BATCHES for m in step.MODES for p in step.PATHS}
    for r in rows:
        assert r["forward_ms"] > 0 and r["select_ms"] > 0
        assert abs(r["step_ms"] - r["forward_ms"] - r["select_ms"]) < 1e-2
        assert 0 < r["select_share_%"] < 100
        assert r["rows"] == r["batch"] * (r["draft_len"] + 1)
    assert (out / "step.png").read_bytes()[:8] == PNG_MAGIC
    _check_roofline(out, roofline.QUICK_ROOFLINE_CONTEXTS, roofline.QUICK_ROOFLINE_BATCHES,
                    roofline.QUICK_VERIFY_BATCHES)


def _check_roofline(out, contexts, batches, verify_batches, *, warmup=1, iters=3):
    """The roofline JSON of a quick CPU run of the tiny bench model (2 layers, 1 KV head of 16 dims a rank at
    TP = 2, fp32: 256 KV bytes a token and rank)."""
    report = json.loads((out / "step_roofline.json").read_text())
    assert report["columns"] == roofline.TABLE_COLUMNS
    rows = [dict(zip(report["columns"], r)) for r in report["rows"]]
    expected = {("decode", c, b) for c in contexts for b in batches} | {("verify", c, b) for c in contexts
                                                                        for b in verify_batches}
    assert {(r["step"], r["context"], r["batch"]) for r in rows} == expected
    middle = warmup + (iters - 1) / 2  # tokens a request gained before the average timed step (decode)
    for r in rows:
        assert r["attention"] == "auto->torch" and r["floor_ms"] > 0 and r["greedy_ms"] > 0
        assert abs(r["ratio"] - r["greedy_ms"] / r["floor_ms"]) < 0.01 * r["ratio"] + 0.01
        if r["step"] == "decode":
            assert r["rows"] == 1 and r["paths"] == "eager/eager/eager"  # CPU: no CUDA graphs
            # Every request reads its cached entries and the one it writes (the table rounds to 10 kB).
            assert abs(r["kv_read_MB"] - r["batch"] * (r["context"] + middle + 1) * 256 / 1e6) <= 0.006
            for column in ("defaults", "logprobs"):
                assert abs(r[f"{column}_vs_greedy"] - r[f"{column}_ms"] / r["greedy_ms"]) < 0.01 * r[
                    f"{column}_vs_greedy"] + 0.01
        else:  # 3 drafts: 4 rows a request, 1 to 4 tokens emitted a step
            assert r["rows"] == 4 and r["paths"] == "eager/-/-" and r["defaults_ms"] == "-"
            low = r["batch"] * (r["context"] + middle + 4) * 256 / 1e6
            high = r["batch"] * (r["context"] + 4 * middle + 4) * 256 / 1e6
            assert low - 0.006 <= r["kv_read_MB"] <= high + 0.006
        target = (roofline.DECODE_TARGETS if r["step"] == "decode" else roofline.VERIFY_TARGETS).get(r["batch"])
        if target is None:
            assert r["verdict"] == "-" and r["checks"] == ""
        else:
            assert r["verdict"] == ("PASS" if r["ratio"] <= target else "FAIL")
            assert r["checks"] == f"greedy <= {target:g}x floor: {r['verdict']}"
    assert report["meta"]["attention_backends"] == ["auto"]
    assert (out / "step_roofline.png").read_bytes()[:8] == PNG_MAGIC


def test_bench_step_roofline_only_several_attention_backends(tmp_path, capsys):
    """--roofline-only writes the roofline alone; each backend of --attention-backends gets its rows, in its
    own rank processes: one that fails (FlashInfer needs CUDA) is named in the JSON, the others' rows stay,
    and the command exits 1."""
    out = tmp_path / "bench"
    assert main(["bench", "step", "--device", "cpu", "--quick", "--tp", "1", "--roofline-only",
                 "--attention-backends", "torch,flashinfer,auto", "--roofline-batch", "2", "--contexts", "16",
                 "--verify-batch", "none", "--roofline-columns", "greedy,logprobs", "--iters", "1",
                 "--out", str(out)]) == 1
    assert "the roofline failed for attention backend(s) flashinfer" in capsys.readouterr().out
    assert not (out / "step.json").exists()
    report = json.loads((out / "step_roofline.json").read_text())
    rows = [dict(zip(report["columns"], r)) for r in report["rows"]]
    assert [(r["attention"], r["step"], r["batch"]) for r in rows] == [("torch", "decode", 2),
                                                                       ("auto->torch", "decode", 2)]
    for r in rows:
        assert r["greedy_ms"] > 0 and r["logprobs_ms"] > 0 and r["defaults_ms"] == "-"
        assert r["paths"] == "eager/-/eager"
    meta = report["meta"]
    assert meta["attention_backends"] == ["torch", "flashinfer", "auto"]
    assert list(meta["failed"]) == ["flashinfer"] and "needs CUDA" in meta["failed"]["flashinfer"]


def test_bench_step_profile_writes_each_cells_operators_per_rank(tmp_path):
    """--profile: after the timed steps of each cell, every rank writes its profile (JSON and text), named by
    rank, backend, step, context, batch and column; on CPU the rows are operators by their own CPU time, the
    matmuls among them, and the TP=2 ranks' all-reduce shows. The table is written as without it."""
    out = tmp_path / "bench"
    assert main(["bench", "step", "--device", "cpu", "--quick", "--tp", "2", "--roofline-only", "--roofline-batch", "1",
                 "--contexts", "16", "--verify-batch", "1", "--roofline-columns", "greedy", "--iters", "1",
                 "--warmup", "0", "--profile", "--out", str(out)]) == 0
    report = json.loads((out / "step_roofline.json").read_text())
    assert len(report["rows"]) == 2 and report["meta"]["profile_dir"] == str(out / "profile")
    names = sorted(p.name for p in (out / "profile").iterdir())
    want = [f"rank{r}-auto-{step}-c16-b1-greedy.{ext}" for r in (0, 1) for step in ("decode", "verify")
            for ext in ("json", "txt")]
    assert names == sorted(want)
    for r in (0, 1):
        prof = json.loads((out / "profile" / f"rank{r}-auto-verify-c16-b1-greedy.json").read_text())
        assert prof["steps"] == roofline.PROFILE_STEPS and prof["what"] == "operators, own CPU time"
        rows = {row["name"]: row for row in prof["rows"]}
        assert rows["aten::mm"]["us_per_step"] > 0 and rows["aten::mm"]["calls_per_step"] >= 1
        assert any("allreduce" in name for name in rows)
        times = [row["us_per_step"] for row in prof["rows"]]
        assert times == sorted(times, reverse=True)
        text = (out / "profile" / f"rank{r}-auto-verify-c16-b1-greedy.txt").read_text().splitlines()
        assert text[0].startswith(f"rank{r}-auto-verify-c16-b1-greedy: {roofline.PROFILE_STEPS} steps")
        assert 1 < len(text) <= roofline.PROFILE_TOP + 1
    with pytest.raises(SystemExit, match="--profile profiles the roofline"):
        main(["bench", "step", "--device", "cpu", "--quick", "--no-roofline", "--profile", "--out", str(tmp_path)])


def test_profile_rows_keep_the_device_events_on_cuda():
    """On CUDA the rows are the device's events (kernels, copies) by device time; CPU operators are left out; the
    largest first. Elsewhere every operator with its own CPU time."""
    from types import SimpleNamespace

    def event(key, device_type, device_us, self_cpu_us, count=2):
        return SimpleNamespace(key=key, device_type=device_type, device_time_total=device_us,
                               self_cpu_time_total=self_cpu_us, count=count)

    events = [event("aten::mm", "DeviceType.CPU", 0.0, 40.0), event("gemv", "DeviceType.CUDA", 30.0, 0.0),
              event("Memcpy HtoD", "DeviceType.CUDA", 50.0, 0.0, 1), event("idle", "DeviceType.CUDA", 0.0, 0.0)]
    assert roofline.profile_rows(events, True) == [{"name": "Memcpy HtoD", "calls": 1, "us": 50.0},
                                                    {"name": "gemv", "calls": 2, "us": 30.0}]
    assert roofline.profile_rows(events, False) == [{"name": "aten::mm", "calls": 2, "us": 40.0}]
    rows = roofline.profile_rows(events, True, {"gemv": 12.5, "Memcpy HtoD": 50.0})
    assert rows == [{"name": "Memcpy HtoD", "calls": 1, "us": 50.0, "exposed_us": 50.0},
                    {"name": "gemv", "calls": 2, "us": 30.0, "exposed_us": 12.5}]


def test_exposed_device_time_counts_each_kernel_past_the_ones_before():
    """Each device event counts from where the events started before it had ended; one launched
    early that waits counts only its time past its predecessor, one inside another nothing, a gap
    nobody; CPU events are left out. The counts add up to the device's busy time."""
    from types import SimpleNamespace

    def event(name, start, end, device_type="DeviceType.CUDA"):
        return SimpleNamespace(name=name, device_type=device_type, time_range=SimpleNamespace(start=start, end=end))

    events = [event("attend", 0.0, 10.0), event("merge", 4.0, 12.0), event("gemv", 15.0, 30.0),
              event("norm", 20.0, 25.0), event("attend", 30.0, 35.0), event("aten::mm", 0.0, 100.0, "DeviceType.CPU")]
    exposed = roofline.exposed_device_time(reversed(events))
    assert exposed == {"attend": 15.0, "merge": 2.0, "gemv": 15.0, "norm": 0.0}
    assert sum(exposed.values()) == 32.0  # busy [0, 12] and [15, 35]


@pytest.mark.slow
def test_bench_step_real_shape_with_fewer_layers(tmp_path):
    """A real model shape (Qwen2.5 7B's layer: 28 heads, 4 KV heads, head_dim 128, q/k/v biases) built with
    random weights on the rank, one layer and a small vocabulary so it runs on CPU."""
    out = tmp_path / "shape"
    assert main(["bench", "step", "--device", "cpu", "--quick", "--tp", "1", "--model-shape", "qwen2.5-7b",
                 "--num-layers", "1", "--vocab-size", "2048", "--modes", "greedy", "--batch", "1",
                 "--roofline-batch", "2", "--contexts", "16", "--verify-batch", "none", "--iters", "1", "--warmup", "0",
                 "--out", str(out)]) == 0
    meta = json.loads((out / "step.json").read_text())["meta"]
    assert meta["model_path"] == "shape:qwen2.5-7b,num_layers=1,vocab_size=2048" and meta["vocab_size"] == 2048
    assert all(meta["tokens_equal"].values())
    row = dict(zip(roofline.TABLE_COLUMNS, json.loads((out / "step_roofline.json").read_text())["rows"][0]))
    # One Qwen2.5-7B layer + the 2048-row LM head, fp32, without the embedding table.
    layer = 3584 * (3584 + 2 * 512) + (3584 + 2 * 512) + 3584 * 3584 + 3 * 3584 * 18944 + 2 * 3584
    assert abs(row["weight_MB"] - (layer + 2048 * 3584 + 3584) * 4 / 1e6) < 0.1
    # 2 requests x 17 entries x 4 KV heads x 128 dims x K and V, fp32.
    assert abs(row["kv_read_MB"] - 2 * 17 * 4 * 128 * 2 * 4 / 1e6) < 0.01


def test_bench_step_rejects_bad_arguments(tmp_path):
    import pytest

    with pytest.raises(SystemExit, match="--modes"):
        main(["bench", "step", "--device", "cpu", "--quick", "--modes", "beam", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="positive"):
        main(["bench", "step", "--device", "cpu", "--quick", "--batch", "0", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--num-layers needs --model-shape"):
        main(["bench", "step", "--device", "cpu", "--quick", "--num-layers", "2", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="attention_backend must be"):
        main(["bench", "step", "--device", "cpu", "--quick", "--attention-backends", "torch,nope", "--out",
              str(tmp_path)])
    with pytest.raises(SystemExit, match="--roofline-columns"):
        main(["bench", "step", "--device", "cpu", "--quick", "--roofline-columns", "beam", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="leave nothing to run"):
        main(["bench", "step", "--device", "cpu", "--quick", "--roofline-only", "--no-roofline", "--out",
              str(tmp_path)])
    with pytest.raises(SystemExit, match="need .* positions"):
        main(["bench", "step", "--device", "cpu", "--quick", "--contexts", "100000", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="num_layers must be a positive int"):
        main(["bench", "step", "--device", "cpu", "--quick", "--model-shape", "llama-3-8b", "--num-layers", "0",
              "--out", str(tmp_path)])


def test_tokens_equal_compares_both_paths_on_every_rank():
    import torch

    def records(gather_out, sharded_out):
        base = {"batch": 1, "mode": "greedy", "rows": 3, "forward_ms": 1.0, "select_ms": 1.0}
        return [dict(base, path="sharded", first_output=sharded_out),
                dict(base, path="gather", first_output=gather_out)]

    same = torch.tensor([5, -1, -1, 5, 6, 7])
    _, equal = step.summarize([records(same, same), records(same, same)], draft_len=2)
    assert equal == {"B=1 greedy": True}
    other_rank = torch.tensor([5, -1, -1, 5, 6, 8])  # rank 1 disagrees on one row's target token
    _, equal = step.summarize([records(same, same), records(other_rank, other_rank)], draft_len=2)
    assert equal == {"B=1 greedy": False}
    _, equal = step.summarize([records(same, other_rank), records(same, same)], draft_len=2)
    assert equal == {"B=1 greedy": False}


def test_roofline_floor_and_kv_bytes():
    # 2 requests with 10 and 20 cached entries, 4 rows each, 100 bytes a token: (14 + 24) x 100.
    assert roofline.kv_bytes_read([10, 20], 4, 100) == 3800
    assert roofline.floor_ms(weight_bytes=3e9, kv_bytes=1e9, bandwidth=2e12) == pytest.approx(2.0)


@pytest.mark.parametrize("step_kind,batch,ratio,vs_greedy,expected", [
    ("decode", 1, 1.11, {}, [("greedy <= 1.12x floor", True)]),
    ("decode", 1, 1.13, {}, [("greedy <= 1.12x floor", False)]),
    ("decode", 8, 1.29, {}, [("greedy <= 1.3x floor", True)]),
    ("decode", 32, 1.31, {}, [("greedy <= 1.3x floor", False)]),
    ("decode", 4, 9.0, {"defaults": 2.0}, []),  # no target at batch 4, none for the sampled columns below 64
    ("decode", 8, 1.0, {"defaults": 2.0, "logprobs": 2.0}, [("greedy <= 1.3x floor", True)]),
    ("decode", 64, 1.2, {"defaults": 1.06, "logprobs": 1.04},
     [("greedy <= 1.3x floor", True), ("defaults <= 1.05x greedy", False), ("logprobs <= 1.05x greedy", True)]),
    ("decode", 64, None, {"defaults": None, "logprobs": 1.0}, [("logprobs <= 1.05x greedy", True)]),
    ("verify", 1, 1.19, {}, [("greedy <= 1.2x floor", True)]),
    ("verify", 8, 1.21, {}, [("greedy <= 1.2x floor", False)]),
    ("verify", 64, 1.0, {"defaults": 9.0}, []),
])
def test_roofline_targets(step_kind, batch, ratio, vs_greedy, expected):
    checks = roofline.roofline_checks(step_kind, batch, ratio, vs_greedy)
    assert checks == expected
    assert roofline.verdict(checks) == ("-" if not expected else "PASS" if all(ok for _, ok in expected) else "FAIL")


def test_roofline_rows_take_the_slowest_rank_and_the_column_ratios():
    def rec(column, step_ms, rank_floor, path="graph"):
        return {"kind": "roofline", "attention": "auto", "resolved": "torch", "step": "decode", "column": column,
                "context": 1024, "batch": 64, "rows": 1, "step_ms": step_ms, "floor_ms": rank_floor,
                "weight_bytes": 1e9, "kv_bytes": 2e6, "bandwidth": 3e12, "path": path}

    rank0 = [rec("greedy", 10.0, 8.0), rec("defaults", 10.4, 8.0, "eager"), rec("logprobs", 11.0, 8.0, "eager")]
    rank1 = [rec("greedy", 12.0, 8.5), rec("defaults", 12.0, 8.5, "eager"), rec("logprobs", 12.5, 8.5, "eager")]
    (row,) = roofline.roofline_rows([rank0, rank1])
    r = dict(zip(roofline.TABLE_COLUMNS, row))
    assert r["attention"] == "auto->torch" and r["greedy_ms"] == 12.0 and r["floor_ms"] == 8.5
    assert r["ratio"] == round(12.0 / 8.5, 3)
    assert r["defaults_vs_greedy"] == 1.0 and r["logprobs_vs_greedy"] == round(12.5 / 12.0, 3)
    assert r["paths"] == "graph/eager/eager" and r["copy_GBps"] == 3000.0
    assert r["verdict"] == "FAIL"  # 1.41x the floor; the sampled columns pass
    assert r["checks"] == ("greedy <= 1.3x floor: FAIL; defaults <= 1.05x greedy: PASS; "
                           "logprobs <= 1.05x greedy: PASS")
    assert roofline.path_of(5, 5) == "graph" and roofline.path_of(0, 5) == "eager"
    assert roofline.path_of(2, 5) == "graph 2/5"


def test_attention_backends_are_validated_by_the_runtime():
    from tpspec.runtime.config import EngineConfig

    assert roofline.accepted_attention_backends(["torch", "nope", "auto"], "cpu") == ["torch", "auto"]
    error = roofline.attention_backend_error("nope", "cpu")
    with pytest.raises(ValueError) as info:
        EngineConfig(model_path="-", tp_size=1, device="cpu", dtype="float32", attention_backend="nope")
    assert error == str(info.value)


def test_graphed_steps_count_what_the_runtime_graphs_ran():
    """The roofline's `paths` column counts the target steps the engine's CUDA graphs replayed
    (`GenerationGraphs.num_replayed`, which tests/test_runtime_gpu.py checks on a GPU; CPU runs have no
    graphs, so the counting is checked here against a stand-in)."""

    class Graphs:  # stands in for GenerationGraphs: only its replay counter is read
        num_replayed = 5

    class Engine:
        graphs = Graphs()

    engine = Engine()
    counter = roofline._GraphedSteps(engine)
    assert counter.graphed == 0
    engine.graphs.num_replayed += 2
    assert counter.graphed == 2
    counter.reset()
    assert counter.graphed == 0
    Engine.graphs = None
    assert roofline._GraphedSteps(Engine()).graphed == 0


def test_write_profile_lists_exposed_time_where_the_rows_have_it(tmp_path):
    """With ``exposed_us`` in every row (a CUDA profile), the JSON holds it per step and the text lists
    it beside each kernel's own time, their sum (the device's busy time) in the first line."""
    import torch

    rows = [{"name": "gemv", "calls": 4, "us": 60.0, "exposed_us": 50.0},
            {"name": "merge", "calls": 2, "us": 20.0, "exposed_us": 4.0}]
    roofline.write_profile(str(tmp_path), "cell", rows, 2, torch.device("cuda"))
    prof = json.loads((tmp_path / "cell.json").read_text())
    assert prof["rows"] == [{"name": "gemv", "calls_per_step": 2.0, "us_per_step": 30.0, "exposed_us_per_step": 25.0},
                            {"name": "merge", "calls_per_step": 1.0, "us_per_step": 10.0, "exposed_us_per_step": 2.0}]
    text = (tmp_path / "cell.txt").read_text().splitlines()
    assert "40.0 us a step in all" in text[0] and "27.0 us a step, the device busy" in text[0]
    assert text[1].split()[:4] == ["30.0", "us", "25.0", "exposed"] and text[2].endswith("merge")
