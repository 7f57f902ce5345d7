"""What machine a measurement ran on, for reports: compare ratios within a run and name the CPU,
since hosts of one kind differ in speed (docs/performance.md, "How to read these figures")."""

from __future__ import annotations

import os
import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def cpu_model(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's model name (Linux /proc/cpuinfo 'model name'), else what platform reports
    (platform.processor() is often empty on Linux), else the architecture."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe() -> dict:
    """{'platform', 'cpu', 'cpu_count'} of this machine."""
    return {"platform": platform.platform(), "cpu": cpu_model(), "cpu_count": os.cpu_count()}


__all__ = ["cpu_model", "describe"]
