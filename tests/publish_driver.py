"""A Spark-like driver process for the publish crash sweep: it stages each epoch's shares
(two partitions) and publishes them into a durable topic, as ``RemoteBridge`` does, and
rides out a server that is killed and restarted: on any error it reconnects and runs the
epoch again from the start (Spark re-runs a failed batch), skipping an epoch the server says
is published. After each publish that answered it prints ``published <epoch>``.
"""

from __future__ import annotations

import sys
import time

import pyarrow as pa

from pushtable.errors import PushTableError
from pushtable.flight import Client, connect

SCHEMA = pa.schema([pa.field("k", pa.int64(), nullable=False), pa.field("epoch", pa.int64())])
QUERY = "sweep"


def share(epoch: int, part: int, rows: int) -> pa.RecordBatch:
    first = (epoch * 2 + part) * rows
    return pa.record_batch(
        {"k": range(first, first + rows), "epoch": [epoch] * rows}, schema=SCHEMA
    )


def run_epoch(client: Client, epoch: int, rows: int) -> None:
    if epoch <= client.published("events", QUERY):
        return  # a replay: the server has it whole
    for part in (0, 1):
        client.stage("events", QUERY, epoch, part, 0, [share(epoch, part, rows)], SCHEMA)
    client.publish("events", QUERY, epoch, [(0, 0, rows), (1, 0, rows)])


def main(location: str, epochs: int, rows: int) -> None:
    client = connect(location)
    print("ready", flush=True)
    for epoch in range(epochs):
        deadline = time.monotonic() + 60
        while True:
            try:
                run_epoch(client, epoch, rows)
                break
            except (PushTableError, OSError) as exc:  # the server died or lost the shares
                if time.monotonic() > deadline:
                    raise
                print(f"retry {epoch} {type(exc).__name__}", flush=True)
                time.sleep(0.1)
                client = connect(location)
        print(f"published {epoch}", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
