//! Spark's session windows: `GROUP BY session_window(ts, gap), k` over a table ordered by
//! `ts`. A session is per value of the other keys: it starts at a row, takes every next row of
//! its key that comes before its end, and ends at its last row + `gap` (Spark: "the timestamp
//! of the latest input of the session + gap duration"); a row at or after the end starts a new
//! session. The value is Spark's `struct<start, end>`.
//!
//! A session is emitted once, when nothing more can join it: when the order has reached its
//! end (a row at or after it, `advance(ts)`, `max_delay`, arrival time), or at the end of the
//! stream. Groups are DataFusion's accumulators, one group per session; closed sessions are
//! read without draining the others ([`copy_groups`]), and the accumulators are rebuilt
//! around the open sessions when the closed ones outnumber them, so the state stays
//! proportional to the open sessions.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use arrow::array::{ArrayRef, AsArray, Int64Array, RecordBatch};
use arrow::compute::cast;
use arrow::datatypes::{DataType, Field, Int64Type, Schema, SchemaRef};
use datafusion::common::{Result, ScalarValue};
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryReservation};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::{EmitTo, GroupsAccumulator};
use datafusion::physical_expr::aggregate::AggregateFunctionExpr;
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExpr};
use datafusion::physical_plan::aggregates::group_values::GroupValues;
use datafusion::physical_plan::aggregates::{aggregate_expressions, AggregateMode};

use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, PlanProperties,
};
use futures::{Stream, StreamExt};

use super::groups::{copy_groups, update_all, Keys, Literals};
use super::int_groups::unordered_group_values;
use super::spark_windows::envelope_of;
use super::tally::{Share, SESSIONS};
use super::window::group_accumulator;
use crate::channel::WatermarkCell;
use crate::plan::{aggregate_display, one_partition, watermark_note};

/// A `GROUP BY session_window(ts, gap), ...` over input ordered by `ts`.
pub struct SessionWindowExec {
    input: Arc<dyn ExecutionPlan>,
    /// The group expressions, in output order; `session` is the session window's place.
    keys: Vec<Arc<dyn PhysicalExpr>>,
    session: usize,
    aggr_expr: Vec<Arc<AggregateFunctionExpr>>,
    filter_expr: Vec<Option<Arc<dyn PhysicalExpr>>>,
    /// The input's order column and the gap, in that column's ticks.
    order_column: usize,
    gap: i64,
    schema: SchemaRef,
    props: Arc<PlanProperties>,
}

impl fmt::Debug for SessionWindowExec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SessionWindowExec").finish()
    }
}

impl SessionWindowExec {
    #[allow(clippy::too_many_arguments)]
    pub fn try_new(
        input: Arc<dyn ExecutionPlan>,
        keys: Vec<Arc<dyn PhysicalExpr>>,
        session: usize,
        aggr_expr: Vec<Arc<AggregateFunctionExpr>>,
        filter_expr: Vec<Option<Arc<dyn PhysicalExpr>>>,
        order_column: usize,
        gap: i64,
        schema: SchemaRef,
    ) -> Result<Self> {
        let props = one_partition(
            EquivalenceProperties::new(Arc::clone(&schema)),
            input.boundedness(),
        );
        Ok(Self {
            input,
            keys,
            session,
            aggr_expr,
            filter_expr,
            order_column,
            gap,
            schema,
            props,
        })
    }
}

impl DisplayAs for SessionWindowExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let (_, aggs) = aggregate_display(None, &self.aggr_expr);
        write!(
            f,
            "SessionWindowExec: gap={} ticks, aggr=[{aggs}], emit=on session close{}",
            self.gap,
            watermark_note(&self.input)
        )
    }
}

#[rustfmt::skip::macros(plan_basics)] // its settings stay on a line or two
impl ExecutionPlan for SessionWindowExec {
    plan_basics!("SessionWindowExec", [input], [false], try_new(keys, session, aggr_expr,
        filter_expr, order_column, gap, schema));

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let reservation = MemoryConsumer::new(format!("SessionWindowExec[{partition}]"))
            .register(context.memory_pool());
        let input_schema = self.input.schema();
        let input = self.input.execute(partition, context)?;
        let others: Vec<Arc<dyn PhysicalExpr>> = self
            .keys
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != self.session)
            .map(|(_, e)| Arc::clone(e))
            .collect();
        let key_fields = others
            .iter()
            .enumerate()
            .map(|(i, e)| {
                Ok(Field::new(
                    format!("k{i}"),
                    e.data_type(&input_schema)?,
                    true,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let key_values = if others.is_empty() {
            None
        } else {
            Some(unordered_group_values(Arc::new(Schema::new(key_fields)))?)
        };
        let stream = SessionStream {
            input,
            others,
            key_values,
            keys: Keys::default(),
            literals: Literals::default(),
            key_count: 0,
            open: Vec::new(),
            sessions: Vec::new(),
            ends: BinaryHeap::new(),
            closed: Vec::new(),
            arguments: aggregate_expressions(&self.aggr_expr, &AggregateMode::Single, 0)?,
            filters: self.filter_expr.clone(),
            exprs: self.aggr_expr.clone(),
            accumulators: self
                .aggr_expr
                .iter()
                .map(group_accumulator)
                .collect::<Result<_>>()?,
            session: self.session,
            order_column: self.order_column,
            time_type: input_schema.field(self.order_column).data_type().clone(),
            gap: self.gap,
            // The watermark of what is right below it when it runs (see `watermark_source`).
            upstream: super::rule::watermark_source(&self.input),
            seen_watermark: None,
            key_indices: Vec::new(),
            session_indices: Vec::new(),
            schema: Arc::clone(&self.schema),
            done: false,
            deferred: None,
            reservation,
            share: Share::new(&SESSIONS),
        };
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            Arc::clone(&self.schema),
            stream,
        )))
    }
}

/// One session: its key, its first row's time and its end (last row + gap), in ticks.
#[derive(Clone, Copy)]
struct Session {
    key: u32,
    start: i64,
    end: i64,
}

struct SessionStream {
    input: SendableRecordBatchStream,
    /// The group keys other than the session window, and their group table (None: no other
    /// key, one key for every row).
    others: Vec<Arc<dyn PhysicalExpr>>,
    key_values: Option<Box<dyn GroupValues>>,
    keys: Keys,
    /// `count(*)`'s ones and other literal arguments, made once.
    literals: Literals,
    key_count: usize,
    /// Per key: its open session (an index into `sessions`), if any.
    open: Vec<Option<u32>>,
    /// Every session the accumulators hold (group i is session i), open or closed.
    sessions: Vec<Session>,
    /// (end, session) of the open sessions, soonest first; stale entries are skipped.
    ends: BinaryHeap<Reverse<(i64, u32)>>,
    /// Sessions closed and emitted, still in the accumulators until they are rebuilt.
    closed: Vec<bool>,
    arguments: Vec<Vec<Arc<dyn PhysicalExpr>>>,
    filters: Vec<Option<Arc<dyn PhysicalExpr>>>,
    exprs: Vec<Arc<AggregateFunctionExpr>>,
    accumulators: Vec<Box<dyn GroupsAccumulator>>,
    session: usize,
    order_column: usize,
    time_type: DataType,
    gap: i64,
    upstream: Option<Arc<WatermarkCell>>,
    seen_watermark: Option<ScalarValue>,
    key_indices: Vec<usize>,
    session_indices: Vec<usize>,
    schema: SchemaRef,
    done: bool,
    /// A batch whose first row closed sessions: folded once they have gone out.
    deferred: Option<RecordBatch>,
    reservation: MemoryReservation,
    /// This stream's share of the process's session-window state (pushtable's stats): its
    /// sessions (open, and closed ones not yet rebuilt away) and bytes.
    share: Share,
}

impl SessionStream {
    /// Fold `batch` into the sessions; returns the time its last row reached (ticks).
    fn absorb(&mut self, batch: &RecordBatch) -> Result<Option<i64>> {
        let n = batch.num_rows();
        if n == 0 {
            return Ok(None);
        }
        match &mut self.key_values {
            None => {
                self.key_indices.clear();
                self.key_indices.resize(n, 0);
                self.key_count = 1;
            }
            Some(values) => {
                let cols = self
                    .others
                    .iter()
                    .map(|e| e.evaluate(batch)?.into_array(n))
                    .collect::<Result<Vec<_>>>()?;
                values.intern(&cols, &mut self.key_indices)?;
                let (before, total) = (self.key_count, values.len());
                if total > before {
                    let mut rows = Vec::with_capacity(total - before);
                    let mut next = before;
                    for (row, &k) in self.key_indices.iter().enumerate() {
                        if k == next {
                            rows.push(row as u32);
                            next += 1;
                        }
                    }
                    self.keys.push(&cols, &rows)?;
                    self.key_count = total;
                }
            }
        }
        self.open.resize(self.key_count, None);
        let ticks = cast(batch.column(self.order_column), &DataType::Int64)?;
        let ticks = ticks.as_primitive::<Int64Type>();
        self.session_indices.clear();
        for (row, &t) in ticks.values().iter().enumerate() {
            let key = self.key_indices[row];
            let id = match self.open[key] {
                // Before the session's end: the row joins it and moves its end.
                // Its entry in `ends` keeps the older end: `close` finds it moved on and files
                // it again by its end then (one entry per session, not one per row).
                Some(id) if t < self.sessions[id as usize].end => {
                    let s = &mut self.sessions[id as usize];
                    s.end = s.end.max(t.saturating_add(self.gap));
                    id
                }
                _ => {
                    let id = self.sessions.len() as u32;
                    let end = t.saturating_add(self.gap);
                    self.sessions.push(Session {
                        key: key as u32,
                        start: t,
                        end,
                    });
                    self.closed.push(false);
                    self.open[key] = Some(id);
                    self.ends.push(Reverse((end, id)));
                    id
                }
            };
            self.session_indices.push(id as usize);
        }
        let total = self.sessions.len();
        update_all(
            &mut self.literals,
            &mut self.accumulators,
            &self.arguments,
            &self.filters,
            batch,
            &self.session_indices,
            total,
        )?;
        Ok(Some(ticks.value(n - 1)))
    }

    /// A new watermark from below, in ticks.
    fn watermark(&mut self) -> Result<Option<i64>> {
        let Some(w) = self.upstream.as_ref().and_then(|c| c.get()) else {
            return Ok(None);
        };
        if self.seen_watermark.as_ref() == Some(&w) {
            return Ok(None);
        }
        let ticks = super::spark_windows::Windowing::ticks(&w)?;
        self.seen_watermark = Some(w);
        Ok(Some(ticks))
    }

    /// The sessions that end at or before `time` (every later row comes at or after it), as
    /// one batch; with `time` None, every open session (the end of the stream).
    fn close(&mut self, time: Option<i64>) -> Result<Option<RecordBatch>> {
        let mut done: Vec<u32> = Vec::new();
        while let Some(&Reverse((end, id))) = self.ends.peek() {
            if time.is_some_and(|t| end > t) {
                break;
            }
            self.ends.pop();
            let s = self.sessions[id as usize];
            if self.closed[id as usize] {
                continue;
            }
            if s.end != end {
                self.ends.push(Reverse((s.end, id))); // moved on since this entry: file it again
                continue;
            }
            self.closed[id as usize] = true;
            if self.open[s.key as usize] == Some(id) {
                self.open[s.key as usize] = None;
            }
            done.push(id);
        }
        if done.is_empty() {
            return Ok(None);
        }
        done.sort_unstable_by_key(|&id| (self.sessions[id as usize].start, id));
        let total = self.sessions.len();
        let starts =
            Int64Array::from_iter_values(done.iter().map(|&i| self.sessions[i as usize].start));
        let ends =
            Int64Array::from_iter_values(done.iter().map(|&i| self.sessions[i as usize].end));
        let window = envelope_of(
            &cast(&starts, &self.time_type)?,
            &cast(&ends, &self.time_type)?,
        )?;
        let key_rows: Vec<u32> = done
            .iter()
            .map(|&i| self.sessions[i as usize].key)
            .collect();
        let mut others = match &self.key_values {
            Some(_) => self.keys.rows(&key_rows, self.others.len())?,
            None => Vec::new(),
        };
        let mut columns: Vec<ArrayRef> = Vec::with_capacity(self.schema.fields().len());
        others.reverse();
        for i in 0..self.others.len() + 1 {
            columns.push(match i == self.session {
                true => Arc::clone(&window),
                false => others.pop().expect("one column per other key"),
            });
        }
        for (acc, expr) in self.accumulators.iter_mut().zip(&self.exprs) {
            columns.push(copy_groups(acc, expr, &done, total)?.evaluate(EmitTo::All)?);
        }
        self.rebuild()?;
        Ok(Some(RecordBatch::try_new(
            Arc::clone(&self.schema),
            columns,
        )?))
    }

    /// Once closed sessions outnumber the open ones, keep only the open ones.
    fn rebuild(&mut self) -> Result<()> {
        let closed = self.closed.iter().filter(|c| **c).count();
        let open = self.sessions.len() - closed;
        if closed < 1024 || closed < open {
            return Ok(());
        }
        let keep: Vec<u32> = (0..self.sessions.len() as u32)
            .filter(|&i| !self.closed[i as usize])
            .collect();
        let total = self.sessions.len();
        for (acc, expr) in self.accumulators.iter_mut().zip(&self.exprs) {
            *acc = copy_groups(acc, expr, &keep, total)?;
        }
        let mut renumber = vec![u32::MAX; total];
        for (new, &old) in keep.iter().enumerate() {
            renumber[old as usize] = new as u32;
        }
        self.sessions = keep.iter().map(|&i| self.sessions[i as usize]).collect();
        self.closed = vec![false; keep.len()];
        for slot in self.open.iter_mut() {
            *slot = slot.map(|id| renumber[id as usize]);
        }
        self.ends = self
            .sessions
            .iter()
            .enumerate()
            .map(|(i, s)| Reverse((s.end, i as u32)))
            .collect();
        Ok(())
    }

    fn account(&mut self) -> Result<()> {
        let size = self.key_values.as_ref().map_or(0, |v| v.size())
            + self.keys.size()
            + self.accumulators.iter().map(|a| a.size()).sum::<usize>()
            + self.sessions.capacity() * std::mem::size_of::<Session>()
            + self.ends.capacity() * 16
            + self.open.capacity() * 8;
        self.share.set(self.sessions.len(), size);
        self.reservation.try_resize(size)
    }

    /// The sessions `batch`'s first row closes (the input is ordered: no row from it on can
    /// join them), so that a batch closing a session need not be folded before it leaves.
    fn closed_by_first_row(&mut self, batch: &RecordBatch) -> Result<Option<RecordBatch>> {
        let first = cast(
            &batch.column(self.order_column).slice(0, 1),
            &DataType::Int64,
        )?;
        self.close(Some(first.as_primitive::<Int64Type>().value(0)))
    }

    fn on_batch(&mut self, batch: &RecordBatch) -> Result<Option<RecordBatch>> {
        let by_rows = self.absorb(batch)?;
        self.account()?;
        let time = match (by_rows, self.watermark()?) {
            (Some(a), Some(b)) => a.max(b),
            (Some(a), None) | (None, Some(a)) => a,
            (None, None) => return Ok(None),
        };
        self.close(Some(time))
    }
}

impl Stream for SessionStream {
    type Item = Result<RecordBatch>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            if self.done {
                return Poll::Ready(None);
            }
            if let Some(batch) = self.deferred.take() {
                match self.on_batch(&batch) {
                    Ok(Some(out)) => return Poll::Ready(Some(Ok(out))),
                    Ok(None) => continue,
                    Err(e) => {
                        self.done = true;
                        return Poll::Ready(Some(Err(e)));
                    }
                }
            }
            let result = match futures::ready!(self.input.poll_next_unpin(cx)) {
                // The sessions the batch's first row closes go out before it is folded.
                Some(Ok(batch)) if batch.num_rows() > 0 => match self.closed_by_first_row(&batch) {
                    Ok(Some(out)) => {
                        self.deferred = Some(batch);
                        Ok(Some(out))
                    }
                    Ok(None) => self.on_batch(&batch),
                    Err(e) => Err(e),
                },
                Some(Ok(batch)) => self.on_batch(&batch),
                Some(Err(e)) => Err(e),
                None => {
                    self.done = true;
                    self.close(None)
                }
            };
            match result {
                Ok(Some(batch)) => return Poll::Ready(Some(Ok(batch))),
                Ok(None) => continue,
                Err(e) => {
                    self.done = true;
                    return Poll::Ready(Some(Err(e)));
                }
            }
        }
    }
}
