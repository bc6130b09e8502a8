//! The window aggregate: a `GROUP BY` whose key includes a non-decreasing function of the
//! input's order column (`date_bin(..., ts)`, `date_trunc`, `ts / 1000`, `ts` itself), run
//! so that each window's groups are emitted exactly once, as soon as the window is closed.
//!
//! A window is closed when nothing more can fall into it: when a row of a later window has
//! been read (the input is ordered), or when a watermark says no row below some value will
//! come. DataFusion's sorted aggregate covers the first case only and cannot be told about
//! watermarks, so this operator does the grouping itself with DataFusion's own group-value
//! tables and `GroupsAccumulator`s (exact results, any aggregate function): groups are
//! numbered in the order they first appear, which for ordered input is window order, so the
//! closed windows are always a prefix and leave with `EmitTo::First(n)`.
//!
//! Watermarks reach it through a [`WatermarkCell`] written by the stream below (a live scan,
//! or another window aggregate's emitted frontier) just before an empty marker batch.

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use arrow::array::RecordBatchOptions;
use arrow::array::{
    new_null_array, Array, ArrayRef, AsArray, Int64Array, RecordBatch, UInt32Array,
};
use arrow::compute::kernels::cmp::distinct;
use arrow::compute::{concat, concat_batches, take, take_record_batch};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::common::{Result, ScalarValue};
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryReservation};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::{EmitTo, GroupsAccumulator};
use datafusion::physical_expr::aggregate::AggregateFunctionExpr;
use datafusion::physical_expr::expressions::{Column, Literal};
use datafusion::physical_expr::utils::{collect_columns, reassign_expr_columns};
use datafusion::physical_expr::{
    EquivalenceProperties, GroupsAccumulatorAdapter, PhysicalExpr, PhysicalSortExpr,
};
use datafusion::physical_plan::aggregates::group_values::{new_group_values, GroupValues};
use datafusion::physical_plan::aggregates::order::{GroupOrdering, GroupOrderingFull};
use datafusion::physical_plan::aggregates::{
    aggregate_expressions, evaluate_group_by, AggregateMode, PhysicalGroupBy,
};

use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, PlanProperties,
};
use futures::{Stream, StreamExt};

use super::bins::Bins;
use super::runs::RunGroupValues;
use super::spark_windows::Windowing;

/// The name of the column of windows' starts appended to the input for Spark's `window()`.
pub const WINDOW_START: &str = "__pushtable_window_start";
use crate::channel::WatermarkCell;
use crate::plan::{aggregate_display, one_partition, watermark_note};

/// A `GROUP BY` over ordered input that emits each window's groups when the window closes.
pub struct WindowAggregateExec {
    input: Arc<dyn ExecutionPlan>,
    group_by: PhysicalGroupBy,
    aggr_expr: Vec<Arc<AggregateFunctionExpr>>,
    filter_expr: Vec<Option<Arc<dyn PhysicalExpr>>>,
    /// Which group expression is the window (non-decreasing in the input order).
    window_key: usize,
    /// The input's order column (index in the input schema): watermarks are its values.
    order_column: usize,
    /// Spark's `window()`: each row is copied into each of its windows, whose start is a
    /// column appended to the input (the window key reads it).
    expand: Option<Windowing>,
    /// Where this operator hands on its frontier (every later output row has a window key
    /// at or above it), for a window aggregate above it.
    frontier: Arc<WatermarkCell>,
    schema: SchemaRef,
    props: Arc<PlanProperties>,
}

impl fmt::Debug for WindowAggregateExec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WindowAggregateExec")
            .field("window", &self.group_by.expr()[self.window_key].1)
            .finish()
    }
}

impl WindowAggregateExec {
    /// How many group keys lead each output row (the window's among them).
    pub fn group_count(&self) -> usize {
        self.group_by.expr().len()
    }

    /// Build over `input`, which must be one partition ordered ascending on `order_column`.
    #[allow(clippy::too_many_arguments)]
    pub fn try_new(
        input: Arc<dyn ExecutionPlan>,
        group_by: PhysicalGroupBy,
        aggr_expr: Vec<Arc<AggregateFunctionExpr>>,
        filter_expr: Vec<Option<Arc<dyn PhysicalExpr>>>,
        window_key: usize,
        order_column: usize,
        expand: Option<Windowing>,
        schema: SchemaRef,
    ) -> Result<Self> {
        let key_name = schema.field(window_key).name().clone();
        // Ascending, nulls last: how the order column itself is declared (it holds no nulls).
        let ordering = vec![PhysicalSortExpr::new(
            Arc::new(Column::new(&key_name, window_key)),
            arrow::compute::SortOptions {
                descending: false,
                nulls_first: false,
            },
        )];
        let eq = EquivalenceProperties::new_with_orderings(Arc::clone(&schema), [ordering]);
        let props = one_partition(eq, input.boundedness());
        Ok(Self {
            input,
            group_by,
            aggr_expr,
            filter_expr,
            window_key,
            order_column,
            expand,
            frontier: Arc::default(),
            schema,
            props,
        })
    }

    /// Where this operator hands on its frontier (read by a window aggregate above it).
    pub fn frontier(&self) -> &Arc<WatermarkCell> {
        &self.frontier
    }
}

impl DisplayAs for WindowAggregateExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let (keys, aggs) = aggregate_display(Some(&self.group_by), &self.aggr_expr);
        write!(
            f,
            "WindowAggregateExec: window={}, gby=[{keys}], aggr=[{aggs}], emit=on window close{}",
            self.group_by.expr()[self.window_key].1,
            watermark_note(&self.input)
        )
    }
}

#[rustfmt::skip::macros(plan_basics)] // its settings stay on a line or two
impl ExecutionPlan for WindowAggregateExec {
    plan_basics!("WindowAggregateExec", [input], [false], try_new(group_by, aggr_expr,
        filter_expr, window_key, order_column, expand, schema));

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let reservation = MemoryConsumer::new(format!("WindowAggregateExec[{partition}]"))
            .register(context.memory_pool());
        let input = self.input.execute(partition, context)?;
        let input_schema = self.input.schema();
        let time_type = input_schema.field(self.order_column).data_type().clone();
        // With Spark's windows, keys and aggregates read the input plus the windows' starts.
        let read_schema = match self.expand {
            Some(_) => {
                let mut fields: Vec<Field> = input_schema
                    .fields()
                    .iter()
                    .map(|f| f.as_ref().clone())
                    .collect();
                fields.push(Field::new(WINDOW_START, time_type.clone(), false));
                Arc::new(Schema::new(fields))
            }
            None => Arc::clone(&input_schema),
        };
        let group_schema = self.group_by.group_schema(&read_schema)?;
        let accumulators = self
            .aggr_expr
            .iter()
            .map(group_accumulator)
            .collect::<Result<Vec<_>>>()?;
        // A run of equal window keys is one group only when a row has one window.
        let window_only = self.group_by.expr().len() == 1
            && self.group_by.is_single()
            && self.expand.is_none_or(|w| w.tumbling());
        let whole_batch = self
            .aggr_expr
            .iter()
            .zip(&self.filter_expr)
            .map(|(expr, filter)| {
                (filter.is_none() && folds_whole_batches(expr)).then(|| Arc::clone(expr))
            })
            .collect();
        let key_read = KeyRead::new(&self.group_by.expr()[0].0, &read_schema)?;
        // `date_bin` of the order column: a batch's windows are found on its raw values.
        let bins = (window_only && self.expand.is_none())
            .then(|| Bins::of(&self.group_by.expr()[0].0, self.order_column, &time_type))
            .flatten();
        let stream = WindowStream {
            input,
            key_read,
            bins,
            group_by: self.group_by.clone(),
            arguments: aggregate_expressions(&self.aggr_expr, &AggregateMode::Single, 0)?,
            filters: self.filter_expr.clone(),
            // Groups must be numbered in the order of their first row (for ordered input,
            // window order): the window alone needs only its runs; with other keys,
            // DataFusion's streaming variant interns row by row.
            group_values: if window_only {
                Box::new(RunGroupValues::new())
            } else {
                new_group_values(group_schema, &GroupOrdering::Full(GroupOrderingFull::new()))?
            },
            window_only,
            read_schema,
            whole_batch,
            one_group: Vec::new(),
            accumulators,
            window_key: self.window_key,
            probe: Probe::new(&input_schema, self.order_column),
            // The watermark of what is right below it when it runs (see `watermark_source`).
            upstream: super::rule::watermark_source(&self.input),
            expand: self.expand.map(|w| (w, self.order_column, time_type)),
            seen_watermark: None,
            frontier: Arc::clone(&self.frontier),
            windows: VecDeque::new(),
            groups_seen: 0,
            group_indices: Vec::new(),
            schema: Arc::clone(&self.schema),
            pending: VecDeque::new(),
            done: false,
            deferred: None,
            failed: None,
            reservation,
        };
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            Arc::clone(&self.schema),
            stream,
        )))
    }
}

/// DataFusion's fast per-group accumulator where the function has one, else its adapter
/// over the row accumulator (count distinct, percentiles…): both emit `First(n)` exactly.
pub(super) fn group_accumulator(
    expr: &Arc<AggregateFunctionExpr>,
) -> Result<Box<dyn GroupsAccumulator>> {
    if expr.groups_accumulator_supported() {
        expr.create_groups_accumulator()
    } else {
        let expr = Arc::clone(expr);
        Ok(Box::new(GroupsAccumulatorAdapter::new(move || {
            expr.create_accumulator()
        })))
    }
}

/// A batch this short is folded row by row (its keys evaluated per row), not cut into windows.
const SHORT: usize = 16;

/// Rows between the samples of the key that find the windows of a batch spanning several.
const STRIDE: usize = 64;

/// When the input has a backlog, the input already queued is folded into the windows going
/// out in one batch for at most this long after they closed, and until this many window
/// rows are pending (see [`WindowStream::fold_ready`]).
const COALESCE_FOR: Duration = Duration::from_millis(1);
const COALESCE_ROWS: usize = 8192;

/// Aggregates whose row accumulator folds a whole batch in vectorised kernels and whose
/// state merges exactly into the group accumulator (integer sums wrap the same way in
/// both). Used for a batch that is one group: one `update_batch` and a one-row merge
/// instead of a per-row scatter into the group's slot.
///
/// Not `avg`: over rows that are all null its row accumulator's state is a valid count of
/// 0 beside a null sum, which DataFusion's group accumulator merges as a group seen with
/// no rows — then NaN for floats and a division by zero (a panic) for decimals, where the
/// answer is NULL.
fn folds_whole_batches(expr: &AggregateFunctionExpr) -> bool {
    !expr.is_distinct()
        && expr.groups_accumulator_supported()
        && matches!(expr.fun().name(), "count" | "sum" | "min" | "max")
}

/// `count` of non-null literals (`count(*)`, `count(1)`): a batch's count is its length.
fn counts_rows(expr: &AggregateFunctionExpr, args: &[Arc<dyn PhysicalExpr>]) -> bool {
    expr.fun().name() == "count"
        && args.iter().all(|a| {
            a.downcast_ref::<Literal>()
                .is_some_and(|l| !l.value().is_null())
        })
}

/// An aggregate's arguments evaluated over `batch`.
fn evaluate(args: &[Arc<dyn PhysicalExpr>], batch: &RecordBatch) -> Result<Vec<ArrayRef>> {
    args.iter()
        .map(|e| e.evaluate(batch)?.into_array(batch.num_rows()))
        .collect()
}

/// The state of `expr` over each part of its evaluated arguments (`(start, len)` each), in
/// vectorised kernels: one row per part, per state field, to merge into the parts' groups.
fn part_states(
    expr: &AggregateFunctionExpr,
    values: &[ArrayRef],
    bounds: &[(usize, usize)],
) -> Result<Vec<ArrayRef>> {
    let mut fields: Vec<Vec<ScalarValue>> = Vec::new();
    for &(start, len) in bounds {
        let mut row = expr.create_accumulator()?;
        let part: Vec<ArrayRef> = values.iter().map(|v| v.slice(start, len)).collect();
        row.update_batch(&part)?;
        let state = row.state()?;
        fields.resize_with(state.len(), || Vec::with_capacity(bounds.len()));
        for (field, value) in fields.iter_mut().zip(state) {
            field.push(value);
        }
    }
    fields.into_iter().map(ScalarValue::iter_to_array).collect()
}

/// Turns a watermark (a value of the input's order column) into the window key it opens:
/// the key expression evaluated on a one-row batch holding the watermark.
struct Probe {
    schema: SchemaRef,
    order_column: usize,
}

impl Probe {
    fn new(input: &Schema, order_column: usize) -> Self {
        let fields: Vec<Field> = input
            .fields()
            .iter()
            .map(|f| f.as_ref().clone().with_nullable(true))
            .collect();
        Self {
            schema: Arc::new(Schema::new(fields)),
            order_column,
        }
    }

    fn key(
        &self,
        key_expr: &Arc<dyn PhysicalExpr>,
        watermark: &ScalarValue,
    ) -> Result<ScalarValue> {
        let columns: Vec<ArrayRef> = self
            .schema
            .fields()
            .iter()
            .enumerate()
            .map(|(i, f)| {
                if i == self.order_column {
                    watermark.cast_to(f.data_type())?.to_array_of_size(1)
                } else {
                    Ok(new_null_array(f.data_type(), 1))
                }
            })
            .collect::<Result<_>>()?;
        let batch = RecordBatch::try_new(Arc::clone(&self.schema), columns)?;
        let value = key_expr.evaluate(&batch)?.into_array(1)?;
        ScalarValue::try_from_array(&value, 0)
    }
}

/// A key expression and the columns it reads: the key of a few rows is found by taking
/// those rows of its columns alone, not of every column of the batch.
struct KeyRead {
    /// The columns to take (None: all of them, when the key reads none or a name is
    /// ambiguous), and the expression over them.
    columns: Option<Vec<usize>>,
    expr: Arc<dyn PhysicalExpr>,
}

impl KeyRead {
    fn new(key: &Arc<dyn PhysicalExpr>, schema: &Schema) -> Result<Self> {
        let mut columns: Vec<usize> = collect_columns(key).iter().map(|c| c.index()).collect();
        columns.sort_unstable();
        columns.dedup();
        let names_unique = schema
            .fields()
            .iter()
            .enumerate()
            .all(|(i, f)| schema.index_of(f.name()).is_ok_and(|j| j == i));
        if columns.is_empty() || !names_unique {
            return Ok(Self {
                columns: None,
                expr: Arc::clone(key),
            });
        }
        let projected = schema.project(&columns)?;
        Ok(Self {
            expr: reassign_expr_columns(Arc::clone(key), &projected)?,
            columns: Some(columns),
        })
    }
}

/// A batch cut where its window changes: each part's `(start, len)`, and the parts' window
/// keys, one row each, in order.
struct Parts {
    bounds: Vec<(usize, usize)>,
    keys: ArrayRef,
}

/// A batch read from the input, with its parts when it is cut into windows (see
/// [`WindowStream::arrive`]): found once, they serve both the windows its first row closes
/// and its fold.
struct Arrived {
    batch: RecordBatch,
    parts: Option<Parts>,
}

/// Record the windows of groups new since `groups_seen` (groups are numbered in the order
/// of their first row): `groups[r]` is row `r`'s group and `window` its window key.
fn record_windows(
    windows: &mut VecDeque<(ScalarValue, usize)>,
    groups_seen: &mut usize,
    window: &ArrayRef,
    groups: &[usize],
    total: usize,
) -> Result<()> {
    if total <= *groups_seen {
        return Ok(());
    }
    for (row, &g) in groups.iter().enumerate() {
        if g == *groups_seen {
            let key = ScalarValue::try_from_array(window, row)?;
            if windows.back().is_none_or(|(k, _)| *k != key) {
                windows.push_back((key, g));
            }
            *groups_seen += 1;
            if *groups_seen == total {
                break;
            }
        }
    }
    Ok(())
}

struct WindowStream {
    input: SendableRecordBatchStream,
    /// The first key read from its own columns (see [`WindowStream::keys_at`]).
    key_read: KeyRead,
    /// The window key as `date_bin` of the order column, if it is (see [`Bins`]).
    bins: Option<Bins>,
    group_by: PhysicalGroupBy,
    arguments: Vec<Vec<Arc<dyn PhysicalExpr>>>,
    filters: Vec<Option<Arc<dyn PhysicalExpr>>>,
    group_values: Box<dyn GroupValues>,
    accumulators: Vec<Box<dyn GroupsAccumulator>>,
    window_key: usize,
    probe: Probe,
    upstream: Option<Arc<WatermarkCell>>,
    /// Spark's windows, the input's time column and its type.
    expand: Option<(Windowing, usize, DataType)>,
    seen_watermark: Option<ScalarValue>,
    frontier: Arc<WatermarkCell>,
    /// Open windows, oldest first: (window key, index of its first group).
    windows: VecDeque<(ScalarValue, usize)>,
    /// Groups whose window is known (all groups created so far).
    groups_seen: usize,
    group_indices: Vec<usize>,
    schema: SchemaRef,
    pending: VecDeque<RecordBatch>,
    done: bool,
    /// A batch whose first row closed windows: folded once they have gone out.
    deferred: Option<Arrived>,
    /// An error met while folding ready input: raised once the windows before it are out.
    failed: Option<datafusion::common::DataFusionError>,
    reservation: MemoryReservation,
    /// The window is the only key: see [`WindowStream::windows_of`].
    window_only: bool,
    /// What keys and aggregates read: the input, plus the windows' starts with `expand`.
    read_schema: SchemaRef,
    /// Per aggregate: its expression when a one-group batch may be folded whole into it
    /// (see [`folds_whole_batches`]; never with a `FILTER`).
    whole_batch: Vec<Option<Arc<AggregateFunctionExpr>>>,
    /// Group indices of a one-group batch, for the aggregates folded row by row.
    one_group: Vec<usize>,
}

impl WindowStream {
    /// Fold a batch into the groups; returns the window key of its last row.
    ///
    /// A batch cut where its window changes (its `parts`, see [`WindowStream::arrive`]) has
    /// its parts folded at once (see [`WindowStream::fold_parts`]).
    fn aggregate(&mut self, arrived: Arrived) -> Result<Option<ScalarValue>> {
        let Arrived { batch, parts } = arrived;
        let batch = &batch;
        let n = batch.num_rows();
        if n == 0 {
            return Ok(None);
        }
        if let Some((windowing, time, time_type)) = &self.expand {
            let (windowing, time, time_type) = (*windowing, *time, time_type.clone());
            let (rows, starts) = windowing.expand(batch.column(time))?;
            let taken = take_record_batch(batch, &rows)?;
            let mut columns = taken.columns().to_vec();
            columns.push(starts);
            let expanded = RecordBatch::try_new_with_options(
                Arc::clone(&self.read_schema),
                columns,
                &RecordBatchOptions::new().with_row_count(Some(rows.len())),
            )?;
            if self.window_only && expanded.num_rows() >= SHORT {
                let parts = self.windows_of(&expanded)?;
                self.fold_parts(&expanded, parts)?;
            } else {
                self.fold(&expanded, None)?;
            }
            // Every later row's windows start at or after the last row's oldest window.
            let last = Windowing::ticks(&ScalarValue::try_from_array(batch.column(time), n - 1)?)?;
            return Windowing::scalar(windowing.oldest(last), &time_type).map(Some);
        }
        match parts {
            Some(parts) => self.fold_parts(batch, parts),
            None => self.fold(batch, None),
        }
    }

    /// Take a batch from the input: with the window as the only key, its parts (see
    /// [`WindowStream::windows_of`]); a batch shorter than `SHORT` is folded row by row.
    fn arrive(&self, batch: RecordBatch) -> Result<Arrived> {
        let cut = self.expand.is_none() && self.window_only && batch.num_rows() >= SHORT;
        let parts = if cut {
            Some(self.windows_of(&batch)?)
        } else {
            None
        };
        Ok(Arrived { batch, parts })
    }

    /// Fold `batch` into the groups: `uniform` is its one window key (as one row) when every
    /// row is in one window, else keys are evaluated per row. Returns the last row's key.
    fn fold(
        &mut self,
        batch: &RecordBatch,
        uniform: Option<ArrayRef>,
    ) -> Result<Option<ScalarValue>> {
        let n = batch.num_rows();
        let keys = match &uniform {
            Some(key) => vec![Arc::clone(key)],
            None => evaluate_group_by(&self.group_by, batch)?.swap_remove(0),
        };
        let keys = &keys;
        let filters = self
            .filters
            .iter()
            .map(|f| match f {
                Some(f) => f.evaluate(batch)?.into_array(n).map(Some),
                None => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        self.group_values.intern(keys, &mut self.group_indices)?;
        let total = self.group_values.len();
        let window = &keys[self.window_key];
        record_windows(
            &mut self.windows,
            &mut self.groups_seen,
            window,
            &self.group_indices,
            total,
        )?;
        for (i, acc) in self.accumulators.iter_mut().enumerate() {
            let filter = filters[i].as_ref().map(|f| f.as_boolean());
            let args = &self.arguments[i];
            let Some(&group) = uniform.as_ref().and(self.group_indices.first()) else {
                acc.update_batch(&evaluate(args, batch)?, &self.group_indices, filter, total)?;
                continue;
            };
            let Some(expr) = &self.whole_batch[i] else {
                self.one_group.clear();
                self.one_group.resize(n, group);
                acc.update_batch(&evaluate(args, batch)?, &self.one_group, filter, total)?;
                continue;
            };
            // The batch's state, in vectorised kernels, merged into its one group; `count(*)`
            // (a count of a literal) is the number of rows, with no column to build.
            let state = if counts_rows(expr, args) {
                vec![Arc::new(Int64Array::from(vec![n as i64])) as ArrayRef]
            } else {
                part_states(expr, &evaluate(args, batch)?, &[(0, n)])?
            };
            acc.merge_batch(&state, &[group], None, total)?;
        }
        ScalarValue::try_from_array(window, window.len() - 1).map(Some)
    }

    /// Fold a batch cut into windows (see [`WindowStream::windows_of`]): the parts' keys are
    /// interned at once, a group each, and every aggregate folds the whole batch in one call
    /// with each row's group known from its part — a batch spanning many windows costs per
    /// row, not per window. `count(*)` merges the parts' lengths. A batch in one window is
    /// folded whole (see [`WindowStream::fold`]). Returns the last part's key.
    fn fold_parts(&mut self, batch: &RecordBatch, parts: Parts) -> Result<Option<ScalarValue>> {
        let Parts { bounds, keys } = parts;
        if bounds.len() == 1 {
            return self.fold(batch, Some(keys));
        }
        let n = batch.num_rows();
        let mut part_groups = Vec::with_capacity(bounds.len());
        self.group_values
            .intern(&[Arc::clone(&keys)], &mut part_groups)?;
        let total = self.group_values.len();
        record_windows(
            &mut self.windows,
            &mut self.groups_seen,
            &keys,
            &part_groups,
            total,
        )?;
        let mut row_groups: Option<Vec<usize>> = None;
        for (i, acc) in self.accumulators.iter_mut().enumerate() {
            let args = &self.arguments[i];
            // `whole_batch` is set only for an aggregate without a FILTER.
            if let Some(expr) = &self.whole_batch[i] {
                let state = if counts_rows(expr, args) {
                    let lens = bounds.iter().map(|&(_, len)| len as i64);
                    vec![Arc::new(Int64Array::from_iter_values(lens)) as ArrayRef]
                } else {
                    part_states(expr, &evaluate(args, batch)?, &bounds)?
                };
                acc.merge_batch(&state, &part_groups, None, total)?;
                continue;
            }
            let groups = row_groups.get_or_insert_with(|| {
                let mut groups = Vec::with_capacity(n);
                for (&(_, len), &g) in bounds.iter().zip(&part_groups) {
                    groups.extend(std::iter::repeat_n(g, len));
                }
                groups
            });
            let filter = match &self.filters[i] {
                Some(f) => Some(f.evaluate(batch)?.into_array(n)?),
                None => None,
            };
            let filter = filter.as_ref().map(|f| f.as_boolean());
            acc.update_batch(&evaluate(args, batch)?, groups, filter, total)?;
        }
        ScalarValue::try_from_array(&keys, keys.len() - 1).map(Some)
    }

    /// The parts of `batch` that lie in one window each, with the windows' keys. A key that
    /// is `date_bin` of the order column is cut by its own arithmetic, confirmed by the key
    /// on each part's ends (see [`WindowStream::binned_parts`]). Otherwise: the key never
    /// decreases along the input, so a batch whose two ends share a key is one window, found
    /// by evaluating the key on two rows (most batches of a stream lie in one window, and
    /// the key — `date_bin` — costs several nanoseconds a row); else the key is evaluated
    /// on every `STRIDE`-th row, and then only on the rows between two samples whose keys
    /// differ, where the boundaries are; a batch with boundaries between most samples has
    /// its key evaluated on every row instead.
    fn windows_of(&self, batch: &RecordBatch) -> Result<Parts> {
        if let Some(parts) = self.binned_parts(batch)? {
            return Ok(parts);
        }
        let n = batch.num_rows();
        let ends = self.keys_at(batch, &[0, n - 1])?;
        if !distinct(&ends.slice(0, 1), &ends.slice(1, 1))?.value(0) {
            return Ok(Parts {
                bounds: vec![(0, n)],
                keys: ends.slice(0, 1),
            });
        }
        let mut samples: Vec<usize> = (0..n).step_by(STRIDE).collect();
        if samples.last() != Some(&(n - 1)) {
            samples.push(n - 1);
        }
        let sampled = self.keys_at(batch, &samples)?;
        let m = samples.len();
        let between = distinct(&sampled.slice(1, m - 1), &sampled.slice(0, m - 1))?;
        let spans: Vec<usize> = between.values().set_indices().collect();
        // (row of the batch, its key) for each row where a window starts, after the first.
        let starts: Vec<(usize, ArrayRef)> = if spans.len() * STRIDE * 2 > n {
            let keys = self.group_by.expr()[0].0.evaluate(batch)?.into_array(n)?;
            let changes = distinct(&keys.slice(1, n - 1), &keys.slice(0, n - 1))?;
            changes
                .values()
                .set_indices()
                .map(|i| (i + 1, keys.slice(i + 1, 1)))
                .collect()
        } else {
            let rows: Vec<usize> = spans
                .iter()
                .flat_map(|&i| samples[i]..=samples[i + 1])
                .collect();
            let keys = self.keys_at(batch, &rows)?;
            let changes = distinct(
                &keys.slice(1, rows.len() - 1),
                &keys.slice(0, rows.len() - 1),
            )?;
            changes
                .values()
                .set_indices()
                // A pair of the same row (where two spans meet) is never a boundary.
                .filter(|&j| rows[j + 1] == rows[j] + 1)
                .map(|j| (rows[j + 1], keys.slice(j + 1, 1)))
                .collect()
        };
        let mut bounds = Vec::with_capacity(starts.len() + 1);
        let mut keys = vec![ends.slice(0, 1)];
        let mut start = 0;
        for (row, next) in starts {
            bounds.push((start, row - start));
            keys.push(next);
            start = row;
        }
        bounds.push((start, n - start));
        let keys: Vec<&dyn Array> = keys.iter().map(|k| k.as_ref()).collect();
        Ok(Parts {
            bounds,
            keys: concat(&keys)?,
        })
    }

    /// The parts of `batch` by `date_bin`'s arithmetic on the order column (see [`Bins`]),
    /// confirmed by the key itself: evaluated on the first and last row of every part, each
    /// part's two ends must share a key (the key never decreases, so the whole part does) and
    /// each part's last row differ from the next part's first. None when the key is not
    /// `date_bin` of the order column or the guess is not confirmed.
    fn binned_parts(&self, batch: &RecordBatch) -> Result<Option<Parts>> {
        let Some(bins) = &self.bins else {
            return Ok(None);
        };
        let Some(starts) = bins.starts(batch.column(bins.column())) else {
            return Ok(None);
        };
        let n = batch.num_rows();
        let firsts = std::iter::once(0).chain(starts.iter().copied());
        let lasts = starts.iter().map(|s| s - 1).chain(std::iter::once(n - 1));
        let rows: Vec<usize> = firsts.zip(lasts).flat_map(|(a, b)| [a, b]).collect();
        let keys = self.keys_at(batch, &rows)?;
        // changed[j]: whether rows[j + 1]'s key differs from rows[j]'s.
        let changed = distinct(
            &keys.slice(1, rows.len() - 1),
            &keys.slice(0, rows.len() - 1),
        )?;
        let confirmed = (0..rows.len() - 1).all(|j| changed.value(j) == (j % 2 == 1));
        if !confirmed {
            return Ok(None);
        }
        let firsts = UInt32Array::from_iter_values((0..rows.len()).step_by(2).map(|j| j as u32));
        Ok(Some(Parts {
            bounds: rows.chunks(2).map(|p| (p[0], p[1] - p[0] + 1)).collect(),
            keys: take(keys.as_ref(), &firsts, None)?,
        }))
    }

    /// The window key of the given rows of `batch`: only the key's columns are taken.
    fn keys_at(&self, batch: &RecordBatch, rows: &[usize]) -> Result<ArrayRef> {
        let rows = UInt32Array::from_iter_values(rows.iter().map(|&r| r as u32));
        let KeyRead { columns, expr } = &self.key_read;
        let taken = match columns {
            Some(columns) => take_record_batch(&batch.project(columns)?, &rows)?,
            None => take_record_batch(batch, &rows)?,
        };
        expr.evaluate(&taken)?.into_array(rows.len())
    }

    /// The window key a new watermark from below opens, if there is a new one.
    fn watermark_key(&mut self) -> Result<Option<ScalarValue>> {
        let Some(cell) = &self.upstream else {
            return Ok(None);
        };
        let Some(w) = cell.get() else {
            return Ok(None);
        };
        if self.seen_watermark.as_ref() == Some(&w) {
            return Ok(None);
        }
        let key = match &self.expand {
            Some((windowing, _, time_type)) => {
                Windowing::scalar(windowing.oldest(Windowing::ticks(&w)?), time_type)?
            }
            None => {
                let key_expr = Arc::clone(&self.group_by.expr()[self.window_key].0);
                self.probe.key(&key_expr, &w)?
            }
        };
        self.seen_watermark = Some(w);
        Ok(Some(key))
    }

    /// Emit every window whose key is below `threshold` (nothing later can fall into it).
    fn emit_below(&mut self, threshold: &ScalarValue) -> Result<()> {
        let mut closed = 0;
        while let Some((key, _)) = self.windows.front() {
            if key.partial_cmp(threshold) != Some(std::cmp::Ordering::Less) {
                break;
            }
            self.windows.pop_front();
            closed += 1;
        }
        if closed > 0 {
            let n = self.windows.front().map_or(self.groups_seen, |(_, g)| *g);
            self.emit(EmitTo::First(n))?;
            for (_, g) in self.windows.iter_mut() {
                *g -= n;
            }
            self.groups_seen -= n;
        }
        // Every later row's window key is at least `threshold`.
        if !threshold.is_null() {
            self.frontier.set(threshold.clone());
        }
        Ok(())
    }

    fn emit(&mut self, to: EmitTo) -> Result<()> {
        if self.group_values.is_empty() {
            return Ok(());
        }
        let mut columns = self.group_values.emit(to)?;
        for acc in self.accumulators.iter_mut() {
            columns.push(acc.evaluate(to)?);
        }
        let batch = RecordBatch::try_new(Arc::clone(&self.schema), columns)?;
        if batch.num_rows() > 0 {
            self.pending.push_back(batch);
        }
        Ok(())
    }

    /// Count the open windows' state against the session's memory pool: a query over its
    /// share fails with DataFusion's "Resources exhausted" error.
    fn account(&mut self) -> Result<()> {
        let size = self.group_values.size()
            + self.accumulators.iter().map(|a| a.size()).sum::<usize>()
            + self
                .pending
                .iter()
                .map(|b| b.get_array_memory_size())
                .sum::<usize>();
        self.reservation.try_resize(size)
    }

    /// Emit the windows that `batch`'s first row closes (the input is ordered: nothing from
    /// it or later falls below that row's window), so that a batch closing a window need
    /// not be folded before the window's row leaves; whether any did.
    fn closed_by_first_row(&mut self, arrived: &Arrived) -> Result<bool> {
        let batch = &arrived.batch;
        if batch.num_rows() == 0 || self.windows.is_empty() {
            return Ok(false);
        }
        let threshold = match (&self.expand, &arrived.parts) {
            (Some((windowing, time, time_type)), _) => {
                let first = ScalarValue::try_from_array(batch.column(*time), 0)?;
                Windowing::scalar(windowing.oldest(Windowing::ticks(&first)?), time_type)?
            }
            (None, Some(parts)) => ScalarValue::try_from_array(&parts.keys, 0)?,
            (None, None) => {
                let key = &self.group_by.expr()[self.window_key].0;
                let value = key.evaluate(&batch.slice(0, 1))?.into_array(1)?;
                ScalarValue::try_from_array(&value, 0)?
            }
        };
        let before = self.pending.len();
        self.emit_below(&threshold)?;
        Ok(self.pending.len() > before)
    }

    fn on_batch(&mut self, arrived: Arrived) -> Result<()> {
        let by_rows = self.aggregate(arrived)?;
        self.account()?;
        let by_watermark = self.watermark_key()?;
        let threshold = match (by_rows, by_watermark) {
            (Some(a), Some(b)) => {
                if a.partial_cmp(&b) == Some(std::cmp::Ordering::Less) {
                    b
                } else {
                    a
                }
            }
            (Some(a), None) | (None, Some(a)) => a,
            (None, None) => return Ok(()),
        };
        self.emit_below(&threshold)?;
        self.account()
    }
}

impl WindowStream {
    /// Fold the input that is ready now into the pending windows (see
    /// [`WindowStream::poll_next`]) for at most `COALESCE_FOR` and until `COALESCE_ROWS`
    /// window rows are pending: the windows already closed wait that long at most, whatever
    /// the size of the batches behind them. A batch whose first row closed windows stays
    /// deferred unless more input is ready: with none, the reader is keeping up and gets
    /// those windows before the batch is folded. An error waits in `failed` until the
    /// windows before it have gone out.
    fn fold_ready(&mut self, cx: &mut Context<'_>) {
        let until = Instant::now() + COALESCE_FOR;
        while !self.done && self.failed.is_none() && Instant::now() < until {
            if self.pending.iter().map(|b| b.num_rows()).sum::<usize>() >= COALESCE_ROWS {
                return;
            }
            let batch = match self.input.poll_next_unpin(cx) {
                Poll::Pending => return,
                Poll::Ready(Some(Ok(batch))) => batch,
                Poll::Ready(Some(Err(e))) => {
                    self.failed = Some(e);
                    return;
                }
                Poll::Ready(None) => {
                    self.done = true;
                    let deferred = self.deferred.take();
                    let outcome = deferred
                        .map_or(Ok(()), |d| self.on_batch(d))
                        .and_then(|()| {
                            self.windows.clear();
                            self.emit(EmitTo::All)
                        });
                    if let Err(e) = outcome {
                        self.failed = Some(e);
                    }
                    return;
                }
            };
            let deferred = self.deferred.take();
            let outcome = deferred
                .map_or(Ok(()), |d| self.on_batch(d))
                .and_then(|()| self.arrive(batch))
                .and_then(|arrived| {
                    self.closed_by_first_row(&arrived)?;
                    self.on_batch(arrived)
                });
            if let Err(e) = outcome {
                self.failed = Some(e);
            }
        }
    }

    /// Every pending window as one batch.
    fn take_pending(&mut self) -> Result<RecordBatch> {
        if self.pending.len() == 1 {
            return Ok(self.pending.pop_front().expect("one pending batch"));
        }
        let batches: Vec<RecordBatch> = self.pending.drain(..).collect();
        Ok(concat_batches(&self.schema, &batches)?)
    }
}

impl Stream for WindowStream {
    type Item = Result<RecordBatch>;

    /// Each batch the reader takes costs it a crossing into Python of its own (about 0.1 ms
    /// on this machine's 2 cores), whatever its rows: when windows are pending, the input
    /// already queued is folded first and every window it closes goes out in the same
    /// batch. A reader that keeps up finds no input queued and gets each window as soon as
    /// it closes.
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            if !self.pending.is_empty() {
                self.fold_ready(cx);
                let batch = self.take_pending();
                if batch.is_err() {
                    self.done = true;
                }
                return Poll::Ready(Some(batch));
            }
            if let Some(e) = self.failed.take() {
                self.done = true;
                return Poll::Ready(Some(Err(e)));
            }
            if self.done {
                return Poll::Ready(None);
            }
            if let Some(arrived) = self.deferred.take() {
                if let Err(e) = self.on_batch(arrived) {
                    self.done = true;
                    return Poll::Ready(Some(Err(e)));
                }
                continue;
            }
            match futures::ready!(self.input.poll_next_unpin(cx)) {
                Some(Ok(batch)) => {
                    let arrived = match self.arrive(batch) {
                        Ok(arrived) => arrived,
                        Err(e) => {
                            self.done = true;
                            return Poll::Ready(Some(Err(e)));
                        }
                    };
                    // The windows the batch's first row closes go out before it is folded.
                    match self.closed_by_first_row(&arrived) {
                        Ok(true) => {
                            self.deferred = Some(arrived);
                            continue;
                        }
                        Ok(false) => {}
                        Err(e) => {
                            self.done = true;
                            return Poll::Ready(Some(Err(e)));
                        }
                    }
                    if let Err(e) = self.on_batch(arrived) {
                        self.done = true;
                        return Poll::Ready(Some(Err(e)));
                    }
                }
                Some(Err(e)) => {
                    self.done = true;
                    return Poll::Ready(Some(Err(e)));
                }
                None => {
                    self.done = true;
                    self.windows.clear();
                    if let Err(e) = self.emit(EmitTo::All) {
                        return Poll::Ready(Some(Err(e)));
                    }
                }
            }
        }
    }
}
