"""Diagnostic: per-phase timestamps of ll_exchange_keys (variant tmp_gpu/v_xstamp) at TP=N on one GPU.

Every rank replays a CUDA graph of 30 max_keys calls on channel 1; the kernel stamps (lane 0 of each
warp) %globaltimer into g_xstamps[epoch % 32][warp][k]: k0 entry / epoch loaded, 1 keys staged,
2 after the first barrier, 3 published, 4 waited (warps with rows), 5 after the second barrier,
6 epoch written (warp 0). Prints medians (ns) from the earliest rank's entry of the same call.
Usage: python tmp_gpu/xstamps.py WORLD [ROWS,...]   (MPS up)
"""
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SRC = os.environ.get("XSTAMP_SRC", "tmp_gpu/v_xstamp")
NAMES = ["entry", "epoch loaded", "keys staged", "barrier 1", "published", "waited(max warp)", "barrier 2",
         "epoch written"]


def worker(rank, world, rows_list, port, queue):
    os.environ["TPSPEC_LL_SOURCE_DIR"] = SRC
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    sys.path.insert(0, ".")
    from tpspec.exchange import cuda_module
    from tpspec.exchange.ll import LLKeyExchange
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.cuda.set_device(0)
    ll = LLKeyExchange(dist.group.WORLD, max_rows=256, num_channels=2)
    import cupy as cp
    mod = cuda_module.load_module(0)
    g = mod.get_global("g_xstamps")
    stamps = cp.ndarray((32, 8, 16), dtype=cp.uint64, memptr=g)
    result = {}
    for rows in rows_list:
        keys = torch.randint(-2**62, 2**62, (rows,), device="cuda", dtype=torch.int64)
        for _ in range(20):
            ll.max_keys(keys, channel=1)
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(30):
                ll.max_keys(keys, channel=1)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        samples = []
        for _ in range(20):
            stamps.fill(0)
            torch.cuda.synchronize()
            dist.barrier()
            graph.replay()
            torch.cuda.synchronize()
            samples.append(stamps.get())
        result[rows] = np.stack(samples).astype(np.int64)
        del graph
    ll.check()
    ll.close()
    dist.barrier()
    queue.put((rank, result))
    dist.destroy_process_group()


def analyse(world, rows_list, per_rank):
    for rows in rows_list:
        a = np.stack([per_rank[r][rows] for r in range(world)])  # [rank, sample, epoch slot, warp, 16]
        entry = a[:, :, :, 0, 0]  # [rank, sample, slot]
        valid = (entry != 0).all(axis=0)  # calls every rank stamped
        t0 = np.where(valid, entry.min(axis=0), 0)
        print(f"\nTP={world}, {rows} rows: {int(valid.sum())} calls")
        cols = {
            0: a[:, :, :, 0, 0], 1: a[:, :, :, 0, 1], 2: a[:, :, :, :, 2].max(axis=3), 3: a[:, :, :, :, 4].max(axis=3),
            4: a[:, :, :, :, 6].max(axis=3), 5: a[:, :, :, :, 8].max(axis=3), 6: a[:, :, :, :, 10].max(axis=3),
            7: a[:, :, :, 0, 12],
        }
        for k, name in enumerate(NAMES):
            vals = [np.median((cols[k][r] - t0)[valid & (cols[k][r] != 0)]) for r in range(world)]
            print(f"  {name:18s} " + "  ".join(f"r{r} {v:7.0f}" for r, v in enumerate(vals)))
        # call period per rank: consecutive entries of the same sample, sorted
        periods = []
        for r in range(world):
            for s in range(a.shape[1]):
                e = np.sort(entry[r, s][entry[r, s] != 0])
                periods.extend(np.diff(e).tolist())
        print(f"  entry-to-entry period: median {np.median(periods):.0f} ns (p10 {np.percentile(periods, 10):.0f}, "
              f"p90 {np.percentile(periods, 90):.0f})")
        end = cols[7]
        dur = [np.median((end[r] - a[r, :, :, 0, 0])[valid & (end[r] != 0)]) for r in range(world)]
        print("  entry-to-epoch-written per rank: " + ", ".join(f"{d:.0f}" for d in dur))


if __name__ == "__main__":
    world = int(sys.argv[1])
    rows_list = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "1,64,256").split(",")]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, rows_list, 29731, queue)) for r in range(world)]
    for p in procs:
        p.start()
    per_rank = {}
    for _ in range(world):
        r, res = queue.get(timeout=300)
        per_rank[r] = res
    for p in procs:
        p.join()
    analyse(world, rows_list, per_rank)
