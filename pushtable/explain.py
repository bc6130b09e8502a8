"""Know before you run: does a query over streaming tables answer while data arrives?

:func:`explain_live` says which engine runs the query and reads the physical plan it would
run. Queries that need an ordered table's order (a window ``GROUP BY``, a running window
function) run in pushtable's embedded engine (``engine="pushtable"``) and stream
(``"incremental: windows emit as they close"``); the rest run in datafusion-python
(``engine="datafusion"``) and are classified:

- ``"incremental"``: every operator above a live scan passes rows on as they come;
- ``"batched"``: an operator above a live scan holds rows until it has ``batch_size`` of
  them (DataFusion 54's joins, repartitions and filters it could not push into the scan);
- ``"at_end"``: an operator needs the whole stream (an aggregate, a sort) and answers at
  ``close()``;
- ``"rejected"``: DataFusion refuses the plan on an unbounded table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import datafusion

from pushtable.errors import UNBOUNDED_HINT, UnboundedQueryError, query_error

__all__ = ["LiveExplanation", "explain_live"]

Mode = Literal["incremental", "batched", "at_end", "rejected"]
_RANK: dict[Mode, int] = {"incremental": 0, "batched": 1, "at_end": 2, "rejected": 3}

# Operators that hold rows until they have `batch_size` of them (DataFusion 54.1).
_BATCHING = {
    "HashJoinExec": "a join emits its output in chunks of batch_size rows (or at end of stream)",
    "NestedLoopJoinExec": "a join emits its output in chunks of batch_size rows",
    "SortMergeJoinExec": "a join emits its output in chunks of batch_size rows",
    "CrossJoinExec": "a cross join emits its output in chunks of batch_size rows",
    "RepartitionExec": "a repartition holds rows until it has batch_size of them",
    "CoalesceBatchesExec": "batches are coalesced up to batch_size rows",
    "FilterExec": "a filter the scan could not take (a volatile one) holds rows for batch_size",
}


@dataclass(frozen=True)
class LiveExplanation:
    """How a query over streaming tables will answer, why, and what to change."""

    mode: Mode
    reasons: list[str] = field(default_factory=list)
    hint: str | None = None
    plan: str = ""
    #: Which engine runs the query: ``"datafusion"`` or ``"pushtable"`` (the live engine).
    engine: Literal["datafusion", "pushtable"] = "datafusion"

    def __str__(self) -> str:
        lines = [f"{self.mode}: " + ("; ".join(self.reasons) or "rows stream as they arrive")]
        if self.engine == "pushtable":
            lines.append("engine: pushtable (its embedded live engine runs it as data arrives)")
        if self.hint:
            lines.append(f"hint: {self.hint}")
        return "\n".join(lines)


def _name(node: datafusion.ExecutionPlan) -> str:
    text = node.display()
    # A foreign (FFI) node displays as "FFI_ExecutionPlan: <name>, number_of_children=...".
    if text.startswith("FFI_ExecutionPlan: "):
        return text.split(": ", 1)[1].split(",", 1)[0]
    return text.split(":", 1)[0].strip()


def _reads_a_live_table(node: datafusion.ExecutionPlan) -> bool:
    return _name(node) in ("LiveScanExec", "LiveQueryExec") or any(
        _reads_a_live_table(c) for c in node.children()
    )


def _classify(node: datafusion.ExecutionPlan, found: list[tuple[Mode, str, str | None]]) -> None:
    if not _reads_a_live_table(node):
        return  # bounded inputs (a Lance dataset, a join's build side) do not matter
    name, text = _name(node), node.display()
    if name == "AggregateExec" and "ordering_mode=Sorted" not in text:
        found.append(
            (
                "at_end",
                "GROUP BY/aggregates over a live table need the whole stream",
                "aggregates answer at close(); declare the table's order (order_by=, or an "
                "arrival column) and GROUP BY a window of it (date_bin, date_trunc, ts / n) "
                "for windows that emit as they close, or end the query with EMIT CHANGES for "
                "an updating answer (the changed groups after each batch)",
            )
        )
    elif name == "SortExec":
        found.append(
            (
                "at_end",
                "ORDER BY over a live table needs the whole stream",
                "drop the ORDER BY (rows come in arrival order) or sort the result yourself",
            )
        )
    elif name == "WindowAggExec":
        found.append(("at_end", "this window function needs the whole stream", None))
    elif name in _BATCHING:
        found.append(
            (
                "batched",
                _BATCHING[name],
                "for row-by-row answers keep the live side to filters and projections, or "
                "lower datafusion.execution.batch_size (it slows every scan)",
            )
        )
    for child in node.children():
        _classify(child, found)


def explain_live(ctx: datafusion.SessionContext, sql: str) -> LiveExplanation:
    """Say whether ``sql`` answers while data arrives, only at end of stream, or not at all.

    Planning does not consume a streaming table, so this is safe to call before the query.

    Example:
        >>> import pyarrow as pa
        >>> from pushtable import SessionContext, explain_live
        >>> ctx = SessionContext()
        >>> _ = ctx.register_streaming_table("t", pa.schema([("k", pa.int64())]))
        >>> explain_live(ctx, "SELECT k FROM t WHERE k > 3").mode
        'incremental'
        >>> explain_live(ctx, "SELECT k, count(*) FROM t GROUP BY k").mode
        'at_end'
    """
    sources = getattr(ctx, "_sources", None)
    if sources is not None:
        from pushtable.engine import plan_live

        try:
            live = plan_live(ctx, sources, sql)
        except UnboundedQueryError as exc:
            return LiveExplanation("rejected", [str(exc)], None, "", "pushtable")
        if live is not None:
            # Each reason is "<mode>: <why>"; the query answers as its slowest part.
            parts = [r.split(": ", 1) for r in live.reasons]
            modes: list[Mode] = [m for m, *_ in parts if m in _RANK] or ["incremental"]
            return LiveExplanation(
                max(modes, key=_RANK.__getitem__),
                [p[-1] for p in parts],
                None,
                live.display,
                "pushtable",
            )
    try:
        plan = ctx.sql(sql).execution_plan()
    except Exception as exc:
        unbounded = exc if isinstance(exc, UnboundedQueryError) else query_error(exc)
        if not isinstance(unbounded, UnboundedQueryError):
            raise
        return LiveExplanation(
            "rejected",
            [f"an unbounded table cannot feed {unbounded.operator}: it would wait forever"],
            UNBOUNDED_HINT,
        )
    found: list[tuple[Mode, str, str | None]] = []
    _classify(plan, found)
    if not found:
        return LiveExplanation("incremental", plan=plan.display_indent())
    worst = max(found, key=lambda f: _RANK[f[0]])[0]
    reasons = list(dict.fromkeys(r for m, r, _ in found if m == worst))
    hint = next((h for m, _, h in found if m == worst and h), None)
    return LiveExplanation(worst, reasons, hint, plan.display_indent())
