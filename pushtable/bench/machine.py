"""The machine's physical limit: memory bandwidth measured as a numpy copy."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import psutil


def bandwidth(mb: int = 256, reps: int = 5) -> dict[str, float]:
    """GB/s of ``np.copyto`` over ``mb`` MiB (read + write counted once, as a copy rate)."""
    src = np.ones(mb * 2**20 // 8)
    dst = np.empty_like(src)
    rates = []
    for _ in range(reps):
        start = time.perf_counter()
        np.copyto(dst, src)
        rates.append(src.nbytes / (time.perf_counter() - start) / 1e9)
    return {
        "copy_gb_per_s_median": statistics.median(rates),
        "copy_gb_per_s_min": min(rates),
        "copy_gb_per_s_max": max(rates),
        # the same copy in float64 "rows" per second, comparable to a one-column scan
        "copy_mrows_per_s": statistics.median(rates) * 1e9 / 8 / 1e6,
    }


def describe() -> dict[str, Any]:
    """Core count and memory, to label every absolute number."""
    return {
        "cores": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


@contextlib.contextmanager
def busy(loops: int) -> Iterator[None]:
    """``loops`` processes spinning on the CPU while the block runs: a busy machine.

    Each is a Python loop of its own (``while True: pass``), as another job on the machine
    would be; every engine a suite alternates between sees the same load. Stopped (killed)
    when the block ends.
    """
    if loops < 0:
        raise ValueError(f"busy: the number of spinning processes must be >= 0, got {loops}")
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(loops)]
    try:
        yield
    finally:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.wait(30)
