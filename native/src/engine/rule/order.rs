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
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};

use crate::channel::WatermarkCell;
use crate::engine::join::LookupJoinExec;
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

/// Where the watermarks of `plan`'s order come from: a live scan or a window aggregate below
/// it, reached only through operators that pass each batch on at once (a projection).
pub(super) fn watermark_source(plan: &Arc<dyn ExecutionPlan>) -> Option<Arc<WatermarkCell>> {
    if let Some(scan) = plan.downcast_ref::<LiveScanExec>() {
        return scan.watermark().cloned();
    }
    if let Some(window) = plan.downcast_ref::<WindowAggregateExec>() {
        return Some(Arc::clone(window.frontier()));
    }
    if plan.is::<ProjectionExec>() {
        return watermark_source(plan.children()[0]);
    }
    if let Some(join) = plan.downcast_ref::<LookupJoinExec>() {
        return watermark_source(join.probe());
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
