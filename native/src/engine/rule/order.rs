//! What the rules know of an input's order: the column it is ordered on, where its
//! watermarks come from, and which expressions of that column keep its order.

use std::sync::Arc;

use arrow::datatypes::Schema;
use datafusion::common::ScalarValue;
use datafusion::logical_expr::interval_arithmetic::Interval;
use datafusion::logical_expr::sort_properties::{ExprProperties, SortProperties};
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::expressions::{BinaryExpr, Column, Literal};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::coop::CooperativeExec;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};

use crate::channel::WatermarkCell;
use crate::engine::join::LookupJoinExec;
use crate::engine::readahead::ReadAheadExec;
use crate::engine::shared_scan::SharedScanExec;
use crate::engine::window::WindowAggregateExec;
use crate::provider::LiveScanExec;

/// The column `plan`'s output is ordered on, ascending, first (index in its schema).
pub(super) fn leading_order_column(plan: &Arc<dyn ExecutionPlan>) -> Option<usize> {
    let ordering = plan.output_ordering()?;
    let first = ordering.first();
    if first.options.descending {
        return None;
    }
    first.expr.downcast_ref::<Column>().map(|c| c.index())
}

/// Where the watermarks of `plan`'s order come from: the cell of the operator that hands
/// them on in order with its rows (a live scan, a shared read's scan, a read-ahead, a window
/// aggregate's frontier), reached only through operators that pass each batch on at once as
/// they get it (a projection, DataFusion's `CooperativeExec`, a lookup join's probe side). None through anything else: an
/// operator that could hold rows back while a watermark after them moved on would close a
/// window before its rows arrive, so such a window closes on its rows and its input's end.
///
/// Resolved when an operator runs (never bound when it is planned): whatever a later rule
/// puts between a scan and a window, the window reads the watermark of what is right below.
pub(crate) fn watermark_source(plan: &Arc<dyn ExecutionPlan>) -> Option<Arc<WatermarkCell>> {
    watermark_path(plan).map(|(cell, _)| cell)
}

/// [`watermark_source`] and the way it comes (`EXPLAIN` shows it: `t → ReadAheadExec`).
pub(crate) fn watermark_path(
    plan: &Arc<dyn ExecutionPlan>,
) -> Option<(Arc<WatermarkCell>, String)> {
    if let Some(scan) = plan.downcast_ref::<LiveScanExec>() {
        return scan
            .watermark()
            .map(|c| (Arc::clone(c), scan.table().to_string()));
    }
    if let Some(shared) = plan.downcast_ref::<SharedScanExec>() {
        let cell = shared.watermark()?;
        return Some((cell, format!("{} (shared read)", shared.table())));
    }
    if let Some(read_ahead) = plan.downcast_ref::<ReadAheadExec>() {
        let (_, below) = watermark_path(read_ahead.input())?;
        return Some((
            Arc::clone(read_ahead.watermark()),
            format!("{below} → ReadAheadExec"),
        ));
    }
    if let Some(window) = plan.downcast_ref::<WindowAggregateExec>() {
        return Some((
            Arc::clone(window.frontier()),
            "WindowAggregateExec".to_string(),
        ));
    }
    // `CooperativeExec` (DataFusion's, above each scan) only yields its task's budget.
    if plan.is::<ProjectionExec>() || plan.is::<CooperativeExec>() {
        return watermark_path(plan.children()[0]);
    }
    if let Some(join) = plan.downcast_ref::<LookupJoinExec>() {
        let (cell, below) = watermark_path(join.probe())?;
        return Some((cell, format!("{below} → LookupJoinExec")));
    }
    None
}

/// Whether `expr` never decreases as column `column` grows: the column itself, `date_bin`,
/// `date_trunc`, casts, `+`/`-` a constant, `*` or `/` a positive constant, and whatever
/// else DataFusion knows to preserve order.
pub(super) fn non_decreasing(expr: &Arc<dyn PhysicalExpr>, column: usize, schema: &Schema) -> bool {
    matches!(
        properties(expr, column, schema).sort_properties,
        SortProperties::Ordered(o) if !o.descending
    )
}

fn properties(expr: &Arc<dyn PhysicalExpr>, column: usize, schema: &Schema) -> ExprProperties {
    if let Some(c) = expr.downcast_ref::<Column>() {
        // The column's type matters: a cast keeps the order only between some types.
        let mut unknown = ExprProperties::new_unknown();
        if let Ok(range) = Interval::make_unbounded(schema.field(c.index()).data_type()) {
            unknown = unknown.with_range(range);
        }
        return if c.index() == column {
            unknown.with_order(SortProperties::Ordered(Default::default()))
        } else {
            unknown
        };
    }
    let children: Vec<ExprProperties> = expr
        .children()
        .iter()
        .map(|c| properties(c, column, schema))
        .collect();
    if let Some(b) = expr.downcast_ref::<BinaryExpr>() {
        // DataFusion does not know that dividing by a positive constant keeps the order
        // (integer bucketing: `ts / 1000`).
        let positive_literal = b
            .right()
            .downcast_ref::<Literal>()
            .is_some_and(|l| is_positive(l.value()));
        if *b.op() == Operator::Divide && positive_literal {
            return ExprProperties::new_unknown().with_order(children[0].sort_properties);
        }
    }
    expr.get_properties(&children)
        .unwrap_or_else(|_| ExprProperties::new_unknown())
}

fn is_positive(value: &ScalarValue) -> bool {
    if value.is_null() {
        return false;
    }
    let zero = ScalarValue::new_zero(&value.data_type());
    zero.is_ok_and(|z| value.partial_cmp(&z) == Some(std::cmp::Ordering::Greater))
}
