"""Per-epoch cost of the Spark bridge: ``python benchmarks/spark_bridge.py [--quick]``.

The suite lives in :mod:`pushtable.bench.spark`; ``pushtable bench`` runs it with the others.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pushtable.bench import run

if __name__ == "__main__":
    run(["spark"], quick="--quick" in sys.argv, json_path=Path("spark.json"))
