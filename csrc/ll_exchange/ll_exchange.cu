// LL (low-latency) key exchange of tpspec: cross-rank max of 64-bit keys over CUDA IPC
// peer memory, fused with the row reduction of a rank's logits slice.
//
// Compiled at run time by NVRTC (tpspec/exchange/cuda_module.py) with --fmad=false and
// -std=c++17; the CI compiles it with nvcc -arch=sm_90 using the same flags. The file is
// self-contained (no headers) so both compilers see exactly the same text.
//
// Semantics: bit-identical to the torch reference in tpspec/keys.py (local_row_keys,
// pack_keys, philox_words, exponential_from_words, portable_log, gumbel_scores). Change
// both together. All float arithmetic of exact scores goes through the inline-PTX helpers
// below (add/sub/mul/div with an explicit .rn rounding and no .ftz): PTX never contracts
// such instructions into FMA, and they keep subnormals even though cupy appends
// -ftz=true to every NVRTC compile. Only the pruning estimates of sampled rows use plain
// float operations: their roundings (and flushed subnormals) sit inside the error bound
// of keys.gumbel_bound_table, so they decide which columns get an exact score, never a key.
//
// Keys: kernels work on the *unsigned* form ukey = key ^ (1 << 63), so the empty key
// (EMPTY_KEY = -2^63) is 0 and a plain unsigned 64-bit max reduces.
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
//
// Inside one rank, the fused kernel's blocks hand their row maxima to one block, the
// collector, the same way: each other block writes one {key_lo, epoch, key_hi, epoch} line
// of the channel's block lines; the collector, after its own columns, polls them (bounded
// by the same timeout) and runs the exchange. No fence, no ticket atomic, no re-read of a
// scratch max: a block's result reaches the collector in one store and one poll. The
// collector is the grid's last block, so every block it waits for has started before it
// (see argmax_logits_impl). Block lines are rewritten only by the next kernel on the
// channel, so clearing all of them in the call of epoch 0xFFFFFFFF (after the collector
// has read this call's) keeps a stale one from matching after the wrap.

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned short u16;

#define LL_THREADS 256
#define LL_MAX_WORLD 64

// Float32 constants of tpspec/keys.py, as bit patterns (test_ll_cpu checks they match).
#define INV3_BITS 0x3eaaaaabu
#define INV5_BITS 0x3e4ccccdu
#define INV7_BITS 0x3e124925u
#define INV9_BITS 0x3de38e39u
#define INV11_BITS 0x3dba2e8cu
#define INV13_BITS 0x3d9d89d9u
#define LN2_HI_BITS 0x3f317200u
#define LN2_LO_BITS 0x35bfbe8eu
#define SQRT2_BITS 0x3fb504f3u
#define TWO_POW_M33_BITS 0x2f000000u
#define CANONICAL_NAN_BITS 0x7fc00000u

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

// Per-channel control block in device memory (64 bytes).
struct ChannelCtrl {
    u32 epoch;        // epoch of the next call (host sets 1 at start)
    u32 error;        // 1 once a wait timed out on this channel (sticky)
    u32 error_epoch;  // epoch of the first timed-out call
    u32 reserved;     // unused (keeps the 64-byte layout)
    u64 missing;      // ranks whose keys never arrived (bit mask)
    u64 pad[5];
};

// Per-channel error record in host-mapped memory (16 bytes), read by the host without a sync.
struct HostError {
    u32 error;
    u32 epoch;
    u64 missing;
};

// ----------------------------------------------------------------- IEEE float32 helpers

__device__ __forceinline__ float f_add(float a, float b) {
    float r;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float f_sub(float a, float b) {
    float r;
    asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float f_mul(float a, float b) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float f_div(float a, float b) {
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ bool f_ge(float a, float b) {  // a >= b, IEEE (false on NaN), no ftz
    u32 r;
    asm("{ .reg .pred p; setp.ge.f32 p, %1, %2; selp.u32 %0, 1, 0, p; }" : "=r"(r) : "f"(a), "f"(b));
    return r != 0;
}
__device__ __forceinline__ float f_from_u64(u64 v) {  // round to nearest even
    float r;
    asm("cvt.rn.f32.u64 %0, %1;" : "=f"(r) : "l"(v));
    return r;
}
__device__ __forceinline__ float f_from_i32(int v) {  // exact for the small ints used here
    float r;
    asm("cvt.rn.f32.s32 %0, %1;" : "=f"(r) : "r"(v));
    return r;
}
__device__ __forceinline__ u32 f16_to_f32_bits(u16 h) {  // exact widening
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h));
    return __float_as_uint(r);
}
__device__ __forceinline__ float fbits(u32 b) { return __uint_as_float(b); }

// ------------------------------------------------------------------------------ keys

// -0 -> +0, every NaN -> the canonical NaN (integer ops only: no ftz can touch them).
__device__ __forceinline__ u32 canonical_bits(u32 b) {
    if ((b & 0x7fffffffu) == 0u) return 0u;
    if ((b & 0x7fffffffu) > 0x7f800000u) return CANONICAL_NAN_BITS;
    return b;
}

// Canonical float bits -> the unsigned form of the key's high word (order preserving).
__device__ __forceinline__ u32 ordered_high(u32 canon) {
    return (canon & 0x80000000u) ? ~canon : (canon | 0x80000000u);
}

__device__ __forceinline__ u64 make_ukey(u32 canon, u32 column) {
    return ((u64)ordered_high(canon) << 32) | (u64)(0xffffffffu - column);
}

// ---------------------------------------------------------------------------- philox

struct Words4 {
    u32 w0, w1, w2, w3;
};

__device__ __forceinline__ Words4 philox4x32_10(u32 c0, u32 c1, u32 c2, u32 c3, u32 k0, u32 k1) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round) {
            k0 += PHILOX_W0;
            k1 += PHILOX_W1;
        }
        u32 hi0 = __umulhi(PHILOX_M0, c0), lo0 = PHILOX_M0 * c0;
        u32 hi1 = __umulhi(PHILOX_M1, c2), lo1 = PHILOX_M1 * c2;
        u32 n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
    }
    Words4 w = {c0, c1, c2, c3};
    return w;
}

// Philox4x32-10 with the key schedule (round r's key words) computed once by the caller.
struct PhiloxKeys {
    u32 k0[10], k1[10];
};

// The moves are opaque to the compiler, so it keeps the 20 words in registers instead of
// recomputing them with two adds per round of every Philox block.
__device__ __forceinline__ u32 kept(u32 v) {
    u32 r;
    asm volatile("mov.b32 %0, %1;" : "=r"(r) : "r"(v));
    return r;
}

__device__ __forceinline__ PhiloxKeys philox_keys(u32 k0, u32 k1) {
    PhiloxKeys keys;
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        keys.k0[round] = kept(k0 + (u32)round * PHILOX_W0);
        keys.k1[round] = kept(k1 + (u32)round * PHILOX_W1);
    }
    return keys;
}

__device__ __forceinline__ Words4 philox4x32_10(u32 c0, u32 c1, u32 c2, u32 c3, const PhiloxKeys& keys) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        u32 hi0 = __umulhi(PHILOX_M0, c0), lo0 = PHILOX_M0 * c0;
        u32 hi1 = __umulhi(PHILOX_M1, c2), lo1 = PHILOX_M1 * c2;
        u32 n0 = hi1 ^ c1 ^ keys.k0[round], n2 = hi0 ^ c3 ^ keys.k1[round];
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
    }
    Words4 w = {c0, c1, c2, c3};
    return w;
}

__device__ __forceinline__ u32 pick_word(const Words4& w, u32 k) {
    return k == 0 ? w.w0 : (k == 1 ? w.w1 : (k == 2 ? w.w2 : w.w3));
}

// ----------------------------------------------------------------- portable arithmetic

// x = m * 2^e with m in [sqrt(1/2), sqrt(2)] (positive, finite, normal x): portable_log's
// reduction, exact.
struct LogReduction {
    float m;
    float e;
};
__device__ __forceinline__ LogReduction log_reduction(float x) {
    u32 bits = __float_as_uint(x);
    int exponent = (int)((bits >> 23) & 0xffu) - 127;
    u32 mantissa_bits = (bits & 0x007fffffu) | 0x3f800000u;
    int big = mantissa_bits > SQRT2_BITS ? 1 : 0;
    float m = fbits(mantissa_bits);
    if (big) m = f_mul(m, 0.5f);
    return {m, f_from_i32(exponent + big)};
}

// keys.portable_log: positive, finite, normal float32 x.
__device__ __forceinline__ float portable_log(float x) {
    const LogReduction r = log_reduction(x);
    float s = f_div(f_sub(r.m, 1.0f), f_add(r.m, 1.0f));
    float z = f_mul(s, s);
    float p = f_mul(z, fbits(INV9_BITS));
    p = f_add(p, fbits(INV7_BITS));
    p = f_mul(p, z);
    p = f_add(p, fbits(INV5_BITS));
    p = f_mul(p, z);
    p = f_add(p, fbits(INV3_BITS));
    p = f_mul(p, z);
    p = f_add(p, 1.0f);
    float t = f_mul(s, p);
    t = f_add(t, t);
    float low = f_mul(r.e, fbits(LN2_LO_BITS));
    low = f_add(low, t);
    float high = f_mul(r.e, fbits(LN2_HI_BITS));
    return f_add(high, low);
}

// (h + 0.5) * 2^-32 rounded once to float32: round(2h + 1) * 2^-33 is the same number.
__device__ __forceinline__ float unit_from_word(u32 h) {
    return f_mul(f_from_u64(2ull * (u64)h + 1ull), fbits(TWO_POW_M33_BITS));
}

// keys.exponential_from_words: E = -ln(1 - U) ~ Exp(1), with no branch. Both of the
// reference's branches are 2 atanh(s) by the same Horner steps, the series one two terms
// longer: U < 1/2 takes s = U / (2 - U); U >= 1/2 takes s = (m - 1) / (m + 1) from the
// complement c = m * 2^e (portable_log's reduction) and adds e ln 2. Picking the operands
// per lane runs one rounding, one division and one series per column where a warp with
// both kinds of lanes ran both branches. Every operation is the reference's, in its
// order (starting the shorter series at the constant 1/9 gives z * 1/9 exactly as
// portable_log's first step), so the bits are the reference's.
__device__ __forceinline__ float exponential_from_word(u32 h) {
    const bool series_branch = h < 0x80000000u;
    const float v = unit_from_word(series_branch ? h : 0xffffffffu - h);  // U, or the complement
    const LogReduction r = log_reduction(v);  // of the complement; unused on the series branch
    const float numerator = series_branch ? v : f_sub(r.m, 1.0f);
    const float denominator = series_branch ? f_sub(2.0f, v) : f_add(r.m, 1.0f);
    const float s = f_div(numerator, denominator);
    const float z = f_mul(s, s);
    float p = f_mul(z, fbits(INV13_BITS));
    p = f_add(p, fbits(INV11_BITS));
    p = f_mul(p, z);
    p = f_add(p, fbits(INV9_BITS));
    p = series_branch ? p : fbits(INV9_BITS);
    p = f_mul(p, z);
    p = f_add(p, fbits(INV7_BITS));
    p = f_mul(p, z);
    p = f_add(p, fbits(INV5_BITS));
    p = f_mul(p, z);
    p = f_add(p, fbits(INV3_BITS));
    p = f_mul(p, z);
    p = f_add(p, 1.0f);
    float t = f_mul(s, p);
    t = f_add(t, t);
    const float low = f_add(f_mul(r.e, fbits(LN2_LO_BITS)), t);  // portable_log's last steps
    const float log_complement = f_add(f_mul(r.e, fbits(LN2_HI_BITS)), low);
    return series_branch ? t : fbits(__float_as_uint(log_complement) ^ 0x80000000u);  // -ln, sign flip: exact
}

// Canonical bits of the Gumbel score x / T - ln(E) of one column (x: canonical logit).
__device__ __forceinline__ u32 gumbel_score_bits(u32 x_canon, float temperature, u32 word) {
    float e = exponential_from_word(word);
    float log_e = portable_log(e);
    float scaled = f_div(fbits(x_canon), temperature);
    return canonical_bits(__float_as_uint(f_sub(scaled, log_e)));
}

// ----------------------------------------------------------------------- value loads

template <int DTYPE>  // 0: float32, 1: bfloat16, 2: float16
struct Elem;

template <>
struct Elem<0> {
    typedef u32 raw;
    static const int per16 = 4;
    static __device__ __forceinline__ u32 bits(u32 v) { return v; }
};
template <>
struct Elem<1> {
    typedef u16 raw;
    static const int per16 = 8;
    static __device__ __forceinline__ u32 bits(u16 v) { return ((u32)v) << 16; }
};
template <>
struct Elem<2> {
    typedef u16 raw;
    static const int per16 = 8;
    static __device__ __forceinline__ u32 bits(u16 v) { return f16_to_f32_bits(v); }
};

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
// take 1, 4 or 8 by world size: a poll runs the instructions of all WAIT_BATCH lines, and
// at TP=2 polling 1 instead of 8 made a call 0.1-0.25 us faster (docs/gpu-results.md,
// session 10). The fused kernel uses 4: its register budget is set by its row reduction.

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
            u32 pending = 0u;
#pragma unroll
            for (int j = 0; j < WAIT_BATCH; ++j) {
                if (first + j < peers) pending |= 1u << j;
            }
            WaitClock clock;
            while (pending) {
                uint4 v[WAIT_BATCH];
#pragma unroll
                for (int j = 0; j < WAIT_BATCH; ++j) {
                    const int src = peer_rank(first + j, x.rank);
                    if ((pending >> j) & 1u) v[j] = load_line(slot_address(own, parity, src, row, world, x.max_rows));
                }
#pragma unroll
                for (int j = 0; j < WAIT_BATCH; ++j) {
                    if (((pending >> j) & 1u) && v[j].y == epoch && v[j].w == epoch) {
                        const u64 key = ((u64)v[j].z << 32) | (u64)v[j].x;
                        best = key > best ? key : best;
                        pending &= ~(1u << j);
                    }
                }
                if (!pending || fail_fast) break;
                // Only the clock and a shared flag between polls: a global load here would
                // add a memory round trip to every poll, and so to the latency of the wait.
                if (*(volatile u32*)&s_gave_up) break;
                if (clock.expired(x.timeout_ns)) {
                    *(volatile u32*)&s_gave_up = 1u;
                    break;
                }
            }
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

    // The last two calls of an epoch cycle clear what they have read (see the header):
    // every line of this parity in this rank's slots, and at the very end the block lines.
    if (epoch >= 0xfffffffeu) {
        const u64 parity_lines = slot_address(own, parity, 0, 0, world, x.max_rows);
        for (int i = threadIdx.x; i < world * x.max_rows; i += blockDim.x) {
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

// ------------------------------------------------------- max_keys / argmax_tokens kernel

// One row of exchange_keys_impl's input as loaded (see there): loads only, so that a
// caller can issue other loads before the first use of these.
struct RowInput {
    i64 key_or_column;  // mode 0: the signed key; mode 1: the local argmax column
    u32 max_raw;        // mode 1: local_max[row] as stored (a float32 or a 16-bit float)
};

__device__ __forceinline__ RowInput load_row_input(int mode, const i64* keys, const void* local_max, int max_dtype,
                                                   const void* local_argmax, int argmax_is_i64, int row) {
    RowInput in;
    in.max_raw = 0u;
    if (mode == 0) {
        in.key_or_column = keys[row];
    } else {
        in.max_raw = max_dtype == 0 ? ((const u32*)local_max)[row] : (u32)((const u16*)local_max)[row];
        in.key_or_column = argmax_is_i64 ? ((const i64*)local_argmax)[row] : (i64)((const int*)local_argmax)[row];
    }
    return in;
}

__device__ __forceinline__ u64 row_ukey(int mode, const RowInput& in, int max_dtype, i64 vocab_offset) {
    if (mode == 0) return (u64)in.key_or_column ^ 0x8000000000000000ull;
    u32 b;
    if (max_dtype == 0) b = in.max_raw;
    else if (max_dtype == 1) b = Elem<1>::bits((u16)in.max_raw);
    else b = Elem<2>::bits((u16)in.max_raw);
    return make_ukey(canonical_bits(b), (u32)(in.key_or_column + vocab_offset));
}

// One block. mode 0: keys[row] are signed int64 keys. mode 1: pack (local_max[row],
// local_argmax[row] + vocab_offset) like keys.pack_keys; max_dtype 0/1/2 =
// float32/bfloat16/float16, argmax_is_i64 picks int64 or int32 columns. WAIT_BATCH: peer
// lines a waiting thread polls at once, no more than the world needs (see there); one
// kernel per batch, picked by the host, so each world size runs only its own wait loop.
template <int WAIT_BATCH>
__device__ __forceinline__ void exchange_keys_impl(int mode, const i64* keys, const void* local_max, int max_dtype,
                                                   const void* local_argmax, int argmax_is_i64, i64 vocab_offset,
                                                   int rows, i64* out, int want_tokens, u64 ctrl, u64 lines,
                                                   int line_count, const u64* peer_slots, u64 host_error, int rank,
                                                   int world, int max_rows, u64 timeout_ns) {
    Exchange x = {(ChannelCtrl*)ctrl, lines, line_count, peer_slots, (HostError*)host_error,
                  rank, world, max_rows, timeout_ns};
    // The thread's first row is loaded before the prologue, whose first use of a loaded
    // value (the slot pointers it stages in shared memory) would otherwise hold these loads
    // back by a memory round trip: one round trip in all before the publish, not two.
    const int first = (int)threadIdx.x;
    RowInput in = {0, 0u};
    if (first < rows) in = load_row_input(mode, keys, local_max, max_dtype, local_argmax, argmax_is_i64, first);
    const ExchangeStart start = exchange_prologue(x);
    if (first < rows) s_keys[first] = row_ukey(mode, in, max_dtype, vocab_offset);
    for (int row = first + (int)blockDim.x; row < rows; row += blockDim.x) {
        in = load_row_input(mode, keys, local_max, max_dtype, local_argmax, argmax_is_i64, row);
        s_keys[row] = row_ukey(mode, in, max_dtype, vocab_offset);
    }
    exchange_rows<WAIT_BATCH>(x, start, s_keys, rows, out, want_tokens, (i64*)0, 0);
}

#define LL_EXCHANGE_KEYS_KERNEL(NAME, WAIT_BATCH)                                                              \
    extern "C" __global__ void __launch_bounds__(LL_THREADS)                                                   \
        NAME(int mode, const i64* keys, const void* local_max, int max_dtype, const void* local_argmax,        \
             int argmax_is_i64, i64 vocab_offset, int rows, i64* out, int want_tokens, u64 ctrl, u64 lines,    \
             int line_count, const u64* peer_slots, u64 host_error, int rank, int world, int max_rows,         \
             u64 timeout_ns) {                                                                                 \
        exchange_keys_impl<WAIT_BATCH>(mode, keys, local_max, max_dtype, local_argmax, argmax_is_i64,          \
                                       vocab_offset, rows, out, want_tokens, ctrl, lines, line_count,          \
                                       peer_slots, host_error, rank, world, max_rows, timeout_ns);             \
    }

LL_EXCHANGE_KEYS_KERNEL(ll_exchange_keys_1, 1)  // world 1-2 (tpspec/exchange/ll.py picks by world)
LL_EXCHANGE_KEYS_KERNEL(ll_exchange_keys_4, 4)  // world 3-5
LL_EXCHANGE_KEYS_KERNEL(ll_exchange_keys_8, 8)  // world 6+

// ------------------------------------------------------------ fused argmax_logits kernel

__device__ __forceinline__ uint4 load_pack(const void* address) {  // read-only 16-byte load
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(address));
    return v;
}

struct RowNoise {  // Gumbel parameters of one sampled row
    float temperature;
    u32 seed_lo, seed_hi, off_lo, off_hi;
};

__device__ __forceinline__ u32 philox_word(u32 column, const RowNoise& noise) {
    Words4 w = philox4x32_10(column >> 2, 0u, noise.off_lo, noise.off_hi, noise.seed_lo, noise.seed_hi);
    return pick_word(w, column & 3u);
}

// Exact unsigned key of one column (canonical value bits `value`): the portable score.
__device__ __forceinline__ u64 exact_key(u32 value, u32 column, bool sampled, const RowNoise& noise) {
    if (sampled) value = gumbel_score_bits(value, noise.temperature, philox_word(column, noise));
    return make_ukey(value, column);
}

// --- NaN-propagating maxima (sm_80+; no .ftz, so subnormals compare exactly)
__device__ __forceinline__ float f_max_nan(float a, float b) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ u32 bf16x2_max_nan(u32 a, u32 b) {
    u32 r;
    asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ u32 f16x2_max_nan(u32 a, u32 b) {
    u32 r;
    asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// float32 bits of the largest value of a pack (any NaN in it -> a NaN). Which zero or
// which NaN comes back does not matter: the caller canonicalizes.
template <int DTYPE>
__device__ __forceinline__ u32 pack_max_bits(uint4 p);
template <>
__device__ __forceinline__ u32 pack_max_bits<0>(uint4 p) {
    float m = f_max_nan(f_max_nan(fbits(p.x), fbits(p.y)), f_max_nan(fbits(p.z), fbits(p.w)));
    return __float_as_uint(m);
}
template <>
__device__ __forceinline__ u32 pack_max_bits<1>(uint4 p) {
    u32 m = bf16x2_max_nan(bf16x2_max_nan(p.x, p.y), bf16x2_max_nan(p.z, p.w));
    return __float_as_uint(f_max_nan(fbits(m & 0xffff0000u), fbits(m << 16)));
}
template <>
__device__ __forceinline__ u32 pack_max_bits<2>(uint4 p) {
    u32 m = f16x2_max_nan(f16x2_max_nan(p.x, p.y), f16x2_max_nan(p.z, p.w));
    return __float_as_uint(f_max_nan(fbits(f16_to_f32_bits((u16)(m & 0xffffu))), fbits(f16_to_f32_bits((u16)(m >> 16)))));
}

// Canonical float32 bits of value i of a pack.
template <int DTYPE>
__device__ __forceinline__ u32 pack_value(const uint4& p, int i) {
    const typename Elem<DTYPE>::raw* vals = (const typename Elem<DTYPE>::raw*)&p;
    return canonical_bits(Elem<DTYPE>::bits(vals[i]));
}

// One pack of a greedy span against the thread's best so far: keeps the first pack that
// holds the largest value (strictly larger replaces, so the earlier pack keeps a tie).
template <int DTYPE>
__device__ __forceinline__ void rank_pack(const uint4& pack, int pack_base, u32& best_order, uint4& best_pack,
                                          int& best_base) {
    const u32 order = ordered_high(canonical_bits(pack_max_bits<DTYPE>(pack)));
    if (order > best_order) {
        best_order = order;
        best_pack = pack;
        best_base = pack_base;
    }
}

// --- greedy rows: memory bound, so a few instructions per 16 bytes. Per pack only its
// maximum (packed NaN-propagating max) is ranked; a thread keeps the first pack holding
// its best value and finds the lowest column of that value inside it at the end.
template <int DTYPE>
__device__ __forceinline__ u64 greedy_span(const typename Elem<DTYPE>::raw* row_ptr, int begin, int vec_end,
                                           u32 column0) {
    const int VEC = Elem<DTYPE>::per16;
    const int UNROLL = 4;  // packs a group: 64 bytes per thread
    const int step = blockDim.x * VEC;
    u32 best_order = 0u;   // ordered_high of the best value; 0 = none (every real value maps above 0)
    uint4 best_pack = make_uint4(0u, 0u, 0u, 0u);
    int best_base = 0;
    int base = begin + threadIdx.x * VEC;
    if (base + (UNROLL - 1) * step < vec_end) {
        // The next group's loads are issued before this group is ranked, so a thread keeps
        // up to two groups in flight (ll_read_floor_bf16 at 256 x 64K on the H200: 12.5 ->
        // 10.4 us; the fused call, whose hand-off and exchange then set the pace, is unchanged).
        uint4 next[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) next[u] = load_pack(row_ptr + base + u * step);
        for (;;) {
            uint4 packs[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) packs[u] = next[u];
            const int next_base = base + UNROLL * step;
            const bool more = next_base + (UNROLL - 1) * step < vec_end;
            if (more) {
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) next[u] = load_pack(row_ptr + next_base + u * step);
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                rank_pack<DTYPE>(packs[u], base + u * step, best_order, best_pack, best_base);
            }
            base = next_base;
            if (!more) break;
        }
    }
    for (; base < vec_end; base += step) {
        rank_pack<DTYPE>(load_pack(row_ptr + base), base, best_order, best_pack, best_base);
    }
    if (best_order == 0u) return 0ull;
    int first = 0;
#pragma unroll
    for (int i = VEC - 1; i >= 0; --i) {
        if (ordered_high(pack_value<DTYPE>(best_pack, i)) == best_order) first = i;
    }
    return ((u64)best_order << 32) | (u64)(0xffffffffu - (column0 + (u32)(best_base + first)));
}

// --- sampled rows: SPEC §2 fixes the noise (Philox4x32-10 of the global column), so
// every column that could win needs its Philox block; the exact portable score is needed
// only by the few columns that can still win. The estimate of a column is
// A = t + G[bucket(h)], t = x * (1/T), h its Philox word; its exact score lies in
// [A - W(A), A + W(A)], W(A) = C0 + REL * |A| (keys.gumbel_bound_table). A + W(A) and
// A - W(A) are increasing in A. `low` is a lower bound of the block's best exact score
// (it starts at -inf): the warp's largest logit X of the tile (its column scores at least
// X/T + noise_min - err) and A - W(A) of columns estimated so far; warps share it through
// s_low. Per tile (SAMPLED_PACKS 16-byte packs a thread, in registers, the next tile
// already loading), per quad (4 columns, one Philox block):
//   pass 1. a lane whose best case (its largest t + noise_max + err) is below low cannot
//      win this tile; when no lane of the warp can, the warp skips Philox for the tile
//      (columns far below the top logit, the common case). Otherwise every quad gets its
//      Philox block: the noise and G[bucket(h)] both decrease as h grows (G holds the
//      midpoints of consecutive word intervals), so A_q = max t + G[bucket(min h)] is at
//      least every estimate of the quad (quads of lanes that cannot win get it too: the
//      bound is sound for every quad, so pass 2 drops them or scores them and they lose),
//      and the column holding min h has the quad's largest noise: its A - W(A) raises
//      low. Then low becomes the warp's maximum (and goes to s_low).
//   pass 2. quads with A_q + W(A_q) >= low (a few per warp) get per-column estimates;
//      every column with A + W(A) >= low is listed (s_survivors).
// Once the block's tiles are done, each listed column still at or above the block's
// final low gets the exact portable score. The winner always does: its score is at least
// every lower bound and at most its own A + W(A) and its quad's A_q + W(A_q).
// The set of exactly scored columns depends on timing (how far s_low has risen), the
// result does not: it is the largest exact key, and the winner is always among them.
// The bound is relative, so it holds for every finite t (an overflowing bound rounds
// outward to +-inf); quads holding a NaN or a t above 1e37 are scored exactly; -inf
// columns can only win when every column is -inf (then low stays -inf and all are scored).
#define SAMPLED_PACKS 2
#define GUMBEL_TABLE_SIZE 528  // 2 * keys.GUMBEL_BUCKETS_PER_HALF
#define GUMBEL_SUB_BITS 3
#define GUMBEL_ABS_ERROR 1e-3f
#define GUMBEL_REL_ERROR 1.52587890625e-05f  // 2^-16
#define HUGE_ESTIMATE 1e37f

__device__ __forceinline__ u32 gumbel_bucket(u32 h) {  // keys.gumbel_bucket_index
    u32 half = h >> 31;
    u32 c = half ? ~h : h;
    u32 lz = __clz(c);
    u32 norm;
    asm("shl.b32 %0, %1, %2;" : "=r"(norm) : "r"(c), "r"(lz));  // PTX clamps: c = 0 gives 0
    u32 sub = (norm >> (31 - GUMBEL_SUB_BITS)) & ((1u << GUMBEL_SUB_BITS) - 1u);
    return half * (33u << GUMBEL_SUB_BITS) + (lz << GUMBEL_SUB_BITS) + sub;
}

__device__ __forceinline__ float bound_error(float t) {  // ABS + REL * |t|
    return GUMBEL_ABS_ERROR + GUMBEL_REL_ERROR * fabsf(t);
}

// Pruning arithmetic, -inf kept as -inf (a plain -inf + inf would give NaN).
__device__ __forceinline__ float best_case(float t, float noise_max) {  // >= every exact score of t
    return t == -__int_as_float(0x7f800000) ? t : t + noise_max + bound_error(t);
}
__device__ __forceinline__ float upper_bound(float a, float c0) {  // A + W(A)
    return a == -__int_as_float(0x7f800000) ? a : a + (c0 + GUMBEL_REL_ERROR * fabsf(a));
}
__device__ __forceinline__ float lower_bound(float a, float c0) {  // A - W(A)
    return a - (c0 + GUMBEL_REL_ERROR * fabsf(a));
}

// Order-preserving int of a non-NaN float (signed compare), and back.
__device__ __forceinline__ int ordered_int(float f) {
    const int i = __float_as_int(f);
    return i >= 0 ? i : i ^ 0x7fffffff;
}
__device__ __forceinline__ float from_ordered_int(int i) { return __int_as_float(i >= 0 ? i : i ^ 0x7fffffff); }

// Canonical float bits back from ordered_high (inverse of ordered_high).
__device__ __forceinline__ u32 canonical_from_ordered(u32 o) { return (o & 0x80000000u) ? (o & 0x7fffffffu) : ~o; }

__device__ __forceinline__ int warp_max_i32(int v) {  // every lane of the warp must call
    int r;
    asm volatile("redux.sync.max.s32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
    return r;
}
__device__ __forceinline__ u32 warp_max_u32(u32 v) {
    u32 r;
    asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
    return r;
}

// Canonical float32 bits of value i (0 <= i < VEC, a run-time index) of a pack.
template <int DTYPE>
__device__ __forceinline__ u32 pack_value_at(const uint4& p, int i) {
    const int per_word = 4 / (int)sizeof(typename Elem<DTYPE>::raw);
    const int word_index = i / per_word;
    const u32 word = word_index == 0 ? p.x : (word_index == 1 ? p.y : (word_index == 2 ? p.z : p.w));
    if (per_word == 1) return canonical_bits(word);
    const u16 half = (i & 1) ? (u16)(word >> 16) : (u16)(word & 0xffffu);
    return canonical_bits(Elem<DTYPE>::bits((typename Elem<DTYPE>::raw)half));
}

template <int DTYPE>
__device__ __forceinline__ float widened(const uint4& pack, int i) {  // value i as float32 (no canonicalization)
    const typename Elem<DTYPE>::raw* vals = (const typename Elem<DTYPE>::raw*)&pack;
    return fbits(Elem<DTYPE>::bits(vals[i]));
}

__device__ __forceinline__ u32 pack_word(const uint4& p, int w) {
    return w == 0 ? p.x : (w == 1 ? p.y : (w == 2 ? p.z : p.w));
}

// Largest value of quad q of a pack as float32, NaN when it holds one (packed maxima for
// 16-bit types; multiplying by 1/T > 0 keeps the order, so it gives the quad's max t).
template <int DTYPE>
__device__ __forceinline__ float quad_max_value(const uint4& p, int q);
template <>
__device__ __forceinline__ float quad_max_value<0>(const uint4& p, int q) {
    return f_max_nan(f_max_nan(fbits(p.x), fbits(p.y)), f_max_nan(fbits(p.z), fbits(p.w)));
}
template <>
__device__ __forceinline__ float quad_max_value<1>(const uint4& p, int q) {
    const u32 m = bf16x2_max_nan(pack_word(p, 2 * q), pack_word(p, 2 * q + 1));
    return f_max_nan(fbits(m << 16), fbits(m & 0xffff0000u));
}
template <>
__device__ __forceinline__ float quad_max_value<2>(const uint4& p, int q) {
    const u32 m = f16x2_max_nan(pack_word(p, 2 * q), pack_word(p, 2 * q + 1));
    return f_max_nan(fbits(f16_to_f32_bits((u16)(m & 0xffffu))), fbits(f16_to_f32_bits((u16)(m >> 16))));
}

// The smallest Philox word of a quad and the value (float32) of the column holding it.
struct MinWord {
    u32 word;
    float value;
};
template <int DTYPE>
__device__ __forceinline__ MinWord min_word_column(const uint4& p, int q, const Words4& w) {
    MinWord m = {w.w0, widened<DTYPE>(p, 4 * q)};
    const float v1 = widened<DTYPE>(p, 4 * q + 1), v2 = widened<DTYPE>(p, 4 * q + 2);
    const float v3 = widened<DTYPE>(p, 4 * q + 3);
    if (w.w1 < m.word) m = {w.w1, v1};
    if (w.w2 < m.word) m = {w.w2, v2};
    if (w.w3 < m.word) m = {w.w3, v3};
    return m;
}

// Estimate t + G of one column (-inf stays -inf; a NaN t gives NaN, handled per quad).
__device__ __forceinline__ float column_estimate(float t, u32 word, const float* s_table) {
    return t + s_table[gumbel_bucket(word)];
}

// The block's lower bound of its row's best exact score (ordered_int), shared by its warps.
__shared__ int s_low;

// Columns that passed a warp's bound, scored exactly once the block's bound is final (by
// then most of them are below it). A full list falls back to scoring on the spot.
#define SURVIVOR_SLOTS 256
struct Survivor {
    u32 column, bits, word;  // global column, canonical value bits, Philox word
    float estimate;          // +inf: must be scored (a NaN or huge t)
};
__shared__ Survivor s_survivors[SURVIVOR_SLOTS];
__shared__ int s_survivor_count;

// One tile of sampled_span (see there): this thread's packs (pack k holds the columns from
// bases[k]; none when bases[k] >= vec_end). BLOCK_BOUND (a block of one tile only: every
// thread of the block must call): pass 2 waits at a barrier for every warp's pass 1 and
// lists against the block's bound instead of the warp's, so fewer columns get listed and
// exactly scored (H200, docs/gpu-results.md session 11: 1 x 64K Gumbel 6.0 -> 5.5 us).
template <int DTYPE, bool BLOCK_BOUND>
__device__ __forceinline__ void sampled_tile(const uint4 (&packs)[SAMPLED_PACKS], const int (&bases)[SAMPLED_PACKS],
                                             int vec_end, u32 column0, const RowNoise& noise,
                                             const PhiloxKeys& keys, const float* s_table, float inv_t, u64& best) {
    const int VEC = Elem<DTYPE>::per16;
    const int K = SAMPLED_PACKS;
    const int QPP = VEC / 4;  // quads per pack
    const float c0 = s_table[GUMBEL_TABLE_SIZE];
    const float noise_max = s_table[GUMBEL_TABLE_SIZE + 1];
    const float noise_min = s_table[GUMBEL_TABLE_SIZE + 2];
    const int lane = (int)(threadIdx.x & 31u);
    float low = from_ordered_int(*(volatile int*)&s_low);
    // The lane's and the warp's largest logit of the tile (ordered; 0: no real pack).
    u32 lane_top = 0u;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        if (bases[k] < vec_end) {
            const u32 order = ordered_high(canonical_bits(pack_max_bits<DTYPE>(packs[k])));
            lane_top = order > lane_top ? order : lane_top;
        }
    }
    const u32 top = warp_max_u32(lane_top);
    if (top != 0u && top <= ordered_high(0x7f800000u)) {
        const float t_top = fbits(canonical_from_ordered(top)) * inv_t;
        if (fabsf(t_top) <= HUGE_ESTIMATE) low = fmaxf(low, t_top + noise_min - bound_error(t_top));
    }
    // The skip rule, per lane: a lane whose largest t cannot reach low even with the
    // largest noise needs no noise this tile. Once any lane needs it, every quad gets
    // its Philox block (side by side, no divergence); pass 2 then sorts them by reach.
    bool lane_needed = false;
    if (lane_top != 0u) {
        const float t_lane = fbits(canonical_from_ordered(lane_top)) * inv_t;  // NaN: a NaN column
        lane_needed = !(t_lane <= HUGE_ESTIMATE) || !(best_case(t_lane, noise_max) < low);
    }
    // Pass 1, per quad: A_q + W(A_q) (what the quad can reach) and A - W(A) of its
    // smallest word's column (the quad's largest noise), a lower bound of the row's best score.
    float reach[K * QPP];
#pragma unroll
    for (int j = 0; j < K * QPP; ++j) reach[j] = -__int_as_float(0x7f800000);
    if (__any_sync(0xffffffffu, lane_needed)) {
#pragma unroll
        for (int j = 0; j < K * QPP; ++j) {
            const int k = j / QPP, q = j - k * QPP;
            const float t_quad = quad_max_value<DTYPE>(packs[k], q) * inv_t;
            const bool special = !(t_quad <= HUGE_ESTIMATE);  // NaN or huge: score exactly
            const u32 column = column0 + (u32)(bases[k] + 4 * q);
            const Words4 w = philox4x32_10(column >> 2, 0u, noise.off_lo, noise.off_hi, keys);
            const MinWord m = min_word_column<DTYPE>(packs[k], q, w);
            const float g = s_table[gumbel_bucket(m.word)];
            reach[j] = special ? __int_as_float(0x7f800000) : upper_bound(t_quad + g, c0);
            if (bases[k] < vec_end && !special) low = fmaxf(low, lower_bound(m.value * inv_t + g, c0));
        }
    }
    {  // the warp's bound, and the block's
        int low_bits = warp_max_i32(ordered_int(low));
        if (lane == 0) low_bits = max(low_bits, atomicMax(&s_low, low_bits));
        low = from_ordered_int(__shfl_sync(0xffffffffu, low_bits, 0));
    }
    if (BLOCK_BOUND) {  // every warp's pass 1 is in s_low: pass 2 lists against the block's bound
        __syncthreads();
        low = from_ordered_int(*(volatile int*)&s_low);
    }
    // Pass 2: quads that can still reach low (a few per warp) list every column that can.
    u32 candidates = 0u, specials = 0u;
#pragma unroll
    for (int j = 0; j < K * QPP; ++j) {
        // (-inf reach passes a -inf low: packs past the span must not)
        if (bases[j / QPP] < vec_end && !(reach[j] < low)) candidates |= 1u << j;
        if (reach[j] == __int_as_float(0x7f800000)) specials |= 1u << j;
    }
    while (candidates) {
        const int j = __ffs(candidates) - 1;
        candidates &= candidates - 1u;
        const int k = j / QPP, first = (j - k * QPP) * 4;
        const uint4 pack = k == 0 ? packs[0] : packs[K - 1];
        const u32 column = column0 + (u32)((k == 0 ? bases[0] : bases[K - 1]) + first);
        const bool special = (specials >> j) & 1u;
        const Words4 w = philox4x32_10(column >> 2, 0u, noise.off_lo, noise.off_hi, keys);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u32 bits = pack_value_at<DTYPE>(pack, first + i);
            const u32 word = pick_word(w, (u32)i);
            const float est = column_estimate(fbits(bits) * inv_t, word, s_table);
            if (special || !(upper_bound(est, c0) < low)) {
                const int slot = atomicAdd(&s_survivor_count, 1);
                if (slot < SURVIVOR_SLOTS) {
                    s_survivors[slot] = {column + (u32)i, bits, word, special ? __int_as_float(0x7f800000) : est};
                } else {
                    const u64 key = make_ukey(gumbel_score_bits(bits, noise.temperature, word), column + (u32)i);
                    best = key > best ? key : best;
                }
            }
        }
    }
    __syncwarp();  // reconverge here, or the lanes run the next tile's setup apart
}

// Sampled rows whose slice starts at a global column that is a multiple of 4 (so a quad
// of a pack is one Philox block; the host's vocab offsets are in practice). See above.
// ONE_TILE (the fused kernels the host picks when every block's chunk fits one tile): a
// block whose span is one tile runs it outside the tile loop, with the block's bound in
// pass 2; other blocks take the loop. Separate kernels, so the loop of the others keeps
// its code (the barrier inside the loop's code took it from 64 to 86 registers).
template <int DTYPE, bool ONE_TILE>
__device__ u64 sampled_span(const typename Elem<DTYPE>::raw* row_ptr, int begin, int vec_end, u32 column0,
                            const RowNoise& noise, const float* s_table) {
    const int VEC = Elem<DTYPE>::per16;
    const int K = SAMPLED_PACKS;
    const float c0 = s_table[GUMBEL_TABLE_SIZE];
    const float inv_t = 1.0f / noise.temperature;  // estimates only: any rounding is in the error bound
    const int stride = (int)blockDim.x * VEC * K;
    const PhiloxKeys keys = philox_keys(noise.seed_lo, noise.seed_hi);
    u64 best = 0ull;
    // This thread's pack k of a tile is pack_ptr[k * blockDim.x]; the pointer advances a
    // tile at a time (no per-tile 64-bit address arithmetic).
    const int thread_base = begin + (int)threadIdx.x * VEC;
    const int pack_stride = (int)blockDim.x;  // in 16-byte packs
    const uint4* pack_ptr = (const uint4*)(row_ptr + thread_base);
    uint4 next[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        next[k] = thread_base + k * pack_stride * VEC < vec_end ? load_pack(pack_ptr + k * pack_stride)
                                                                : make_uint4(0u, 0u, 0u, 0u);
    }
    if (ONE_TILE && begin < vec_end && begin + stride >= vec_end) {  // uniform over the block
        uint4 packs[K];
        int bases[K];
#pragma unroll
        for (int k = 0; k < K; ++k) {
            packs[k] = next[k];
            bases[k] = thread_base + k * pack_stride * VEC;
        }
        sampled_tile<DTYPE, true>(packs, bases, vec_end, column0, noise, keys, s_table, inv_t, best);
    } else {
        for (int tile = begin; tile < vec_end; tile += stride) {  // uniform over the block
            uint4 packs[K];
            int bases[K];
            pack_ptr += K * pack_stride;
#pragma unroll
            for (int k = 0; k < K; ++k) {
                packs[k] = next[k];
                bases[k] = tile - begin + thread_base + k * pack_stride * VEC;
                next[k] = bases[k] + stride < vec_end ? load_pack(pack_ptr + k * pack_stride)
                                                      : make_uint4(0u, 0u, 0u, 0u);
            }
            sampled_tile<DTYPE, false>(packs, bases, vec_end, column0, noise, keys, s_table, inv_t, best);
        }
    }
    // The survivors against the block's final bound, one per thread.
    __syncthreads();
    const float final_low = from_ordered_int(*(volatile int*)&s_low);
    const int listed = min(*(volatile int*)&s_survivor_count, SURVIVOR_SLOTS);
    for (int i = threadIdx.x; i < listed; i += blockDim.x) {
        const Survivor sv = s_survivors[i];
        if (!(upper_bound(sv.estimate, c0) < final_low)) {
            const u64 key = make_ukey(gumbel_score_bits(sv.bits, noise.temperature, sv.word), sv.column);
            best = key > best ? key : best;
        }
    }
    return best;
}

// Columns [begin, end) one by one (unaligned rows and the tail after the 16-byte packs).
template <int DTYPE>
__device__ __forceinline__ u64 scalar_span(const typename Elem<DTYPE>::raw* row_ptr, int begin, int end,
                                           u32 column0, bool sampled, const RowNoise& noise) {
    u64 best = 0ull;
    for (int col = begin + threadIdx.x; col < end; col += blockDim.x) {
        const u64 key = exact_key(canonical_bits(Elem<DTYPE>::bits(row_ptr[col])), column0 + (u32)col, sampled, noise);
        best = key > best ? key : best;
    }
    return best;
}

// The largest chunk of the _one_tile kernels' pruned quads (pruned_quads), in quads a thread
// at 256 threads; larger chunks take sampled_span. Four quads a thread took 96-109 registers
// and were no faster on the H200 (session 19).
#define PRUNED_QUADS_MAX 2

// The quad of columns at p (a multiple of 4 columns from a 16-byte aligned row start) as
// loaded, in one read-only load: four float32 words, or four 16-bit values in x and y.
template <int DTYPE>
__device__ __forceinline__ uint4 load_quad(const typename Elem<DTYPE>::raw* p) {
    if (DTYPE == 0) return load_pack(p);
    uint4 q = make_uint4(0u, 0u, 0u, 0u);
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(q.x), "=r"(q.y) : "l"(p));
    return q;
}

// Value k (0-3) of a loaded quad as float32 bits (widened, not canonicalized).
template <int DTYPE>
__device__ __forceinline__ u32 quad_bits(const uint4& q, int k) {
    if (DTYPE == 0) return k == 0 ? q.x : (k == 1 ? q.y : (k == 2 ? q.z : q.w));
    const u32 word = k < 2 ? q.x : q.y;
    return Elem<DTYPE>::bits((typename Elem<DTYPE>::raw)((k & 1) ? word >> 16 : word & 0xffffu));
}

// Sampled columns [begin, quad_end) of a block, QPT (1 or 2) quads a thread: thread i's quad j
// starts at column begin + 4 * (i + j * blockDim.x) (begin and column0 multiples of 4, 16-byte
// aligned rows). Pruned within each warp, with no barrier and no shared list: every quad gets
// its Philox block and every column its estimate A = t + G[bucket(h)] (as in sampled_span);
// the warp's bound `low` is its largest A - W(A), a lower bound of its best exact score; only
// columns with A + W(A) >= low can be the warp's best, and only they get the exact portable
// score, one after another in the lanes that hold them. On random rows about one column a
// warp passes (the table's bound is that tight), so a warp runs about one exact score where
// scoring every column ran four a lane (H200, session 19: Gumbel 8 x 64K 6.46 -> 5.97 us, 32 x 16K 7.4 ->
// 6.6 at one quad a thread; 64 x 16K 9.4 -> 7.3 at two, against sampled_span). Columns with a NaN or huge t
// pass without raising low; -inf columns reach -inf, so they pass only when low is -inf (every column of
// the warp -inf). The result, the max of the passing columns' exact keys, is the max of all of them.
template <int DTYPE, int QPT>
__device__ u64 pruned_quads(const typename Elem<DTYPE>::raw* row_ptr, int begin, int quad_end, u32 column0,
                            const RowNoise& noise, const float* s_table) {
    const float c0 = s_table[GUMBEL_TABLE_SIZE];
    const float inv_t = 1.0f / noise.temperature;  // estimates only: any rounding is in the error bound
    // Two quads share one key schedule; one quad derives its keys inside its rounds (the
    // schedule's moves are volatile, so an unused one would still run).
    PhiloxKeys keys;
    if constexpr (QPT > 1) keys = philox_keys(noise.seed_lo, noise.seed_hi);
    uint4 quad[QPT];
    Words4 words[QPT];
    float reach[QPT][4];
    float low = -__int_as_float(0x7f800000);
#pragma unroll
    for (int j = 0; j < QPT; ++j) {
        const int col = begin + 4 * ((int)threadIdx.x + j * (int)blockDim.x);
        quad[j] = col < quad_end ? load_quad<DTYPE>(row_ptr + col) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int j = 0; j < QPT; ++j) {
        const int col = begin + 4 * ((int)threadIdx.x + j * (int)blockDim.x);
        const u32 column = column0 + (u32)col;
        if constexpr (QPT == 1) {
            words[j] = philox4x32_10(column >> 2, 0u, noise.off_lo, noise.off_hi, noise.seed_lo, noise.seed_hi);
        } else {
            words[j] = philox4x32_10(column >> 2, 0u, noise.off_lo, noise.off_hi, keys);
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float t = fbits(quad_bits<DTYPE>(quad[j], k)) * inv_t;
            const bool special = !(t <= HUGE_ESTIMATE);  // NaN or huge: scored exactly
            const float estimate = column_estimate(t, pick_word(words[j], (u32)k), s_table);
            reach[j][k] = special ? __int_as_float(0x7f800000) : upper_bound(estimate, c0);
            if (col < quad_end && !special) low = fmaxf(low, lower_bound(estimate, c0));
        }
    }
    low = from_ordered_int(warp_max_i32(ordered_int(low)));
    u32 passing = 0u;  // bit 4 * j + k: column k of quad j
#pragma unroll
    for (int j = 0; j < QPT; ++j) {
        const int col = begin + 4 * ((int)threadIdx.x + j * (int)blockDim.x);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            if (col < quad_end && !(reach[j][k] < low)) passing |= 1u << (4 * j + k);
        }
    }
    u64 best = 0ull;
    while (passing) {
        const int bit = __ffs(passing) - 1;
        passing &= passing - 1u;
        const int j = bit >> 2;
        const u32 k = (u32)(bit & 3);
        const uint4 q = (QPT > 1 && j == 1) ? quad[QPT - 1] : quad[0];  // selects, not a local array
        const Words4 w = (QPT > 1 && j == 1) ? words[QPT - 1] : words[0];
        u32 bits = quad_bits<DTYPE>(q, 0);
        bits = k == 1u ? quad_bits<DTYPE>(q, 1) : bits;
        bits = k == 2u ? quad_bits<DTYPE>(q, 2) : bits;
        bits = k == 3u ? quad_bits<DTYPE>(q, 3) : bits;
        const u32 column = column0 + (u32)(begin + 4 * ((int)threadIdx.x + j * (int)blockDim.x)) + k;
        const u64 key = make_ukey(gumbel_score_bits(canonical_bits(bits), noise.temperature, pick_word(w, k)), column);
        best = key > best ? key : best;
    }
    __syncwarp();  // reconverge before the block's maximum
    return best;
}

// Max of a 64-bit value over the warp: the high words' max, then the low words' max among
// the lanes holding it (two redux instructions instead of five dependent shuffle rounds).
__device__ __forceinline__ u64 warp_max_u64(u64 v) {  // every lane of the warp must call
    const u32 high = warp_max_u32((u32)(v >> 32));
    const u32 low = warp_max_u32((u32)(v >> 32) == high ? (u32)v : 0u);
    return ((u64)high << 32) | (u64)low;
}

__device__ __forceinline__ u64 block_max(u64 v) {
    __shared__ u64 s_warp[LL_THREADS / 32];
    v = warp_max_u64(v);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) s_warp[warp] = v;
    __syncthreads();
    if (warp == 0) v = warp_max_u64(lane < (int)(blockDim.x >> 5) ? s_warp[lane] : 0ull);
    return v;  // valid in thread 0
}

// The fused kernel's collector, for batches gather_row_maxima (below) does not take: every
// other work item's line of this call into s_parts[item] (the collector's own key, item 0,
// is put there by the caller), for reduce_chunk_parts. A thread keeps up to 4 lines in flight
// until each carries this call's epoch. Returns false in a thread whose wait ran past
// timeout_ns.
__device__ bool gather_block_lines(u64 lines, int blocks, u32 epoch, u64 timeout_ns, u64* s_parts) {
    const int BATCH = 4;
    for (int first = (int)threadIdx.x; first < blocks; first += BATCH * (int)blockDim.x) {
        u32 pending = 0u;
#pragma unroll
        for (int j = 0; j < BATCH; ++j) {
            const int b = first + j * (int)blockDim.x;
            if (b > 0 && b < blocks) pending |= 1u << j;
        }
        WaitClock clock;
        while (pending) {
            uint4 v[BATCH];
#pragma unroll
            for (int j = 0; j < BATCH; ++j) {
                if ((pending >> j) & 1u) v[j] = load_line(lines + 16ull * (u64)(first + j * (int)blockDim.x));
            }
#pragma unroll
            for (int j = 0; j < BATCH; ++j) {
                if (((pending >> j) & 1u) && v[j].y == epoch && v[j].w == epoch) {
                    const int b = first + j * (int)blockDim.x;
                    s_parts[b] = ((u64)v[j].z << 32) | (u64)v[j].x;
                    pending &= ~(1u << j);
                }
            }
            if (!pending) break;
            if (clock.expired(timeout_ns)) return false;
        }
    }
    return true;
}

#define ROW_GATHER_MAX_CHUNKS 64  // gather_row_maxima<2>: 32 lanes x 2 lines
#define COLUMNS_GATHER_MAX_CHUNKS 128  // gather_row_maxima<4>, the _columns kernels': 32 lanes x 4 lines

// The fused kernel's collector when rows <= warps and chunks <= 32 * LINES (small batches:
// ROW_GATHER_MAX_CHUNKS, or COLUMNS_GATHER_MAX_CHUNKS in the _columns kernels, whose rows
// span more blocks): warp `row` polls its row's block lines, up to LINES per lane in flight,
// and reduces them with warp_max_u64 straight into s_keys[row]: no shared-memory round
// trip and no barrier between the gather and the reduction. `own` is the collector's key (valid
// in thread 0). Returns false in a thread whose wait ran past timeout_ns.
template <int LINES>
__device__ bool gather_row_maxima(u64 lines, int rows, int chunks, u32 epoch, u64 timeout_ns, u64 own,
                                  u64* s_keys) {
    const int row = (int)threadIdx.x >> 5, lane = (int)threadIdx.x & 31;
    if (row >= rows) return true;  // uniform over the warp
    u32 pending = 0u;
#pragma unroll
    for (int j = 0; j < LINES; ++j) {
        const int c = lane + 32 * j;
        if (c < chunks && row * chunks + c > 0) pending |= 1u << j;
    }
    u64 best = threadIdx.x == 0 ? own : 0ull;
    bool complete = true;
    WaitClock clock;
    while (pending) {
        uint4 v[LINES];
#pragma unroll
        for (int j = 0; j < LINES; ++j) {
            if ((pending >> j) & 1u) v[j] = load_line(lines + 16ull * (u64)(row * chunks + lane + 32 * j));
        }
#pragma unroll
        for (int j = 0; j < LINES; ++j) {
            if (((pending >> j) & 1u) && v[j].y == epoch && v[j].w == epoch) {
                const u64 key = ((u64)v[j].z << 32) | (u64)v[j].x;
                best = key > best ? key : best;
                pending &= ~(1u << j);
            }
        }
        if (!pending) break;
        if (clock.expired(timeout_ns)) {
            complete = false;
            break;
        }
    }
    best = warp_max_u64(best);
    if (lane == 0) s_keys[row] = best;
    return complete;
}

// s_keys[row] = max over the row's chunks of s_parts[row * chunks + chunk] (chunks > 1):
// g = 2^lg lanes per row (the smallest power of two >= chunks, at most a warp), striding
// its chunks, then a shuffle max. Shifts only: this runs once per call, in the collector, on
// the path from the last block's key to the exchange.
__device__ void reduce_chunk_parts(const u64* s_parts, int rows, int chunks, u64* s_keys) {
    const int lg = chunks >= 32 ? 5 : 32 - __clz(chunks - 1);
    const int g = 1 << lg;
    const int rows_per_pass = (int)blockDim.x >> lg;
    const int member = (int)threadIdx.x & (g - 1);
    for (int base = 0; base < rows; base += rows_per_pass) {  // uniform over the block
        const int row = base + ((int)threadIdx.x >> lg);
        u64 m = 0ull;
        if (row < rows) {
            for (int c = member; c < chunks; c += g) {
                const u64 v = s_parts[row * chunks + c];
                m = v > m ? v : m;
            }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            if (off < g) {  // uniform
                const u64 o = __shfl_xor_sync(0xffffffffu, m, off);
                m = o > m ? o : m;
            }
        }
        if (row < rows && member == 0) s_keys[row] = m;
    }
}

// grid = rows * chunks blocks, one work item each; item w reduces columns
// [chunk * (w % chunks), ...) of row w / chunks. Item 0, the collector, runs in the last
// block, item w > 0 in block w - 1. Every item but 0 writes its key to its block line w (see
// the protocol above); the collector gathers them, reduces each row over its chunks, runs
// the exchange and writes out[row]: the token (want_tokens) or the winning signed key.
//   logits: [rows, *] with row stride `row_stride` (elements), `cols` real columns
//           (columns at or past the true vocab size are excluded by the host).
//   temperature: float32 [rows] or null (all greedy); rows with T >= threshold sample.
//   seeds/offsets: int64 [rows] or null (then seed = unseeded_seed, offset =
//           (*step_counter << 32) + row; *step_counter += 1 once the collector holds every
//           block's line, so after all blocks read it, when advance_step).
//   gumbel_table: keys.gumbel_bound_table() (GUMBEL_TABLE_SIZE + 4 floats).
//   lines: the channel's block lines (line_count >= rows * chunks lines of 16 bytes).
//   Dynamic shared memory: 8 * rows bytes, plus 8 * rows * chunks when chunks > 1.
template <int DTYPE, bool ONE_TILE, bool COLUMNS>
__device__ void argmax_logits_impl(const void* logits, i64 row_stride, int rows, int cols, u32 column0, int chunk,
                                   int chunks, int aligned, const float* temperature, float threshold,
                                   const i64* seeds, const i64* offsets, i64* step_counter, u64 unseeded_seed,
                                   int advance_step, i64* out, int want_tokens, const float* gumbel_table,
                                   u64 ctrl_ptr, u64 lines, int line_count, const u64* peer_slots,
                                   u64 host_error, int rank, int world, int max_rows, u64 timeout_ns) {
    typedef typename Elem<DTYPE>::raw raw;
    __shared__ float s_table[GUMBEL_TABLE_SIZE + 4];
    ChannelCtrl* ctrl = (ChannelCtrl*)ctrl_ptr;
    // Work item 0 (the collector: row 0's first chunk) runs in the grid's last block, item w
    // in block w - 1. Blocks start in index order, so by the time the collector waits, every
    // block it waits for has started, and none of them waits for anything. Run as block 0, a
    // collector that held its SM while the grid was larger than what fits the GPU at once
    // (another kernel beside it, or more registers or shared memory per block) kept later
    // blocks from starting until it timed out (docs/gpu-results.md, session 16).
    const int work = blockIdx.x + 1 == gridDim.x ? 0 : (int)blockIdx.x + 1;
    const bool collector = work == 0;

    const int row = work / chunks;
    const int chunk_index = work - row * chunks;
    const int begin = chunk_index * chunk;
    const int end = min(cols, begin + chunk);
    const raw* row_ptr = (const raw*)logits + (i64)row * row_stride;
    const int VEC = Elem<DTYPE>::per16;
    // 16-byte packs over [begin, vec_end) when the rows allow (begin is a multiple of VEC).
    const int vec_end = aligned ? begin + max(0, (end - begin) / VEC) * VEC : begin;

    // The epoch (and, in the collector, what the exchange needs) is loaded up front, beside the
    // row's inputs: off the path from the last block's key to the exchange.
    Exchange x = {ctrl, lines, line_count, peer_slots, (HostError*)host_error, rank, world, max_rows, timeout_ns};
    ExchangeStart start;
    if (collector) {
        start = exchange_prologue(x);
    } else {
        start.epoch = *(volatile u32*)&ctrl->epoch;
        start.failed_before = 0u;
    }

    // A row's inputs are loaded side by side, with no branch between them: on a sampled
    // row each dependent load would add a memory round trip to a latency-bound call.
    float t = 1.0f;
    u64 seed = unseeded_seed, offset = 0ull;
    const int TABLE_PER_THREAD = (GUMBEL_TABLE_SIZE + 4 + LL_THREADS - 1) / LL_THREADS;
    float table_part[TABLE_PER_THREAD];
    const bool pruned_quad_chunk =
        ONE_TILE && chunk <= 4 * PRUNED_QUADS_MAX * LL_THREADS && aligned && (column0 & 3u) == 0u;
    if (temperature) {  // uniform: the call has sampled rows
        t = temperature[row];
        if (seeds) {
            seed = (u64)seeds[row];
            offset = (u64)offsets[row];
        } else {
            offset = ((u64)(*(volatile i64*)step_counter) << 32) + (u64)row;
        }
        if (!COLUMNS) {  // uniform: the _columns kernels score every column exactly
#pragma unroll
            for (int k = 0; k < TABLE_PER_THREAD; ++k) {
                const int i = (int)threadIdx.x + k * LL_THREADS;
                table_part[k] = i < GUMBEL_TABLE_SIZE + 4 ? gumbel_table[i] : 0.0f;
            }
        }
    }
    const bool sampled = temperature && f_ge(t, threshold);
    u64 best;
    if (COLUMNS && sampled) {  // uniform over the block
        // The _columns kernels (chunks of one or two columns a thread): each column with its
        // quad's Philox block and its word, one exact score. A thread's chain then holds one or
        // two scores, not the four of a quad (session 13 timed one a thread inside the
        // _one_tile kernels: 1 x 16K Gumbel 3.6 -> 3.2 us on the H200).
        RowNoise noise = {t, (u32)seed, (u32)(seed >> 32), (u32)offset, (u32)(offset >> 32)};
        best = scalar_span<DTYPE>(row_ptr, begin, end, column0, true, noise);
    } else if (sampled) {
        RowNoise noise = {t, (u32)seed, (u32)(seed >> 32), (u32)offset, (u32)(offset >> 32)};
#pragma unroll
        for (int k = 0; k < TABLE_PER_THREAD; ++k) {
            const int i = (int)threadIdx.x + k * LL_THREADS;
            if (i < GUMBEL_TABLE_SIZE + 4) s_table[i] = table_part[k];
        }
        if (threadIdx.x == 0) {
            s_low = ordered_int(-__int_as_float(0x7f800000));
            s_survivor_count = 0;
        }
        __syncthreads();
        if (pruned_quad_chunk) {  // uniform over the block
            const int quad_end = begin + max(0, (end - begin) / 4) * 4;
            best = chunk <= 4 * LL_THREADS ? pruned_quads<DTYPE, 1>(row_ptr, begin, quad_end, column0, noise, s_table)
                                           : pruned_quads<DTYPE, 2>(row_ptr, begin, quad_end, column0, noise, s_table);
            const u64 tail = scalar_span<DTYPE>(row_ptr, quad_end, end, column0, true, noise);
            best = tail > best ? tail : best;
        } else {
            // Pruned packs need quads aligned with Philox blocks; otherwise every column is scored.
            const int packed_end = (column0 & 3u) == 0u ? vec_end : begin;
            best = sampled_span<DTYPE, ONE_TILE>(row_ptr, begin, packed_end, column0, noise, s_table);
            const u64 tail = scalar_span<DTYPE>(row_ptr, packed_end, end, column0, true, noise);
            best = tail > best ? tail : best;
        }
    } else {
        RowNoise none = {1.0f, 0u, 0u, 0u, 0u};
        best = greedy_span<DTYPE>(row_ptr, begin, vec_end, column0);
        u64 tail = scalar_span<DTYPE>(row_ptr, vec_end, end, column0, false, none);
        best = tail > best ? tail : best;
    }
    best = block_max(best);

    if (!collector) {
        if (threadIdx.x == 0) {
            store_line(lines + 16ull * (u64)work, (u32)best, start.epoch, (u32)(best >> 32), start.epoch);
        }
        return;
    }

    // The collector: every item's key (one line each), the row maxima, the exchange (whose first
    // barrier publishes s_keys and s_local_failed to the whole block).
    if (rows <= LL_THREADS / 32 &&
        chunks <= (COLUMNS ? COLUMNS_GATHER_MAX_CHUNKS : ROW_GATHER_MAX_CHUNKS)) {  // uniform
        if (!gather_row_maxima<COLUMNS ? 4 : 2>(lines, rows, chunks, start.epoch, timeout_ns, best, s_keys)) {
            s_local_failed = 1u;
        }
    } else {
        u64* s_parts = chunks > 1 ? s_keys + rows : s_keys;
        if (threadIdx.x == 0) s_parts[0] = best;
        const bool complete = gather_block_lines(lines, rows * chunks, start.epoch, timeout_ns, s_parts);
        if (!complete) s_local_failed = 1u;
        __syncthreads();
        if (chunks > 1) reduce_chunk_parts(s_parts, rows, chunks, s_keys);
    }
    exchange_rows<4>(x, start, s_keys, rows, out, want_tokens, step_counter, advance_step);
}

#define LL_ARGMAX_LOGITS_KERNEL(NAME, DTYPE, ONE, COLUMNS)                                                             \
    extern "C" __global__ void __launch_bounds__(LL_THREADS)                                                           \
        NAME(const void* logits, i64 row_stride, int rows, int cols, u32 column0, int chunk, int chunks,               \
             int aligned, const float* temperature, float threshold, const i64* seeds, const i64* offsets,             \
             i64* step_counter, u64 unseeded_seed, int advance_step, i64* out, int want_tokens,                        \
             const float* gumbel_table, u64 ctrl, u64 lines, int line_count, const u64* peer_slots,                    \
             u64 host_error, int rank, int world, int max_rows, u64 timeout_ns) {                                      \
        argmax_logits_impl<DTYPE, ONE, COLUMNS>(logits, row_stride, rows, cols, column0, chunk, chunks, aligned,       \
                                                temperature, threshold, seeds, offsets, step_counter, unseeded_seed,   \
                                                advance_step, out, want_tokens, gumbel_table, ctrl, lines, line_count, \
                                                peer_slots, host_error, rank, world, max_rows, timeout_ns);            \
    }

LL_ARGMAX_LOGITS_KERNEL(ll_argmax_logits_f32, 0, false, false)
LL_ARGMAX_LOGITS_KERNEL(ll_argmax_logits_bf16, 1, false, false)
LL_ARGMAX_LOGITS_KERNEL(ll_argmax_logits_f16, 2, false, false)
// Calls with sampled rows whose every chunk fits one tile (tpspec/exchange/ll.py picks them).
LL_ARGMAX_LOGITS_KERNEL(ll_argmax_logits_f32_one_tile, 0, true, false)
LL_ARGMAX_LOGITS_KERNEL(ll_argmax_logits_bf16_one_tile, 1, true, false)
LL_ARGMAX_LOGITS_KERNEL(ll_argmax_logits_f16_one_tile, 2, true, false)
// Calls with sampled rows whose chunks hold at most a column a thread (ll.py picks them).
// Kernels of their own, so the _one_tile kernels' code stays as measured.
LL_ARGMAX_LOGITS_KERNEL(ll_argmax_logits_f32_columns, 0, false, true)
LL_ARGMAX_LOGITS_KERNEL(ll_argmax_logits_bf16_columns, 1, false, true)
LL_ARGMAX_LOGITS_KERNEL(ll_argmax_logits_f16_columns, 2, false, true)

// ------------------------------------------------- benchmark reference (not an exchange)

// The floor of a sampled row under SPEC §2's noise, for tpspec bench exchange: read a bf16
// [rows, cols] slice (cols a multiple of 8, rows 16-byte aligned) the way the fused kernel
// does (grid = rows * chunks, the same tiles and prefetch) and compute the Philox block of
// every column, folding the words into out[block * warps + warp] so nothing is optimised
// away. No scores, no pruning, no exchange.
extern "C" __global__ void __launch_bounds__(LL_THREADS)
    ll_philox_floor_bf16(const u16* logits, i64 row_stride, int cols, int chunk, int chunks, u32 seed, u32* out) {
    const int VEC = 8, K = SAMPLED_PACKS;
    const int row = blockIdx.x / chunks;
    const int begin = (blockIdx.x - row * chunks) * chunk;
    const int end = min(cols, begin + chunk);
    const u16* row_ptr = logits + (i64)row * row_stride;
    const int stride = (int)blockDim.x * VEC * K;
    const PhiloxKeys keys = philox_keys(seed, 0u);  // as the fused kernel computes them
    u32 acc = 0u;
    uint4 next[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int b = begin + (k * (int)blockDim.x + (int)threadIdx.x) * VEC;
        next[k] = b < end ? load_pack(row_ptr + b) : make_uint4(0u, 0u, 0u, 0u);
    }
    for (int tile = begin; tile < end; tile += stride) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const uint4 pack = next[k];
            const int base = tile + (k * (int)blockDim.x + (int)threadIdx.x) * VEC;
            next[k] = base + stride < end ? load_pack(row_ptr + base + stride) : make_uint4(0u, 0u, 0u, 0u);
            if (base < end) {
#pragma unroll
                for (int q = 0; q < 2; ++q) {
                    const Words4 w = philox4x32_10((u32)(base + 4 * q) >> 2, 0u, (u32)row, 0u, keys);
                    const u32 folded = (w.w0 ^ w.w1) + (w.w2 ^ w.w3) + pack_word(pack, 2 * q);
                    acc = folded > acc ? folded : acc;
                }
            }
        }
    }
    // One plain store a warp, each to its own word: atomics of every warp onto its row's word
    // cost the launch ~0.6 us per 1024 of them on the H200 (session 19), which no fused call pays.
    acc = warp_max_u32(acc);
    if ((threadIdx.x & 31u) == 0u) out[blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)] = acc;
}

// A reference for tpspec bench exchange: one launch with the fused kernel's greedy grid
// that reads a bf16 [rows, cols] slice (cols a multiple of 8, rows 16-byte aligned) with
// the greedy rows' loop and stores each block's maximum key to out[block]. No block lines,
// no exchange: at small shapes, what the launch and the reads of a greedy call cost alone.
extern "C" __global__ void __launch_bounds__(LL_THREADS)
    ll_read_floor_bf16(const u16* logits, i64 row_stride, int cols, int chunk, int chunks, u64* out) {
    const int row = blockIdx.x / chunks;
    const int begin = (blockIdx.x - row * chunks) * chunk;
    const int end = min(cols, begin + chunk);
    const u64 best = block_max(greedy_span<1>(logits + (i64)row * row_stride, begin, max(begin, end), 0u));
    if (threadIdx.x == 0) out[blockIdx.x] = best;
}
