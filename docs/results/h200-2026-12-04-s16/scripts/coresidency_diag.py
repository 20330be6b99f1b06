"""Session 16 diagnostic: when the fused kernel's blocks cannot all be resident (run with a host variant that
pads each block's shared memory), which block lines did block 0 miss, and with which epochs? One process, one
call per case, a 2 s timeout; after each call prints the expected epoch and a histogram of the call's lines."""
import collections
import sys

import numpy as np
import torch

from tpspec.exchange.ll import LLKeyExchange, plan_chunks, fused_kernel_name


def lines_of(ll, blocks):
    host = np.zeros(blocks * 4, dtype=np.uint32)
    ll._cupy.cuda.runtime.memcpy(host.ctypes.data, ll.layout.block_lines(ll._base, 0), blocks * 16, 2)  # D2H
    return host.reshape(blocks, 4)


def epoch_of(ll):
    host = np.zeros(4, dtype=np.uint32)
    ll._cupy.cuda.runtime.memcpy(host.ctypes.data, ll.layout.ctrl(ll._base, 0), 16, 2)
    return host


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator().manual_seed(5)
    for rows, width, sampled in ((8, 65536, True), (8, 65536, False), (256, 65536, False), (64, 16384, True)):
        ll = LLKeyExchange(None, max_rows=4096, num_channels=1, timeout_s=2.0)
        x = (torch.randn(rows, width, generator=gen) * 3).to(torch.bfloat16).cuda()
        chunk, chunks = plan_chunks(rows, width, 2, sms, sampled)
        name = fused_kernel_name(torch.bfloat16, chunk, sampled)
        blocks = rows * chunks
        before = epoch_of(ll)
        kw = dict(temperature=torch.full((rows,), 0.8, device="cuda"),
                  seeds=torch.arange(rows, device="cuda"), offsets=torch.zeros(rows, dtype=torch.int64, device="cuda")) if sampled else {}
        out = ll.max_logits_keys(x, 0, **kw)
        torch.cuda.synchronize()
        after = epoch_of(ll)
        lines = lines_of(ll, blocks)
        ok = (lines[:, 1] == before[0]) & (lines[:, 3] == before[0])
        hist = collections.Counter(zip(lines[:, 1].tolist(), lines[:, 3].tolist()))
        missing = [b for b in range(1, blocks) if not ok[b]]
        print(f"{rows}x{width} sampled={sampled} kernel={name} blocks={blocks} epoch before={before[0]} after={after[0]} "
              f"error={after[1]} out[-1 count]={(out == -1).sum().item()} lines(epochs)={dict(hist)} "
              f"missing={len(missing)} first missing={missing[:12]}", flush=True)
        try:
            ll.close()
        except Exception as e:
            print("close:", type(e).__name__, e)


if __name__ == "__main__":
    sys.exit(main())
