"""What machine and checkout a benchmark ran on, for its JSON: the CPU's model and vector
class, the commit; and the JSON line a benchmark ends with."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

CPUINFO = Path("/proc/cpuinfo")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (/proc/<pid>/stat: Linux only)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        for line in CPUINFO.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_class() -> str:
    """The widest vector class the CPU offers (what a release build targets on it)."""
    try:
        flags = set(next(line for line in CPUINFO.read_text().splitlines()
                         if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return "unknown"
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "AVX-512" + (" VNNI" if "avx512_vnni" in flags else "")
    if {"avx2", "fma"} <= flags:
        return "AVX2+FMA"
    return "no AVX2"


def commit_of_repo() -> str:
    """The checkout's short commit (with a + when its tracked files differ from it)."""
    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent)
    try:
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
        return git("rev-parse", "--short", "HEAD").stdout.strip() + ("+" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def emit(result: dict[str, Any], out: Path | None) -> None:
    """Prints a benchmark's result as its last line, one JSON object, and writes it to
    `out` too when given."""
    line = json.dumps(result, sort_keys=True)
    if out is not None:
        out.write_text(line + "\n")
    print(line)
