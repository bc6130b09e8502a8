"""A five-panel dashboard over one live stream: four panels from the start, one joining late.

Every panel is its own query over its own subscription of one ``Topic``; the late panel starts
from the retained history (``start="earliest"``), so it misses nothing.

Run: ``python examples/dashboard.py``
"""

from __future__ import annotations

import random
import threading
import time

import pyarrow as pa

from pushtable import SessionContext, Topic

SCHEMA = pa.schema([("service", pa.string()), ("latency_ms", pa.float64())])
PANELS = {
    "requests": "SELECT count(*) AS requests FROM {t}",
    "slow": "SELECT count(*) AS slow FROM {t} WHERE latency_ms > 90",
    "by_service": "SELECT service, avg(latency_ms) AS avg_ms FROM {t} GROUP BY service ORDER BY 1",
    "worst": "SELECT max(latency_ms) AS worst_ms FROM {t}",
}


def produce(topic: Topic, batches: int = 200) -> None:
    """Request logs arriving in small batches."""
    rng = random.Random(0)
    with topic:
        for _ in range(batches):
            services = [rng.choice(["api", "auth", "search"]) for _ in range(50)]
            latencies = [rng.expovariate(1 / 30) for _ in range(50)]
            topic.write(pa.record_batch([pa.array(services), pa.array(latencies)], schema=SCHEMA))
            time.sleep(0.002)


def main() -> None:
    topic = Topic("requests", SCHEMA, retain=1_000)  # enough history for a late panel
    ctx = SessionContext()
    for name in PANELS:
        topic.subscribe(ctx, name, capacity=8)
    results: dict[str, list[dict[str, object]]] = {}

    def panel(name: str, sql: str) -> None:
        results[name] = ctx.sql(sql.format(t=name)).to_arrow_table().to_pylist()

    threads = [threading.Thread(target=panel, args=item) for item in PANELS.items()]
    for t in threads:
        t.start()
    producer = threading.Thread(target=produce, args=(topic,))
    producer.start()
    time.sleep(0.2)  # the dashboard is already live when a fifth panel opens
    topic.subscribe(ctx, "late", start="earliest")
    late = threading.Thread(
        target=panel, args=("late", "SELECT count(*) AS requests_seen_by_late_panel FROM {t}")
    )
    late.start()
    for t in [producer, *threads, late]:
        t.join()
    for name, rows in results.items():
        print(f"{name:>10}: {rows}")
    assert results["late"][0]["requests_seen_by_late_panel"] == results["requests"][0]["requests"]


if __name__ == "__main__":
    main()
