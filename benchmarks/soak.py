"""Soak: a steady producer and a slow reader for a long time; RSS must stay bounded and flat.

Run: ``python benchmarks/soak.py [--minutes 10]`` (not in CI; tests/test_soak.py runs 30 s).
"""

from __future__ import annotations

import argparse
import json

from pushtable.bench.memory import measure

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--max-bytes", type=int, default=8 << 20)
    args = parser.parse_args()
    result = measure(args.minutes * 60, 65_536, capacity=1024, max_bytes=args.max_bytes)
    print(json.dumps(result, indent=2))
    margin_mb = 64
    bound = result["baseline_rss_mb"] + result["queue_bound_mb"] + margin_mb
    ok = result["max_rss_mb"] <= bound and abs(result["growth_mb"]) < 16
    print(
        f"RSS {result['min_rss_mb']:.0f}-{result['max_rss_mb']:.0f} MB, bound {bound:.0f} MB, "
        f"growth {result['growth_mb']:+.1f} MB: {'OK' if ok else 'OVER'}"
    )
    raise SystemExit(0 if ok else 1)
