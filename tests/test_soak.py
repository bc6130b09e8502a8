"""A 30-second soak: steady producer, slow reader; RSS stays within the queue's bound.

Under ``-m slow``: half a minute of RSS sampling is a measurement (``pushtable bench --suite
memory`` reports the same figures), not a check the default run needs each time.

It runs in a fresh interpreter: in the test process, memory that earlier tests left to the
allocator is returned during the soak and would read as a (negative) trend.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

MARGIN_MB = 64  # allocator slack, DataFusion's own buffers, the batch being built
CODE = """
import json
from pushtable.bench.memory import measure
result = measure(30.0, 65_536, capacity=1024, max_bytes=8 << 20)
print(json.dumps({k: float(v) if v is not None else None for k, v in result.items()}))
"""


@pytest.mark.slow
def test_rss_stays_bounded_with_a_slow_reader() -> None:
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["rows_read"] > 0
    bound = result["baseline_rss_mb"] + result["queue_bound_mb"] + MARGIN_MB
    assert result["max_rss_mb"] <= bound, result
    assert abs(result["growth_mb"]) < 16, result  # no trend between the two halves
