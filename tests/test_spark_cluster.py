"""Spark on a real standalone cluster, pushtable serve on an object store.

A master and two workers from pyspark's own ``bin/spark-class`` (executors in JVMs of their
own, Python workers in their own processes), moto's S3 server, and a ``pushtable serve``
process whose data dir is an S3 prefix. A driver in a child process (``tests/cluster_job.py``):
the worker check asks the executors (a worker Python that cannot import pushtable is named,
not patched over with the driver's), ``format("pushtable")`` writes micro-batches with zoned
timestamps and decimals into a durable topic on the store, and the source reads them back on
the executors straight from the topic's dataset on the store (``dataset`` and
``storage_options``). Every row lands once, in the topic and as read back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pytest

from tests.conftest import ObjectStore
from tests.spark_cluster import standalone_cluster

pytestmark = [pytest.mark.slow, pytest.mark.spark, pytest.mark.timeout(900)]

EPOCHS, ROWS = 4, 50


def write_epochs(src: Path) -> list[list[object]]:
    """One JSON file a micro-batch; the rows as ``[id, level, ts ISO (UTC), amount]``."""
    src.mkdir()
    expected: list[list[object]] = []
    for e in range(EPOCHS):
        path = src / f"part-{e:04d}.json"
        with path.open("w") as f:
            for r in range(ROWS):
                i = e * ROWS + r
                ts = datetime(2026, 11, 27, 12, 0, i % 60, tzinfo=timezone.utc)
                amount = Decimal(i) / 8
                f.write(
                    json.dumps(
                        {"id": i, "level": "ab"[i % 2], "ts": ts.isoformat(), "amount": str(amount)}
                    )
                    + "\n"
                )
                expected.append([i, "ab"[i % 2], ts.isoformat(), f"{amount:.4f}"])
        stamp = 1_700_000_000 + e * 10  # epochs follow file order
        os.utime(path, (stamp, stamp))
    return expected


def test_the_sink_and_the_source_on_a_standalone_cluster_with_topics_on_s3(
    object_store: ObjectStore, tmp_path: Path
) -> None:
    from tests.test_object_store import serve

    expected = write_epochs(tmp_path / "src")
    workdir = tmp_path / "server"
    workdir.mkdir()
    with (
        serve(object_store, "cluster", workdir) as (_proc, location, _line),
        standalone_cluster(tmp_path / "cluster") as master,
    ):
        from pushtable.flight import connect

        schema = pa.schema(
            [
                ("id", pa.int64()),
                ("level", pa.string()),
                ("ts", pa.timestamp("us", tz="UTC")),
                ("amount", pa.decimal128(18, 4)),
            ]
        )
        with connect(location) as client:
            client.create_topic("ticks", schema, durable=True)
        settings = {
            "master": master,
            "server": location,
            "dataset": f"s3://{object_store.bucket}/cluster/ticks.lance",
            "storage_options": object_store.options,
            "src": str(tmp_path / "src"),
            "checkpoints": str(tmp_path / "checkpoints"),
        }
        path = tmp_path / "job.json"
        path.write_text(json.dumps(settings))
        done = subprocess.run(
            [sys.executable, str(Path(__file__).parent / "cluster_job.py"), str(path)],
            capture_output=True,
            text=True,
            timeout=800,
            cwd=tmp_path,
            check=False,
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        assert lines, f"the driver failed ({done.returncode}):\n{done.stderr[-4000:]}"
        result = json.loads(lines[0].removeprefix("RESULT "))
        with connect(location) as client:
            stored = client.read("ticks", 0, client.offsets("ticks")["next"]).read_all()
    assert result["executors"] == 2
    assert result["driver_pid"] not in result["worker_pids"]  # Python ran on the executors
    assert result["bad_worker_python"] is not None
    assert "cannot import pushtable" in result["bad_worker_python"]
    assert "/usr/bin/python3" in result["bad_worker_python"]
    assert result["sink_error"] is None, result["sink_error"]
    assert result["source_error"] is None, result["source_error"]
    assert sorted(stored["id"].to_pylist()) == list(range(EPOCHS * ROWS))  # each row once
    assert result["read_back"] == expected
