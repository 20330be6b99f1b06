"""The README's user-facing Python is true: every spelling of its vLLM table runs as written,
top to bottom; its script that keeps ranks between executor calls prints what it says. Its first
Python example runs as a script in tests/test_install.py, against the package installed into a
fresh virtual environment."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def readme_table_spellings() -> list[str]:
    """The first column of the table under '### vLLM spellings', in order."""
    section = README.split("### vLLM spellings", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    rows = [re.match(r"^\| `(.+?)` \|", line) for line in section.splitlines()]
    return [m.group(1) for m in rows if m]


def readme_first_python_example() -> str:
    return README.split("```python\n", 1)[1].split("```", 1)[0]


def test_every_vllm_spelling_in_the_readme_runs(monkeypatch):
    from tpspec import LLM, SamplingParams

    monkeypatch.setenv("TPSPEC_NUM_THREADS", "1")
    spellings = readme_table_spellings()
    assert len(spellings) >= 10, spellings
    names: dict = {"LLM": LLM, "SamplingParams": SamplingParams}
    try:
        for code in spellings:
            exec(compile(code, "README.md", "exec"), names)  # noqa: S102 - the README's own code
        # What the spellings promise, checked on what they produced.
        out, params = names["out"], names["params"]
        assert len(out.outputs) == params.n == 2
        assert [c.index for c in out.outputs] == [0, 1]
        assert out.outputs[0].token_ids != out.outputs[1].token_ids
        assert all(c.finish_reason in ("stop", "length") for c in out.outputs)
        assert names["outputs"][0].prompt == "The cat sat"
        assert names["chat"][0].outputs[0].finish_reason in ("stop", "length")
        assert json.loads(names["js"].text)["pet"] in ("cat", "dog") and names["js"].finish_reason == "stop"
    finally:
        if "llm" in names:
            names["llm"].shutdown()


def test_the_readme_executor_script_keeps_state_between_calls(tmp_path):
    block = next(b.split("```", 1)[0] for b in README.split("```python\n")[1:] if "MPExecutor(GroupSpec" in b)
    script = tmp_path / "executor_script.py"
    script.write_text(block)
    env = dict(os.environ, PYTHONPATH=str(REPO), TPSPEC_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[0, 45]", proc.stdout
