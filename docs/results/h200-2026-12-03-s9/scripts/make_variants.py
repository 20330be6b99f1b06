"""Write the session 9 kernel variants under tmp_gpu/v_*/ll_exchange.cu from csrc/ll_exchange."""
import pathlib
import sys

SRC = pathlib.Path("csrc/ll_exchange/ll_exchange.cu").read_text()


def patch(text, pairs):
    for old, new in pairs:
        if text.count(old) != 1:
            sys.exit(f"patch anchor found {text.count(old)} times: {old[:60]!r}")
        text = text.replace(old, new)
    return text


def write(name, text):
    d = pathlib.Path("tmp_gpu") / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "ll_exchange.cu").write_text(text)
    print("wrote", d)


# v_xstamp: timestamps of the exchange, per warp (lane 0), indexed by the call's epoch % 32.
XSTAMP = [
    ("// The clock of one bounded wait:",
     "__device__ u64 g_xstamps[32 * 8 * 16];  // [epoch % 32][warp][k] = {globaltimer, clock64}\n"
     "__device__ __forceinline__ void xstamp(u32 epoch, int k) {\n"
     "    if ((threadIdx.x & 31u) == 0u && threadIdx.x < 256u) {\n"
     "        u64 c;\n"
     "        asm volatile(\"mov.u64 %0, %%clock64;\" : \"=l\"(c) :: \"memory\");\n"
     "        u64* p = g_xstamps + ((epoch & 31u) * 8u + (threadIdx.x >> 5)) * 16u + 2u * k;\n"
     "        u64 g;\n"
     "        asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(g) :: \"memory\");\n"
     "        p[0] = g;\n"
     "        p[1] = c;\n"
     "    }\n"
     "}\n\n"
     "// The clock of one bounded wait:"),
    ("                              i64* out, int want_tokens, i64* step_counter, int advance_step) {\n"
     "    __syncthreads();\n"
     "    const u32 epoch = start.epoch;\n",
     "                              i64* out, int want_tokens, i64* step_counter, int advance_step) {\n"
     "    xstamp(start.epoch, 1);\n"
     "    __syncthreads();\n"
     "    const u32 epoch = start.epoch;\n"
     "    xstamp(epoch, 2);\n"),
    ("    // Wait: the same thread per row; the lines of up to WAIT_BATCH peers in flight at once.\n",
     "    xstamp(epoch, 3);\n"
     "    // Wait: the same thread per row; the lines of up to WAIT_BATCH peers in flight at once.\n"),
    ("        if (missing) atomicOr(&s_missing_ranks, missing);\n",
     "        if (missing) atomicOr(&s_missing_ranks, missing);\n"
     "        xstamp(epoch, 4);\n"),
    ("    __syncthreads();\n\n    // The last two calls of an epoch cycle",
     "    __syncthreads();\n    xstamp(epoch, 5);\n\n    // The last two calls of an epoch cycle"),
    ("        if (advance_step) *(volatile i64*)step_counter = *(volatile i64*)step_counter + 1;\n    }\n}\n",
     "        if (advance_step) *(volatile i64*)step_counter = *(volatile i64*)step_counter + 1;\n"
     "        xstamp(epoch, 6);\n    }\n}\n"),
    ("    const ExchangeStart start = exchange_prologue(x);  // its loads overlap the key loads below\n",
     "    const u64 t_entry = global_timer_ns();\n"
     "    const ExchangeStart start = exchange_prologue(x);  // its loads overlap the key loads below\n"
     "    {\n        u64 t_epoch; asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(t_epoch) : \"r\"(start.epoch));\n"
     "        if ((threadIdx.x & 31u) == 0u) { u64* p = g_xstamps + ((start.epoch & 31u) * 8u + (threadIdx.x >> 5)) * 16u; p[0] = t_entry; p[1] = t_epoch; }\n    }\n"),
]
# The same stamps on the session 9 kernel (csrc at the time): epoch written first, keys loaded before the prologue.
XSTAMP_NEW = [XSTAMP[0],
    ("        if (advance_step) *(volatile i64*)step_counter = *(volatile i64*)step_counter + 1;\n    }\n    __syncthreads();\n",
     "        if (advance_step) *(volatile i64*)step_counter = *(volatile i64*)step_counter + 1;\n    }\n"
     "    xstamp(epoch, 1);\n    __syncthreads();\n    xstamp(epoch, 2);\n"),
    XSTAMP[2], XSTAMP[3], XSTAMP[4],
    ("                __threadfence_system();\n            }\n        }\n    }\n}\n",
     "                __threadfence_system();\n            }\n        }\n        xstamp(epoch, 6);\n    }\n}\n"),
    ("    const int first = (int)threadIdx.x;\n",
     "    const u64 t_entry = global_timer_ns();\n    const int first = (int)threadIdx.x;\n"),
    ("    const ExchangeStart start = exchange_prologue(x);\n    if (first < rows)",
     "    const ExchangeStart start = exchange_prologue(x);\n"
     "    {\n        u64 t_epoch; asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(t_epoch) : \"r\"(start.epoch));\n"
     "        if ((threadIdx.x & 31u) == 0u) { u64* p = g_xstamps + ((start.epoch & 31u) * 8u + (threadIdx.x >> 5)) * 16u; p[0] = t_entry; p[1] = t_epoch; }\n    }\n"
     "    if (first < rows)"),
]
if __name__ == "__main__":
    if "--new" in sys.argv:
        write("v_xstamp_new", patch(SRC, XSTAMP_NEW))
    else:
        write("v_xstamp", patch(SRC, XSTAMP))
