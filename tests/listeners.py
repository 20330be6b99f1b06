"""The TCP listeners of a process (Linux ``/proc``): which addresses a test's servers bind."""

from __future__ import annotations

import os

LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
"""127.0.0.1 and ::1 (and ::ffff:127.0.0.1) as ``/proc/net/tcp*`` writes them."""


def listening_addresses(pid: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* writes them) of the TCP sockets ``pid`` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A = LISTEN
                    found.append(fields[1].rsplit(":", 1)[0])
    return found
