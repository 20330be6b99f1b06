"""Session 22 probe: session 20's ``probe_ablation.py`` (same arguments, same output), plus
--b4 (every sampled call planned at four blocks an SM: 32 x 32K and 64 x 16K as 2048-column
pruned quads; its label gets -b4) and the kernel column named from each call's grid (so the
_tiles kernels show). Usage: PYTHONPATH=$REPO probe.py LABEL 8x16384,8x65536 [--floors] [--lm] [--b4]"""
import inspect, runpy, sys
from pathlib import Path

import tpspec.exchange.ll as L

if "--b4" in sys.argv:
    sys.argv.remove("--b4")
    sys.argv[1] += "-b4"
    L.SAMPLED_BLOCKS_PER_SM_FIRST = L.SAMPLED_BLOCKS_PER_SM  # the buffers are sized for four an SM already

if "grid_blocks" in inspect.signature(L.fused_kernel_name).parameters:  # a6e58d0's host has no _tiles kernels
    plan_chunks, kernel_name, last_grid = L.plan_chunks, L.fused_kernel_name, {}

    def recording_plan(rows, cols, elem_bytes, num_sms, sampled):  # the probe plans just before naming
        chunk, chunks = plan_chunks(rows, cols, elem_bytes, num_sms, sampled)
        last_grid.update(grid_blocks=rows * chunks, num_sms=num_sms)
        return chunk, chunks

    def grid_kernel_name(dtype, chunk, sampled, **grid):
        return kernel_name(dtype, chunk, sampled, **(grid or last_grid))

    L.plan_chunks, L.fused_kernel_name = recording_plan, grid_kernel_name

S20 = Path(__file__).resolve().parents[2] / "h200-2026-12-05-s20" / "scripts" / "probe_ablation.py"
runpy.run_path(str(S20), run_name="__main__")
