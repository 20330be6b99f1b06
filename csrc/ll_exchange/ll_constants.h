// Constants shared by the LL kernels and the Python host code. The host reads this file
// (tpspec/exchange/cuda_module.py: shared_constants), so it holds only lines of the form
//   #define NAME VALUE  // optional comment
// with VALUE a decimal or hex integer (optional u suffix) or a float with an f suffix,
// besides comments, blank lines and the include guard.

#ifndef TPSPEC_LL_CONSTANTS_H
#define TPSPEC_LL_CONSTANTS_H

// ------------------------------------------------------------------------- launch shape
#define LL_THREADS 256    // threads of every block
#define LL_MAX_WORLD 64   // ranks of a group: missing-rank masks are 64-bit

// ------------------------------------------------------------------ buffer layout (bytes)
#define LL_CTRL_BYTES 64        // sizeof(ChannelCtrl): one per channel, in device memory
#define LL_LINE_BYTES 16        // one LL line {key_lo, epoch, key_hi, epoch}
#define LL_HOST_ERROR_BYTES 16  // sizeof(HostError): one per channel, host-mapped

// ---------------------------------------------------------------- row reduction shapes
#define GREEDY_UNROLL 4  // 16-byte packs a thread of a greedy row loads together (a group)
#define SAMPLED_PACKS 2  // 16-byte packs a thread of a sampled row holds per tile
#define PRUNED_QUADS_MAX 2  // most quads a thread of pruned_quads (the _one_tile kernels)
#define ROW_GATHER_MAX_CHUNKS 64  // gather_row_maxima<2>: 32 lanes x 2 lines
#define COLUMNS_GATHER_MAX_CHUNKS 128  // gather_row_maxima<4>, the _columns kernels': 32 lanes x 4 lines

// ------------------------------------- float32 constants of tpspec/keys.py, as bit patterns
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

// ------------------------------------------------------ Philox4x32-10 (tpspec/keys.py)
#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

// ------------------------------------ Gumbel pruning bounds (keys.gumbel_bound_table)
#define GUMBEL_TABLE_SIZE 528  // 2 * keys.GUMBEL_BUCKETS_PER_HALF
#define GUMBEL_SUB_BITS 3
#define GUMBEL_ABS_ERROR 1e-3f
#define GUMBEL_REL_ERROR 1.52587890625e-05f  // 2^-16

#endif  // TPSPEC_LL_CONSTANTS_H
