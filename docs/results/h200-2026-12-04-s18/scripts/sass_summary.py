"""Summarise an ncu source-page CSV (ncu -i X.ncu-rep --page source --csv --print-source sass): warp
instructions executed, stall samples by reason, opcode mix; with a second argument, every executed SASS line
(index, executions, samples, top stall). Session 18 ran it on batch A's profiles (a/sass-summary.txt)."""
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
hdr = rows[1]; data = rows[2:]
ix = {h: i for i, h in enumerate(hdr)}
def num(r, k):
    try: return float(r[ix[k]])
    except: return 0.0
tot_i = sum(num(r, "Instructions Executed") for r in data)
tot_s = sum(num(r, "Warp Stall Sampling (All Samples)") for r in data)
print(f"instr executed (warp) {tot_i:.0f}  samples {tot_s:.0f}  sass lines {len(data)}")
stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
agg = {s: sum(num(r, s) for r in data) for s in stalls}
print("stalls:", ", ".join(f"{k[6:]} {v/tot_s*100:.1f}%" for k, v in sorted(agg.items(), key=lambda x: -x[1]) if v))
op = collections.Counter()
for r in data:
    o = r[ix["Source"]].split()
    o = [t for t in o if not t.startswith("@")]
    op[o[0].split(".")[0] if o else "?"] += num(r, "Instructions Executed")
print("opcodes:", ", ".join(f"{k} {v/tot_i*100:.1f}%" for k, v in op.most_common(25)))
if len(sys.argv) > 2:
    for n, r in enumerate(data):
        e = num(r, "Instructions Executed"); s = num(r, "Warp Stall Sampling (All Samples)")
        if e or s:
            top = max(stalls, key=lambda k: num(r, k))
            print(f"{n:5d} {e:9.0f} {s:6.0f} {top[6:] if s else '':12s} {r[ix['Source']].strip()[:90]}")
