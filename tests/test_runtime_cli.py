"""`tpspec generate`: the README's main job as a smoke test, and the torchrun launcher
(`launch/torchrun.sh`: every process a rank) giving the tokens of the mp launcher."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from started import Started
from tpspec import LLM, SpeculativeConfig
from tpspec.runtime.generate_cli import DEFAULT_PROMPTS

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    # The package's cache dir: the trained tiny model is made once for the whole suite.
    env = dict(os.environ, TPSPEC_NUM_THREADS="1", OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable))


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """The module's command lines, started at once, side by side: name -> :class:`Started`."""
    programs = {"main_job": [sys.executable, "-m", "tpspec", "generate"]}
    if TORCHRUN is not None:  # the README's script: torchrun, 2 ranks, the external launcher
        programs["torchrun"] = ["bash", str(REPO / "launch" / "torchrun.sh"), "--json", "--max-tokens", "16",
                                "--num-prompts", "3", "--temperature", "0.8", "--seed", "5"]
    runs: dict[str, Started] = {}
    try:
        for name, args in programs.items():
            runs[name] = Started(args, tmp_path_factory.mktemp(name), dict(_env(), PYTHON=sys.executable))
        yield runs
    finally:
        for run in runs.values():
            run.close()


def test_main_job_command(started):
    """`tpspec generate` with no arguments: tiny model, TP = 2, mp, CPU; outputs and a summary."""
    out = started["main_job"].stdout(300)
    assert "tp=2 backend=mp device=cpu" in out and "trained briefly" in out
    assert out.count("    tokens: ") == len(DEFAULT_PROMPTS)
    assert "tokens/s" in out and "mean accepted tokens per step" in out and "acceptance rate" in out
    assert "prefix cache on: " in out and " preemptions" in out


def test_bad_cli_arguments_exit_cleanly(capsys):
    from tpspec.cli import main

    assert main(["generate", "--temperature", "-1"]) == 2  # rejected before any worker starts
    assert "temperature" in capsys.readouterr().err


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not installed next to this python")
def test_torchrun_launcher_matches_mp(started):
    stdout = started["torchrun"].stdout(300)
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, stdout  # rank 0 prints, rank 1 stays silent
    report = json.loads(lines[0])
    assert "backend=external_launcher" in report["config"] and "tp=2" in report["config"]
    got = [o["outputs"][0]["token_ids"] for o in report["outputs"]]

    from tpspec import SamplingParams

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TPSPEC_NUM_THREADS", "1")
        with LLM("tiny", tensor_parallel_size=2, speculative_config=SpeculativeConfig("ngram", 4)) as llm:
            ref = llm.generate(DEFAULT_PROMPTS[:3], SamplingParams(temperature=0.8, seed=5, max_tokens=16))
    assert got == [o.outputs[0].token_ids for o in ref]


def test_help_and_version_do_not_import_torch():
    """``--help`` of every command and of every benchmark (``tpspec bench NAME --help``), and
    ``--version``, answer without importing torch (which takes seconds): each command's module is
    imported only once it is chosen, and imports torch only when it runs."""
    code = ("import sys\nfrom tpspec.bench import BENCHMARKS\nfrom tpspec.cli import COMMANDS, main\n"
            "for argv in ([['--help'], ['--version']] + [[name, '--help'] for name in COMMANDS]\n"
            "             + [['bench', name, '--help'] for name in BENCHMARKS]):\n"
            "    try:\n        main(argv)\n    except SystemExit as e:\n        assert e.code == 0, (argv, e.code)\n"
            "    assert 'torch' not in sys.modules, f'{argv} imported torch'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    import tpspec

    assert f"tpspec {tpspec.__version__}" in proc.stdout and "serve" in proc.stdout
    for option in ("--speculative-config", "--max-body-bytes", "--launcher", "--draft", "IN", "BENCHMARK",
                   "--logits", "--roofline-only", "--baseline", "--backends", "--request-rate", "llama-3-8b"):
        assert option in proc.stdout, option  # each command's own help, not an empty parser


def test_stop_strings_on_the_command_line_take_escapes():
    """``--stop "\\n"`` (a backslash and an n, as a shell passes it) stops at a newline."""
    from tpspec.runtime.generate_cli import unescape

    assert unescape(r"\n") == "\n" and unescape(r"\t|\r") == "\t|\r"
    assert unescape(r"a\\nb") == "a\\nb"  # an escaped backslash stays one backslash
    assert unescape(r"\x café") == r"\x café"  # other escapes, and non-ASCII text, are left alone


def test_summary_counts_are_spelled_right_and_the_random_head_says_so(capsys):
    """One request, one token: no "1 requests". The tiny EAGLE-3 head is random, and the output
    says so beside its near-zero acceptance."""
    from tpspec.cli import main

    argv = ["generate", "-tp", "1", "--prompt", "Once upon a time", "--max-tokens", "1", "--speculative-config",
            '{"method": "eagle3", "num_speculative_tokens": 2}']
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "summary: 1 request, 1 token in" in out and "1 step," in out, out
    assert "note: the tiny EAGLE-3 head is random" in out
