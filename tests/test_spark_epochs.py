"""Per-epoch live results from Spark: ``epoch_column`` and the watermark the bridge advances.

Real local Spark, real Lance, real live queries; every wait is bounded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql import SparkSession

from pushtable import SessionContext
from pushtable.spark import ForeachBatchBridge
from tests.spark_support import ARROW, ids, run, stream, write_epochs
from tests.test_windows import LiveRows

pytestmark = pytest.mark.spark

STAMPED = ARROW.append(pa.field("epoch", pa.int64()))


def test_each_epoch_result_arrives_as_the_epoch_lands(spark: SparkSession, tmp_path: Path) -> None:
    write_epochs(tmp_path / "src", 4)
    ctx = SessionContext()
    live = ctx.register_streaming_table("events", STAMPED, order_by="epoch", unbounded=True)
    uri = tmp_path / "out.lance"
    bridge = ForeachBatchBridge(sinks=[live], lance_uri=uri, epoch_column="epoch")
    results = LiveRows(ctx, "SELECT epoch, count(*) AS n, min(id) AS lo FROM events GROUP BY epoch")
    seen_before: dict[int, list[dict[str, Any]]] = {}

    def fault(step: str, epoch: int) -> None:
        # Before epoch e is read, the results of every earlier epoch are already out.
        if step == "before_arrow" and epoch > 0:
            seen_before[epoch] = results.take(1)

    bridge.fault = fault
    run(stream(spark, tmp_path / "src"), bridge, tmp_path / "chk")
    assert results.finish() == [{"epoch": 3, "n": 5, "lo": 15}]
    assert seen_before == {e: [{"epoch": e - 1, "n": 5, "lo": (e - 1) * 5}] for e in (1, 2, 3)}
    assert ids(uri) == list(range(20))
    assert "epoch" not in __import__("lance").dataset(str(uri)).schema.names


def test_epoch_column_needs_it_in_every_live_table() -> None:
    ctx = SessionContext()
    plain = ctx.register_streaming_table("plain", ARROW)
    with pytest.raises(ValueError, match=r"'plain' needs an integer column 'epoch'"):
        ForeachBatchBridge(sinks=[plain], epoch_column="epoch")
