"""The ``windows`` suite's side-by-side part: pushtable's live engine beside LaminarDB and Pathway.

All in one run: the same rows, the same 1-second tumbling ``count(*)``/``sum(v)``, the same
closing rule (a window closes with the first batch of a later second), throughput and
write→window-row latency.

The peers pin an older pyarrow than pushtable, so they run from a venv of their own
(``PUSHTABLE_PEERS_PYTHON``, or one made on first use under ``~/.cache/pushtable``) in child
processes; ``peer_laminardb.py``, ``peer_pathway.py`` and ``peer_workload.py`` are the files
they run. Pathway's Python connector takes rows one at a time, so its throughput run is capped
at ``PATHWAY_MAX_ROWS`` rows (the table says how many it ran).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from pushtable.bench import peer_workload as workload
from pushtable.bench.windows import DENSE, SESSIONS, SLIDING, Workload, close_latency, throughput

PEERS = {"laminardb": "laminardb==0.17.*", "pathway": "pathway==0.33.*"}
PATHWAY_MAX_ROWS = 500_000
HERE = Path(__file__).parent

INTS = Workload(
    schema=workload.SCHEMA,
    sql="SELECT ts / 1000 AS w, count(*) AS n, sum(v) AS s FROM t GROUP BY ts / 1000",
    batches=workload.throughput_batches,
    latency_batch=workload.latency_batch,
    window_of=lambda w: [int(v) for v in w.cast(pa.int64()).to_pylist()],
)


def peers_python() -> Path:
    """The interpreter of the peers venv, made (with pip, from the package index) if missing."""
    given = os.environ.get("PUSHTABLE_PEERS_PYTHON")
    if given:
        return Path(given)
    venv = Path.home() / ".cache" / "pushtable" / "peers-venv"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    probe = subprocess.run([str(python), "-c", "import laminardb, pathway"], capture_output=True)
    if probe.returncode != 0:
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", *PEERS.values()],
            check=True,
            timeout=1800,
        )
    return python


def peer(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """Run ``peer_<name>.py`` with ``params`` in the peers venv: its JSON, or why it was skipped."""
    try:
        python = peers_python()
    except (OSError, subprocess.SubprocessError) as exc:
        return {"skipped": f"no peers venv with {PEERS[name]}: {exc}"}
    done = subprocess.run(
        [str(python), str(HERE / f"peer_{name}.py"), json.dumps(params)],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=HERE,
    )
    if done.returncode != 0:
        return {"skipped": f"{name} run failed: {done.stderr.strip()[-500:]}"}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def run(quick: bool) -> dict[str, Any]:
    """pushtable, then LaminarDB, then Pathway, on the same workload."""
    params: dict[str, Any] = {
        "rows": 200_000 if quick else 2_000_000,
        "batch_rows": 8192,
        "runs": 1 if quick else 5,
        # one unmeasured throughput run first, for every engine (allocators, page faults,
        # lazy start-up: a 2,000,000-row run takes under 10 ms here, so its first run shows them)
        "warmup": 0 if quick else 1,
        "samples": 20 if quick else 200,
        "latency_batch_rows": [1, 100, 8192],
        "pathway_max_rows": PATHWAY_MAX_ROWS,
    }
    for _ in range(params["warmup"]):
        throughput(params["rows"], params["batch_rows"], INTS)
    ours = {
        "engine": "pushtable",
        "throughput": [
            throughput(params["rows"], params["batch_rows"], INTS) for _ in range(params["runs"])
        ],
        "close_latency": [
            close_latency(r, params["samples"], workload=INTS) for r in params["latency_batch_rows"]
        ],
    }
    out: dict[str, Any] = {"params": params, "pushtable": ours}
    for name in PEERS:
        out[name] = peer(name, params)
    out["shapes"] = {shape: shape_side_by_side(shape, quick) for shape in workload.SHAPES}
    return out


#: pushtable's form of each shape: Spark's own functions over the same rows as timestamps
PUSHTABLE_SHAPES = {"sliding": SLIDING, "session": SESSIONS, "dense": DENSE}
#: rows for a shape's run (Pathway's: fewer, it takes one row per call)
SHAPE_ROWS = {"sliding": 2_000_000, "session": 2_000_000, "dense": 2_000_000}
PATHWAY_SHAPE_ROWS = 49_152


def shape_side_by_side(shape: str, quick: bool) -> dict[str, Any]:
    """One Spark window shape on pushtable, LaminarDB and Pathway: throughput of the same rows.

    The shape is ``window`` / ``session_window`` on pushtable, ``HOPPING`` / ``SESSION`` on
    LaminarDB and ``sliding`` / ``session`` on Pathway. Each engine's windows are checked
    against Spark's (every row counted in each of its windows).
    """
    rows = SHAPE_ROWS[shape] // (10 if quick else 1)
    params = {
        "shape": shape,
        "rows": rows,
        "batch_rows": 8192,
        "pathway_max_rows": PATHWAY_SHAPE_ROWS,
    }
    tries = [throughput(rows, 8192, PUSHTABLE_SHAPES[shape]) for _ in range(1 if quick else 3)]
    out: dict[str, Any] = {
        "params": params,
        "pushtable": {"engine": "pushtable", "throughput": tries},
    }
    for name in PEERS:
        out[name] = peer(name, params)
    return out


def _median_throughput(result: dict[str, Any]) -> dict[str, Any]:
    runs = sorted(result["throughput"], key=lambda r: r["rows_per_s"] or 0.0)
    return dict(runs[len(runs) // 2])


def _ran(
    side: dict[str, Any], lines: list[str], skipped: str
) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """Each engine's result and median throughput run, pushtable first.

    An engine that did not run adds its ``skipped`` line (``{name}``, ``{why}``) to ``lines``
    instead.
    """
    for name in ("pushtable", *PEERS):
        result = side.get(name, {"skipped": "not run"})
        if "skipped" in result:
            lines.append(skipped.format(name=name, why=result["skipped"]))
        else:
            yield result, _median_throughput(result)


def table(suite: dict[str, Any]) -> str:
    """The side-by-side tables as text."""
    p = suite["params"]
    lines = [
        f"windows side by side: {p['rows']:,} rows in {p['batch_rows']:,}-row batches, "
        f"1-second tumbling count/sum (median of {p['runs']}); "
        f"window-close latency over {p['samples']} windows",
        f"{'engine':<18s} {'rows':>9s} {'M rows/s':>9s} {'ok':>3s} "
        + " ".join(f"{f'p50/p99 ms @{n}':>20s}" for n in p["latency_batch_rows"]),
    ]
    for result, t in _ran(suite, lines, "{name:<18s} skipped: {why}"):
        cells = [
            f"{c['p50_ms']:9.2f}/{c['p99_ms']:<9.2f}" if c.get("samples") else f"{'-':>19s}"
            for c in result["close_latency"]
        ]
        lines.append(
            f"{result['engine']:<18s} {t['rows']:9,d} {t['rows_per_s'] / 1e6:9.3f} "
            f"{'yes' if t['verified'] else 'NO':>3s} " + " ".join(f"{c:>20s}" for c in cells)
        )
    for shape, side in suite.get("shapes", {}).items():
        lines.append(
            f"{shape} windows side by side ({SHAPE_TEXT[shape]}), throughput; ok = the windows "
            "count every row as Spark's do:"
        )
        for result, t in _ran(side, lines, "  {name:<16s} skipped: {why}"):
            rate = "-" if t["rows_per_s"] is None else f"{t['rows_per_s'] / 1e6:.3f}"
            lines.append(
                f"  {result['engine']:<16s} {t['rows']:9,d} rows {rate:>9s} M rows/s "
                f"{t['windows']:6,d} windows ok={'yes' if t['verified'] else 'NO'}"
            )
    return "\n".join(lines)


SHAPE_TEXT = {
    "sliding": "pushtable window(ts, '10 seconds', '1 second'), LaminarDB HOPPING(ts, 10000, "
    "1000), Pathway sliding(hop=1000, duration=10000)",
    "session": "pushtable session_window(ts, '300 milliseconds'), LaminarDB SESSION(ts, 300), "
    "Pathway session(max_gap=300)",
    "dense": "1-second tumbling windows closing every 1,000 rows: pushtable date_bin, LaminarDB "
    "TUMBLE(ts, INTERVAL '1' SECOND), Pathway tumbling(duration=1000)",
}
