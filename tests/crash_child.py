"""One run of a Spark -> Lance (+ live table) stream that may hard-exit at a chosen step.

``python -m tests.crash_child SRC URI CHK [STEP EPOCH [driver|executor|update]]``: runs the
stream over every file in SRC with the bridge (``update``: counts per level, upserted by key);
when STEP/EPOCH are given the process dies with ``os._exit(17)``
(no cleanup, no exception handling, like a kill) when the bridge reaches that step of that
epoch. Exit status 0 means the stream finished.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from pushtable import SessionContext
from pushtable.spark import ForeachBatchBridge
from tests.spark_support import ARROW, QUERY_WAIT, spark_session, stream

CRASH_EXIT = 17


def main(argv: list[str]) -> int:
    src, uri, chk = (Path(a) for a in argv[:3])
    step, epoch = (argv[3], int(argv[4])) if len(argv) > 4 else (None, -1)
    path = argv[5] if len(argv) > 5 else "driver"
    executor, update = path == "executor", path == "update"
    spark = spark_session("pushtable-crash")
    ctx = SessionContext()
    live = ctx.register_streaming_table("events", ARROW, capacity=2)
    drained: list[int] = []
    reader = threading.Thread(
        target=lambda: drained.append(
            ctx.sql("SELECT count(*) AS n FROM events").to_pydict()["n"][0]
        ),
        daemon=True,
    )
    reader.start()
    if update:  # no live sink: update mode refuses them
        live.close()
        bridge = ForeachBatchBridge(lance_uri=uri, mode="update", key=["level"])
    else:
        bridge = ForeachBatchBridge(sinks=[live], lance_uri=uri, executor_writes=executor)

    def fault(s: str, e: int) -> None:
        if s == step and e == epoch:
            os._exit(CRASH_EXIT)

    bridge.fault = fault
    df = stream(spark, src)
    if update:
        df = df.groupBy("level").count()
    q = (
        df.writeStream.foreachBatch(bridge)
        .outputMode("update" if update else "append")
        .option("checkpointLocation", str(chk))
        .trigger(availableNow=True)
        .start()
    )
    bridge.watch(q, spark)
    if not q.awaitTermination(QUERY_WAIT):
        return 3
    reader.join(QUERY_WAIT)
    print(f"live rows {drained[0] if drained else -1}", flush=True)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
