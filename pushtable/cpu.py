"""The CPU the native core needs, checked before it loads.

On Linux x86_64 the native core is built for x86-64-v3 (AVX2, FMA, BMI2: Intel Haswell and
later, AMD Zen and Excavator), as polars' main wheel is: arrow-rs's comparison kernels only
vectorize with AVX2 (``.cargo/config.toml`` has the figures). On an older CPU the library
would die with SIGILL on its first instruction of those; this check says why instead. A core
built from source for an older CPU (``RUSTFLAGS="-C target-cpu=x86-64" make setup``) runs
with ``PUSHTABLE_CPU_CHECK=0``.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

__all__ = ["check", "missing_features"]

#: x86-64-v3's features as /proc/cpuinfo names them, with their usual names.
X86_64_V3 = {
    "pni": "SSE3",
    "ssse3": "SSSE3",
    "sse4_1": "SSE4.1",
    "sse4_2": "SSE4.2",
    "popcnt": "POPCNT",
    "cx16": "CMPXCHG16B",
    "lahf_lm": "LAHF/SAHF",
    "avx": "AVX",
    "avx2": "AVX2",
    "bmi1": "BMI1",
    "bmi2": "BMI2",
    "f16c": "F16C",
    "fma": "FMA",
    "abm": "LZCNT",
    "movbe": "MOVBE",
    "xsave": "XSAVE",
}


def missing_features(cpuinfo: str) -> list[str]:
    """The x86-64-v3 features the first ``flags`` line of ``cpuinfo`` lacks."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            return [name for flag, name in X86_64_V3.items() if flag not in flags]
    return []  # no flags line: nothing to go by


def check() -> None:
    """Raise ImportError, naming the missing features, if this CPU cannot run the core."""
    if os.environ.get("PUSHTABLE_CPU_CHECK") == "0":
        return
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return
    missing = missing_features(cpuinfo)
    if missing:
        raise ImportError(
            "pushtable's native core is built for x86-64-v3 and this CPU lacks "
            f"{', '.join(missing)}. Build it for this CPU from a clone of pushtable: "
            'RUSTFLAGS="-C target-cpu=x86-64" make setup, and run with PUSHTABLE_CPU_CHECK=0'
        )
