"""Table, JSON and PNG output shared by every benchmark."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from typing import Any, Sequence


def machine_description() -> dict[str, Any]:
    """What the numbers were measured on. torch's version and GPUs when the benchmark uses
    torch (a client benchmark such as ``bench serve`` never imports it)."""
    torch = sys.modules.get("torch")
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__ if torch is not None else None,
        "cpu_count": os.cpu_count(),
    }
    if torch is not None and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_count"] = torch.cuda.device_count()
    return info


def format_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table, right-aligned numbers."""
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    text_rows = [[cell(v) for v in row] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in text_rows)) if text_rows else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in text_rows]
    return "\n".join(lines)


def log_log_axes(ax: Any, *, xlabel: str, ylabel: str, title: str, legend_fontsize: float) -> None:
    """Finish a plot of times against sizes on ``ax``: both axes logarithmic (x in powers of two),
    the labels, the title and the legend."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=legend_fontsize)


def write_report(
    out_dir: str,
    name: str,
    *,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    meta: dict[str, Any],
    plot: Any | None = None,
) -> tuple[str, str | None]:
    """Print the table; write ``<out_dir>/<name>.json`` (meta, machine, columns, rows) and,
    when ``plot(ax)`` is given and ``matplotlib`` is installed (the ``bench`` extra),
    ``<out_dir>/<name>.png``; without matplotlib it says so and writes no PNG. Returns the two
    paths (the PNG's None when none was written)."""
    os.makedirs(out_dir, exist_ok=True)
    print(format_table(columns, rows))
    json_path = os.path.join(out_dir, f"{name}.json")
    with open(json_path, "w") as f:
        json.dump(
            {"benchmark": name, "machine": machine_description(), "meta": meta, "columns": list(columns),
             "rows": [list(r) for r in rows]},
            f,
            indent=2,
        )
    png_path = None
    try:
        import matplotlib
    except ImportError:
        if plot is not None:
            print("matplotlib is not installed: no PNG written (pip install 'tpspec[bench]' for plots)")
        plot = None
    if plot is not None:
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 5))
        plot(ax)
        fig.tight_layout()
        png_path = os.path.join(out_dir, f"{name}.png")
        fig.savefig(png_path, dpi=120)
        plt.close(fig)
    print(f"wrote {json_path}" + (f" and {png_path}" if png_path else ""))
    return json_path, png_path
