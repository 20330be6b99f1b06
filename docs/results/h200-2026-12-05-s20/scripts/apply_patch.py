"""Apply a unified diff of one file (as in patches/) to SOURCE and write OUTPUT; no `patch` binary needed.
Every hunk's context and removed lines must match exactly at the hunk's position (fails otherwise).
Usage: apply_patch.py SOURCE DIFF OUTPUT"""
import re
import sys

source, diff, output = sys.argv[1:4]
lines = open(source).read().split("\n")
out, pos = [], 0  # pos: next unread line of the source (0-based)
hunk = None
for raw in open(diff).read().split("\n"):
    m = re.match(r"@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@", raw)
    if m:
        start = int(m.group(1)) - (1 if m.group(2) != "0" else 0)
        out.extend(lines[pos:start])
        pos = start
        hunk = True
        continue
    if hunk is None:  # the header, before the first hunk
        continue
    if raw.startswith("\\"):
        continue
    tag, text = raw[:1], raw[1:]
    if tag == " " or tag == "-":
        if lines[pos] != text:
            sys.exit(f"{diff}: line {pos + 1} of {source} does not match the patch: {lines[pos]!r} != {text!r}")
        pos += 1
        if tag == " ":
            out.append(text)
    elif tag == "+":
        out.append(text)
    elif raw == "":
        continue  # the diff's last newline
out.extend(lines[pos:])
open(output, "w").write("\n".join(out))
