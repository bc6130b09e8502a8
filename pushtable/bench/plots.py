"""PNG plots of a benchmark run (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _saved(fig: Any, path: Path) -> Path:
    """``fig`` laid out, written to ``path`` (PNG, 110 dpi) and closed."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def core_throughput(
    suite: dict[str, Any], cores: int, path: Path, limit_mrows: float | None = None
) -> Path:
    """Throughput vs batch size per engine, at the suite's largest capacity.

    A row per workload (schema), a panel per (query, producers).

    ``limit_mrows`` draws the machine's copy rate (float64 values per second) as the
    physical limit of a one-column scan.
    """
    capacity = max(r["capacity"] for r in suite["results"])
    results = [r for r in suite["results"] if r["capacity"] == capacity]
    workloads = list(dict.fromkeys(r.get("workload", "numbers") for r in results))
    panels = sorted({(r["query"], r["producers"]) for r in results})
    fig, axes = plt.subplots(
        len(workloads),
        len(panels),
        figsize=(4.2 * len(panels), 3.0 * len(workloads)),
        sharex=True,
        squeeze=False,
    )
    for row, workload in enumerate(workloads):
        for col, (query, producers) in enumerate(panels):
            ax = axes[row][col]
            for engine in sorted({r["engine"] for r in results}):
                points = sorted(
                    (
                        r
                        for r in results
                        if (r["engine"], r.get("workload", "numbers"), r["query"], r["producers"])
                        == (engine, workload, query, producers)
                    ),
                    key=lambda r: r["batch_rows"],
                )
                x = [r["batch_rows"] for r in points]
                y = [r["median_rows_per_s"] / 1e6 for r in points]
                err = [
                    [m - r["min_rows_per_s"] / 1e6 for m, r in zip(y, points, strict=True)],
                    [r["max_rows_per_s"] / 1e6 - m for m, r in zip(y, points, strict=True)],
                ]
                ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=engine)
            if limit_mrows and workload == "numbers":
                ax.axhline(
                    limit_mrows, color="grey", linestyle="--", linewidth=1, label="memory copy"
                )
            ax.set_xscale("log", base=2)
            ax.set_xticks([1024, 8192, 65536], ["1K", "8K", "64K"])
            ax.set_title(f"{workload}: {query}, {producers} producer(s)", fontsize=9)
            ax.grid(alpha=0.3)
            if row == len(workloads) - 1:
                ax.set_xlabel("rows per batch")
            if col == 0:
                ax.set_ylabel(f"M rows/s ({cores} cores)")
    axes[0][0].legend(fontsize=8)
    duckdb = suite.get("duckdb_version", "?")
    fig.suptitle(
        f"Live-table throughput, capacity {capacity} (median of {suite.get('reps', 5)}, "
        f"bars: min-max; DuckDB {duckdb})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def spark_split(suite: dict[str, Any], cores: int, path: Path) -> Path:
    """Per-epoch time split of the bridge next to toArrow alone."""
    d = suite["driver_path"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    labels = ["toArrow alone", "bridge (driver path)", "Lance only, executors"]
    left = 0.0
    for part, color in (("to_arrow", "#4c72b0"), ("commit", "#dd8452"), ("push", "#55a868")):
        width = d[part]["median_ms"]
        ax.barh(labels[1], width, left=left, color=color, label=part.replace("_", " "))
        left += width
    ax.barh(labels[0], suite["to_arrow_alone"]["median_ms"], color="#4c72b0")
    ax.barh(labels[2], suite["executor_path"]["median_ms"], color="#8172b3")
    ax.set_xlabel(f"ms per epoch of {suite['rows_per_epoch']:,} rows ({cores} cores, median)")
    ax.set_title(f"Spark bridge: +{suite['bridge_overhead_pct']:.1f}% over toArrow alone")
    ax.legend(loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    return _saved(fig, path)


def latency(suite: dict[str, Any], path: Path) -> Path:
    """Write -> result p50 and p99 per query and batch size (log scale), one panel per rate."""
    rates = sorted({c["batches_per_s"] for c in suite["cases"]}, reverse=True)
    fig, axes = plt.subplots(1, len(rates), figsize=(6 * len(rates), 3.6), squeeze=False)
    for ax, rate in zip(axes[0], rates, strict=True):
        cases = [c for c in suite["cases"] if c["batches_per_s"] == rate]
        labels = [f"{c['query']}\n{c['batch_rows']} rows" for c in cases]
        xs = range(len(cases))
        ax.bar([x - 0.2 for x in xs], [c["p50_ms"] for c in cases], 0.4, label="p50")
        ax.bar([x + 0.2 for x in xs], [c["p99_ms"] for c in cases], 0.4, label="p99")
        ax.axhline(20, color="grey", linestyle="--", linewidth=1, label="20 ms")
        ax.set_yscale("log")
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_ylabel("ms from write to result")
        ax.set_title(f"{rate:g} batch(es) per second")
        ax.legend(fontsize=8)
    fig.suptitle("Live answers: write -> result latency")
    return _saved(fig, path)


def fanout(suite: dict[str, Any], path: Path) -> Path:
    """Rows/s (per subscriber and total) and peak RSS growth vs the bound, per subscriber count."""
    counts = list(suite)
    xs = range(len(counts))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    each = [suite[n]["rows_per_s_per_subscriber"] / 1e6 for n in counts]
    total = [suite[n]["rows_per_s_total"] / 1e6 for n in counts]
    left.bar([x - 0.2 for x in xs], each, 0.4, label="per subscriber")
    left.bar([x + 0.2 for x in xs], total, 0.4, label="total")
    left.set_xticks(list(xs), [f"{n} subscriber(s)" for n in counts])
    left.set_ylabel("M rows/s")
    left.legend(fontsize=8)
    left.set_title("SELECT count(*), sum(v) per subscriber")
    right.bar(list(xs), [suite[n]["peak_rss_growth_mb"] for n in counts], 0.5, label="RSS growth")
    right.plot(list(xs), [suite[n]["bound_mb"] * 1.1 for n in counts], "k--", label="bound + 10 %")
    right.set_xticks(list(xs), [f"{n}" for n in counts])
    right.set_xlabel("subscribers")
    right.set_ylabel("MB")
    right.legend(fontsize=8)
    right.set_title("Peak RSS growth while streaming")
    fig.suptitle("Fan-out: one producer, one Topic")
    return _saved(fig, path)


def flight(suite: dict[str, Any], path: Path) -> Path:
    """Local, remote and bare-wire write rows/s per (batch rows, producers), and Spark's paths.

    Spark's driver path vs its executor path.
    """
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), width_ratios=[2, 1])
    rows = suite["write"]
    xs = range(len(rows))
    bars = [("local", "local_rows_per_s"), ("remote", "remote_rows_per_s")]
    if all("raw_rows_per_s" in r for r in rows):
        bars.append(("bare DoPut", "raw_rows_per_s"))
    width = 0.8 / len(bars)
    for i, (label, key) in enumerate(bars):
        offset = (i - (len(bars) - 1) / 2) * width
        left.bar([x + offset for x in xs], [r[key] / 1e6 for r in rows], width, label=label)
    left.set_xticks(list(xs), [f"{r['batch_rows']:,} rows\n{r['producers']} prod" for r in rows])
    left.set_yscale("log")
    left.set_ylabel("M rows/s (log)")
    left.legend(fontsize=8)
    left.set_title("write -> live count(*): one process, pushtable serve, bare wire")
    spark = suite["spark"]
    keys = ("driver", "executors", "driver+lance", "executors+lance")
    right.bar(range(4), [spark[k]["rows_per_s"] / 1e6 for k in keys], 0.5)
    right.set_xticks(range(4), ["driver", "executors", "driver\n+Lance", "executors\n+Lance"])
    right.set_ylabel("M rows/s")
    right.set_title("Spark epochs -> server (local[2])")
    return _saved(fig, path)


def windows(suite: dict[str, Any], path: Path) -> Path:
    """The window engines side by side: throughput (log) and window-close p50/p99 (log)."""
    side = suite["peers"]
    ran = [
        (name, side[name])
        for name in ("pushtable", "laminardb", "pathway")
        if name in side and "skipped" not in side[name]
    ]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), width_ratios=[1, 2])
    rates = [sorted(r["rows_per_s"] for r in res["throughput"]) for _, res in ran]
    left.bar(range(len(ran)), [r[len(r) // 2] / 1e6 for r in rates], 0.5)
    left.set_xticks(range(len(ran)), [res["engine"] for _, res in ran], fontsize=8)
    left.set_yscale("log")
    left.set_ylabel("M rows/s (median)")
    left.set_title("1-second tumbling count/sum, flat out")
    sizes = side["params"]["latency_batch_rows"]
    width = 0.8 / max(len(ran), 1)
    for i, (_, res) in enumerate(ran):
        cells = res["close_latency"]
        xs = [x + (i - (len(ran) - 1) / 2) * width for x in range(len(sizes))]
        p99 = [c["p99_ms"] if c.get("samples") else float("nan") for c in cells]
        p50 = [c["p50_ms"] if c.get("samples") else float("nan") for c in cells]
        right.bar(xs, p99, width, label=f"{res['engine']} p99")
        right.scatter(xs, p50, color="black", marker="_", s=120, zorder=3)
    right.axhline(5, color="grey", linestyle="--", linewidth=1, label="5 ms")
    right.set_yscale("log")
    right.set_xticks(range(len(sizes)), [f"{n:,}-row batches" for n in sizes])
    right.set_ylabel("ms, write -> window row (bar p99, tick p50)")
    right.set_title("window-close latency, one batch per 20 ms")
    right.legend(fontsize=7)
    return _saved(fig, path)


def render(results: dict[str, Any], plot_dir: Path) -> list[Path]:
    """Every plot a ``pushtable bench`` JSON result supports, into ``plot_dir``."""
    plot_dir.mkdir(parents=True, exist_ok=True)
    cores = int(results["machine"]["cores"] or 0)
    out = []
    if "core" in results:
        limit = results.get("bandwidth", {}).get("copy_mrows_per_s")
        out.append(core_throughput(results["core"], cores, plot_dir / "core_throughput.png", limit))
    if "spark" in results:
        out.append(spark_split(results["spark"], cores, plot_dir / "spark_epoch_split.png"))
    if "latency" in results:
        out.append(latency(results["latency"], plot_dir / "latency.png"))
    if "fanout" in results:
        out.append(fanout(results["fanout"], plot_dir / "fanout.png"))
    if "flight" in results:
        out.append(flight(results["flight"], plot_dir / "flight.png"))
    if "peers" in results.get("windows", {}):
        out.append(windows(results["windows"], plot_dir / "windows.png"))
    return out


if __name__ == "__main__":
    import json
    import sys

    # python -m pushtable.bench.plots RESULTS.json PLOT_DIR: re-draw the plots of a run
    for written in render(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])):
        print(written)
