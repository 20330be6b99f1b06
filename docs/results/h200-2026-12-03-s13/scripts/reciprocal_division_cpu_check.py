# Session 13, CPU, exact rational arithmetic; not adopted and never run on the GPU. Could x / T be taken with one
# reciprocal of T a row: r = RN(1/t), q = RN(x r), rem = RN(x - q t) (fma), q1 = RN(q + rem r) (fma), against RN(x/t),
# for float32 t and |x| in [2^-60, 2^60]? Four runs of 150,000 cases (seeds 1-4): q1 matched every time, but the
# residual was inexact in 5,041 cases (t with a mantissa of all or nearly all ones), so the premise of the usual proof fails
# for some t: without a proof for every t the kernel keeps div.rn. Usage: python3 THIS SEED CASES
from fractions import Fraction as F
import random, struct, sys
def f32(bits): return struct.unpack('<f', struct.pack('<I', bits))[0]
def RN(v):  # round a Fraction to float32, ties to even (normal range only)
    if v == 0: return F(0)
    s = -1 if v < 0 else 1; a = abs(v)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    while F(2)**e > a: e -= 1
    while F(2)**(e+1) <= a: e += 1
    assert -126 <= e <= 127, e
    scale = F(2)**(e-23)
    m = a / scale
    n = m.numerator // m.denominator; rem = m - n
    if rem > F(1,2) or (rem == F(1,2) and n % 2 == 1): n += 1
    return s * n * scale
random.seed(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
bad = 0; N = int(sys.argv[2]) if len(sys.argv) > 2 else 200000
def rand_f32(lo_exp, hi_exp):
    kind = random.random()
    e = random.randint(lo_exp, hi_exp)
    if kind < 0.1: m = 0x7fffff
    elif kind < 0.2: m = 0
    elif kind < 0.3: m = random.choice([1, 2, 0x7ffffe, 0x400000, 0x3fffff])
    else: m = random.getrandbits(23)
    return ((e + 127) << 23) | m
for i in range(N):
    tb = rand_f32(-60, 59)
    xb = rand_f32(-60, 59) if random.random() < 0.5 else (random.getrandbits(16) << 16) & 0x7fffffff  # bf16 values too
    if (xb >> 23) & 0xff == 0xff: continue
    t = F(f32(tb)); x = F(f32(xb))
    if x == 0 or not (F(2)**-60 <= abs(x) < F(2)**60): continue
    if random.random() < 0.5: x = -x
    r = RN(1 / t); q = RN(x * r); rem = RN(x - q * t); q1 = RN(q + rem * r)
    if rem != x - q * t: print('inexact residual', xb, tb)
    if q1 != RN(x / t): bad += 1; print('MISMATCH', hex(xb), hex(tb))
print('bad', bad, 'of', N)
