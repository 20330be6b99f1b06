"""Programs started now and checked later, so that a test module's programs run side by side:
each is mostly one process's start-up and CPU work, and the machine has more than one core."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


class Started:
    """``args`` started in ``cwd`` with ``env``, its output in files ``stdout`` and ``stderr`` there
    (``<name>.out`` and ``<name>.err`` in ``logs``, where given)."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str], *, logs: Path | None = None,
                 name: str = "") -> None:
        self.args, self.cwd = args, cwd
        out, err = (logs / f"{name}.out", logs / f"{name}.err") if logs is not None else (cwd / "stdout", cwd / "stderr")
        self.out, self.err = open(out, "w+"), open(err, "w+")
        # Its own session, so that a program that hangs is ended with every process it started.
        self.proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=self.out, stderr=self.err, text=True,
                                     start_new_session=True)

    def output(self, timeout: float) -> tuple[int, str, str]:
        """``(exit code, stdout, stderr)`` once it exited (``subprocess.TimeoutExpired`` after ``timeout``)."""
        self.proc.wait(timeout=timeout)
        self.out.seek(0)
        self.err.seek(0)
        return self.proc.returncode, self.out.read(), self.err.read()

    def stdout(self, timeout: float) -> str:
        """Its output once it exited 0 (else the assertion says how it ended)."""
        code, out, err = self.output(timeout)
        assert code == 0, f"{self.args} exited {code}\n{out[-3000:]}\n{err[-3000:]}"
        return out

    def close(self) -> None:
        """End it (and what it started) if it still runs."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.out.close()
        self.err.close()
