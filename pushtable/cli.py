"""The ``pushtable`` command: ``pushtable demo`` (the main job), ``bench`` and ``serve``.

Argument errors print a message naming the argument and exit with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

CONFIG_EXAMPLE = """\
a --config file (JSON): who may do what, what remote clients may use, what is declared

  {
    "tokens": [
      {"name": "ops", "secret_env": "PUSHTABLE_ADMIN_TOKEN", "role": "admin"},
      {"name": "spark-ingest", "secret_env": "INGEST_TOKEN", "role": "write",
       "tables": ["events*"]},
      {"name": "dashboard", "secret": "s3cret-read-only", "role": "read",
       "tables": ["events*", "alerts"]}
    ],
    "limits": {"query_memory": 2147483648, "max_queries": 4,
               "max_streams_per_client": 8, "max_staged_bytes": 1073741824,
               "max_staged_bytes_per_query": 268435456, "max_tables": 64,
               "max_capacity": 256, "max_table_bytes": 536870912, "idle_timeout": 120},
    "tables": [{"name": "events", "schema": {"ts": "int64", "v": "double"},
                "capacity": 64}],
    "topics": [{"name": "alerts", "schema": {"msg": "string"}}]
  }

roles: read = remote SQL (queries only), tables, stats; write = push, close, fail, advance;
admin = all of that plus create_table, subscribe and Spark's stage/publish.
A token's "tables" are names or fnmatch patterns (default: every table). Secrets are
compared in constant time and never logged; each call is logged, with the token's name,
on the "pushtable.audit" logger.
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


#: ``prctl`` option that turns transparent huge pages off for the calling process
_PR_SET_THP_DISABLE = 41


def _without_huge_pages() -> None:
    """Turn transparent huge pages off for a server process (Linux).

    ``PUSHTABLE_SERVE_THP=1`` keeps them. The allocators in a server's process (pyarrow's,
    DataFusion's, the native core's mimalloc) back each thread's heap with 2 MiB pages where
    the kernel allows it, and a server runs two threads a query, so its memory followed its
    thread count more than what its queries hold (docs/network.md, Resource limits;
    ``benchmarks/slow_queries_memory.py``).
    """
    if os.environ.get("PUSHTABLE_SERVE_THP") == "1" or not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):  # an old kernel: nothing to turn off
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_THP_DISABLE, 1, 0, 0, 0)


def describe_startup(exc: BaseException) -> str:
    """One line for a server that could not start: the message, without a traceback."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, KeyError):
        text = f"missing {text}"
    return text


def _say(line: str) -> None:
    print(line, flush=True)


def parser() -> argparse.ArgumentParser:
    """The argument parser (``pushtable --help``)."""
    from pushtable.bench import SUITES
    from pushtable.demo import DEFAULT_SQL

    top = argparse.ArgumentParser(
        prog="pushtable",
        description="Run SQL over live Arrow data. `pushtable <command> --help` says how each "
        "command runs; `python -m pydoc pushtable` documents the library (an installed wheel "
        "carries no docs/ folder: it is in the project's source).",
    )
    commands = top.add_subparsers(dest="command", required=True, metavar="{demo,bench,serve}")

    demo = commands.add_parser(
        "demo",
        help="stream with Spark into a live table and Lance, query both",
        description="Start a local Spark streaming query over generated files, bridge it into a "
        "live streaming table and a Lance dataset, print live SQL results as they arrive, then "
        "check that what the live table saw equals what was persisted.",
    )
    demo.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory for the source files, checkpoint and Lance dataset "
        "(default: a fresh ./pushtable-demo-<timestamp>)",
    )
    demo.add_argument(
        "--connect",
        action="store_true",
        help="run Spark through Spark Connect and push epochs to a pushtable server "
        "(Arrow Flight) from Spark's workers",
    )
    demo.add_argument("--epochs", type=_positive_int, default=10, help="micro-batches (default 10)")
    demo.add_argument(
        "--rows-per-epoch",
        type=_positive_int,
        default=20_000,
        help="rows per epoch (default 20000)",
    )
    demo.add_argument(
        "--sql",
        default=DEFAULT_SQL,
        help="the live query over table 'events' (id, level, latency_ms); "
        "default: an aggregate by level",
    )
    demo.add_argument(
        "--capacity",
        type=_positive_int,
        default=8,
        help="queued batches before Spark waits (default 8)",
    )

    bench = commands.add_parser(
        "bench",
        help="reproduce the performance figures",
        description="Run benchmark suites side by side; each figure is the median of 5 runs, "
        "with min and max.",
    )
    bench.add_argument(
        "--suite",
        action="append",
        choices=SUITES,
        dest="suites",
        help="a suite to run (repeatable; default: all of " + ", ".join(SUITES) + ")",
    )
    bench.add_argument(
        "--no-peers",
        dest="peers",
        action="store_false",
        help="windows: leave out LaminarDB and Pathway (they run from a venv of their own: "
        "$PUSHTABLE_PEERS_PYTHON, or one made from the package index on first use)",
    )
    bench.add_argument(
        "--quick",
        action="store_true",
        help="small inputs: the whole run in about three minutes on 2 cores",
    )
    bench.add_argument(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="N processes spinning on the CPU for the whole run: figures on a busy machine "
        "(every engine of a ratio under the same load)",
    )
    bench.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    bench.add_argument(
        "--plots", type=Path, default=None, help="write PNG plots into this directory"
    )
    serve = commands.add_parser(
        "serve",
        help="host live tables over Arrow Flight",
        description="Serve streaming tables and topics over Arrow Flight: remote producers push "
        "with backpressure, remote clients run live SQL. Stops cleanly on Ctrl-C / SIGTERM. "
        "See docs/network.md.",
        epilog=CONFIG_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8815, help="port (default 8815; 0: any free)")
    serve.add_argument(
        "--token",
        default=None,
        help="a token with every role: require 'authorization: Bearer TOKEN' on every call "
        "(default: $PUSHTABLE_TOKEN if set; with neither this nor config tokens: no auth)",
    )
    serve.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate (enables TLS)")
    serve.add_argument("--tls-key", type=Path, default=None, help="PEM private key for --tls-cert")
    serve.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this port (same host as --host; 0: any free)",
    )
    serve.add_argument(
        "--ui-port",
        type=int,
        default=None,
        help="serve the browser view on this port: tables with live rates and queue fill, a "
        "live SQL query as a grid and a chart, and /metrics (0: any free; needs pushtable[ui])",
    )
    serve.add_argument(
        "--config",
        type=Path,
        default=None,
        help="JSON file: scoped tokens (read / write / admin, limited to table patterns), "
        "resource limits, tables and topics (example below; docs/network.md, 'Security')",
    )
    serve.add_argument(
        "--data-dir",
        default=None,
        help="where durable topics live (one Lance dataset each, <name>.lance): a directory, "
        "or an object store prefix (s3://bucket/prefix, gs://, az://; credentials from the "
        "config file's storage_options or Lance's environment, never printed). Their "
        "acknowledgements mean committed, and a server started on it again, anywhere, "
        "reopens them (docs/network.md, 'Durability')",
    )
    serve.add_argument(
        "--no-fsync",
        dest="fsync",
        action="store_false",
        help="acknowledge durable topics' batches once committed, without syncing to disk: "
        "faster, and they survive a killed server but not an OS crash or power loss",
    )
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pushtable`` command; returns the exit status."""
    args = parser().parse_args(argv)
    if args.command == "demo":
        from pushtable import demo

        out = args.out or Path.cwd() / f"pushtable-demo-{datetime.now():%Y%m%d-%H%M%S}"
        if out.exists() and any(out.iterdir()):
            parser().error(f"--out {out} exists and is not empty; pick a fresh directory")
        runner = demo.run_connect if args.connect else demo.run
        try:
            result = runner(out, args.epochs, args.rows_per_epoch, args.sql, args.capacity)
        except demo.LiveQueryFailed as exc:
            print(f"pushtable demo: {exc}", file=sys.stderr)
            return 1
        if result.interrupted:
            return 130
        return 0 if result.matched else 1
    if args.command == "serve":
        _without_huge_pages()
        import pyarrow as pa

        from pushtable.errors import DataDirInUseError
        from pushtable.flight import serve
        from pushtable.flight.server.server import run_until_stopped

        if (args.tls_cert is None) != (args.tls_key is None):
            parser().error("--tls-cert and --tls-key go together")
        tls = (args.tls_cert, args.tls_key) if args.tls_cert is not None else None
        token = args.token or os.environ.get("PUSHTABLE_TOKEN") or None
        try:  # a mistake in the set-up (config, files, port) is one line, not a traceback
            server = serve(
                args.host,
                args.port,
                token=token,
                tls=tls,
                config=args.config,
                metrics_port=args.metrics_port,
                ui_port=args.ui_port,
                data_dir=args.data_dir,
                fsync=args.fsync,
                block=False,
                say=_say,
            )
        except (ValueError, OSError, KeyError, DataDirInUseError, pa.ArrowException) as exc:
            print(f"pushtable serve: {describe_startup(exc)}", file=sys.stderr)
            return 2
        run_until_stopped(server, _say)
        return 0
    from pushtable import bench

    bench.run(
        args.suites or bench.SUITES,
        args.quick,
        args.json,
        args.plots,
        peers=args.peers,
        busy=args.busy,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
