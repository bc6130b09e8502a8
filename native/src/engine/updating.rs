//! The updating aggregate: a `GROUP BY` (or `SELECT DISTINCT`, or an aggregate with no
//! `GROUP BY`) over a live input that has no window of its order, answered as an upsert
//! changelog while rows arrive.
//!
//! Each output batch holds the groups that changed since the previous one, with their
//! current values, in the query's own columns: the last row seen for a key is its current
//! value (as a Kafka Streams KTable, or ksqlDB's `EMIT CHANGES`). A batch is emitted after
//! each input batch; when the reader is slower than the writers, every input batch already
//! queued is folded first and one batch of changes goes out, so a reader never works
//! through a backlog of stale versions.
//!
//! Groups are DataFusion's own group-value tables and `GroupsAccumulator`s (exact results,
//! any aggregate function). Their `evaluate` drains what it returns, so the current values
//! of the changed groups are computed from a copy: every accumulator hands out its state
//! (the partial-aggregate form DataFusion merges across partitions), is rebuilt from it,
//! and the changed groups' rows of that state are merged into a scratch accumulator, which
//! is evaluated. That costs a pass over all groups per emission, so with more groups than
//! rows per batch an emission waits until as many rows as there are groups have been
//! folded, or until the input has nothing more ready.
//!
//! The groups' keys are kept as compact copies (one chunk per input batch that opened
//! groups), and the state is counted against the session's memory pool and held to a
//! limit: past it the query fails naming the limit, rather than the process running out.
//!
//! The folding runs as a task of the engine's runtime, so input is folded while the reader
//! works on the previous changes; a batch of changes is made when the reader asks for the
//! next one (after whatever input is ready has been folded), so it always holds the latest
//! values, never a version made before the reader was ready for it.

use std::fmt;
use std::pin::pin;
use std::sync::Arc;
use std::task::Poll;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryReservation};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::{EmitTo, GroupsAccumulator};
use datafusion::physical_expr::aggregate::AggregateFunctionExpr;
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr};
use datafusion::physical_plan::aggregates::group_values::GroupValues;
use datafusion::physical_plan::aggregates::{
    aggregate_expressions, evaluate_group_by, AggregateMode, PhysicalGroupBy,
};

use datafusion::physical_plan::metrics::{
    ExecutionPlanMetricsSet, Gauge, MetricBuilder, MetricsSet,
};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, PlanProperties,
};
use futures::future::poll_fn;
use futures::future::{select, Either};
use futures::StreamExt;
use tokio::sync::{mpsc, oneshot};

use super::groups::{copy_groups, update_all, Keys, Literals};
use super::int_groups::unordered_group_values;
use super::tally::{Share, UPDATING};
use super::window::group_accumulator;
use crate::plan::{aggregate_display, one_partition};

/// Input batches (of the session's batch size) folded into one emission when input is queued.
const COALESCE_BATCHES: usize = 8;

/// The state an updating aggregate may hold when the session sets no memory limit.
pub const DEFAULT_STATE_LIMIT: usize = 1 << 30;

/// A `GROUP BY` over a live input answered as an upsert changelog.
pub struct UpdatingAggregateExec {
    input: Arc<dyn ExecutionPlan>,
    group_by: PhysicalGroupBy,
    aggr_expr: Vec<Arc<AggregateFunctionExpr>>,
    filter_expr: Vec<Option<Arc<dyn PhysicalExpr>>>,
    /// Bytes of state past which the query fails.
    limit: usize,
    schema: SchemaRef,
    props: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

impl fmt::Debug for UpdatingAggregateExec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpdatingAggregateExec").finish()
    }
}

impl UpdatingAggregateExec {
    /// Build over `input` (one partition), with the output schema of the aggregate it replaces.
    pub fn try_new(
        input: Arc<dyn ExecutionPlan>,
        group_by: PhysicalGroupBy,
        aggr_expr: Vec<Arc<AggregateFunctionExpr>>,
        filter_expr: Vec<Option<Arc<dyn PhysicalExpr>>>,
        limit: usize,
        schema: SchemaRef,
    ) -> Result<Self> {
        let props = one_partition(
            EquivalenceProperties::new(Arc::clone(&schema)),
            input.boundedness(),
        );
        Ok(Self {
            input,
            group_by,
            aggr_expr,
            filter_expr,
            limit,
            schema,
            props,
            metrics: ExecutionPlanMetricsSet::new(),
        })
    }

    /// How many group keys lead each output row (the upsert key).
    pub fn group_count(&self) -> usize {
        self.group_by.expr().len()
    }
}

impl DisplayAs for UpdatingAggregateExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let (keys, aggs) = aggregate_display(Some(&self.group_by), &self.aggr_expr);
        write!(
            f,
            "UpdatingAggregateExec: gby=[{keys}], aggr=[{aggs}], emit=changes, state_limit={}",
            self.limit
        )
    }
}

#[rustfmt::skip::macros(plan_basics)] // its settings stay on a line or two
impl ExecutionPlan for UpdatingAggregateExec {
    plan_basics!("UpdatingAggregateExec", [input], [false],
        try_new(group_by, aggr_expr, filter_expr, limit, schema));

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let reservation = MemoryConsumer::new(format!("UpdatingAggregateExec[{partition}]"))
            .register(context.memory_pool());
        let batch_size = context.session_config().batch_size();
        let input = self.input.execute(partition, context)?;
        let runtime = super::runtime().map_err(|e| DataFusionError::Execution(e.to_string()))?;
        let group_schema = self.group_by.group_schema(&self.input.schema())?;
        let keyless = self.group_by.expr().is_empty();
        let changes = Changes {
            group_by: self.group_by.clone(),
            arguments: aggregate_expressions(&self.aggr_expr, &AggregateMode::Single, 0)?,
            filters: self.filter_expr.clone(),
            exprs: self.aggr_expr.clone(),
            accumulators: self
                .aggr_expr
                .iter()
                .map(group_accumulator)
                .collect::<Result<_>>()?,
            group_values: if keyless {
                None
            } else {
                Some(unordered_group_values(group_schema)?)
            },
            keys: Keys::default(),
            literals: Literals::default(),
            groups: 0,
            group_indices: Vec::new(),
            changed: Changed::default(),
            rows_since_emit: 0,
            batch_size,
            limit: self.limit,
            reservation,
            groups_gauge: MetricBuilder::new(&self.metrics).gauge("groups", partition),
            state_gauge: MetricBuilder::new(&self.metrics).gauge("state_bytes", partition),
            share: Share::new(&UPDATING),
            schema: Arc::clone(&self.schema),
        };
        // Each poll of the output asks the task for the next batch of changes.
        let (asks, asked) = mpsc::channel(1);
        // A panic of the task drops its side of the channels: the output ends with an error
        // naming the operator then, never as if the input had ended.
        let operator = format!("UpdatingAggregateExec[{partition}]");
        let gone = super::task::panicked(&operator, &"the task ended without an answer");
        super::task::spawn(runtime, operator, changes.run(input, asked), |_| ());
        let gone = Arc::new(gone);
        let output = futures::stream::unfold(Some(asks), move |asks| {
            let gone = Arc::clone(&gone);
            async move {
                let asks = asks?;
                let ended = || Some((Err(DataFusionError::Shared(Arc::clone(&gone))), None));
                let (reply, answer) = oneshot::channel();
                if asks.send(reply).await.is_err() {
                    return ended();
                }
                match answer.await {
                    Ok(Some(item)) => Some((item, Some(asks))),
                    Ok(None) => None, // the input ended: so do the changes
                    Err(_) => ended(),
                }
            }
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            Arc::clone(&self.schema),
            output,
        )))
    }
}

/// The groups changed since the last emission: a flag per group.
///
/// Marking is a store per row, with no branch on whether the group was marked before (a
/// batch marks every group it touches: 8,192 rows a batch at 1,000 keys); the changed
/// groups are found by one pass over the flags when they are taken, which is no more than
/// the pass over every group's state an emission makes anyway ([`copy_groups`]).
#[derive(Default)]
struct Changed {
    flags: Vec<bool>,
    any: bool,
}

impl Changed {
    fn mark(&mut self, group: usize) {
        self.mark_all(&[group], group + 1);
    }

    /// Mark every group of `groups`, each below `total` (the number of groups).
    fn mark_all(&mut self, groups: &[usize], total: usize) {
        if groups.is_empty() {
            return;
        }
        if total > self.flags.len() {
            self.flags.resize(total, false);
        }
        let flags = &mut self.flags[..];
        for &g in groups {
            flags[g] = true;
        }
        self.any = true;
    }

    /// The changed groups in the order they were created, and a clean slate.
    fn take(&mut self) -> Vec<u32> {
        let list = self
            .flags
            .iter()
            .enumerate()
            .filter_map(|(g, &changed)| changed.then_some(g as u32))
            .collect();
        self.flags.fill(false);
        self.any = false;
        list
    }

    fn is_empty(&self) -> bool {
        !self.any
    }

    fn size(&self) -> usize {
        self.flags.capacity()
    }
}

/// The groups and their accumulators: what an updating aggregate's task folds into.
struct Changes {
    group_by: PhysicalGroupBy,
    arguments: Vec<Vec<Arc<dyn PhysicalExpr>>>,
    filters: Vec<Option<Arc<dyn PhysicalExpr>>>,
    exprs: Vec<Arc<AggregateFunctionExpr>>,
    accumulators: Vec<Box<dyn GroupsAccumulator>>,
    /// None for an aggregate with no `GROUP BY`: one group, always.
    group_values: Option<Box<dyn GroupValues>>,
    keys: Keys,
    /// `count(*)`'s ones and other literal arguments, made once.
    literals: Literals,
    groups: usize,
    group_indices: Vec<usize>,
    changed: Changed,
    rows_since_emit: usize,
    batch_size: usize,
    limit: usize,
    reservation: MemoryReservation,
    groups_gauge: Gauge,
    state_gauge: Gauge,
    /// This stream's share of the process's updating-aggregate state (pushtable's stats).
    share: Share,
    schema: SchemaRef,
}

/// The reader's request for the next batch of changes: answered with it, or None at the end.
type Ask = oneshot::Sender<Option<Result<RecordBatch>>>;

impl Changes {
    /// Fold `input` as it comes and answer the reader's asks (see the module's docs), until
    /// the input ends or fails and its last answers are given, or the reader goes away.
    ///
    /// An ask is answered once input that is ready has been folded, unless enough was folded
    /// since the last answer to pay for the next one ([`Self::due`]); with nothing changed
    /// it waits for input that changes something.
    async fn run(mut self, mut input: SendableRecordBatchStream, mut asks: mpsc::Receiver<Ask>) {
        let mut ask: Option<Ask> = None;
        loop {
            let item = match ask.take() {
                // An ask first: folding on while the reader waits would starve it.
                None => match select(pin!(asks.recv()), input.next()).await {
                    Either::Left((Some(next), _)) => {
                        ask = Some(next);
                        continue;
                    }
                    Either::Left((None, _)) => return, // the reader is gone
                    Either::Right((item, _)) => item,
                },
                Some(mut reply) => {
                    let ready = if self.changed.is_empty() {
                        match select(input.next(), pin!(reply.closed())).await {
                            Either::Left((item, _)) => Some(item),
                            Either::Right(_) => return,
                        }
                    } else if self.due() {
                        None
                    } else {
                        ready_now(&mut input).await
                    };
                    match ready {
                        Some(item) => {
                            ask = Some(reply);
                            item
                        }
                        None => {
                            let changes = self.emit().transpose();
                            let failed = matches!(changes, Some(Err(_)));
                            let _ = reply.send(changes);
                            if failed {
                                return;
                            }
                            continue;
                        }
                    }
                }
            };
            let failure = match item {
                Some(Ok(batch)) => match self.absorb(&batch) {
                    Ok(()) => continue,
                    Err(e) => e,
                },
                Some(Err(e)) => e,
                None => {
                    // The end: the last changes, then a keyless aggregate's answer over no rows.
                    let last = self.emit().transpose();
                    let answer = self.keyless_of_nothing().transpose();
                    Self::answer_all(ask, &mut asks, last.into_iter().chain(answer)).await;
                    return;
                }
            };
            Self::answer_all(ask, &mut asks, std::iter::once(Err(failure))).await;
            return;
        }
    }

    /// Answer the pending ask and the next ones with `items`, then the end.
    async fn answer_all(
        mut ask: Option<Ask>,
        asks: &mut mpsc::Receiver<Ask>,
        items: impl Iterator<Item = Result<RecordBatch>>,
    ) {
        for item in items.map(Some).chain(std::iter::once(None)) {
            let reply = match ask.take() {
                Some(reply) => reply,
                None => match asks.recv().await {
                    Some(reply) => reply,
                    None => return,
                },
            };
            let last = !matches!(item, Some(Ok(_)));
            if reply.send(item).is_err() || last {
                return;
            }
        }
    }

    /// Fold `batch` into the groups and mark the groups it touched.
    fn absorb(&mut self, batch: &RecordBatch) -> Result<()> {
        let n = batch.num_rows();
        if n == 0 {
            return Ok(());
        }
        match &mut self.group_values {
            None => {
                self.group_indices.clear();
                self.group_indices.resize(n, 0);
                self.groups = 1;
                self.changed.mark(0);
            }
            Some(values) => {
                let keys = evaluate_group_by(&self.group_by, batch)?.swap_remove(0);
                values.intern(&keys, &mut self.group_indices)?;
                let (before, total) = (self.groups, values.len());
                if total > before {
                    // New groups are numbered in the order of their first row.
                    let mut rows = Vec::with_capacity(total - before);
                    let mut next = before;
                    for (row, &g) in self.group_indices.iter().enumerate() {
                        if g == next {
                            rows.push(row as u32);
                            next += 1;
                            if next == total {
                                break;
                            }
                        }
                    }
                    self.keys.push(&keys, &rows)?;
                    self.groups = total;
                }
                if self.accumulators.is_empty() {
                    // DISTINCT: a group changes only when it appears.
                    (before..total).for_each(|g| self.changed.mark(g));
                } else {
                    self.changed.mark_all(&self.group_indices, total);
                }
            }
        }
        update_all(
            &mut self.literals,
            &mut self.accumulators,
            &self.arguments,
            &self.filters,
            batch,
            &self.group_indices,
            self.groups,
        )?;
        self.rows_since_emit += n;
        self.account()
    }

    /// An aggregate with no `GROUP BY` over no rows answers one row at the end, as DataFusion
    /// does (`count` 0, the others null): from fresh row accumulators.
    fn keyless_of_nothing(&self) -> Result<Option<RecordBatch>> {
        if self.group_values.is_some() || self.groups > 0 {
            return Ok(None);
        }
        let columns = self
            .exprs
            .iter()
            .map(|e| e.create_accumulator()?.evaluate()?.to_array_of_size(1))
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(RecordBatch::try_new(
            Arc::clone(&self.schema),
            columns,
        )?))
    }

    /// Count the state against the memory pool and the limit.
    fn account(&mut self) -> Result<()> {
        let size = self.group_values.as_ref().map_or(0, |v| v.size())
            + self.accumulators.iter().map(|a| a.size()).sum::<usize>()
            + self.keys.size()
            + self.changed.size();
        self.groups_gauge.set(self.groups);
        self.state_gauge.set(size);
        self.share.set(self.groups, size);
        if size > self.limit {
            return Err(DataFusionError::ResourcesExhausted(format!(
                "the updating GROUP BY holds {} groups in {size} bytes of state, past its limit \
                 of {} bytes (SessionContext(memory_limit=...) sets it); group by fewer keys, \
                 or by a window of the table's order so that closed windows leave the state",
                self.groups, self.limit
            )));
        }
        self.reservation.try_resize(size)
    }

    /// The changed groups with their current values, as one batch (None: nothing changed).
    fn emit(&mut self) -> Result<Option<RecordBatch>> {
        self.rows_since_emit = 0;
        if self.changed.is_empty() {
            return Ok(None);
        }
        let changed = self.changed.take();
        let mut columns = match &self.group_values {
            Some(_) => self.keys.rows(&changed, self.group_by.expr().len())?,
            None => Vec::new(),
        };
        for (acc, expr) in self.accumulators.iter_mut().zip(&self.exprs) {
            columns.push(copy_groups(acc, expr, &changed, self.groups)?.evaluate(EmitTo::All)?);
        }
        Ok(Some(RecordBatch::try_new(
            Arc::clone(&self.schema),
            columns,
        )?))
    }

    /// Whether enough rows were folded since the last emission to pay for the next one.
    ///
    /// An emission costs a pass over the groups, and the reader a crossing into Python of
    /// its own (about 0.1 ms on this machine's 2 cores, whatever its rows): with input
    /// queued, up to `COALESCE_BATCHES` batches' rows are folded into one emission.
    fn due(&self) -> bool {
        self.rows_since_emit >= self.groups.max(COALESCE_BATCHES * self.batch_size)
    }
}

/// The input's next item if it is ready now. Polled with the task's own waker: a live
/// table's write wakes one waker per reader, so a throwaway waker registered here could take
/// the one wake-up the task was waiting for.
async fn ready_now(input: &mut SendableRecordBatchStream) -> Option<Option<Result<RecordBatch>>> {
    poll_fn(|cx| match input.poll_next_unpin(cx) {
        Poll::Ready(item) => Poll::Ready(Some(item)),
        Poll::Pending => Poll::Ready(None),
    })
    .await
}
