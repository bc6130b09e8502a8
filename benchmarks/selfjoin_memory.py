"""Self-join memory: the smallest fair pool a self-join answers in, pushtable beside DataFusion.

A table named twice in one query is read once (``SharedScanExec``): the rows one scan has not
read yet wait in the session's memory pool, counted, so a self-join needs a larger pool than
plain DataFusion over a memory table, whose rows its pool does not count. This prints the
answer (or the error) of ``SELECT count(*) FROM d a JOIN d b ON a.k = b.k`` over the same
batches for pools of 1.2, 1.6, 2.0 and 3.0 times the data, in both.

Run: ``python benchmarks/selfjoin_memory.py [--batches 40]`` (not in CI).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import datafusion
import numpy as np
import pyarrow as pa

from pushtable import SessionContext

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])
QUERY = "SELECT count(*) AS n FROM d a JOIN d b ON a.k = b.k"
ROWS = 65_536


def _outcome(run: Callable[[int], object], limit: int) -> str:
    try:
        return str(run(limit))
    except Exception as exc:  # noqa: BLE001 (the outcome is what is printed)
        return f"{type(exc).__name__}: {str(exc)[:120]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=40)
    args = parser.parse_args()
    batches = [
        pa.record_batch(
            [pa.array(np.arange(i * ROWS, (i + 1) * ROWS)), pa.array(np.ones(ROWS, np.int64))],
            schema=SCHEMA,
        )
        for i in range(args.batches)
    ]
    data = sum(b.get_total_buffer_size() for b in batches)
    print(f"data: {data / 1e6:.1f} MB in {args.batches} batches")

    def plain(limit: int) -> object:
        runtime = datafusion.RuntimeEnvBuilder().with_fair_spill_pool(limit)
        ctx = datafusion.SessionContext(runtime=runtime)
        ctx.register_record_batches("d", [batches])
        return ctx.sql(QUERY).to_pydict()

    def live(limit: int) -> object:
        ctx = SessionContext(memory_limit=limit)
        sink = ctx.register_streaming_table("d", SCHEMA, capacity=len(batches) + 1)
        for b in batches:
            sink.write(b)
        sink.close()
        return ctx.sql(QUERY).to_pydict()

    for times in (1.2, 1.6, 2.0, 3.0):
        limit = int(data * times)
        print(f"pool {times}x: datafusion {_outcome(plain, limit)}")
        print(f"pool {times}x: pushtable  {_outcome(live, limit)}")


if __name__ == "__main__":
    main()
