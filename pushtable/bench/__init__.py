"""``pushtable bench``: every performance claim, reproducible in one run.

Suites: ``core`` (live-table throughput vs DuckDB and a Python drain), ``latency`` (write ->
result time of live queries), ``windows`` (the live engine's window aggregates: throughput and
window-close latency, beside LaminarDB and Pathway unless ``peers=False``), ``updating``
(updating ``GROUP BY``: throughput and write -> updated row latency at 1,000 and 100,000 keys),
``joins`` (an interval join of two live tables: throughput, and memory over 10 M rows a side),
``spark`` (the bridge's per-epoch split vs ``toArrow``), ``memory`` (RSS stays bounded with a
slow reader), ``fanout`` (one producer, 1 / 4 / 16 live queries over a Topic), ``flight``
(``pushtable serve`` vs one process; Spark executor vs driver push), ``durable`` (durable vs
memory topics: ingest, acknowledgement latency, restart, upkeep) and ``bandwidth`` (the
machine's copy rate, the physical limit). Needs the ``cli`` extra.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

SUITES: tuple[str, ...] = (
    "core",
    "latency",
    "windows",
    "updating",
    "joins",
    "fanout",
    "flight",
    "spark",
    "memory",
    "durable",
    "bandwidth",
)


def run(
    suites: Sequence[str],
    quick: bool,
    json_path: Path | None = None,
    plot_dir: Path | None = None,
    say: Callable[[str], None] = print,
    peers: bool = True,
    busy: int = 0,
) -> dict[str, Any]:
    """Run ``suites``, print their tables, write JSON and plots; return the results.

    The suites run from the lightest footprint to the heaviest (memory, spark, core), so a
    suite's figures are not skewed by what an earlier one left in the process's heap.
    ``peers=False`` leaves LaminarDB and Pathway out of ``windows`` (they run from a venv of
    their own, made from the package index on first use). ``busy`` processes spin on the CPU
    for the whole run (a busy machine: both sides of each ratio under the same load).
    """
    from pushtable.bench import machine

    with machine.busy(busy):
        return _run(suites, quick, json_path, plot_dir, say, peers, busy)


def _run(
    suites: Sequence[str],
    quick: bool,
    json_path: Path | None,
    plot_dir: Path | None,
    say: Callable[[str], None],
    peers: bool,
    busy: int,
) -> dict[str, Any]:
    from pushtable.bench import machine, memory, spark

    out: dict[str, Any] = {"machine": machine.describe(), "quick": quick, "busy_loops": busy}
    say(f"machine: {out['machine']['cores']} cores, {out['machine']['memory_gb']} GB")
    if busy:
        say(f"busy: {busy} processes spinning on the CPU throughout")
    # Always: absolute figures from machines whose memory copies at different rates are
    # not comparable without it (the ``bandwidth`` suite is this line alone).
    out["bandwidth"] = machine.bandwidth(64 if quick else 256)
    say(f"bandwidth: numpy copy {out['bandwidth']['copy_gb_per_s_median']:.1f} GB/s")
    if "memory" in suites:
        out["memory"] = memory.run(quick)
        for name, m in out["memory"].items():
            say(
                f"memory {name}: RSS {m['min_rss_mb']:.0f}-{m['max_rss_mb']:.0f} MB "
                f"(baseline {m['baseline_rss_mb']:.0f}, queue bound {m['queue_bound_mb']:.0f}, "
                f"growth {m['growth_mb']:+.1f} MB)"
            )

    def suite(name: str, *args: Any) -> dict[str, Any]:
        """Run suite ``name`` (its module's ``run(quick, *args)``) and print its table."""
        module = importlib.import_module(f"pushtable.bench.{name}")
        figures: dict[str, Any] = module.run(quick, *args)
        out[name] = figures
        say(module.table(figures))
        return figures

    if "durable" in suites:
        suite("durable")
    if "spark" in suites:
        from pushtable.bench import spark_format

        out["spark"] = spark.run(quick)
        say(spark.report(out["spark"]))
        out["spark"]["format"] = spark_format.run(quick)
        say(spark_format.report(out["spark"]["format"]))
    for name in ("flight", "fanout", "latency"):
        if name in suites:
            suite(name)
    if "windows" in suites:
        suite("windows")
        if peers:
            from pushtable.bench import peers as side_by_side

            out["windows"]["peers"] = side_by_side.run(quick)
            say(side_by_side.table(out["windows"]["peers"]))
    for name in ("updating", "joins"):
        if name in suites:
            suite(name, peers)
    if "core" in suites:
        gone = suite("core")["reader_gone"]
        say(f"reader gone -> blocked write raises: median {gone['median_s'] * 1e3:.1f} ms")
    if plot_dir is not None:
        from pushtable.bench import plots

        for path in plots.render(out, plot_dir):
            say(f"plot: {path}")
    if json_path is not None:
        json_path.write_text(json.dumps(out, indent=2))
        say(f"json: {json_path}")
    return out
