"""A process's memory as the memory benchmarks read it, and a tree ready to be measured.

RSS is what the ≤ 40 MiB goal (issue 25) reads: every resident page the process maps,
shared libraries' code included. PSS divides each shared page among the processes that map
it; USS counts only the process's private pages (what stopping it gives back).
"""

from __future__ import annotations

import compileall
import io
from collections import Counter
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

PACKAGES = ("nodeagent", "tunnel", "netfilter")


def compile_bytecode(tree: Path) -> None:
    """Write the tree's bytecode, as installing nodeagent does (pip compiles it). Without
    it (a checkout run with PYTHONDONTWRITEBYTECODE set), every start compiles each module
    from source, and the compiler's freed memory stays in the heap: up to ~1 MiB more RSS
    than an installed nodeagent."""
    with redirect_stdout(io.StringIO()):
        for package in PACKAGES:
            compileall.compile_dir(str(tree / package), quiet=2)


def smaps(pid: int, top: int = 6) -> dict[str, Any]:
    """MiB: RSS, PSS, USS, RSS's anonymous and file-backed pages, and the `top` files with
    the most pages in RSS."""
    roll: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                roll[parts[0].rstrip(":")] = int(parts[1])
    files: Counter[str] = Counter()
    name = ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if parts and not parts[0].endswith(":"):  # a mapping's first line
                name = parts[5] if len(parts) > 5 and parts[5].startswith("/") else ""
            elif parts and parts[0] == "Rss:" and name:
                files[Path(name).name] += int(parts[1])
    mib = {k: v / 1024 for k, v in roll.items()}
    return {"rss": mib["Rss"], "pss": mib["Pss"],
            "uss": mib["Private_Clean"] + mib["Private_Dirty"],
            "anon": mib["Anonymous"], "file": mib["Rss"] - mib["Anonymous"],
            "files": {k: v / 1024 for k, v in files.most_common(top)}}
