//! Windows over a live table's order: a `GROUP BY` keyed by a window of the order column
//! (`date_bin`, `ts / n`, Spark's `window` and `session_window`) becomes a window aggregate
//! that emits each window as it closes; window functions above it are fitted to the order it
//! declares; Spark's window functions anywhere else are refused, naming where.

use std::sync::Arc;

use arrow::datatypes::{Field, Schema};
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::common::{plan_err, Result, ScalarValue};
use datafusion::physical_expr::expressions::{Column, Literal};
use datafusion::physical_expr::projection::ProjectionExpr;
use datafusion::physical_expr::{PhysicalExpr, ScalarFunctionExpr};
use datafusion::physical_plan::aggregates::{AggregateExec, PhysicalGroupBy};
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::windows::{
    get_best_fitting_window, BoundedWindowAggExec, WindowAggExec,
};
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};

use super::order::{leading_order_column, non_decreasing};
use super::{raw_aggregate, reads_live};
use crate::engine::frames;
use crate::engine::session::SessionWindowExec;
use crate::engine::spark_windows::{
    session_gap, SessionWindow, SparkWindow, WindowEnvelope, Windowing, INVALID,
};
use crate::engine::window::{WindowAggregateExec, WINDOW_START};

pub(super) fn window_aggregate(
    node: &Arc<dyn ExecutionPlan>,
) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let Some(raw) = raw_aggregate(node) else {
        return Ok(None);
    };
    let group_by = raw.group_expr();
    if group_by.is_empty() || group_by.has_grouping_set() || raw.limit_options().is_some() {
        return Ok(None);
    }
    let input = raw.input();
    if input.output_partitioning().partition_count() != 1 {
        return Ok(None);
    }
    let Some(order_column) = leading_order_column(input) else {
        return Ok(None);
    };
    if let Some(spark) = spark_window(node, raw, order_column)? {
        return Ok(Some(spark));
    }
    if let Some(session) = session_window(node, raw, order_column)? {
        return Ok(Some(session));
    }
    let Some(window_key) = group_by
        .expr()
        .iter()
        .position(|(e, _)| non_decreasing(e, order_column, &input.schema()))
    else {
        return Ok(None);
    };
    let exec = WindowAggregateExec::try_new(
        Arc::clone(input),
        group_by.clone(),
        raw.aggr_expr().to_vec(),
        raw.filter_expr().to_vec(),
        window_key,
        order_column,
        None,
        node.schema(),
    )?;
    Ok(Some(Arc::new(exec)))
}

/// The group key calling the function `F` on the order column, if any: its place and call.
fn call_on_order<F: datafusion::logical_expr::ScalarUDFImpl>(
    group_by: &PhysicalGroupBy,
    order_column: usize,
) -> Option<(usize, &ScalarFunctionExpr)> {
    group_by.expr().iter().enumerate().find_map(|(i, (e, _))| {
        let call = e.downcast_ref::<ScalarFunctionExpr>()?;
        let on_order = call
            .args()
            .first()?
            .downcast_ref::<Column>()
            .is_some_and(|c| c.index() == order_column);
        (call.fun().inner().is::<F>() && on_order).then_some((i, call))
    })
}

/// The literal arguments of `call` after its first (None where one is not a literal).
fn literal_arguments(call: &ScalarFunctionExpr) -> Vec<Option<&ScalarValue>> {
    call.args()[1..]
        .iter()
        .map(|a| a.downcast_ref::<Literal>().map(|l| l.value()))
        .collect()
}

/// A `GROUP BY session_window(ts, gap), ...` over the order column `ts`: a
/// [`SessionWindowExec`].
fn session_window(
    node: &Arc<dyn ExecutionPlan>,
    raw: &AggregateExec,
    order_column: usize,
) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let group_by = raw.group_expr();
    let Some((session, call)) = call_on_order::<SessionWindow>(group_by, order_column) else {
        return Ok(None);
    };
    let input = raw.input();
    let time_type = input.schema().field(order_column).data_type().clone();
    let gap = session_gap(&time_type, &literal_arguments(call))?;
    let exec = SessionWindowExec::try_new(
        Arc::clone(input),
        group_by.expr().iter().map(|(e, _)| Arc::clone(e)).collect(),
        session,
        raw.aggr_expr().to_vec(),
        raw.filter_expr().to_vec(),
        order_column,
        gap,
        node.schema(),
    )?;
    Ok(Some(Arc::new(exec)))
}

/// A `GROUP BY` whose key includes Spark's `window(ts, ...)` over the order column `ts`: a
/// window aggregate that copies each row into each of its windows (keyed by the window's
/// start), under a projection that turns each start into Spark's `struct<start, end>`.
fn spark_window(
    node: &Arc<dyn ExecutionPlan>,
    raw: &AggregateExec,
    order_column: usize,
) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let group_by = raw.group_expr();
    let input = raw.input();
    let Some((window_key, call)) = call_on_order::<SparkWindow>(group_by, order_column) else {
        return Ok(None);
    };
    let input_schema = input.schema();
    let time_type = input_schema.field(order_column).data_type().clone();
    let windowing = Windowing::from_arguments(&time_type, &literal_arguments(call))?;
    let start: Arc<dyn PhysicalExpr> =
        Arc::new(Column::new(WINDOW_START, input_schema.fields().len()));
    let keys: Vec<(Arc<dyn PhysicalExpr>, String)> = group_by
        .expr()
        .iter()
        .enumerate()
        .map(|(i, (e, name))| {
            let e = if i == window_key {
                Arc::clone(&start)
            } else {
                Arc::clone(e)
            };
            (e, name.clone())
        })
        .collect();
    let schema = node.schema();
    let fields: Vec<Field> = schema
        .fields()
        .iter()
        .enumerate()
        .map(|(i, f)| match i == window_key {
            true => Field::new(f.name(), time_type.clone(), true),
            false => f.as_ref().clone(),
        })
        .collect();
    let starts_schema = Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone()));
    let exec: Arc<dyn ExecutionPlan> = Arc::new(WindowAggregateExec::try_new(
        Arc::clone(input),
        PhysicalGroupBy::new_single(keys),
        raw.aggr_expr().to_vec(),
        raw.filter_expr().to_vec(),
        window_key,
        order_column,
        Some(windowing),
        Arc::clone(&starts_schema),
    )?);
    let envelope = Arc::new(WindowEnvelope::udf(windowing.size));
    let columns = starts_schema
        .fields()
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let column: Arc<dyn PhysicalExpr> = Arc::new(Column::new(f.name(), i));
            let expr: Arc<dyn PhysicalExpr> = if i == window_key {
                Arc::new(ScalarFunctionExpr::try_new(
                    Arc::clone(&envelope),
                    vec![column],
                    &starts_schema,
                    Arc::new(ConfigOptions::default()),
                )?)
            } else {
                column
            };
            Ok(ProjectionExpr {
                expr,
                alias: f.name().clone(),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Some(Arc::new(ProjectionExec::try_new(columns, exec)?)))
}

/// Spark's sliding `window()` and `session_window()` are answered only where the rules above
/// put them: as a key of a `GROUP BY` over the order column of a live table. Anywhere else
/// (a projection, a filter, a `GROUP BY` over an unordered table) they are refused at
/// planning, naming where, rather than failing once the query runs.
pub(super) fn check_spark_windows_placed(plan: &Arc<dyn ExecutionPlan>) -> Result<()> {
    let (exprs, schema): (Vec<Arc<dyn PhysicalExpr>>, _) =
        if let Some(p) = plan.downcast_ref::<ProjectionExec>() {
            let exprs = p.expr().iter().map(|e| Arc::clone(&e.expr)).collect();
            (exprs, p.input().schema())
        } else if let Some(f) = plan.downcast_ref::<FilterExec>() {
            (vec![Arc::clone(f.predicate())], f.input().schema())
        } else if let Some(a) = plan.downcast_ref::<AggregateExec>() {
            let exprs = a
                .group_expr()
                .expr()
                .iter()
                .map(|(e, _)| Arc::clone(e))
                .collect();
            (exprs, a.input_schema())
        } else {
            (vec![], plan.schema())
        };
    for expr in &exprs {
        let mut misplaced: Option<&str> = None;
        expr.apply(|e| {
            let Some(call) = e.downcast_ref::<ScalarFunctionExpr>() else {
                return Ok(TreeNodeRecursion::Continue);
            };
            if call.fun().inner().is::<SessionWindow>() {
                misplaced = Some("session_window()");
            } else if call.fun().inner().is::<SparkWindow>() {
                let ts_type = call.args()[0].data_type(&schema)?;
                let windowing = Windowing::from_arguments(&ts_type, &literal_arguments(call))?;
                if !windowing.tumbling() {
                    misplaced =
                        Some("window() with a slideDuration shorter than its windowDuration");
                }
            }
            Ok(if misplaced.is_some() {
                TreeNodeRecursion::Stop
            } else {
                TreeNodeRecursion::Continue
            })
        })?;
        if let Some(what) = misplaced {
            let name = plan.name();
            return plan_err!(
                "{INVALID}{what} is answered only as a GROUP BY key over a live table ordered \
                 by its time column (order_by=), where each window is emitted as it closes; \
                 here it is in {name}"
            );
        }
    }
    plan.children()
        .into_iter()
        .try_for_each(check_spark_windows_placed)
}

/// A window function over an input whose order changed (a window aggregate below it now
/// declares its output order): planned again to fit that order instead of sorting.
pub(super) fn refit_window_function(
    node: &Arc<dyn ExecutionPlan>,
) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let (exprs, input, keys) = if let Some(w) = node.downcast_ref::<BoundedWindowAggExec>() {
        (w.window_expr(), w.input(), w.partition_keys())
    } else if let Some(w) = node.downcast_ref::<WindowAggExec>() {
        (w.window_expr(), w.input(), w.partition_keys())
    } else {
        return Ok(None);
    };
    if !reads_live(input) {
        return Ok(None);
    }
    // Over window results, a running frame with no peers need not wait for the next window.
    let peerless = frames::without_peers(exprs, input)?;
    let exprs = peerless.as_deref().unwrap_or(exprs);
    // Without the sort planned for it, where the input's own order fits.
    if let Some(sort) = input.downcast_ref::<SortExec>() {
        if let Some(fitted) = get_best_fitting_window(exprs, sort.input(), &keys)? {
            return Ok(Some(fitted));
        }
    }
    get_best_fitting_window(exprs, input, &keys)
}
