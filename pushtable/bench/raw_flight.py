"""A bare pyarrow Flight server: the wire's own speed, for the ``flight`` suite to compare with.

DoPut reads every chunk and drops it (what the wire and pyarrow's reader cost, nothing of
pushtable's); DoGet serves the batches a ticket asks for (``{"rows": r, "batches": n}``) from
memory. Run as ``python -m pushtable.bench.raw_flight``: it prints its location and serves
until killed.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.float64())])


class RawServer(flight.FlightServerBase):  # type: ignore[misc]
    """DoPut: read and drop; DoGet: batches from memory."""

    def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        while True:
            try:
                reader.read_chunk()
            except StopIteration:
                return

    def do_get(self, context: Any, ticket: Any) -> Any:
        ask = json.loads(ticket.ticket)
        rows, count = int(ask["rows"]), int(ask["batches"])
        rng = np.random.default_rng(1)
        k = pa.array(np.arange(rows, dtype=np.int64))
        batch = pa.record_batch([k, pa.array(rng.random(rows))], schema=SCHEMA)
        return flight.GeneratorStream(SCHEMA, (batch for _ in range(count)))


def main() -> None:
    server = RawServer("grpc://127.0.0.1:0")
    print(f"raw flight: listening on grpc://127.0.0.1:{server.port}", flush=True)
    server.serve()


if __name__ == "__main__":
    main()
