//! Read-ahead: an operator's live inputs read while it waits on another one of them.
//!
//! DataFusion's `SymmetricHashJoinExec` polls its two inputs in turn and waits on the one it
//! chose; a hash join reads its build side whole before its probe side; `ScalarSubqueryExec`
//! answers its subqueries before it reads its main input. With a producer that writes many
//! batches to one live table before it writes the other, such an operator would wait on the
//! empty table while the full one's producer blocks on its queue, for good.
//!
//! The read-aheads of one operator's inputs form a [`ReadGroup`]. Each passes its input on
//! as its consumer polls; when its input has nothing ready, the operator above is about to
//! wait on it, so it reads every other input of the group that has rows ready into that
//! input's queue (counted in the session's memory pool: past the pool's limit the query
//! fails with DataFusion's "Resources exhausted" naming it). Nothing is read between polls:
//! a paused consumer holds every producer at its table's `capacity`, as a plain scan does,
//! and what a read-ahead holds is only what its operator had to hold while it waited.
//!
//! A watermark travels with the rows (see [`WatermarkCell`]): the value the input's cell
//! holds right after each batch is read is queued with that batch, and handed on to this
//! read-ahead's own cell only when its consumer takes the batch, after every row before it.

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Wake, Waker};

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use datafusion::common::{DataFusionError, Result, ScalarValue};
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryReservation};
use datafusion::execution::{RecordBatchStream, SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, PlanProperties,
};
use futures::{Stream, StreamExt};

use crate::channel::WatermarkCell;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while polling an input leaves the queues whole: recover them.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Reads `input` as its consumer polls it, and while another read-ahead of its group waits
/// (see the module's docs); same output, same order.
pub struct ReadAheadExec {
    input: Arc<dyn ExecutionPlan>,
    group: Arc<ReadGroup>,
    /// Where it hands on the watermark of each batch as its consumer takes it.
    cell: Arc<WatermarkCell>,
    /// Slots of the group, by partition, once started ([`ReadAheadExec::start`]) or
    /// executed: an operator above may execute its input only later (DataFusion's
    /// `ScalarSubqueryExec` runs its subqueries to their end first), and the table's
    /// producer must be read meanwhile. Its input is executed once per partition, however
    /// often `start` is called.
    slots: Mutex<Option<Vec<Option<usize>>>>,
}

impl ReadAheadExec {
    /// A read-ahead of `input` in `group` (the read-aheads of one operator's inputs).
    pub fn new(input: Arc<dyn ExecutionPlan>, group: &Arc<ReadGroup>) -> Self {
        Self::with_cell(input, group, Arc::default())
    }

    fn with_cell(
        input: Arc<dyn ExecutionPlan>,
        group: &Arc<ReadGroup>,
        cell: Arc<WatermarkCell>,
    ) -> Self {
        Self {
            input,
            group: Arc::clone(group),
            cell,
            slots: Mutex::new(None),
        }
    }

    /// The same read-ahead (its group, its cell) over another input: where a rule moves it.
    pub fn over(&self, input: Arc<dyn ExecutionPlan>) -> Self {
        Self::with_cell(input, &self.group, Arc::clone(&self.cell))
    }

    /// What it reads ahead.
    pub fn input(&self) -> &Arc<dyn ExecutionPlan> {
        &self.input
    }

    /// Where it hands on its input's watermarks, each as its consumer reaches it.
    pub fn watermark(&self) -> &Arc<WatermarkCell> {
        &self.cell
    }

    /// Execute every partition of the input now, so that the group reads it from now on;
    /// `execute` then hands each one out. Does nothing once started (or once a partition
    /// was executed): a second reader of the same input would take rows nobody reads.
    pub fn start(&self, context: &Arc<TaskContext>) -> Result<()> {
        let mut slots = lock(&self.slots);
        if slots.is_some() {
            return Ok(());
        }
        let n = self.input.output_partitioning().partition_count();
        let started = (0..n)
            .map(|p| self.join_group(p, context).map(Some))
            .collect::<Result<Vec<_>>>()?;
        *slots = Some(started);
        Ok(())
    }

    /// Partition `partition` of the input as a slot of the group.
    fn join_group(&self, partition: usize, context: &Arc<TaskContext>) -> Result<usize> {
        let input = self.input.execute(partition, Arc::clone(context))?;
        let source = super::rule::watermark_source(&self.input);
        let reservation = MemoryConsumer::new(format!("ReadAheadExec[{partition}]"))
            .register(context.memory_pool());
        let mut state = lock(&self.group.state);
        state.slots.push(Slot {
            input: Some(input),
            queue: VecDeque::new(),
            reservation,
            source,
            cell: Arc::clone(&self.cell),
            context: Arc::clone(context),
        });
        Ok(state.slots.len() - 1)
    }
}

impl fmt::Debug for ReadAheadExec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadAheadExec").finish()
    }
}

impl DisplayAs for ReadAheadExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "ReadAheadExec")
    }
}

impl ExecutionPlan for ReadAheadExec {
    fn name(&self) -> &str {
        "ReadAheadExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.input.properties()
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![true]
    }

    fn with_new_children(
        self: Arc<Self>,
        mut children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        Ok(Arc::new(self.over(children.pop().expect("one child"))))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let started = {
            let mut slots = lock(&self.slots);
            // Executed before any start: a later `start` must not read the input again.
            let n = self.input.output_partitioning().partition_count();
            slots
                .get_or_insert_with(|| (0..n).map(|_| None).collect())
                .get_mut(partition)
                .and_then(Option::take)
        };
        let slot = match started {
            Some(slot) => slot,
            None => self.join_group(partition, &context)?,
        };
        Ok(Box::pin(Member {
            group: Arc::clone(&self.group),
            slot,
            schema: self.input.schema(),
        }))
    }
}

/// The read-aheads of one operator's inputs: each reads the others while it waits.
#[derive(Default)]
pub struct ReadGroup {
    state: Mutex<GroupState>,
    /// The waker every input is polled with: it wakes the consumers that wait.
    wake: Arc<WakeWaiting>,
}

impl ReadGroup {
    pub fn new() -> Arc<Self> {
        Arc::default()
    }
}

impl fmt::Debug for ReadGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadGroup").finish()
    }
}

#[derive(Default)]
struct GroupState {
    slots: Vec<Slot>,
}

/// One partition of one read-ahead: its input (None once it ended, failed or its consumer
/// left) and what was read of it while another slot's consumer waited.
struct Slot {
    input: Option<SendableRecordBatchStream>,
    queue: VecDeque<Queued>,
    reservation: MemoryReservation,
    /// The input's watermark cell, read right after each batch.
    source: Option<Arc<WatermarkCell>>,
    /// The read-ahead's own cell, set as its consumer takes each batch.
    cell: Arc<WatermarkCell>,
    context: Arc<TaskContext>,
}

enum Queued {
    Batch {
        batch: RecordBatch,
        size: usize,
        watermark: Option<ScalarValue>,
    },
    Failed(DataFusionError),
    End,
}

impl Slot {
    /// Poll the input once with the group's waker.
    fn poll_input(&mut self, waker: &Waker) -> Poll<Option<Result<RecordBatch>>> {
        let Some(input) = self.input.as_mut() else {
            return Poll::Ready(None);
        };
        let mut cx = Context::from_waker(waker);
        let polled = input.poll_next_unpin(&mut cx);
        if matches!(polled, Poll::Ready(None) | Poll::Ready(Some(Err(_)))) {
            self.input = None; // the producers learn the reader is gone
        }
        polled
    }

    fn watermark(&self) -> Option<ScalarValue> {
        self.source.as_ref().and_then(|c| c.get())
    }

    /// Queue what the input has ready now (another slot's consumer waits).
    fn read_ready(&mut self, waker: &Waker) {
        while self.input.is_some() {
            let item = match self.poll_input(waker) {
                Poll::Pending => return,
                Poll::Ready(item) => item,
            };
            let queued = match item {
                None => Queued::End,
                Some(Err(e)) => Queued::Failed(self.raise(e)),
                Some(Ok(batch)) => {
                    let size = batch.get_array_memory_size();
                    match self.reservation.try_grow(size) {
                        Ok(()) => Queued::Batch {
                            watermark: self.watermark(),
                            batch,
                            size,
                        },
                        Err(e) => {
                            self.input = None;
                            Queued::Failed(self.raise(DataFusionError::ResourcesExhausted(
                                format!(
                                    "a query over live tables holds the rows of one input \
                                     while it waits on another (a join's build side, the \
                                     side of a time-bounded join that is behind, a scalar \
                                     subquery), and they passed the session's \
                                     memory_limit: {e}"
                                ),
                            )))
                        }
                    }
                }
            };
            self.queue.push_back(queued);
        }
    }

    /// A failure read ahead ends the query at once: the operator above may be waiting on
    /// another input and never ask for this one's error.
    fn raise(&self, e: DataFusionError) -> DataFusionError {
        super::abort::raise(&self.context, e)
    }

    /// The next queued item as the consumer takes it (its watermark handed on).
    fn take(&mut self) -> Option<Option<Result<RecordBatch>>> {
        Some(match self.queue.pop_front()? {
            Queued::Batch {
                batch,
                size,
                watermark,
            } => {
                self.reservation.shrink(size);
                if let Some(w) = watermark {
                    self.cell.set(w);
                }
                Some(Ok(batch))
            }
            Queued::Failed(e) => Some(Err(e)),
            Queued::End => None,
        })
    }
}

/// The consumers waiting on a group's read-aheads, woken when any input has news.
#[derive(Default)]
struct WakeWaiting(Mutex<Vec<(usize, Waker)>>);

impl WakeWaiting {
    fn register(&self, slot: usize, waker: &Waker) {
        let mut waiting = lock(&self.0);
        match waiting.iter_mut().find(|(s, _)| *s == slot) {
            Some((_, w)) if !w.will_wake(waker) => *w = waker.clone(),
            Some(_) => {}
            None => waiting.push((slot, waker.clone())),
        }
    }

    fn unregister(&self, slot: usize) {
        lock(&self.0).retain(|(s, _)| *s != slot);
    }
}

impl Wake for WakeWaiting {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let waiting = std::mem::take(&mut *lock(&self.0));
        for (_, waker) in waiting {
            waker.wake();
        }
    }
}

/// One read-ahead partition's output stream.
struct Member {
    group: Arc<ReadGroup>,
    slot: usize,
    schema: SchemaRef,
}

impl Stream for Member {
    type Item = Result<RecordBatch>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let me = self.slot;
        let mut state = lock(&self.group.state);
        if let Some(item) = state.slots[me].take() {
            return Poll::Ready(item);
        }
        // Registered before any input is polled: news from one polled below reaches it.
        let wake = &self.group.wake;
        wake.register(me, cx.waker());
        let waker = Waker::from(Arc::clone(wake));
        let slot = &mut state.slots[me];
        if let Poll::Ready(item) = slot.poll_input(&waker) {
            wake.unregister(me);
            return Poll::Ready(item.map(|item| {
                item.inspect(|_| {
                    if let Some(w) = slot.watermark() {
                        slot.cell.set(w);
                    }
                })
            }));
        }
        // The operator above waits on this input: read the others meanwhile.
        for (i, other) in state.slots.iter_mut().enumerate() {
            if i != me {
                other.read_ready(&waker);
            }
        }
        Poll::Pending
    }
}

impl RecordBatchStream for Member {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.schema)
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        // The consumer left: the input goes (its producers see it), and what it held.
        let mut state = lock(&self.group.state);
        let slot = &mut state.slots[self.slot];
        let input = slot.input.take();
        slot.queue.clear();
        slot.reservation.free();
        drop(state);
        drop(input);
        self.group.wake.unregister(self.slot);
    }
}
