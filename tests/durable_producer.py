"""A producer process for the durable-topic crash tests: an idempotent producer that writes
``batches`` batches of ``rows`` rows to a topic, flushing every ``every`` batches.

Each row says who wrote it and where: (producer, seq, row). After each flush it prints
``flushed <seq>``: every batch up to ``seq`` was acknowledged, so it must be stored. It
rides out a server that is killed and restarted (``retry``), and prints ``done`` at the end.
"""

from __future__ import annotations

import sys
import time

import pyarrow as pa

from pushtable.errors import CommitFailedError
from pushtable.flight import connect
from pushtable.flight.client.idempotent import IdempotentSink

SCHEMA = pa.schema([("producer", pa.string()), ("seq", pa.int64()), ("row", pa.int64())])


def batch(producer: str, seq: int, rows: int) -> pa.RecordBatch:
    return pa.record_batch(
        [pa.array([producer] * rows), pa.array([seq] * rows, pa.int64()), pa.array(range(rows))],
        schema=SCHEMA,
    )


def flush(sink: IdempotentSink) -> None:
    """Flush; a commit that failed (``tests/faulty_serve.py`` injects some) is retried by the
    topic, and the sink keeps what it covers: flush again, as the error says (bounded)."""
    for _ in range(200):
        try:
            sink.flush()
            return
        except CommitFailedError as exc:
            if not getattr(exc, "kept", False):
                raise
            time.sleep(0.05)
    sink.flush()


def main(location: str, topic: str, producer: str, batches: int, rows: int, every: int) -> None:
    client = connect(location)
    sink = client.sink(topic, producer_id=producer, retry=60.0)
    assert isinstance(sink, IdempotentSink)
    first = sink._next_sequence  # a restarted producer continues after what is stored
    print("ready", flush=True)
    for seq in range(first, batches):
        try:
            sink.write(batch(producer, seq, rows))
        except CommitFailedError as exc:  # kept by the sink, as the error says: not again
            if not getattr(exc, "kept", False):
                raise
        if (seq + 1) % every == 0:
            flush(sink)
            print(f"flushed {seq}", flush=True)
    flush(sink)
    print(f"flushed {batches - 1}", flush=True)
    print("done", flush=True)
    client.close()


if __name__ == "__main__":
    location, topic, producer, batches, rows, every = sys.argv[1:7]
    main(location, topic, producer, int(batches), int(rows), int(every))
