"""launch/gpu_run.sh, the GPU run behind docs/benchmarks.md: its step list, its selection of steps, and
that a failing or unbuilt step is recorded while the run goes on (checked on CPU, where GPU steps fail)."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch", "gpu_run.sh")


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=ROOT)
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)


def dry_run_group(out, group: str) -> tuple[str, dict[str, int], dict[str, str]]:
    """`gpu_run.sh --dry-run OUT group`: its output, each listed step's time limit (in run order) and
    each step's command line."""
    result = run_script("--dry-run", str(out), group)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    limits, commands = {}, {}
    for i, line in enumerate(lines):
        if line.endswith(" s]"):
            name = line.split(" [")[0]
            limits[name] = int(line.split(", ")[1].split(" s]")[0])
            commands[name] = lines[i + 1]
    return result.stdout, limits, commands


def test_dry_run_lists_every_step_and_runs_nothing(tmp_path):
    out = tmp_path / "out"
    result = run_script("--dry-run", str(out))
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert not out.exists()  # a dry run writes nothing
    expected = [
        "-m pytest -m gpu",
        "launch/ll_kernel_check.py",
        *(f"tpspec check --tp {tp} --device cuda" for tp in (2, 4, 8)),
        "bench exchange --device cuda --tp 1 ",
        *(f"bench exchange --device cuda --tp {tp} " for tp in (2, 4, 8)),
        *(f"bench step --device cuda --tp {tp} --vocab-size 131072 --batch 1,2,8,16,64 "
          f"--modes greedy,sampled,top_p,defaults" for tp in (2, 4, 8)),
        *(f"--tp {tp} --model-shape llama-3-8b --batch 1,8,32,64 --modes greedy" for tp in (1, 2, 4)),
        "bench generate --device cuda --tp 1 --model-shape llama-3-8b --rates 0,1.5,3 --timeout",
        "--spec draft_model --rates 0,1.5,3",
        "--spec eagle3 --rates 0,1.5,3",
        "--rates 0,1.5,3 --deterministic",
    ]
    for fragment in expected:
        assert fragment in text, fragment
    # Order: correctness before any measurement, the exchange before the runtime benches.
    assert text.index("gpu-tests [") < text.index("check-tp8 [") < text.index("exchange-tp1 [")
    assert text.index("exchange-tp8 [") < text.index("step-sampling-tp2 [") < text.index("generate-llama-3-8b-ngram [")
    # Every output lands under OUT_DIR.
    assert f"--out {out}/exchange-tp4" in text and f"--json {out}/check-tp2.json" in text
    # Every command parses with this build's `tpspec`.
    for name in ("check-tp2", "check-tp8", "exchange-tp1", "exchange-tp8", "step-llama-3-8b-tp1"):
        assert f"    {name}: accepted" in text
    assert "NOT ACCEPTED" not in text
    assert "quick" not in text and "profile" not in text and "switches" not in text  # these run only when named
    assert "rows-" not in text and "fused-" not in text


def test_fused_group_fits_nine_minutes_and_every_command_parses(tmp_path):
    """`gpu_run.sh OUT fused`: the GPU tests of rotary inside the attention and of the norm kernel
    storing `silu(gate) * up`, then the greedy steps as they run, with `FUSED_ROTARY` and with
    `FUSED_INPUT_ROWS` raised to 32, twice, under 9 minutes together."""
    text, limits, commands = dry_run_group(tmp_path / "out", "fused")
    runs = [f"fused-steps-{state}-{run}" for run in (1, 2) for state in ("default", "rotary", "norm")]
    assert list(limits) == ["fused-gpu-tests", *runs]
    assert sum(limits.values()) <= 540
    for name in runs:
        assert ("--set tpspec.model.attention.FUSED_ROTARY=True" in commands[name]) == ("-rotary-" in name), name
        assert ("--set tpspec.model.linear.FUSED_INPUT_ROWS=32" in commands[name]) == ("-norm-" in name), name
        assert "--roofline-batch 1,8,32 --verify-batch 1,8" in commands[name], name
        assert f"    {name}: accepted" in text
    tests = commands["fused-gpu-tests"]
    assert "test_paged_attention_triton.py::test_cuda_rotary_inside_equals_the_two_kernels" in tests
    assert "tests/test_gemv_triton.py::test_cuda_gate_up_stores_silu_mul" in tests and "NOT ACCEPTED" not in text


def test_profile_group_fits_nine_minutes_and_every_command_parses(tmp_path):
    """`gpu_run.sh OUT profile`: the roofline's one- and eight-request steps with `--profile` at 1K
    and 4K, its batch-64 decode step's greedy and sampled columns at 1K, and the Triton attention at
    forced split counts, under 9 minutes together."""
    text, limits, _ = dry_run_group(tmp_path / "out", "profile")
    names = ["profile-roofline-llama-3-8b", "profile-roofline-sampled-b64", "profile-attention-splits"]
    assert list(limits) == names
    assert sum(limits.values()) <= 520
    assert "--roofline-batch 1,8 --verify-batch 1,8 --profile" in text and "--num-splits 1,2,4,5,8,12,16" in text
    assert "--roofline-columns greedy,defaults,logprobs --contexts 1024 --roofline-batch 64 --verify-batch none --profile" in text
    for name in names:
        assert f"    {name}: accepted" in text
    assert "NOT ACCEPTED" not in text


def test_switches_group_fits_nine_minutes_and_every_command_parses(tmp_path):
    """`gpu_run.sh OUT switches`: the GPU tests of the sampled columns' tail kernels, then the
    batch-64 sampled columns with them off, on, off, on (`--set` of every switch to off), under 9
    minutes together."""
    text, limits, commands = dry_run_group(tmp_path / "out", "switches")
    runs = [f"switches-sampled-b64-{state}-{run}" for run in (1, 2) for state in ("off", "on")]
    assert list(limits) == ["switches-gpu-tests", *runs]
    assert sum(limits.values()) <= 540
    switches = ("--set tpspec.sampling.select.PENALIZED_KEYS_KERNEL=False "
                "--set tpspec.sampling.select.FILTERS_IN_DRAW_KERNEL=False "
                "--set tpspec.sampling.penalties.COUNT_KERNEL=False")
    for name in runs:
        assert (switches in commands[name]) == ("-off-" in name), name
        assert f"    {name}: accepted" in text
    assert "test_qwen_defaults_and_logprobs_at_batch_64_stay_in_the_graph" in commands["switches-gpu-tests"]
    assert "NOT ACCEPTED" not in text


def test_rows_group_fits_nine_minutes_and_every_command_parses(tmp_path):
    """`gpu_run.sh OUT rows`: the several-row GEMV's GPU tests, its linears at 8 and 32 rows, then the
    steps of 8 and 32 requests with gate/up and the LM head in cuBLAS, in the GEMV without and with
    `silu(gate) * up` stored by gate/up (the default), twice, under 9 minutes together."""
    text, limits, commands = dry_run_group(tmp_path / "out", "rows")
    runs = [f"rows-steps-{state}-{run}" for run in (1, 2) for state in ("cublas", "gemv", "default")]
    assert list(limits) == ["rows-gpu-tests", "rows-gemv-llama-3-8b", *runs]
    assert sum(limits.values()) <= 540
    for name in runs:
        assert ("--set tpspec.model.linear.TRITON_GEMV_ROWS=4" in commands[name]) == ("-cublas-" in name), name
        assert ("--set tpspec.model.linear.TRITON_GATE_UP_SILU=False" in commands[name]) == ("-gemv-" in name), name
        assert "--set" in commands[name] or "-default-" in name, name
        assert "--roofline-batch 8,32 --verify-batch 8" in commands[name], name
        assert f"    {name}: accepted" in text
    assert "--batch 8,32" in commands["rows-gemv-llama-3-8b"] and "    rows-gemv-llama-3-8b: accepted" in text
    assert "tests/test_gemv_triton.py -k 'bfloat16 or not float64_reference'" in commands["rows-gpu-tests"]
    assert "NOT ACCEPTED" not in text


def test_quick_group_fits_nine_minutes_and_every_command_parses(tmp_path):
    """`gpu_run.sh OUT quick`: the GPU tests, the roofline at the Llama 3 8B shape with every attention
    backend of torch and triton the runtime accepts, those backends' attention alone, tpspec against
    transformers at batch 1/8/32, and deterministic mode's cost, in that order, their time limits
    together under 9 minutes with room for the script's own start."""
    from tpspec.bench.roofline import accepted_attention_backends

    out = tmp_path / "out"
    text, limits, _ = dry_run_group(out, "quick")
    assert list(limits) == ["quick-gpu-tests", "quick-roofline-llama-3-8b", "quick-attention-llama-3-8b",
                            "quick-hf-llama-3-8b", "quick-deterministic-llama-3-8b"]
    assert sum(limits.values()) <= 520
    backends = ",".join(accepted_attention_backends(["torch", "triton"]))
    assert backends.startswith("torch")
    for fragment in ("-m pytest -m 'gpu and not slow' ",
                     # the case with the tail kernels switched off belongs to the switches group
                     "--deselect 'tests/test_runtime_gpu.py::test_qwen_defaults_and_logprobs_at_batch_64_stay_in_the_"
                     "graph[apart]' ",
                     "bench step --device cuda --tp 1 --model-shape llama-3-8b --roofline-only "
                     f"--attention-backends {backends} ",
                     f"bench attention --device cuda --model-shape llama-3-8b --backends {backends} ",
                     "bench generate --device cuda --tp 1 --model-shape llama-3-8b --baseline hf --num-prompts 1,8,32 ",
                     "--model-shape llama-3-8b --rates none --deterministic --num-prompts 1,8,32 ",
                     f"--out {out}/quick-roofline-llama-3-8b", f"--out {out}/quick-hf-llama-3-8b"):
        assert fragment in text, fragment
    for name in ("quick-roofline-llama-3-8b", "quick-attention-llama-3-8b", "quick-hf-llama-3-8b",
                 "quick-deterministic-llama-3-8b"):
        assert f"    {name}: accepted" in text
    assert "NOT ACCEPTED" not in text


def test_generate_steps_find_their_drafters(tmp_path):
    """The draft-model and EAGLE-3 steps pass no --draft-model: the target shape's defaults stand in
    (the Llama 3.2 1B shape, a random EAGLE-3 head of the target shape)."""
    import shlex

    from tpspec.bench.generate import default_draft_model
    from tpspec.cli import build_parser

    result = run_script("--dry-run", str(tmp_path / "out"), "generate")
    assert result.returncode == 0, result.stderr
    drafters = {}
    for line in result.stdout.splitlines():
        if "bench generate" in line and "--spec" in line:
            argv = shlex.split(line.split(" -m tpspec ", 1)[1])
            args = build_parser(argv).parse_args(argv)
            assert args.draft_model is None
            drafters[args.spec] = default_draft_model(args)
    assert drafters == {"draft_model": "shape:llama-3.2-1b", "eagle3": "shape-eagle3:llama-3-8b"}


def test_selection_by_group_and_step_name(tmp_path):
    result = run_script("--dry-run", str(tmp_path / "out"), "exchange", "ll-kernel-check")
    assert result.returncode == 0, result.stderr
    listed = [line.split(" [")[0] for line in result.stdout.splitlines() if line.endswith(" s]")]
    assert listed == ["ll-kernel-check", "exchange-tp1", "exchange-tp2", "exchange-tp4", "exchange-tp8"]

    bad = run_script("--dry-run", str(tmp_path / "out"), "exchnage")
    assert bad.returncode == 2 and "no group or step named 'exchnage'" in bad.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU steps fail only where there is no GPU")
def test_a_failing_step_is_recorded_and_the_run_goes_on(tmp_path):
    out = tmp_path / "out"
    result = run_script(str(out), "ll-kernel-check", "generate-llama-3-8b-eagle3")
    assert result.returncode == 1
    lines = (out / "summary.tsv").read_text().splitlines()
    assert lines[0] == "step\tstatus\texit_code\tseconds"
    rows = [line.split("\t") for line in lines[1:]]
    assert [r[0] for r in rows] == ["ll-kernel-check", "generate-llama-3-8b-eagle3"]
    assert rows[0][1:3] == ["failed", "2"]  # needs a CUDA device
    assert rows[1][1] in ("not-built", "failed")  # not-built until its options exist, then no CUDA device
    assert "needs a CUDA device" in (out / "ll-kernel-check.log").read_text()
    assert (out / "generate-llama-3-8b-eagle3.log").read_text().startswith("$ ")
    assert "commit:" in (out / "env.txt").read_text()
