//! Running totals over window results answer as each window closes.
//!
//! A window function's default frame, `RANGE BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW`,
//! takes in the current row's peers (the rows with its ORDER BY value), so DataFusion holds
//! a row back until a later ORDER BY value shows its peers are complete. Over the results of
//! a window `GROUP BY` that later value is the *next* window's row: every running total came
//! one window late (`sum(n) OVER (PARTITION BY k ORDER BY second)` over per-second counts).
//!
//! Where the function's PARTITION BY and ORDER BY columns include every group key of the
//! window aggregate below, no row has a peer, so that frame is exactly
//! `ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW`, which DataFusion evaluates at once.
//! Frames with peers keep their meaning (and their wait).

use std::collections::HashSet;
use std::sync::Arc;

use datafusion::common::{Result, ScalarValue};
use datafusion::logical_expr::{WindowFrame, WindowFrameBound, WindowFrameUnits};
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::window::{PlainAggregateWindowExpr, StandardWindowExpr, WindowExpr};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::coop::CooperativeExec;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::windows::BoundedWindowAggExec;
use datafusion::physical_plan::ExecutionPlan;

use super::window::WindowAggregateExec;

/// `exprs` with every peer-taking frame that has no peers over `input` made a ROWS frame,
/// or None when nothing changes.
pub fn without_peers(
    exprs: &[Arc<dyn WindowExpr>],
    input: &Arc<dyn ExecutionPlan>,
) -> Result<Option<Vec<Arc<dyn WindowExpr>>>> {
    let Some(key) = unique_key(input) else {
        return Ok(None);
    };
    let mut changed = false;
    let mut out = Vec::with_capacity(exprs.len());
    for expr in exprs {
        let frame = expr.get_window_frame();
        let peerless = running_to_current_row(frame)
            && !expr.order_by().is_empty()
            && key.is_subset(&columns(
                expr.partition_by()
                    .iter()
                    .chain(expr.order_by().iter().map(|s| &s.expr)),
            ));
        match peerless.then(|| as_rows(expr)).flatten() {
            Some(rows) => {
                out.push(rows);
                changed = true;
            }
            None => out.push(Arc::clone(expr)),
        }
    }
    Ok(changed.then_some(out))
}

/// `RANGE BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW` (the default frame with ORDER BY).
fn running_to_current_row(frame: &WindowFrame) -> bool {
    frame.units == WindowFrameUnits::Range
        && matches!(frame.start_bound, WindowFrameBound::Preceding(_))
        && frame.start_bound.is_unbounded()
        && frame.end_bound == WindowFrameBound::CurrentRow
}

/// The same function over `ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW`.
fn as_rows(expr: &Arc<dyn WindowExpr>) -> Option<Arc<dyn WindowExpr>> {
    // A ROWS frame's bounds are row counts (UInt64; None is unbounded).
    let rows = Arc::new(WindowFrame::new_bounds(
        WindowFrameUnits::Rows,
        WindowFrameBound::Preceding(ScalarValue::UInt64(None)),
        WindowFrameBound::CurrentRow,
    ));
    if let Some(w) = expr.as_any().downcast_ref::<PlainAggregateWindowExpr>() {
        // DataFusion 54.1 keeps an aggregate's `FILTER (WHERE ...)` where no public API
        // reads it; only a function shown to have none is rebuilt (it would be lost).
        if !format!("{w:?}").ends_with("filter: None }") {
            return None;
        }
        return Some(Arc::new(PlainAggregateWindowExpr::new(
            Arc::new(w.get_aggregate_expr().clone()),
            w.partition_by(),
            w.order_by(),
            rows,
            None,
        )));
    }
    if let Some(w) = expr.as_any().downcast_ref::<StandardWindowExpr>() {
        return Some(Arc::new(StandardWindowExpr::new(
            Arc::clone(w.get_standard_func_expr()),
            w.partition_by(),
            w.order_by(),
            rows,
        )));
    }
    None
}

/// The column indices of `exprs` that are plain columns.
fn columns<'a>(exprs: impl Iterator<Item = &'a Arc<dyn PhysicalExpr>>) -> HashSet<usize> {
    exprs
        .filter_map(|e| e.downcast_ref::<Column>().map(Column::index))
        .collect()
}

/// Columns of `plan`'s output that no two of its rows share all of: the group keys of a
/// window aggregate (each group of each window is emitted once), followed through the
/// operators that keep rows whole.
fn unique_key(plan: &Arc<dyn ExecutionPlan>) -> Option<HashSet<usize>> {
    if let Some(agg) = plan.downcast_ref::<WindowAggregateExec>() {
        return Some((0..agg.group_count()).collect());
    }
    if plan.is::<SortExec>()
        || plan.is::<CooperativeExec>()
        || plan.is::<CoalescePartitionsExec>()
        || plan.is::<BoundedWindowAggExec>()
    {
        // Same rows; a window operator appends its columns after its input's.
        return unique_key(plan.children()[0]);
    }
    if let Some(filter) = plan.downcast_ref::<FilterExec>() {
        let key = unique_key(filter.input())?;
        return match filter.projection() {
            None => Some(key),
            Some(p) => key.iter().map(|k| p.iter().position(|i| i == k)).collect(),
        };
    }
    if let Some(projection) = plan.downcast_ref::<ProjectionExec>() {
        let key = unique_key(projection.input())?;
        let exprs = projection.expr();
        return key
            .iter()
            .map(|k| {
                exprs.iter().position(|p| {
                    p.expr
                        .downcast_ref::<Column>()
                        .is_some_and(|c| c.index() == *k)
                })
            })
            .collect();
    }
    None
}
