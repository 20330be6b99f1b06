#ifndef TPSPEC_LL_GREEDY_H
#define TPSPEC_LL_GREEDY_H

#include "ll_common.h"

// Greedy rows: memory bound, so a few instructions per 16 bytes. Per pack only its maximum
// (packed NaN-propagating max) is ranked; a thread keeps the first pack holding its best
// value and finds the lowest column of that value inside it at the end.

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

// The greedy key of columns [begin, vec_end) of a row (16-byte packs; begin a multiple of a
// pack): GREEDY_UNROLL packs a thread form a group, loaded together.
template <int DTYPE>
__device__ __forceinline__ u64 greedy_span(const typename Elem<DTYPE>::raw* row_ptr, int begin, int vec_end,
                                           u32 column0) {
    const int VEC = Elem<DTYPE>::per16;
    const int UNROLL = GREEDY_UNROLL;
    const int step = blockDim.x * VEC;
    u32 best_order = 0u;   // ordered_high of the best value; 0 = none (every real value maps above 0)
    uint4 best_pack = make_uint4(0u, 0u, 0u, 0u);
    int best_base = 0;
    int base = begin + threadIdx.x * VEC;
    if (base + (UNROLL - 1) * step < vec_end) {
        // The next group's loads are issued before this group is ranked, so a thread keeps
        // up to two groups in flight and HBM stays busy while a group is ranked.
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

#endif  // TPSPEC_LL_GREEDY_H
