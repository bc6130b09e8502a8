"""PNG plots of a benchmark run (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def core_throughput(suite: dict[str, Any], cores: int, path: Path) -> Path:
    """Throughput vs batch size per engine: one panel per (query, producers), capacity 64."""
    results = [
        r
        for r in suite["results"]
        if r["capacity"] == max(r2["capacity"] for r2 in suite["results"])
    ]
    panels = sorted({(r["query"], r["producers"]) for r in results})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), sharey=True)
    for ax, (query, producers) in zip(axes, panels, strict=True):
        for engine in sorted({r["engine"] for r in results}):
            rows = sorted(
                (
                    r
                    for r in results
                    if (r["engine"], r["query"], r["producers"]) == (engine, query, producers)
                ),
                key=lambda r: r["batch_rows"],
            )
            x = [r["batch_rows"] for r in rows]
            y = [r["median_rows_per_s"] / 1e6 for r in rows]
            err = [
                [m - r["min_rows_per_s"] / 1e6 for m, r in zip(y, rows, strict=True)],
                [r["max_rows_per_s"] / 1e6 - m for m, r in zip(y, rows, strict=True)],
            ]
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=engine)
        ax.set_xscale("log", base=2)
        ax.set_xticks([1024, 8192, 65536], ["1K", "8K", "64K"])
        ax.set_title(f"{query}, {producers} producer(s)")
        ax.set_xlabel("rows per batch")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"M rows/s ({cores} cores, median, min-max)")
    axes[0].legend()
    fig.suptitle("Live-table throughput: pushtable vs DuckDB lazy reader vs Python drain")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
