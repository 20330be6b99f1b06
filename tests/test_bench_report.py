"""Benchmark reports without the ``bench`` extra: the table and JSON are written, the PNG is
skipped with a note saying how to get it."""

from __future__ import annotations

import json
import sys

from tpspec.bench.report import write_report


def test_report_without_matplotlib_skips_the_png(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    json_path, png_path = write_report(str(tmp_path), "demo", columns=["a", "b"], rows=[[1, 2.5]], meta={"k": 1},
                                       plot=lambda ax: ax.plot([0, 1]))
    assert png_path is None and not list(tmp_path.glob("*.png"))
    assert json.loads(open(json_path).read())["rows"] == [[1, 2.5]]
    assert "tpspec[bench]" in capsys.readouterr().out
