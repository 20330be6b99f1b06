#ifndef TPSPEC_LL_LINE_PROTOCOL_H
#define TPSPEC_LL_LINE_PROTOCOL_H

#include "ll_common.h"

// The LL line protocol: how a rank's keys reach its peers (and, in the fused kernel, how
// blocks hand theirs to the collector), with a bounded wait and a sticky error record.
//
// LL protocol, per channel (slots never shared between channels):
//   slot(parity, src, row) in every rank's buffer is one 16-byte line
//   {key_lo, epoch, key_hi, epoch}, written by rank `src` with one 16-byte store and
//   read back with one 16-byte load until both epoch words equal the reader's epoch
//   (each 8-byte half carries its own copy of the flag, so a torn line never passes).
//   Slots are double-buffered by epoch parity: a rank one call ahead writes the other
//   half. The epoch lives in device memory and the kernel advances it (graph replays
//   need no host work). Epochs are 32-bit and never 0 (0 is "never written"): after
//   0xFFFFFFFF comes 2, keeping the parity alternation.
//   Lines stay in the slots after they are read, so a row unused for a whole epoch cycle
//   (~4.3e9 calls) would still hold a line whose epoch matches again. The cycle's last
//   two calls therefore clear them: the call of epoch 0xFFFFFFFE zeroes every line of
//   parity 0 in this rank's slots once it has read its own rows, the call of 0xFFFFFFFF
//   every line of parity 1 (and the channel's block lines, below). The clearing cannot
//   erase a line of the next cycle: a peer writes that parity again two calls later,
//   after it has read this rank's line of the next call, which this rank publishes only
//   after the clearing kernel has ended. The hot path carries no extra store.
//   Waiting is bounded: after timeout_ns (%globaltimer) the kernel stops, records the
//   missing ranks and the epoch in the channel's control block and in host-mapped
//   memory, writes -1 for the affected rows, and every later call on that channel fails
//   fast. The host turns the record into a clear error.

// Per-channel control block in device memory (LL_CTRL_BYTES; the host writes the first
// epoch and reads nothing else).
struct ChannelCtrl {
    u32 epoch;        // epoch of the next call (host sets 1 at start)
    u32 error;        // 1 once a wait timed out on this channel (sticky)
    u32 error_epoch;  // epoch of the first timed-out call
    u32 reserved;     // unused (keeps the 64-byte layout)
    u64 missing;      // ranks whose keys never arrived (bit mask)
    u64 pad[5];
};

// Per-channel error record in host-mapped memory (LL_HOST_ERROR_BYTES), read by the host
// without a sync.
struct HostError {
    u32 error;
    u32 epoch;
    u64 missing;
};

static_assert(sizeof(ChannelCtrl) == LL_CTRL_BYTES, "ChannelCtrl is LL_CTRL_BYTES");
static_assert(sizeof(HostError) == LL_HOST_ERROR_BYTES, "HostError is LL_HOST_ERROR_BYTES");
// NVRTC's front end has no __builtin_offsetof; nvcc (which compiles these headers in the tests) checks
// the field offsets.
#ifndef __CUDACC_RTC__
static_assert(__builtin_offsetof(ChannelCtrl, epoch) == 0, "the host writes the first epoch at offset 0");
static_assert(__builtin_offsetof(ChannelCtrl, error) == 4 && __builtin_offsetof(ChannelCtrl, missing) == 16,
              "ChannelCtrl layout");
static_assert(__builtin_offsetof(HostError, error) == 0 && __builtin_offsetof(HostError, epoch) == 4 &&
                  __builtin_offsetof(HostError, missing) == 8,
              "the host reads HostError as {u32 error, u32 epoch, u64 missing}");
#endif
static_assert(sizeof(uint4) == LL_LINE_BYTES, "one LL line is one 16-byte store");

// ------------------------------------------------------------------ the exchange phase

// Dynamic shared memory of both kernels: one unsigned key per row (rows * 8 bytes).
extern __shared__ u64 s_keys[];

struct Exchange {
    ChannelCtrl* ctrl;         // this rank's control block of the channel
    u64 block_lines;           // the channel's block lines (cleared at the end of an epoch cycle)
    int block_line_count;      // how many there are
    const u64* peer_slots;     // [world] base of each rank's slot area of the channel
    HostError* host_error;     // host-mapped error record of the channel
    int rank;
    int world;
    int max_rows;
    u64 timeout_ns;
};

__device__ __forceinline__ u64 global_timer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// The clock of one bounded wait: started by the first poll that finds a line missing
// (a wait that never fails reads no clock), expired once timeout_ns have passed since.
struct WaitClock {
    u64 begin_ns;
    bool started;
    __device__ WaitClock() : begin_ns(0ull), started(false) {}
    __device__ __forceinline__ bool expired(u64 timeout_ns) {
        const u64 now = global_timer_ns();
        if (!started) {
            begin_ns = now;
            started = true;
            return false;
        }
        return now - begin_ns > timeout_ns;
    }
};

__device__ __forceinline__ void store_line(u64 address, u32 a, u32 b, u32 c, u32 d) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(address), "r"(a), "r"(b), "r"(c),
                 "r"(d)
                 : "memory");
}

__device__ __forceinline__ uint4 load_line(u64 address) {
    uint4 v;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(address)
                 : "memory");
    return v;
}

__device__ __forceinline__ u64 slot_address(u64 base, int parity, int src, int row, int world, int max_rows) {
    return base + 16ull * ((u64)(parity * world + src) * (u64)max_rows + (u64)row);
}

// The rank of a rank's i-th peer (its own rank skipped: its key never travels).
__device__ __forceinline__ int peer_rank(int i, int rank) { return i + (i >= rank ? 1 : 0); }

__device__ __forceinline__ u32 next_epoch(u32 e) { return e == 0xffffffffu ? 2u : e + 1u; }

// Bitmask of ranks whose lines never arrived in this call (the waiting threads OR into it).
__shared__ u64 s_missing_ranks;
// 1 once a waiting thread has given up: the others then poll once more and stop, so a
// rank that never arrives costs one timeout, not one per row a thread waits for.
__shared__ u32 s_gave_up;
// 1 when a block line of this rank's own fused kernel never arrived (then this rank
// publishes nothing: its peers time out on it instead of taking a wrong key).
__shared__ u32 s_local_failed;
// Every rank's slot area of the channel (peer_slots, copied at kernel start).
__shared__ u64 s_peer_slots[LL_MAX_WORLD];

// What the exchange needs from memory, loaded at the start of a kernel so the loads
// overlap the kernel's other loads instead of delaying the publish.
struct ExchangeStart {
    u32 epoch;          // this call's epoch
    u32 failed_before;  // the channel had already timed out: do not wait
};

__device__ __forceinline__ ExchangeStart exchange_prologue(const Exchange& x) {
    ExchangeStart start;
    start.epoch = *(volatile u32*)&x.ctrl->epoch;  // same word for every thread: one broadcast load per warp
    start.failed_before = *(volatile u32*)&x.ctrl->error;
    for (int r = threadIdx.x; r < x.world; r += blockDim.x) s_peer_slots[r] = x.peer_slots[r];
    if (threadIdx.x == 0) {
        s_missing_ranks = 0ull;
        s_local_failed = 0u;
        s_gave_up = 0u;
    }
    return start;
}

// WAIT_BATCH: lines a waiting thread keeps in flight at once; its loads are issued
// together, so a poll costs one memory round trip, not one per line. The exchange kernels
// take 1, 4 or 8 by world size: a poll runs the instructions of all WAIT_BATCH lines, so a
// small world polls no more lines than it has peers. The fused kernel uses 4: its register
// budget is set by its row reduction.

// The end of every call that waited on slot lines, after a barrier: the last two calls of an
// epoch cycle clear what they have read (see the header): every line of this parity in this
// rank's slots, and at the very end the block lines. Then thread 0 records the ranks whose
// lines never arrived, once per channel (the first timeout only).
__device__ __forceinline__ void end_call(const Exchange& x, const ExchangeStart& start, u64 own, int parity) {
    const u32 epoch = start.epoch;
    if (epoch >= 0xfffffffeu) {
        const u64 parity_lines = slot_address(own, parity, 0, 0, x.world, x.max_rows);
        for (int i = threadIdx.x; i < x.world * x.max_rows; i += blockDim.x) {
            store_line(parity_lines + 16ull * (u64)i, 0u, 0u, 0u, 0u);
        }
        if (epoch == 0xffffffffu) {
            for (int i = threadIdx.x; i < x.block_line_count; i += blockDim.x) {
                store_line(x.block_lines + 16ull * (u64)i, 0u, 0u, 0u, 0u);
            }
        }
    }

    const u64 missing = s_missing_ranks;
    if (threadIdx.x == 0) {
        if (missing && start.failed_before == 0u) {
            if (atomicCAS(&x.ctrl->error, 0u, 1u) == 0u) {
                x.ctrl->error_epoch = epoch;
                x.ctrl->missing = missing;
                x.host_error->epoch = epoch;
                x.host_error->missing = missing;
                __threadfence_system();
                *(volatile u32*)&x.host_error->error = 1u;
                __threadfence_system();
            }
        }
    }
}

// One thread's bounded wait for slot row SLOT of the peers first .. first + WAIT_BATCH - 1 (of
// `peers`), their lines in flight at once: ON_LINE runs for each line that arrives with this call's
// epoch, with `j` its peer's index in the batch and `value` its 64 bits; PENDING (a u32) ends with
// the bits of the peers whose lines did not arrive. Reads x, own, parity, world, peers, epoch, first
// and fail_fast of the caller. A macro so that the two waits (exchange_rows, gather_rows_impl)
// share one text and still compile as they did when each was written out.
#define LL_WAIT_PEER_LINES(PENDING, SLOT, ON_LINE)                                                          \
    PENDING = 0u;                                                                                          \
    _Pragma("unroll") for (int j = 0; j < WAIT_BATCH; ++j) {                                                \
        if (first + j < peers) PENDING |= 1u << j;                                                          \
    }                                                                                                      \
    {                                                                                                      \
        WaitClock clock;                                                                                   \
        while (PENDING) {                                                                                  \
            uint4 v[WAIT_BATCH];                                                                           \
            _Pragma("unroll") for (int j = 0; j < WAIT_BATCH; ++j) {                                        \
                const int src = peer_rank(first + j, x.rank);                                              \
                if ((PENDING >> j) & 1u)                                                                   \
                    v[j] = load_line(slot_address(own, parity, src, SLOT, world, x.max_rows));             \
            }                                                                                              \
            _Pragma("unroll") for (int j = 0; j < WAIT_BATCH; ++j) {                                        \
                if (((PENDING >> j) & 1u) && v[j].y == epoch && v[j].w == epoch) {                          \
                    const u64 value = ((u64)v[j].z << 32) | (u64)v[j].x;                                   \
                    ON_LINE                                                                                \
                    PENDING &= ~(1u << j);                                                                 \
                }                                                                                          \
            }                                                                                              \
            if (!PENDING || fail_fast) break;                                                              \
            /* Only the clock and a shared flag between polls: a global load here would add a memory */   \
            /* round trip to every poll, and so to the latency of the wait. */                             \
            if (*(volatile u32*)&s_gave_up) break;                                                         \
            if (clock.expired(x.timeout_ns)) {                                                             \
                *(volatile u32*)&s_gave_up = 1u;                                                           \
                break;                                                                                     \
            }                                                                                              \
        }                                                                                                  \
    }

// Run by exactly one block after exchange_prologue. s_keys[row] holds this rank's
// unsigned key of each row (written by this block; this function syncs before reading).
// Advances the epoch and, when asked, the step counter, publishes the keys to every other
// rank, waits for every other rank's, and writes out[row] (the signed max key, or its
// token when want_tokens; -1 for a row whose lines did not all arrive). One thread per
// row throughout: no index arithmetic beyond a stride, no shared atomics.
template <int WAIT_BATCH>
__device__ void exchange_rows(const Exchange& x, const ExchangeStart& start, const u64* s_keys, int rows,
                              i64* out, int want_tokens, i64* step_counter, int advance_step) {
    const u32 epoch = start.epoch;
    // Nothing of this kernel reads the epoch or the step counter again (every block of the
    // fused kernel has read both before its line reached the collector; if a line never came, this
    // call fails and so does every later one on the channel), and the next kernel on the
    // channel starts after this one ends: writing them first takes them off the tail.
    if (threadIdx.x == 0) {
        *(volatile u32*)&x.ctrl->epoch = next_epoch(epoch);
        if (advance_step) *(volatile i64*)step_counter = *(volatile i64*)step_counter + 1;
    }
    __syncthreads();
    const int parity = (int)(epoch & 1u);
    const int world = x.world, peers = world - 1;  // a rank's own key never travels
    const bool local_failed = s_local_failed != 0u;

    // Publish: a 16-byte line per other rank (a warp writes consecutive slots of each peer).
    for (int row = threadIdx.x; row < rows && !local_failed; row += blockDim.x) {
        const u64 key = s_keys[row];
        for (int d = 0; d < peers; ++d) {
            const int dst = peer_rank(d, x.rank);
            store_line(slot_address(s_peer_slots[dst], parity, x.rank, row, world, x.max_rows), (u32)key, epoch,
                       (u32)(key >> 32), epoch);
        }
    }

    // Wait: the same thread per row; the lines of up to WAIT_BATCH peers in flight at once.
    const u64 own = s_peer_slots[x.rank];
    const bool fail_fast = start.failed_before != 0u || local_failed;
    for (int row = threadIdx.x; row < rows; row += blockDim.x) {
        u64 best = s_keys[row];
        u64 missing = 0ull;
        for (int first = 0; first < peers; first += WAIT_BATCH) {
            u32 pending;
            LL_WAIT_PEER_LINES(pending, row, best = value > best ? value : best;)
#pragma unroll
            for (int j = 0; j < WAIT_BATCH; ++j) {
                if ((pending >> j) & 1u) missing |= 1ull << peer_rank(first + j, x.rank);
            }
        }
        if (local_failed) missing |= 1ull << x.rank;
        if (missing) atomicOr(&s_missing_ranks, missing);
        out[row] = missing ? -1
                           : (want_tokens ? (i64)(0xffffffffull - (best & 0xffffffffull))
                                          : (i64)(best ^ 0x8000000000000000ull));
    }
    __syncthreads();
    end_call(x, start, own, parity);
}

#endif  // TPSPEC_LL_LINE_PROTOCOL_H
