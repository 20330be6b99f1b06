"""Ray job entrypoint: run `tpspec generate` with one Ray actor per TP rank on the cluster
this job was submitted to (``ray job submit`` sets ``RAY_ADDRESS``; see ray_submit.sh).

    python launch/ray_job.py --tensor-parallel-size 8 --device cuda --model /ckpt/llama [other tpspec generate flags]

Placement: one ``{"GPU": 1}`` bundle per rank (``{"CPU": 1}`` with ``--device cpu``), packed
onto as few nodes as possible; ranks on one node see all of its GPUs (sorted as integers)
so the LL exchange can use CUDA IPC; a TP group across nodes uses the all-gather exchange.
"""

import sys

from tpspec.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--distributed-executor-backend" not in args:
        args = ["--distributed-executor-backend", "ray", *args]
    sys.exit(main(["generate", *args]))
