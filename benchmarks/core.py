"""Live-table throughput vs DuckDB and a Python drain: ``python benchmarks/core.py [--quick]``.

The suite lives in :mod:`pushtable.bench.core`; ``pushtable bench`` runs it with the others.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pushtable.bench import run

if __name__ == "__main__":
    run(["core", "bandwidth"], quick="--quick" in sys.argv, json_path=Path("core.json"))
