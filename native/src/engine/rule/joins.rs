//! Joins over live tables, by what each side is.
//!
//! - A live table with a bounded table that is not live (a Lance dataset, in-memory data): a
//!   [`LookupJoinExec`], the bounded side built once, each live batch joined and passed on
//!   at once.
//! - Two live tables with a time bound between their order columns: DataFusion's
//!   `SymmetricHashJoinExec`, which reads both sides as they come, emits each match once
//!   both rows are in, and forgets what the bound says can no longer match.
//! - Two bounded live tables (producers that will `close()`) without such a bound: the join
//!   DataFusion planned, each side below a [`ReadAheadExec`] that reads it as it is written
//!   (held in the session's memory pool): a hash join reads its build side whole before its
//!   probe side yields a row, and one thread writing both tables would otherwise block on
//!   the unread one for good. It answers as that join can: once the build side closes.
//! - A bounded live table with an unbounded one: a lookup join once the bounded one closes
//!   (its side read whole first, the unbounded side held in a read-ahead meanwhile).
//! - Two unbounded live tables without a time bound: refused, naming what is missing.
//!
//! Every replacement keeps the join's type, its filter and its null equality (`IS NOT
//! DISTINCT FROM`, `EXCEPT` and `INTERSECT` match NULL keys; `=` does not).

use std::sync::Arc;

use arrow::datatypes::{DataType, Schema, TimeUnit};
use datafusion::common::tree_node::{Transformed, TransformedResult, TreeNode};
use datafusion::common::{plan_err, JoinType, NullEquality, Result, ScalarValue};
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::expressions::{BinaryExpr, CastExpr, Column, Literal};
use datafusion::physical_expr::intervals::utils::check_support;
use datafusion::physical_expr::{PhysicalExpr, PhysicalExprRef};
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::joins::utils::JoinFilter;
use datafusion::physical_plan::joins::{
    CrossJoinExec, HashJoinExec, NestedLoopJoinExec, PartitionMode, PiecewiseMergeJoinExec,
    SortMergeJoinExec, StreamJoinPartitionMode, SymmetricHashJoinExec,
};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::scalar_subquery::ScalarSubqueryExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};

use super::order::{leading_order_column, watermark_source};
use super::{reads_live, REFUSED};
use crate::engine::join::LookupJoinExec;
use crate::engine::readahead::{ReadAheadExec, ReadGroup};
use crate::engine::watermark_rows::{WatermarkRowsExec, MARKER};
use crate::provider::LiveScanExec;

/// `node` as the engine runs it when it is a join over live input (see the module's docs);
/// None when DataFusion's own plan stands.
pub(super) fn join(node: &Arc<dyn ExecutionPlan>) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    if let Some(shj) = node.downcast_ref::<SymmetricHashJoinExec>() {
        // DataFusion plans one itself only over two unbounded inputs.
        if shj.left().is::<ReadAheadExec>() || !two_live_inputs(shj.left(), shj.right()) {
            return Ok(None);
        }
        let filter = shj.filter().map(prunable_filter).transpose()?.flatten();
        let on = shj.on().to_vec();
        let (jt, nulls) = (shj.join_type(), shj.null_equality());
        return match symmetric(shj.left(), shj.right(), on, filter, jt, nulls, None)? {
            Some(joined) => Ok(Some(joined)),
            None => refuse_join(),
        };
    }
    if let Some(join) = node.downcast_ref::<HashJoinExec>() {
        return hash_join(node, join);
    }
    if node.is::<ScalarSubqueryExec>() {
        return scalar_subqueries(node);
    }
    let named_join = node.is::<NestedLoopJoinExec>()
        || node.is::<CrossJoinExec>()
        || node.is::<SortMergeJoinExec>()
        || node.is::<PiecewiseMergeJoinExec>();
    let children = node.children();
    if !named_join || children.len() != 2 || !two_live_inputs(children[0], children[1]) {
        return Ok(None);
    }
    if children.iter().any(|c| c.boundedness().is_unbounded()) {
        let name = node.name();
        return plan_err!(
            "{REFUSED}{name}: a join of live tables without equal keys (or a time bound) \
             holds every row of both sides, and one of them is unbounded; join on equal keys \
             (a lookup once the bounded table closes) or bound the join in time"
        );
    }
    read_ahead_both(node).map(Some)
}

/// DataFusion 54's `ScalarSubqueryExec` answers its subqueries (`WHERE k > (SELECT avg(k)
/// FROM r)`) whole before it reads a row of its main input: with live tables on both, the
/// main input is read ahead meanwhile (one thread may write both). A subquery over an
/// unbounded live table never ends: refused.
fn scalar_subqueries(node: &Arc<dyn ExecutionPlan>) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let children = node.children();
    let live: Vec<bool> = children.iter().map(|c| reads_live(c)).collect();
    if live.iter().filter(|l| **l).count() < 2 {
        return Ok(None);
    }
    if children[1..]
        .iter()
        .any(|c| reads_live(c) && c.boundedness().is_unbounded())
    {
        return plan_err!(
            "{REFUSED}ScalarSubqueryExec: a scalar subquery is answered whole before the query \
             reads a row, and this one reads an unbounded live table, which never ends; read \
             the subquery's table from a bounded source, or join it instead"
        );
    }
    read_ahead_both(node).map(Some)
}

/// Whether each side of a join reads a live table (the same one on both sides is read once
/// for both: see `ShareScans`).
fn two_live_inputs(left: &Arc<dyn ExecutionPlan>, right: &Arc<dyn ExecutionPlan>) -> bool {
    reads_live(left) && reads_live(right)
}

/// `node` with each live scan in its inputs below a [`ReadAheadExec`]: right above the
/// scan, so that what is read ahead is the table's rows, never an expression (a scalar
/// subquery's value) that may only be evaluated later.
fn read_ahead_both(node: &Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>> {
    let group = ReadGroup::new();
    let children = node
        .children()
        .into_iter()
        .map(|c| read_ahead_scans(c, &group))
        .collect::<Result<Vec<_>>>()?;
    Arc::clone(node).with_new_children(children)
}

/// `plan` with each [`ReadAheadExec`] back above the sort DataFusion's `EnforceSorting` sank
/// below it (it pushes a sort through an operator that keeps its input's order). A
/// read-ahead starts reading when the query starts: above a sort whose key holds a scalar
/// subquery's value, it would evaluate that before the subquery ran. Anything else below a
/// read-ahead is where the rules above put it (a watermark's marker rows, a probe side).
///
/// Then every read-ahead of the plan joins one group: an operator waiting on a join below it
/// (a join of a join, a scalar subquery over a join) must still have every other live input
/// read meanwhile, not only its own operator's (one thread may write them all).
pub fn reseat_read_aheads(plan: Arc<dyn ExecutionPlan>) -> Result<Arc<dyn ExecutionPlan>> {
    let group = ReadGroup::new();
    let reseated = plan
        .transform_up(|node| {
            let Some(read_ahead) = node.downcast_ref::<ReadAheadExec>() else {
                return Ok(Transformed::no(node));
            };
            let sort = read_ahead.input();
            if !sort.is::<SortExec>() {
                return Ok(Transformed::no(node));
            }
            let below = Arc::clone(sort.children()[0]);
            let read: Arc<dyn ExecutionPlan> = Arc::new(read_ahead.over(below));
            Ok(Transformed::yes(
                Arc::clone(sort).with_new_children(vec![read])?,
            ))
        })
        .data()?;
    reseated
        .transform_up(|node| {
            let Some(read_ahead) = node.downcast_ref::<ReadAheadExec>() else {
                return Ok(Transformed::no(node));
            };
            let joined: Arc<dyn ExecutionPlan> = Arc::new(read_ahead.in_group(&group));
            Ok(Transformed::yes(joined))
        })
        .data()
}

fn read_ahead_scans(
    plan: &Arc<dyn ExecutionPlan>,
    group: &Arc<ReadGroup>,
) -> Result<Arc<dyn ExecutionPlan>> {
    if plan.is::<ReadAheadExec>() || !reads_live(plan) {
        return Ok(Arc::clone(plan));
    }
    if plan.is::<LiveScanExec>() {
        return Ok(Arc::new(ReadAheadExec::new(Arc::clone(plan), group)));
    }
    let children = plan
        .children()
        .into_iter()
        .map(|c| read_ahead_scans(c, group))
        .collect::<Result<Vec<_>>>()?;
    Arc::clone(plan).with_new_children(children)
}

/// A hash join over live input (`node` is `join`), as the module's docs say.
fn hash_join(
    node: &Arc<dyn ExecutionPlan>,
    join: &HashJoinExec,
) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let (left, right) = (join.left(), join.right());
    let (left_live, right_live) = (reads_live(left), reads_live(right));
    let bounded = |p: &Arc<dyn ExecutionPlan>| !p.boundedness().is_unbounded();
    if left_live && !right_live && bounded(right) {
        // The live side must be the probe side: swap, then replace the swapped join.
        return lookup(join, Swap::Yes, false);
    }
    if !left_live && right_live {
        return lookup(join, Swap::No, false);
    }
    if !(left_live && right_live) {
        return Ok(None);
    }
    // Two live inputs: a symmetric join where a time bound lets it forget rows.
    let filter = join.filter().map(prunable_filter).transpose()?.flatten();
    let projection = join.projection.as_ref().map(|p| p.to_vec());
    let on = join.on().to_vec();
    let (jt, nulls) = (join.join_type(), join.null_equality());
    if let Some(shj) = symmetric(left, right, on, filter, jt, nulls, projection)? {
        return Ok(Some(shj));
    }
    match (bounded(left), bounded(right)) {
        (true, true) => read_ahead_both(node).map(Some),
        // The bounded side is built whole once it closes; the other is read ahead meanwhile.
        (true, false) if !join.null_aware && LookupJoinExec::supports(*jt) => {
            lookup(join, Swap::No, true)
        }
        (false, true) if !join.null_aware && LookupJoinExec::supports(jt.swap()) => {
            lookup(join, Swap::Yes, true)
        }
        (true, false) | (false, true) => {
            let jt = join_name(*jt);
            plan_err!(
                "{REFUSED}HashJoinExec: this {jt} of a bounded live table with an unbounded \
                 one would keep rows that only the unbounded table's end could release, and \
                 it never ends; an inner join, or an outer or semi/anti join that keeps the \
                 unbounded side's rows, answers as a lookup once the bounded table closes"
            )
        }
        (false, false) => refuse_join(),
    }
}

/// How a join's type reads in a message.
pub(super) fn join_name(join_type: JoinType) -> String {
    match join_type {
        JoinType::Inner => "inner join".to_string(),
        JoinType::Left | JoinType::Right => "outer join".to_string(),
        JoinType::Full => "full outer join".to_string(),
        JoinType::LeftSemi | JoinType::RightSemi => "semi join (IN, EXISTS, INTERSECT)".into(),
        JoinType::LeftAnti | JoinType::RightAnti => "anti join (NOT IN, NOT EXISTS, EXCEPT)".into(),
        other => format!("{other} join"),
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Swap {
    Yes,
    No,
}

/// `join` as a [`LookupJoinExec`] probing with its right input (its left after `Swap::Yes`),
/// read ahead when `read_ahead`; DataFusion's join (swapped) where the lookup cannot run it.
fn lookup(
    join: &HashJoinExec,
    swap: Swap,
    read_ahead: bool,
) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    if join.null_aware {
        return Ok(None);
    }
    if swap == Swap::Yes {
        let swapped = join.swap_inputs(PartitionMode::CollectLeft)?;
        let replaced = swapped
            .transform_up(|n| {
                let Some(inner) = n.downcast_ref::<HashJoinExec>() else {
                    return Ok(Transformed::no(n));
                };
                Ok(match lookup(inner, Swap::No, read_ahead)? {
                    Some(new) => Transformed::yes(new),
                    None => Transformed::no(n),
                })
            })
            .data()?;
        return Ok(Some(replaced));
    }
    if !LookupJoinExec::supports(*join.join_type()) {
        return Ok(None);
    }
    // With a live build side, both sides read ahead as one group: while the join reads its
    // build side whole, the probe side's rows are held (its producer is not blocked); once
    // built, the probe side is read only as the join asks.
    let (build, probe): (Arc<dyn ExecutionPlan>, Arc<dyn ExecutionPlan>) = match read_ahead {
        true => {
            let group = ReadGroup::new();
            (
                Arc::new(ReadAheadExec::new(Arc::clone(join.left()), &group)),
                Arc::new(ReadAheadExec::new(Arc::clone(join.right()), &group)),
            )
        }
        false => (Arc::clone(join.left()), Arc::clone(join.right())),
    };
    let exec = LookupJoinExec::try_new(
        build,
        probe,
        join.on().to_vec(),
        *join.join_type(),
        join.filter().cloned(),
        join.projection.as_ref().map(|p| p.to_vec()),
        Arc::clone(join.join_schema()),
        join.null_equality(),
    )?;
    Ok(Some(Arc::new(exec)))
}

/// A `SymmetricHashJoinExec` of two live inputs ordered by the columns its (prunable)
/// `filter` bounds, under `projection` if any; None when it could not prune.
fn symmetric(
    left: &Arc<dyn ExecutionPlan>,
    right: &Arc<dyn ExecutionPlan>,
    on: Vec<(PhysicalExprRef, PhysicalExprRef)>,
    filter: Option<JoinFilter>,
    join_type: &JoinType,
    null_equality: NullEquality,
    projection: Option<Vec<usize>>,
) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    if filter.is_none() {
        return Ok(None);
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
    let group = ReadGroup::new();
    let left: Arc<dyn ExecutionPlan> = Arc::new(ReadAheadExec::new(left, &group));
    let right: Arc<dyn ExecutionPlan> = Arc::new(ReadAheadExec::new(right, &group));
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
        return Ok(None);
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
        return Ok(Some(shj));
    };
    let schema = shj.schema();
    let columns = projection.iter().map(|&i| {
        let column: Arc<dyn PhysicalExpr> = Arc::new(Column::new(schema.field(i).name(), i));
        (column, schema.field(i).name().to_string())
    });
    Ok(Some(Arc::new(ProjectionExec::try_new(columns, shj)?)))
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
        "{REFUSED}SymmetricHashJoinExec: a join of two unbounded live tables needs a time bound \
         between their order columns, e.g. `ON a.k = b.k AND b.ts BETWEEN a.ts AND a.ts + \
         INTERVAL '1 second'` with both tables registered with order_by='ts' (comparisons of \
         the two order columns, each plus or minus a constant or an interval of fixed \
         length); without one it would hold both streams in memory forever. Join a live \
         table with a bounded one (a Lance dataset, in-memory data, or a live table that \
         its producer will close) for lookups without a bound"
    )
}

/// `input` with its watermarks as marker rows ([`WatermarkRowsExec`]), when it has both a
/// watermark source and an ascending order column.
fn with_watermark_rows(input: &Arc<dyn ExecutionPlan>) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let (Some(_), Some(order)) = (watermark_source(input), leading_order_column(input)) else {
        return Ok(None);
    };
    let marked = WatermarkRowsExec::try_new(Arc::clone(input), order)?;
    Ok(Some(Arc::new(marked)))
}
