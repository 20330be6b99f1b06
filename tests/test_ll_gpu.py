"""LL exchange on a GPU: N rank processes sharing one GPU (CUDA IPC between processes,
gloo for bootstrap and for the all-gather reference, MPS so the ranks run concurrently).

Checks: LL tokens == all-gather tokens == the CPU reference (and torch.argmax
for greedy rows), winning keys bit-equal to the CPU reference, ranks agree; CUDA-graph
replays over two channels; a long back-to-back stress; the timeout error; the epoch cycle
(the calls at the end of the 32-bit cycle clear every line left, so none matches after the wrap).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tpspec import keys as K
from tpspec.exchange.base import Channel
from tpspec.testing import run_ranks

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def mps():
    """Skip only without a CUDA device. On a CUDA machine a cupy that does not import, or an MPS
    daemon that does not start, fails every test here with the cause: ranks sharing a GPU must
    run concurrently, or every exchange waits for a time slice. (This process creates no CUDA
    context itself.)"""
    from tpspec.testing import MPSDaemon

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure is the install's fault here
        pytest.fail(f"CUDA is available but cupy does not import ({type(exc).__name__}: {exc}); install the cuda "
                    "extra: pip install -e '.[cuda]' (cupy-cuda13x instead on CUDA 13, never both)")
    daemon = MPSDaemon()
    reason = daemon.start()
    if reason is not None:
        pytest.fail(f"CUDA is available but NVIDIA MPS did not start ({reason}); several rank processes share "
                    "a GPU here and need it")
    yield daemon
    daemon.stop()


def _exchanges(rank, max_rows=64, num_channels=2, timeout_s=60.0):
    from tpspec import distributed as D
    from tpspec.exchange import AllGatherKeyExchange
    from tpspec.exchange.ll import LLKeyExchange

    torch.cuda.set_device(rank % torch.cuda.device_count())
    group = D.tp_group()
    ll = LLKeyExchange(group, max_rows=max_rows, num_channels=num_channels, timeout_s=timeout_s)
    ag = AllGatherKeyExchange(group, device=ll.device)
    return group, ll, ag


# ------------------------------------------------------------------------ correctness

def _adversarial_rows(vocab: int, shard: int, world: int) -> torch.Tensor:
    """Rows that exercise ties across ranks, NaN, ±inf, ±0 and subnormals (float32)."""
    rows = []
    base = torch.linspace(-3, 3, vocab)
    rows.append(torch.zeros(vocab))  # all tie: column 0
    r = base.clone()
    r[[shard - 1, shard, vocab - 1]] = 10.0  # equal maxima in several shards: the first
    rows.append(r)
    r = base.clone()
    r[[vocab - 1, shard + 1]] = float("nan")  # NaNs: the first NaN wins
    rows.append(r)
    r = base.clone()
    r[[vocab // 2, 1]] = float("inf")
    rows.append(r)
    rows.append(torch.full((vocab,), float("-inf")))  # all -inf: column 0
    r = torch.zeros(vocab)
    r[0] = -0.0
    r[vocab - 1] = 0.0
    rows.append(r)  # ±0 tie: column 0
    r = torch.full((vocab,), -1.0)
    r[[3, vocab - 2]] = torch.tensor([1e-40, 2e-40])  # subnormals order (no flush to zero)
    rows.append(r)
    r = torch.full((vocab,), -1.0)
    r[[2, vocab - 3]] = torch.tensor([-1e-40, -2e-40])
    rows.append(r)
    r = base.clone()
    r[world * 0 + 5] = float("-inf")
    r[vocab - 1] = float("nan")
    r[0] = float("inf")
    rows.append(r)
    return torch.stack(rows)


def _case_inputs(gen, rows, vocab, world, dtype, kind):
    shard = -(-vocab // world)
    if kind == "adversarial":
        full = _adversarial_rows(vocab, shard, world)
        reps = -(-rows // full.shape[0])
        full = full.repeat(reps, 1)[:rows]
    elif kind == "flat":
        full = torch.zeros(rows, vocab)
    elif kind == "lm":
        # Like a real LM's logits: a few columns far above the rest, a masked (-inf) share.
        # Sampled rows skip Philox for most columns here (the kernel's pruning).
        full = torch.randn(rows, vocab, generator=gen) * 2.5
        top = torch.randint(0, vocab, (rows, 12), generator=gen)
        full.scatter_(1, top, 18.0 + torch.rand(rows, 12, generator=gen))
        full[:, ::9] = float("-inf")
    elif kind == "huge":
        full = torch.randn(rows, vocab, generator=gen) * 3e4  # float16 overflows some to +-inf
    else:
        full = torch.randn(rows, vocab, generator=gen) * 4
        # Coarse values: many exact ties inside and across shards.
        full[: rows // 2] = torch.round(full[: rows // 2])
    return full.to(dtype), shard


def _local_slice(full, rank, shard, layout, gen):
    """This rank's [R, shard] slice, padded past the vocab with values that must never win."""
    rows, vocab = full.shape
    begin = rank * shard
    width = shard
    pad = torch.full((rows, width), float("nan")).to(full.dtype)
    real = max(0, min(width, vocab - begin))
    pad[:, :real] = full[:, begin:begin + real]
    if real < width:
        pad[:, real:] = float("inf") if rank % 2 else float("nan")
    if layout == "strided":  # a view into a wider buffer: unaligned row stride
        wide = torch.zeros(rows, width + 3, dtype=full.dtype)
        wide[:, 1:width + 1] = pad
        return wide, (slice(None), slice(1, width + 1))
    return pad, None


def _correctness_worker(rank, world):
    from tpspec.exchange.base import UNSEEDED_STREAM_SEED

    group, ll, ag = _exchanges(rank, max_rows=64)
    dev = ll.device
    gen = torch.Generator().manual_seed(2024)
    failures, digests = [], []
    step = 0  # unseeded calls so far; ll and ag are kept in step
    cases = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for rows in (1, 3, 8, 64, 65):
            cases.append((dtype, rows, 997 + 2 * world, "random", "greedy", "contiguous"))
        cases.append((dtype, 9, 613, "adversarial", "greedy", "contiguous"))
        cases.append((dtype, 9, 613, "adversarial", "greedy", "strided"))
        cases.append((dtype, 9, 613, "adversarial", "seeded", "contiguous"))
        cases.append((dtype, 16, 40009, "random", "seeded", "contiguous"))
        cases.append((dtype, 64, 5003, "random", "mixed", "strided"))
        cases.append((dtype, 7, 3001, "random", "unseeded", "contiguous"))
        cases.append((dtype, 65, 1001, "random", "unseeded", "contiguous"))
        cases.append((dtype, 2, 50021, "random", "threshold", "contiguous"))
        # Slices starting at multiples of 4 on every rank at TP 2/4/8: the kernel's pruned path
        # (odd splits above take its column-by-column path on ranks > 0).
        cases.append((dtype, 12, 130688, "lm", "seeded", "contiguous"))  # several tiles per block
        cases.append((dtype, 24, 32672, "random", "seeded", "contiguous"))
        cases.append((dtype, 9, 32672, "adversarial", "seeded", "contiguous"))
        cases.append((dtype, 6, 20016, "huge", "seeded", "contiguous"))
        cases.append((dtype, 5, 7008, "huge", "tiny-t", "contiguous"))
    cases.append((torch.bfloat16, 0, 101, "random", "unseeded", "contiguous"))
    for index, (dtype, rows, vocab, kind, mode, layout) in enumerate(cases):
        name = f"case {index}: {dtype} rows={rows} vocab={vocab} {kind} {mode} {layout}"
        full, shard = _case_inputs(gen, rows, vocab, world, dtype, kind)
        local_cpu, view = _local_slice(full, rank, shard, layout, gen)
        local = local_cpu.to(dev)
        if view is not None:
            local = local[view]
        offset = rank * shard
        temperature = seeds = offsets = None
        if mode != "greedy":
            temperature = (torch.rand(rows, generator=gen) * 1.5 + 0.25).to(torch.float32)
            if mode == "mixed":
                temperature[::2] = 0.0
            if mode == "threshold":  # exactly at the float32 threshold samples, just below is greedy
                temperature = torch.tensor([1e-5, np.nextafter(np.float32(1e-5), np.float32(0))][:rows],
                                           dtype=torch.float64)
            if mode == "tiny-t":  # |logit / T| up to ~1e10 and beyond float32 (inf scores)
                temperature = torch.tensor([1e-5, 1e-4, 0.01, 1.0, 100.0][:rows], dtype=torch.float32)
        if mode in ("seeded", "mixed", "threshold", "tiny-t"):
            seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=gen)
            offsets = torch.randint(0, 2**40, (rows,), generator=gen)
        kw = dict(vocab_size=vocab)
        if temperature is not None:
            kw["rows"] = K.SamplingRows(temperature.to(dev), None if seeds is None else seeds.to(dev),
                                        None if seeds is None else offsets.to(dev))
        ll_step = step
        if mode == "unseeded":
            step += 2
        tok_ll = ll.argmax_logits(local, offset, **kw).cpu()
        keys_ll = ll.max_logits_keys(local, offset, channel=Channel.TARGET, **kw).cpu()
        if rows == 0:
            if mode == "unseeded":
                ag.step_counter.add_(2)
            if tok_ll.shape != (0,) or keys_ll.shape != (0,):
                failures.append(f"{name}: shapes {tuple(tok_ll.shape)} {tuple(keys_ll.shape)}")
            continue
        tok_ag = ag.argmax_logits(local, offset, **kw).cpu()
        if mode == "unseeded":
            ag.step_counter.add_(1)  # the LL made two unseeded calls (tokens, keys)
        if not torch.equal(tok_ll, tok_ag):
            failures.append(f"{name}: LL {tok_ll.tolist()[:8]} != all-gather {tok_ag.tolist()[:8]}")
        # Unseeded calls draw at consecutive steps, so only seeded/greedy keys match the tokens call.
        if mode != "unseeded" and not torch.equal(K.unpack_indices(keys_ll), tok_ll):
            failures.append(f"{name}: max_logits_keys disagrees with argmax_logits")
        digests.append(tok_ll.tolist())
        if rank == 0:  # the CPU reference on the full logits
            ref_rows = None if temperature is None else K.SamplingRows(temperature, seeds, offsets)
            ref_keys = []
            for s in ((ll_step, ll_step + 1) if mode == "unseeded" else (None, None)):
                if s is not None:
                    ref_rows = K.SamplingRows(temperature, torch.full((rows,), UNSEEDED_STREAM_SEED, dtype=torch.int64),
                                              (torch.tensor(s, dtype=torch.int64) << 32) + torch.arange(rows))
                ref_keys.append(K.local_row_keys(full, 0, vocab_size=vocab, rows=ref_rows))
            if not torch.equal(K.unpack_indices(ref_keys[0]), tok_ll):
                bad = (K.unpack_indices(ref_keys[0]) != tok_ll).nonzero().flatten().tolist()
                failures.append(f"{name}: LL tokens differ from the CPU reference at rows {bad[:8]}")
            if not torch.equal(ref_keys[1], keys_ll):
                bad = (ref_keys[1] != keys_ll).nonzero().flatten().tolist()
                failures.append(f"{name}: LL keys not bit-equal to the CPU reference at rows {bad[:8]}")
            if mode == "greedy":
                argmax = full.float().argmax(dim=-1)
                if not torch.equal(argmax, tok_ll):
                    failures.append(f"{name}: LL {tok_ll.tolist()[:8]} != torch.argmax {argmax.tolist()[:8]}")

    # argmax_tokens and max_keys, against the all-gather exchange and a CPU max.
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for rows in (1, 5, 64, 65):
            values = torch.randn(world, rows, generator=gen).round().to(dtype)
            values[:, 0] = float("nan") if rows > 1 else values[:, 0]
            cols = torch.randint(0, 500, (world, rows), generator=gen)
            got = ll.argmax_tokens(values[rank].to(dev), cols[rank].to(dev, torch.int32), rank * 500).cpu()
            want = ag.argmax_tokens(values[rank].to(dev), cols[rank].to(dev), rank * 500).cpu()
            ref = K.unpack_indices(K.pack_keys(values, cols + torch.arange(world).reshape(-1, 1) * 500).max(0).values)
            if not (torch.equal(got, want) and torch.equal(got, ref)):
                failures.append(f"argmax_tokens {dtype} rows={rows}: {got.tolist()[:6]} {want.tolist()[:6]}")
    for rows in (1, 2, 64, 65):
        keys = torch.randint(-(2**63), 2**63 - 1, (world, rows), generator=gen)
        keys[:, 0] = K.EMPTY_KEY
        if rows > 1:
            keys[:, 1] = 2**63 - 1
        got = ll.max_keys(keys[rank].to(dev), channel=rows % 2).cpu()
        if not torch.equal(got, keys.max(0).values):
            failures.append(f"max_keys rows={rows}: mismatch")
    try:
        ll.max_keys(torch.zeros(3, dtype=torch.int64, device=dev), channel=2)
        failures.append("channel 2 of 2 was accepted")
    except ValueError:
        pass
    ll.check()
    counters = (int(ll.step_counter.item()), int(ag.step_counter.item()))
    if counters != (step, step):
        failures.append(f"step counters {counters} != expected {(step, step)}")
    ll.close()
    ll.close()  # idempotent
    return failures, digests


@pytest.mark.parametrize("world", [2, 4, 8])
def test_ll_equals_allgather_and_reference(world):
    results = run_ranks(_correctness_worker, world, backend="gloo", timeout_s=600)
    for rank, (failures, _) in enumerate(results):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)
    for rank, (_, digests) in enumerate(results[1:], start=1):
        assert digests == results[0][1], f"rank {rank} returned other tokens than rank 0"


# ------------------------------------------------------------------------ CUDA graphs

REPLAYS = 10_000


def _graph_worker(rank, world):
    from tpspec.exchange.base import UNSEEDED_STREAM_SEED

    group, ll, _ = _exchanges(rank, max_rows=16)
    dev = ll.device
    gen = torch.Generator().manual_seed(77)
    rows, vocab, pool_size = 8, 3001, 8
    shard = -(-vocab // world)
    offset = rank * shard
    pool_full = (torch.randn(pool_size, rows, vocab, generator=gen) * 3).to(torch.bfloat16)
    pool_local = torch.full((pool_size, rows, shard), float("-inf"), dtype=torch.bfloat16)
    real = min(shard, vocab - offset)
    pool_local[:, :, :real] = pool_full[:, :, offset:offset + real]
    pool_local = pool_local.to(dev)
    expected_greedy = pool_full.float().argmax(dim=-1).to(dev)  # [pool, rows]
    keys_pool = torch.randint(-(2**62), 2**62, (pool_size, world, rows), generator=gen)
    expected_keys = keys_pool.max(dim=1).values.to(dev)
    keys_local = keys_pool[:, rank].contiguous().to(dev)

    static_logits = pool_local[0].clone()
    static_keys = keys_local[0].clone()
    flat = torch.zeros(rows, shard, dtype=torch.bfloat16, device=dev)
    temperature = torch.ones(rows, device=dev)

    def step():
        target = ll.argmax_logits(static_logits, offset, vocab_size=vocab, channel=Channel.TARGET)
        draft = ll.argmax_logits(flat, offset, vocab_size=vocab, rows=K.SamplingRows(temperature),
                                 channel=Channel.DRAFT)
        best = ll.max_keys(static_keys, channel=Channel.DRAFT)
        return target, draft, best

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up (advances the step counter once)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        target, draft, best = step()
    hist_target = torch.empty(REPLAYS, rows, dtype=torch.int64, device=dev)
    hist_draft = torch.empty_like(hist_target)
    bad_keys = torch.zeros((), dtype=torch.int64, device=dev)
    for i in range(REPLAYS):
        static_logits.copy_(pool_local[i % pool_size])
        static_keys.copy_(keys_local[i % pool_size])
        graph.replay()
        hist_target[i].copy_(target)
        hist_draft[i].copy_(draft)
        bad_keys += (best != expected_keys[i % pool_size]).sum()
    torch.cuda.synchronize()
    ll.check()
    failures = []
    want = expected_greedy[torch.arange(REPLAYS, device=dev) % pool_size]
    wrong = (hist_target != want).any(dim=1).nonzero().flatten().tolist()
    if wrong:
        failures.append(f"greedy target wrong on {len(wrong)} replays, first {wrong[:5]}")
    if int(bad_keys):
        failures.append(f"max_keys wrong {int(bad_keys)} times")
    if int(ll.step_counter.item()) != REPLAYS + 1:
        failures.append(f"step counter {int(ll.step_counter.item())} != {REPLAYS + 1}")
    draft_cpu = hist_draft.cpu()
    changed = (draft_cpu[1:] != draft_cpu[:-1]).float().mean().item()
    if changed < 0.99:  # uniform over 3001 columns: consecutive draws repeat with p = 1/3001
        failures.append(f"unseeded draws changed between replays only {changed:.3f} of the time")
    if rank == 0:  # replay i used step i + 1 (the warm-up took step 0): check a sample on CPU
        flat_full = torch.zeros(rows, vocab, dtype=torch.bfloat16)
        for i in list(range(0, REPLAYS, 997)) + [REPLAYS - 1]:
            offsets = (torch.tensor(i + 1, dtype=torch.int64) << 32) + torch.arange(rows)
            seeds = torch.full((rows,), UNSEEDED_STREAM_SEED, dtype=torch.int64)
            ref = K.unpack_indices(K.local_row_keys(flat_full, 0, vocab_size=vocab,
                                                    rows=K.SamplingRows(torch.ones(rows), seeds, offsets)))
            if not torch.equal(ref, draft_cpu[i]):
                failures.append(f"replay {i}: draft {draft_cpu[i].tolist()} != CPU reference {ref.tolist()}")
    ll.close()
    return failures, draft_cpu


@pytest.mark.parametrize("world", [2, 4])
def test_ll_cuda_graph_two_channels_many_replays(world):
    results = run_ranks(_graph_worker, world, backend="gloo", timeout_s=600)
    for rank, (failures, _) in enumerate(results):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)
    for rank, (_, draws) in enumerate(results[1:], start=1):
        assert torch.equal(draws, results[0][1]), f"rank {rank} drew other tokens than rank 0"


# ---------------------------------------------------------------------------- stress

STRESS_CALLS = 100_000


def _stress_worker(rank, world):
    group, ll, _ = _exchanges(rank, max_rows=64)
    dev = ll.device
    rng = np.random.default_rng(5)
    row_counts = rng.integers(1, 65, size=STRESS_CALLS)
    row_counts[::997] = 65  # now and then past max_rows: the all-gather path
    gen = torch.Generator().manual_seed(11)
    pool, width = 16, 700
    keys_pool = torch.randint(-(2**63), 2**63 - 1, (pool, world, 65), generator=gen)
    keys_pool[:, :, ::7] = K.EMPTY_KEY
    expected_keys = keys_pool.max(dim=1).values.to(dev)
    keys_local = keys_pool[:, rank].contiguous().to(dev)
    full = (torch.randn(pool, 65, width * world, generator=gen) * 2).round().to(torch.bfloat16)
    expected_tokens = full.float().argmax(dim=-1).to(dev)
    logits_local = full[:, :, rank * width:(rank + 1) * width].contiguous().to(dev)
    bad = torch.zeros((), dtype=torch.int64, device=dev)
    for i in range(STRESS_CALLS):
        r, p = int(row_counts[i]), i % pool
        if i % 5 == 4:
            out = ll.argmax_logits(logits_local[p, :r], rank * width, channel=i & 1)
            bad += (out != expected_tokens[p, :r]).sum()
        else:
            out = ll.max_keys(keys_local[p, :r], channel=i & 1)
            bad += (out != expected_keys[p, :r]).sum()
    torch.cuda.synchronize()
    ll.check()
    ll.close()
    return int(bad)


def test_ll_stress_back_to_back_calls():
    assert run_ranks(_stress_worker, 4, backend="gloo", timeout_s=600) == [0, 0, 0, 0]


# --------------------------------------------------------------------------- one wave or more

# (rows, width, sampled): each needs more than one wave at one block an SM when two ranks share
# an H200 (66 SMs each); test_ll_cpu checks that on any machine, since ll_plan.plan decides it.
WAVE_CASES = ((16, 65536, True), (64, 16384, True), (256, 65536, False))


def _more_than_one_wave_worker(rank, world):
    """Fused calls whose grid does not fit the GPU at once: every block asks for 130 KiB of
    shared memory it does not use, so one block fits an SM and a 512-block grid runs in
    several waves, while the other rank's blocks compete for the same SMs. With the collector
    in block 0, later blocks did not start while it waited, and the call timed out. (The
    padding assumes an SM of 228 KiB of shared memory, as on the H100 and H200.)"""
    from tpspec.exchange import ll_plan

    group, ll, ag = _exchanges(rank, max_rows=64, timeout_s=5.0)
    for kernel in ll._kernels.values():
        kernel.max_dynamic_shared_size_bytes = 200 * 1024
    padded = ll_plan.fused_shared_bytes
    ll_plan.fused_shared_bytes = lambda rows, chunks: padded(rows, chunks) + 130 * 1024
    sms = torch.cuda.get_device_properties(ll.device).multi_processor_count
    assert ll.plan_sms == sms // world  # every rank on this one GPU plans for its share
    gen = torch.Generator().manual_seed(31)
    bad = 0
    try:
        for rows, width, sampled in WAVE_CASES:
            launch = ll_plan.plan(rows, width, "bfloat16", "sampled" if sampled else "greedy", ll.plan_sms)
            assert launch.blocks > sms, "the case must need more than one wave at one block an SM"
            full = (torch.randn(rows, width * world, generator=gen) * 3).to(torch.bfloat16)
            local = full[:, rank * width:(rank + 1) * width].contiguous().to(ll.device)
            kw = {}
            if sampled:
                kw = dict(rows=K.SamplingRows(torch.full((rows,), 0.8, device=ll.device),
                                              torch.arange(rows, device=ll.device),
                                              torch.zeros(rows, dtype=torch.int64, device=ll.device)))
            got = ll.argmax_logits(local, rank * width, **kw)
            want = ag.argmax_logits(local, rank * width, **kw)
            bad += int((got != want).sum())
        ll.check()
    finally:
        ll_plan.fused_shared_bytes = padded
    ll.close()
    return bad


def test_ll_fused_call_larger_than_one_wave():
    assert run_ranks(_more_than_one_wave_worker, 2, backend="gloo", timeout_s=300) == [0, 0]


# --------------------------------------------------------------------------- timeout

def _timeout_worker(rank, world):
    import time

    from tpspec import distributed as D
    from tpspec.exchange.ll import LLTimeoutError

    group, ll, _ = _exchanges(rank, max_rows=1024, timeout_s=2.0)
    keys = torch.arange(4, dtype=torch.int64, device=ll.device) * (rank + 1)
    first = ll.max_keys(keys).cpu().tolist()  # everyone takes part: fine
    result = None
    if rank != world - 1:  # the last rank skips the next call on channel 1
        # 1000 rows: a waiting thread serves up to 4 of them, and the whole call must still
        # give up after one timeout, not one per row.
        many = torch.arange(1000, dtype=torch.int64, device=ll.device)
        begin = time.monotonic()
        ll.max_keys(many, channel=1)
        try:
            ll.check()
        except LLTimeoutError as exc:
            result = (str(exc), exc.channel, exc.epoch, exc.missing_ranks, time.monotonic() - begin)
        try:
            ll.max_keys(keys)
            again = "no error"
        except LLTimeoutError as exc:
            again = str(exc)
        result = (result, again)
    D.all_gather_object(None, group)  # the skipping rank waits here, then everyone closes
    ll.close()
    return first, result


def test_ll_timeout_names_channel_epoch_and_missing_rank():
    world = 3
    results = run_ranks(_timeout_worker, world, backend="gloo", timeout_s=300)
    for rank, (first, result) in enumerate(results):
        assert first == [3 * k for k in range(4)]
        if rank == world - 1:
            assert result is None
            continue
        (message, channel, epoch, missing, seconds), again = result
        assert (channel, epoch, missing) == (1, 1, [world - 1]), message
        assert seconds < 2 * 2.0, f"the timed-out call took {seconds:.1f} s with timeout_s=2"  # not 4 timeouts
        assert "channel 1" in message and "epoch 1" in message and f"rank {world - 1}" in message
        assert "timed out" in again


# ------------------------------------------------------------------- epoch cycle

_MEMCPY_DEVICE_TO_HOST = 2


def _device_words(ll, address, count):
    """``count`` uint32 words of this rank's exchange buffer at ``address`` (synchronizes)."""
    torch.cuda.synchronize()
    out = np.zeros(count, dtype=np.uint32)
    ll._cupy.cuda.runtime.memcpy(out.ctypes.data, address, out.nbytes, _MEMCPY_DEVICE_TO_HOST)
    return out


def _set_epoch(ll, group, channel, epoch):
    """Every rank sets the channel's epoch while no call is in flight (between barriers)."""
    from tpspec import distributed as D
    from tpspec.exchange.ll import _CUDA_MEMCPY_HOST_TO_DEVICE

    torch.cuda.synchronize()
    D.all_gather_object(None, group)
    word = np.array([epoch], dtype=np.uint32)
    ll._cupy.cuda.runtime.memcpy(ll.layout.ctrl(ll._base, channel), word.ctypes.data, 4,
                                 _CUDA_MEMCPY_HOST_TO_DEVICE)
    torch.cuda.synchronize()
    D.all_gather_object(None, group)


def _epoch_cycle_worker(rank, world):
    import time

    from tpspec import distributed as D

    group, ll, ag = _exchanges(rank, max_rows=64)
    dev = ll.device
    ctrl = ll.layout.ctrl(ll._base, 0)
    slot_words = 2 * world * 64 * 4
    failures = []
    # Lines at all 64 rows from epochs 1..4 (max_keys) and 5 (a fused call, which also
    # leaves 255 block lines): what a late rank's peer could take again after the wrap.
    for epoch in range(1, 5):
        keys = torch.arange(64, dtype=torch.int64, device=dev) + 10**12 * (rank + 1) + epoch
        ll.max_keys(keys)
    logits = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16)
    ll.argmax_logits(logits, rank * 4096)
    if not _device_words(ll, ll.layout.slots(ll._base, 0), slot_words).any():
        failures.append("no lines left in the slots before the wrap (the test would prove nothing)")
    # The end of the cycle, one row a call: rows 1..63 keep their old lines until the
    # calls of epochs 0xFFFFFFFE and 0xFFFFFFFF clear them.
    _set_epoch(ll, group, 0, 0xFFFFFFFD)
    for _ in range(3):
        ll.max_keys(torch.tensor([rank], dtype=torch.int64, device=dev))
    slots = _device_words(ll, ll.layout.slots(ll._base, 0), slot_words)
    block_lines = _device_words(ll, ll.layout.block_lines(ll._base, 0), 4 * ll.layout.max_blocks)
    D.all_gather_object(None, group)  # no rank starts the next cycle before both have looked
    if slots.any():
        failures.append(f"{np.count_nonzero(slots.reshape(-1, 4).any(axis=1))} slot lines left after the cycle")
    if block_lines.any():
        failures.append(f"{np.count_nonzero(block_lines.reshape(-1, 4).any(axis=1))} block lines left after the cycle")
    # The new cycle: epochs 2 and 3 at one row (rows 1..63 keep what epochs 4 and 5 of the
    # old cycle left, unless it was cleared), then 4 (max_keys) and 5 (fused) at all 64
    # rows with the last rank 0.3 s late: its peer must wait for its new lines, not take
    # the old ones (nor, in the fused call, the old block lines).
    gen = torch.Generator().manual_seed(5)
    for epoch, rows in ((2, 1), (3, 1), (4, 64), (5, 64)):
        keys = torch.randint(-2**62, 2**62, (rows,), generator=gen).add_(rank).to(dev)
        logits = torch.randn(rows, 4096, generator=gen).to(dev, torch.bfloat16)
        if rank == world - 1:
            time.sleep(0.3)
        if epoch < 5:
            got, want = ll.max_keys(keys), ag.max_keys(keys)
        else:
            got, want = ll.argmax_logits(logits, rank * 4096), ag.argmax_logits(logits, rank * 4096)
        if not torch.equal(got, want):
            failures.append(f"epoch {epoch} after the wrap: {got.tolist()[:4]}... != {want.tolist()[:4]}...")
    after = int(_device_words(ll, ctrl, 1)[0])
    if after != 6:  # epochs 2..5 used after the wrap
        failures.append(f"epoch after the wrap is {after}, expected 6")
    ll.check()
    ll.close()
    return failures


def test_ll_epoch_wrap_clears_stale_lines():
    assert run_ranks(_epoch_cycle_worker, 2, backend="gloo", timeout_s=300) == [[], []]


def _gather_rows_worker(rank: int, world: int) -> int:
    """LL gather_rows / sum_rows against the all-gather (one launch while rows * C fits the
    slots, the all-gather beyond), then the sharded filters through the LL exchange against
    the full-row reference."""
    from test_sampling_sharded import VOCAB, adversarial_batch, reference_tokens, shard

    from tpspec.sampling.select import sample_filtered
    from tpspec.vocab_parallel import VocabShardedLogits

    _, ll, ag = _exchanges(rank, max_rows=256)
    gen = torch.Generator().manual_seed(7)
    bad = 0
    for rows, width in ((1, 1), (3, 64), (4, 64), (5, 64), (256, 1), (300, 1)):  # 4 x 64 = 256 slots fit
        values = (torch.randint(-(2**62), 2**62, (rows, width), generator=gen) + rank).to(ll.device)
        for channel in (0, 1):
            bad += int((ll.gather_rows(values, channel=channel) != ag.gather_rows(values, channel=channel)).sum())
            column = values[:, 0].contiguous()
            bad += int((ll.sum_rows(column, channel=channel) != ag.sum_rows(column, channel=channel)).sum())
    batch = adversarial_batch()
    local, offset = shard(batch["logits"], world, rank)
    logits = VocabShardedLogits(local.to(ll.device), offset, VOCAB, ll)
    rows = K.SamplingRows(*(batch[k].to(ll.device) for k in ("temperature", "seeds", "offsets")),
                          **{k: batch[k].to(ll.device) for k in ("top_k", "top_p", "min_p")})
    bad += int((sample_filtered(logits, rows).cpu() != reference_tokens(batch)).sum())
    ll.check()
    ll.close()
    return bad


@pytest.mark.parametrize("world", [2, 4])
def test_ll_gather_rows_sum_rows_and_filters_on_shards(world):
    assert run_ranks(_gather_rows_worker, world, backend="gloo", timeout_s=600) == [0] * world
