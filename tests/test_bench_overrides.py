"""``--set MODULE.NAME=VALUE`` of the benchmarks: what it accepts, the errors that name what is wrong,
and that a rank process of ``tpspec bench step`` runs with the value."""

from __future__ import annotations

import json

import pytest

from tpspec.bench import overrides, roofline
from tpspec.cli import main


def test_parse_overrides_takes_literals_of_the_constants_type():
    got = overrides.parse_overrides([
        "tpspec.bench.roofline.PROFILE_STEPS=2",
        "tpspec.model.dependent_launch.PDL_KERNELS = False",
        "tpspec.bench.attention.MAX_LAYERS=4",
    ])
    assert got == {"tpspec.bench.roofline.PROFILE_STEPS": 2, "tpspec.model.dependent_launch.PDL_KERNELS": False,
                   "tpspec.bench.attention.MAX_LAYERS": 4}
    assert overrides.parse_overrides(None) == {}


@pytest.mark.parametrize("item, message", [
    ("PROFILE_STEPS=2", "expected MODULE.NAME=VALUE"),
    ("tpspec.bench.roofline.PROFILE_STEPS", "expected MODULE.NAME=VALUE"),
    ("os.SEP=1", "'os' is not a tpspec module"),
    ("tpspec.nowhere.X=1", "module 'tpspec.nowhere' does not import"),
    ("tpspec.bench.roofline.NOT_THERE=1", "no upper-case constant 'NOT_THERE'"),
    ("tpspec.bench.roofline.profile_rows=1", "no upper-case constant 'profile_rows'"),
    ("tpspec.bench.roofline.PROFILE_STEPS=two", "'two' is not a Python literal"),
    ("tpspec.bench.roofline.PROFILE_STEPS=2.5", "PROFILE_STEPS is int \\(5\\); got float 2.5"),
    ("tpspec.bench.roofline.PROFILE_STEPS=True", "PROFILE_STEPS is int \\(5\\); got bool True"),
    ("tpspec.model.dependent_launch.PDL_KERNELS=1", "PDL_KERNELS is bool"),
])
def test_parse_overrides_errors(item, message):
    with pytest.raises(SystemExit, match=message):
        overrides.parse_overrides([item], option="--set")


def test_tuples_keep_their_length_and_floats_take_ints():
    assert overrides._same_kind((8, 256), (16, 128)) and not overrides._same_kind((8, 256), (8, 256, 1))
    assert not overrides._same_kind((8, 256), (8.0, 256))
    assert overrides._same_kind(0.5, 1) and not overrides._same_kind(1, 0.5)


def test_bench_step_ranks_run_with_the_override(tmp_path):
    """The TP=2 ranks profile 2 steps a cell, not PROFILE_STEPS: the override reached them; the JSON's
    meta records it; this process's constant is put back by the test."""
    out = tmp_path / "bench"
    before = roofline.PROFILE_STEPS
    try:
        assert main(["bench", "step", "--device", "cpu", "--quick", "--tp", "2", "--roofline-only", "--roofline-batch",
                     "1", "--contexts", "16", "--verify-batch", "none", "--roofline-columns", "greedy", "--iters", "1",
                     "--warmup", "0", "--profile", "--set", "tpspec.bench.roofline.PROFILE_STEPS=2",
                     "--out", str(out)]) == 0
    finally:
        roofline.PROFILE_STEPS = before
    report = json.loads((out / "step_roofline.json").read_text())
    assert report["meta"]["overrides"] == {"tpspec.bench.roofline.PROFILE_STEPS": 2}
    for r in (0, 1):
        assert json.loads((out / "profile" / f"rank{r}-auto-decode-c16-b1-greedy.json").read_text())["steps"] == 2
