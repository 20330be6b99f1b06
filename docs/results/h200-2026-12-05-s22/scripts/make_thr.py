"""Session 22 candidate `thr`: pruned_quads and pruned_loop test each column against one threshold a
warp instead of computing its own upper and lower bounds. Both bounds, a + c0 + REL*|a| and
a - c0 - REL*|a|, increase with a, so the warp's bound is lower_bound(max a), one of the terms the max of
lower bounds takes (`low` now holds max a, carried from tile to tile in pruned_loop), and a column with
a < thr = L - c0 - 2*REL*(|L| + c0), L = lower_bound(max a), has a + c0 + REL*|a| < L (margin
REL*(|L| + c0)*(1 - 2*REL), far above the float rounding). Same keys; fewer instructions a column.
Usage: make_thr.py SRC DST  (SRC: the source with the _tiles patch applied)"""
import sys
s = open(sys.argv[1]).read()
helper_anchor = "// Order-preserving int of a non-NaN float (signed compare), and back."
helper = '''// A column whose estimate is below pass_threshold(low) has upper_bound < low (see make_thr.py).
__device__ __forceinline__ float pass_threshold(float low, float c0) {
    return low - (c0 + 2.0f * GUMBEL_REL_ERROR * (fabsf(low) + c0));
}

'''
assert s.count(helper_anchor) == 1
s = s.replace(helper_anchor, helper + helper_anchor)
import re
pat = re.compile(r"(\n\s+)const float estimate = column_estimate\(t, pick_word\(words\[j\], \(u32\)k\), s_table\);"
                 r"(\n\s+)reach\[j\]\[k\] = special \? __int_as_float\(0x7f800000\) : upper_bound\(estimate, c0\);"
                 r"(\n\s+)if \(col < quad_end && !special\) low = fmaxf\(low, lower_bound\(estimate, c0\)\);")
s, n = pat.subn(r"\1const float estimate = column_estimate(t, pick_word(words[j], (u32)k), s_table);"
                r"\2reach[j][k] = special ? __int_as_float(0x7f800000) : estimate;"
                r"\3if (col < quad_end && !special) low = fmaxf(low, estimate);", s)
assert n == 2, n
pat2 = re.compile(r"(\n\s+)low = from_ordered_int\(warp_max_i32\(ordered_int\(low\)\)\);")
s, n = pat2.subn(r"\1low = from_ordered_int(warp_max_i32(ordered_int(low)));  // the warp's largest estimate"
                 r"\1const float thr = pass_threshold(lower_bound(low, c0), c0);", s)
assert n == 2, n
pat3 = re.compile(r"if \(col < quad_end && !\(reach\[j\]\[k\] < low\)\) passing")
s, n = pat3.subn("if (col < quad_end && !(reach[j][k] < thr)) passing", s)
assert n == 2, n
open(sys.argv[2], "w").write(s)
