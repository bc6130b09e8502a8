//! The engine's physical optimizer rule: a `GROUP BY` over an ordered live input whose key
//! includes a window of the order column becomes a [`WindowAggregateExec`]; a hash join of a
//! live table with a bounded one becomes a [`LookupJoinExec`]; a join of two live tables
//! becomes DataFusion's `SymmetricHashJoinExec` when a time bound between their order
//! columns lets it prune its state, and is refused otherwise ([`REFUSED`]): a hash join
//! would read one side whole before the other and hang; window functions above them are
//! fitted to the order they now declare.
//!
//! It runs right after DataFusion combines partial and final aggregates and before sorting
//! is enforced (so an `ORDER BY window` above it costs nothing: the output is in window
//! order) and long before the sanity check (which would refuse an unordered aggregate over
//! an unbounded input). A second rule, run last, keeps filters above live inputs from
//! holding rows back ([`PassFilteredBatches`]).

use std::sync::Arc;

use arrow::datatypes::{DataType, Field, Schema, TimeUnit};
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TransformedResult, TreeNode, TreeNodeRecursion};
use datafusion::common::{plan_err, JoinType, NullEquality, Result, ScalarValue};
use datafusion::logical_expr::interval_arithmetic::Interval;
use datafusion::logical_expr::sort_properties::{ExprProperties, SortProperties};
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::expressions::{BinaryExpr, CastExpr, Column, Literal};
use datafusion::physical_expr::intervals::utils::check_support;
use datafusion::physical_expr::projection::ProjectionExpr;
use datafusion::physical_expr::{PhysicalExpr, PhysicalExprRef, ScalarFunctionExpr};
use datafusion::physical_optimizer::output_requirements::OutputRequirementExec;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode, PhysicalGroupBy};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::joins::utils::JoinFilter;
use datafusion::physical_plan::joins::{
    HashJoinExec, PartitionMode, StreamJoinPartitionMode, SymmetricHashJoinExec,
};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::windows::{
    get_best_fitting_window, BoundedWindowAggExec, WindowAggExec,
};
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};

use super::frames;
use super::join::LookupJoinExec;
use super::readahead::ReadAheadExec;
use super::session::SessionWindowExec;
use super::spark_windows::{
    session_gap, SessionWindow, SparkWindow, WindowEnvelope, Windowing, INVALID,
};
use super::updating::UpdatingAggregateExec;
use super::watermark_rows::{WatermarkRowsExec, MARKER};
use super::window::{WindowAggregateExec, WINDOW_START};
use crate::channel::WatermarkCell;
use crate::provider::LiveScanExec;

/// Replaces window `GROUP BY`s over ordered input by [`WindowAggregateExec`], other
/// `GROUP BY`s over live input by [`UpdatingAggregateExec`] (see [`EmitOnWindowClose::new`]),
/// and joins as the module says.
#[derive(Debug)]
pub struct EmitOnWindowClose {
    /// Aggregates over bounded live tables emit changes too (`EMIT CHANGES`), not only at end.
    changes: bool,
    /// Bytes of state an updating aggregate may hold.
    state_limit: usize,
}

impl EmitOnWindowClose {
    /// A `GROUP BY` with no window over an unbounded live input (or over any live input with
    /// `changes`) answers as an upsert changelog holding at most `state_limit` bytes.
    pub fn new(changes: bool, state_limit: usize) -> Self {
        Self {
            changes,
            state_limit,
        }
    }
}

impl PhysicalOptimizerRule for EmitOnWindowClose {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let plan = plan
            .transform_up(|node| {
                let new = match window_aggregate(&node)? {
                    Some(new) => Some(new),
                    None => match self.updating_aggregate(&node)? {
                        Some(new) => Some(new),
                        None => match lookup_join(&node)? {
                            Some(new) => Some(new),
                            None => match stream_join(&node)? {
                                Some(new) => Some(new),
                                None => refit_window_function(&node)?,
                            },
                        },
                    },
                };
                Ok(match new {
                    Some(new) => Transformed::yes(new),
                    None => Transformed::no(node),
                })
            })
            .data()?;
        check_changelog_readers(&plan)?;
        check_spark_windows_placed(&plan)?;
        Ok(plan)
    }

    fn name(&self) -> &str {
        "pushtable_emit_on_window_close"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// Lets every filtered batch above a live input go on at once.
///
/// DataFusion 54's `FilterExec` gathers its output into `batch_size`-row batches. Over a
/// live table that is harmless (the scan evaluates those filters itself), but above what
/// the engine derives from one — a `HAVING` over windows, a `WHERE` over window results or
/// a join — it would hold answers back until 8,192 rows had passed, or until `close()`.
/// A batch size of 1 makes its coalescer pass each filtered batch through whole.
#[derive(Debug, Default)]
pub struct PassFilteredBatches;

impl PhysicalOptimizerRule for PassFilteredBatches {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        plan.transform_up(|node| {
            let Some(filter) = node.downcast_ref::<FilterExec>() else {
                return Ok(Transformed::no(node));
            };
            if filter.batch_size() == 1 || !reads_live(filter.input()) {
                return Ok(Transformed::no(node));
            }
            let passing: Arc<dyn ExecutionPlan> = Arc::new(filter.with_batch_size(1)?);
            Ok(Transformed::yes(passing))
        })
        .data()
    }

    fn name(&self) -> &str {
        "pushtable_pass_filtered_batches"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// The aggregate reading raw rows behind `node` (itself, or the partial stage of a final one).
fn raw_aggregate(node: &Arc<dyn ExecutionPlan>) -> Option<&AggregateExec> {
    let agg = node.downcast_ref::<AggregateExec>()?;
    match agg.mode() {
        AggregateMode::Single | AggregateMode::SinglePartitioned => Some(agg),
        AggregateMode::Final | AggregateMode::FinalPartitioned => {
            let mut child = agg.input();
            while child.is::<CoalescePartitionsExec>() || child.is::<RepartitionExec>() {
                child = child.children()[0];
            }
            let partial = child.downcast_ref::<AggregateExec>()?;
            (*partial.mode() == AggregateMode::Partial).then_some(partial)
        }
        _ => None,
    }
}

fn window_aggregate(node: &Arc<dyn ExecutionPlan>) -> Result<Option<Arc<dyn ExecutionPlan>>> {
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
        watermark_source(input),
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
        watermark_source(input),
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
        watermark_source(input),
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

impl EmitOnWindowClose {
    /// A `GROUP BY` (or `DISTINCT`, or a whole-input aggregate) over a live input that found
    /// no window of its order: an [`UpdatingAggregateExec`] when the input is unbounded (it
    /// would never answer otherwise) or when changes were asked for.
    fn updating_aggregate(
        &self,
        node: &Arc<dyn ExecutionPlan>,
    ) -> Result<Option<Arc<dyn ExecutionPlan>>> {
        let Some(raw) = raw_aggregate(node) else {
            return Ok(None);
        };
        let input = raw.input();
        let asked = self.changes || input.boundedness().is_unbounded() || reads_changes(input);
        if !reads_live(input) || !asked {
            return Ok(None);
        }
        if raw.group_expr().has_grouping_set() {
            return plan_err!(
                "{REFUSED}AggregateExec: GROUPING SETS, CUBE and ROLLUP over a live table have \
                 no updating form; GROUP BY the keys of one grouping set at a time"
            );
        }
        let input: Arc<dyn ExecutionPlan> = if input.output_partitioning().partition_count() > 1 {
            Arc::new(CoalescePartitionsExec::new(Arc::clone(input)))
        } else {
            Arc::clone(input)
        };
        let exec = UpdatingAggregateExec::try_new(
            input,
            raw.group_expr().clone(),
            raw.aggr_expr().to_vec(),
            raw.filter_expr().to_vec(),
            self.state_limit,
            node.schema(),
        )?;
        Ok(Some(Arc::new(exec)))
    }
}

/// Operators that pass an updating aggregate's changes on as they are, row for row (the
/// output requirement is the planner's marker, removed before the plan runs).
fn passes_changes(node: &Arc<dyn ExecutionPlan>) -> bool {
    node.is::<ProjectionExec>()
        || node.is::<CoalescePartitionsExec>()
        || node.is::<OutputRequirementExec>()
}

/// Whether `node`'s output is an updating aggregate's changelog.
fn emits_changes(node: &Arc<dyn ExecutionPlan>) -> bool {
    node.is::<UpdatingAggregateExec>()
        || (passes_changes(node) && node.children().into_iter().any(emits_changes))
}

/// A changelog goes to the query's output through projections only: any other reader would
/// take a group's new value for another row (an aggregate over it would count a group once
/// per change), and a filter (a `HAVING`) would leave a group's last row standing when the
/// group stops matching: a stale row, silently. Refused, naming the operator.
fn check_changelog_readers(plan: &Arc<dyn ExecutionPlan>) -> Result<()> {
    let reads_changes = !passes_changes(plan) && plan.children().into_iter().any(emits_changes);
    if reads_changes && plan.is::<FilterExec>() {
        return plan_err!(
            "{REFUSED}FilterExec: a HAVING (or a filter) over an updating GROUP BY would leave \
             a group's last row standing once the group stops matching; select the aggregates \
             without HAVING and filter the changes as they come, or GROUP BY a window of the \
             table's order (each window is final when it closes, so HAVING is exact there)"
        );
    }
    if reads_changes {
        let name = plan.name();
        return plan_err!(
            "{REFUSED}{name}: {name} over an updating GROUP BY would read its changelog (each \
             changed group again, with its new value) as if it were rows; read the changes as \
             they come, or GROUP BY a window of the table's order (each window is final when \
             it closes)"
        );
    }
    plan.children()
        .into_iter()
        .try_for_each(check_changelog_readers)
}

/// Spark's sliding `window()` and `session_window()` are answered only where the rules above
/// put them: as a key of a `GROUP BY` over the order column of a live table. Anywhere else
/// (a projection, a filter, a `GROUP BY` over an unordered table) they are refused at
/// planning, naming where, rather than failing once the query runs.
fn check_spark_windows_placed(plan: &Arc<dyn ExecutionPlan>) -> Result<()> {
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

/// The live tables `plan` scans.
fn live_tables(plan: &Arc<dyn ExecutionPlan>) -> Vec<String> {
    let mut out: Vec<String> = plan.children().into_iter().flat_map(live_tables).collect();
    if let Some(scan) = plan.downcast_ref::<LiveScanExec>() {
        out.push(scan.table().to_string());
    }
    out
}

/// Whether a join reads two different live tables, one on each side (a self-join of one
/// single-scan table is left alone: its second scan raises the single-scan error).
fn two_live_inputs(left: &Arc<dyn ExecutionPlan>, right: &Arc<dyn ExecutionPlan>) -> bool {
    let (l, r) = (live_tables(left), live_tables(right));
    !l.is_empty() && !r.is_empty() && !l.iter().any(|t| r.contains(t))
}

/// Whether `plan` reads a topic subscription (whose aggregates answer with changes).
fn reads_changes(plan: &Arc<dyn ExecutionPlan>) -> bool {
    plan.downcast_ref::<LiveScanExec>()
        .is_some_and(|s| s.changes())
        || plan.children().into_iter().any(reads_changes)
}

/// Whether `plan` reads a live table.
fn reads_live(plan: &Arc<dyn ExecutionPlan>) -> bool {
    plan.is::<LiveScanExec>() || plan.children().into_iter().any(reads_live)
}

/// A hash join of a live table (probe) with a bounded one (build) becomes a
/// [`LookupJoinExec`], which emits each probe batch's rows at once.
fn lookup_join(node: &Arc<dyn ExecutionPlan>) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let Some(join) = node.downcast_ref::<HashJoinExec>() else {
        return Ok(None);
    };
    if join.null_aware {
        return Ok(None);
    }
    let (left_live, right_live) = (reads_live(join.left()), reads_live(join.right()));
    if left_live && !right_live && !join.right().boundedness().is_unbounded() {
        // The live side must be the probe side: swap, then replace the swapped join.
        let swapped = join.swap_inputs(PartitionMode::CollectLeft)?;
        return Ok(Some(
            swapped
                .transform_up(|n| {
                    Ok(match lookup_join(&n)? {
                        Some(new) => Transformed::yes(new),
                        None => Transformed::no(n),
                    })
                })
                .data()?,
        ));
    }
    if left_live || !right_live || !LookupJoinExec::supports(*join.join_type()) {
        return Ok(None);
    }
    let exec = LookupJoinExec::try_new(
        Arc::clone(join.left()),
        Arc::clone(join.right()),
        join.on().to_vec(),
        *join.join_type(),
        join.filter().cloned(),
        join.projection.as_ref().map(|p| p.to_vec()),
        Arc::clone(join.join_schema()),
    )?;
    Ok(Some(Arc::new(exec)))
}

/// What starts the message of a query the engine refuses (never hands to another engine).
pub const REFUSED: &str = "pushtable refuses this live query: ";

/// A join of two live tables: DataFusion's `SymmetricHashJoinExec`, which reads both sides
/// as they come and emits each match once both rows are in, pruning what a time bound
/// between the two order columns says can no longer match. Without such a bound (or
/// without a declared order on both sides) its state would only grow: refused, naming
/// what is missing. A hash join would read one side whole first: a producer writing the
/// other would block forever.
fn stream_join(node: &Arc<dyn ExecutionPlan>) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    if let Some(shj) = node.downcast_ref::<SymmetricHashJoinExec>() {
        let done = shj.left().is::<ReadAheadExec>();
        if done || !two_live_inputs(shj.left(), shj.right()) {
            return Ok(None);
        }
        let filter = shj.filter().map(prunable_filter).transpose()?.flatten();
        return symmetric(
            shj.left(),
            shj.right(),
            shj.on().to_vec(),
            filter,
            shj.join_type(),
            shj.null_equality(),
            None,
        )
        .map(Some);
    }
    let Some(join) = node.downcast_ref::<HashJoinExec>() else {
        return Ok(None);
    };
    if !two_live_inputs(join.left(), join.right()) {
        return Ok(None);
    }
    let filter = join.filter().map(prunable_filter).transpose()?.flatten();
    let projection = join.projection.as_ref().map(|p| p.to_vec());
    symmetric(
        join.left(),
        join.right(),
        join.on().to_vec(),
        filter,
        join.join_type(),
        join.null_equality(),
        projection,
    )
    .map(Some)
}

/// A `SymmetricHashJoinExec` of two live inputs ordered by the columns its (prunable)
/// `filter` bounds, under `projection` if any; refused when it could not prune.
fn symmetric(
    left: &Arc<dyn ExecutionPlan>,
    right: &Arc<dyn ExecutionPlan>,
    on: Vec<(PhysicalExprRef, PhysicalExprRef)>,
    filter: Option<JoinFilter>,
    join_type: &JoinType,
    null_equality: NullEquality,
    projection: Option<Vec<usize>>,
) -> Result<Arc<dyn ExecutionPlan>> {
    if filter.is_none() {
        return refuse_join();
    }
    let (nl, nr) = (left.schema().fields().len(), right.schema().fields().len());
    // Only an outer join has rows a watermark must let out; an inner join's state is pruned
    // by rows (the markers would cost an inner join about a quarter of its throughput).
    let marked = match join_type {
        JoinType::Left | JoinType::Right | JoinType::Full => {
            match (with_watermark_rows(left)?, with_watermark_rows(right)?) {
                (Some(l), Some(r)) => Some((l, r)),
                _ => None,
            }
        }
        _ => None,
    };
    let (left, right, on) = match marked {
        Some((l, r)) => {
            // A marker row meets only marker rows: one more equal key.
            let mut on = on;
            let lm: PhysicalExprRef = Arc::new(Column::new(MARKER, nl));
            let rm: PhysicalExprRef = Arc::new(Column::new(MARKER, nr));
            on.push((lm, rm));
            (l, r, on)
        }
        None => (Arc::clone(left), Arc::clone(right), on),
    };
    let with_markers = left.is::<WatermarkRowsExec>();
    let left: Arc<dyn ExecutionPlan> = Arc::new(ReadAheadExec::new(left));
    let right: Arc<dyn ExecutionPlan> = Arc::new(ReadAheadExec::new(right));
    let shj = SymmetricHashJoinExec::try_new(
        Arc::clone(&left),
        Arc::clone(&right),
        on,
        filter,
        join_type,
        null_equality,
        left.output_ordering().cloned(),
        right.output_ordering().cloned(),
        StreamJoinPartitionMode::SinglePartition,
    )?;
    if !shj.check_if_order_information_available()? {
        return refuse_join();
    }
    let mut shj: Arc<dyn ExecutionPlan> = Arc::new(shj);
    let mut projection = projection;
    if with_markers {
        // The rows that carry a marker (a marker meeting a marker, or one left unmatched)
        // go no further; the marker columns neither.
        let yes: Arc<dyn PhysicalExpr> = Arc::new(Literal::new(ScalarValue::Boolean(Some(true))));
        let unmarked = |at: usize| -> Arc<dyn PhysicalExpr> {
            let marker: Arc<dyn PhysicalExpr> = Arc::new(Column::new(MARKER, at));
            Arc::new(BinaryExpr::new(
                marker,
                Operator::IsDistinctFrom,
                Arc::clone(&yes),
            ))
        };
        let predicate: Arc<dyn PhysicalExpr> = Arc::new(BinaryExpr::new(
            unmarked(nl),
            Operator::And,
            unmarked(nl + 1 + nr),
        ));
        shj = Arc::new(FilterExec::try_new(predicate, shj)?);
        let original: Vec<usize> = (0..nl).chain(nl + 1..nl + 1 + nr).collect();
        projection = Some(match projection {
            Some(p) => p.iter().map(|&i| original[i]).collect(),
            None => original,
        });
    }
    let Some(projection) = projection else {
        return Ok(shj);
    };
    let schema = shj.schema();
    let columns = projection.iter().map(|&i| {
        let column: Arc<dyn PhysicalExpr> = Arc::new(Column::new(schema.field(i).name(), i));
        (column, schema.field(i).name().to_string())
    });
    Ok(Arc::new(ProjectionExec::try_new(columns, shj)?))
}

/// `filter` in a form whose bounds DataFusion's interval analysis can follow (None: it
/// cannot, so the join could never forget a row). DataFusion 54 prunes by intervals over
/// numbers and timestamps but not interval literals: `b.ts <= a.ts + INTERVAL '1 second'`
/// is rewritten to compare the timestamps' ticks, `CAST(b.ts AS BIGINT) <= CAST(a.ts AS
/// BIGINT) + 1000000` (microseconds), which means the same for intervals of fixed length.
fn prunable_filter(filter: &JoinFilter) -> Result<Option<JoinFilter>> {
    let schema = filter.schema();
    let expression = Arc::clone(filter.expression())
        .transform_up(|e| {
            let Some(b) = e.downcast_ref::<BinaryExpr>() else {
                return Ok(Transformed::no(e));
            };
            let comparison = matches!(
                b.op(),
                Operator::Lt | Operator::LtEq | Operator::Gt | Operator::GtEq | Operator::Eq
            );
            match (
                comparison,
                ticks(b.left(), schema),
                ticks(b.right(), schema),
            ) {
                (true, Some(l), Some(r)) => {
                    let compared: Arc<dyn PhysicalExpr> = Arc::new(BinaryExpr::new(l, *b.op(), r));
                    Ok(Transformed::yes(compared))
                }
                _ => Ok(Transformed::no(e)),
            }
        })?
        .data;
    let rewritten = JoinFilter::new(
        expression,
        filter.column_indices().to_vec(),
        Arc::clone(filter.schema()),
    );
    Ok(check_support(rewritten.expression(), rewritten.schema()).then_some(rewritten))
}

/// A timestamp column, or one plus or minus an interval of fixed length, as an `Int64`
/// count of the column's unit (None: another expression).
fn ticks(expr: &Arc<dyn PhysicalExpr>, schema: &Schema) -> Option<Arc<dyn PhysicalExpr>> {
    if let Some(c) = expr.downcast_ref::<Column>() {
        let DataType::Timestamp(..) = schema.field(c.index()).data_type() else {
            return None;
        };
        return Some(Arc::new(CastExpr::new(
            Arc::clone(expr),
            DataType::Int64,
            None,
        )));
    }
    let b = expr.downcast_ref::<BinaryExpr>()?;
    if !matches!(b.op(), Operator::Plus | Operator::Minus) {
        return None;
    }
    let c = b.left().downcast_ref::<Column>()?;
    let DataType::Timestamp(unit, tz) = schema.field(c.index()).data_type() else {
        return None;
    };
    let (days, nanos) = match b.right().downcast_ref::<Literal>()?.value() {
        ScalarValue::IntervalMonthDayNano(Some(v)) if v.months == 0 => {
            (i128::from(v.days), i128::from(v.nanoseconds))
        }
        ScalarValue::IntervalDayTime(Some(v)) => {
            (i128::from(v.days), i128::from(v.milliseconds) * 1_000_000)
        }
        _ => return None,
    };
    // A day is 24 hours in UTC only: elsewhere a day can be 23 or 25 (daylight saving).
    let utc = tz
        .as_deref()
        .is_none_or(|z| matches!(z, "UTC" | "+00:00" | "Z"));
    if days != 0 && !utc {
        return None;
    }
    let per: i128 = match unit {
        TimeUnit::Second => 1_000_000_000,
        TimeUnit::Millisecond => 1_000_000,
        TimeUnit::Microsecond => 1_000,
        TimeUnit::Nanosecond => 1,
    };
    let total = days * 86_400_000_000_000 + nanos;
    if total % per != 0 {
        return None;
    }
    let amount = Literal::new(ScalarValue::Int64(Some(i64::try_from(total / per).ok()?)));
    Some(Arc::new(BinaryExpr::new(
        ticks(b.left(), schema)?,
        *b.op(),
        Arc::new(amount),
    )))
}

fn refuse_join<T>() -> Result<T> {
    plan_err!(
        "{REFUSED}SymmetricHashJoinExec: a join of two live tables needs a time bound between their order columns, \
         e.g. `ON a.k = b.k AND b.ts BETWEEN a.ts AND a.ts + INTERVAL '1 second'` with both \
         tables registered with order_by='ts' (comparisons of the two order columns, each \
         plus or minus a constant or an interval of fixed length); without one it would \
         hold both streams in memory forever. Join a live table with a bounded one (a Lance \
         dataset, in-memory data) for lookups without a bound"
    )
}

/// A window function over an input whose order changed (a window aggregate below it now
/// declares its output order): planned again to fit that order instead of sorting.
fn refit_window_function(node: &Arc<dyn ExecutionPlan>) -> Result<Option<Arc<dyn ExecutionPlan>>> {
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

/// `input` with its watermarks as marker rows ([`WatermarkRowsExec`]), when it has both a
/// watermark source and an ascending order column.
fn with_watermark_rows(input: &Arc<dyn ExecutionPlan>) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let (Some(cell), Some(order)) = (watermark_source(input), leading_order_column(input)) else {
        return Ok(None);
    };
    let marked = WatermarkRowsExec::try_new(Arc::clone(input), order, cell)?;
    Ok(Some(Arc::new(marked)))
}

/// The column `plan`'s output is ordered on, ascending, first (index in its schema).
fn leading_order_column(plan: &Arc<dyn ExecutionPlan>) -> Option<usize> {
    let ordering = plan.output_ordering()?;
    let first = ordering.first();
    if first.options.descending {
        return None;
    }
    first.expr.downcast_ref::<Column>().map(|c| c.index())
}

/// Where the watermarks of `plan`'s order come from: a live scan or a window aggregate below
/// it, reached only through operators that pass each batch on at once (a projection).
fn watermark_source(plan: &Arc<dyn ExecutionPlan>) -> Option<Arc<WatermarkCell>> {
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
pub fn non_decreasing(expr: &Arc<dyn PhysicalExpr>, column: usize, schema: &Schema) -> bool {
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
