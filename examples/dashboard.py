"""A live dashboard: five per-second panels over one stream, each printing as a second closes.

Request logs carry their event time (``ts``); the ``Topic`` declares it (``order_by="ts"``), so
every panel is a window ``GROUP BY`` that pushtable's live engine emits the moment the next
second's first request arrives: no panel waits for the end of the stream. Four panels start
with the stream; a fifth joins late and reads the retained history first (``start="earliest"``),
so it misses nothing.

Run: ``python examples/dashboard.py``
"""

from __future__ import annotations

import random
import threading
import time
from datetime import datetime, timedelta, timezone

import pyarrow as pa

from pushtable import SessionContext, Topic

SCHEMA = pa.schema(
    [
        ("ts", pa.timestamp("ms", tz="UTC")),
        ("service", pa.string()),
        ("latency_ms", pa.float64()),
    ]
)
SECOND = "date_bin(INTERVAL '1 second', ts)"
PANELS = {
    "requests": f"SELECT {SECOND} AS second, count(*) AS requests FROM {{t}} GROUP BY 1",
    "slow": f"SELECT {SECOND} AS second, count(*) AS slow FROM {{t}} "
    "WHERE latency_ms > 90 GROUP BY 1",
    "by_service": f"SELECT {SECOND} AS second, service, round(avg(latency_ms), 1) AS avg_ms "
    "FROM {t} GROUP BY 1, 2",
    "worst": f"SELECT {SECOND} AS second, round(max(latency_ms), 1) AS worst_ms "
    "FROM {t} GROUP BY 1",
}
START = datetime(2026, 1, 1, tzinfo=timezone.utc)


def produce(topic: Topic, batches: int = 100, per_second: int = 10) -> None:
    """Request logs in small batches; each batch is a tenth of a second of event time."""
    rng = random.Random(0)
    with topic:
        for i in range(batches):
            base = START + timedelta(seconds=i / per_second)
            ts = [base + timedelta(milliseconds=j) for j in range(50)]
            services = [rng.choice(["api", "auth", "search"]) for _ in range(50)]
            latencies = [rng.expovariate(1 / 30) for _ in range(50)]
            topic.write(pa.record_batch([ts, services, latencies], schema=SCHEMA))
            time.sleep(0.005)


def main() -> dict[str, list[tuple[float, dict[str, object]]]]:
    """Run the dashboard; returns each panel's rows with the time each arrived."""
    topic = Topic("requests", SCHEMA, order_by="ts", retain=1_000)  # history for a late panel
    ctx = SessionContext()
    for name in PANELS:
        topic.subscribe(ctx, name, capacity=8)
    rows: dict[str, list[tuple[float, dict[str, object]]]] = {name: [] for name in PANELS}
    rows["late"] = []
    lock = threading.Lock()

    def panel(name: str, sql: str) -> None:
        for batch in ctx.sql(sql.format(t=name)).execute_stream():
            for row in batch.to_pyarrow().to_pylist():
                with lock:
                    rows[name].append((time.monotonic(), row))
                    second = row.pop("second")
                    print(f"{name:>10} {second:%H:%M:%S}: {row}", flush=True)

    threads = [threading.Thread(target=panel, args=item) for item in PANELS.items()]
    for t in threads:
        t.start()
    producer = threading.Thread(target=produce, args=(topic,))
    producer.start()
    time.sleep(0.2)  # the dashboard is already live when a fifth panel opens
    topic.subscribe(ctx, "late", start="earliest")
    late_sql = f"SELECT {SECOND} AS second, count(*) AS requests_seen_late FROM {{t}} GROUP BY 1"
    late = threading.Thread(target=panel, args=("late", late_sql))
    late.start()
    producer.join()
    closed_at = time.monotonic()
    for t in [*threads, late]:
        t.join()
    # Each panel printed its seconds while the stream was still open (not at close).
    for name, got in rows.items():
        assert got, f"panel {name} printed nothing"
        assert got[0][0] < closed_at, f"panel {name} printed nothing before close()"
    requests = [r["requests"] for _, r in rows["requests"]]
    assert [r["requests_seen_late"] for _, r in rows["late"]] == requests
    return rows


if __name__ == "__main__":
    main()
