//! Read-ahead: an operator's live inputs read while it waits on another one of them.
//!
//! DataFusion's `SymmetricHashJoinExec` polls its two inputs in turn and waits on the one it
//! chose; a hash join reads its build side whole before its probe side; `ScalarSubqueryExec`
//! answers its subqueries before it reads its main input. With a producer that writes many
//! batches to one live table before it writes the other, such an operator would wait on the
//! empty table while the full one's producer blocks on its queue, for good.
//!
//! The read-aheads of one plan form a [`ReadGroup`]. Each passes its input on
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
    /// A read-ahead of `input` in `group` (the rules join every read-ahead of a plan in one group at the end).
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

    /// The same read-ahead (its input, its cell) in `group`.
    pub fn in_group(&self, group: &Arc<ReadGroup>) -> Self {
        Self::with_cell(Arc::clone(&self.input), group, Arc::clone(&self.cell))
    }

    /// The group it reads in.
    pub fn group(&self) -> &Arc<ReadGroup> {
        &self.group
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
            input: Input::Open(input),
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

/// The read-aheads of one query: each reads the others while it waits (one group for the
/// whole plan, so that an operator waiting on a join below it still has every other live
/// input read: a join of a join, a scalar subquery over a join).
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

    /// Let go of every input of the group and what it holds (the query ended or failed):
    /// their producers see their reader gone. A read-ahead started but never executed (its
    /// operator failed or ended first) holds an input that may hold another read-ahead of
    /// this group: only this frees it.
    pub fn close(&self) {
        let inputs: Vec<Input> = {
            let mut state = lock(&self.state);
            state
                .slots
                .iter_mut()
                .map(|slot| {
                    slot.queue.clear();
                    slot.reservation.free();
                    std::mem::replace(&mut slot.input, Input::Gone)
                })
                .collect()
        };
        drop(inputs); // the lock released: an input's read-aheads lock it as they go
    }

    /// Poll slot `i`'s input once, the lock released meanwhile (an input may hold another
    /// read-ahead of the group below it). `Busy` while another poll of it runs.
    fn poll_slot(&self, i: usize, waker: &Waker) -> Polled {
        let mut input = {
            let mut state = lock(&self.state);
            match std::mem::replace(&mut state.slots[i].input, Input::Busy) {
                Input::Open(stream) => stream,
                other => {
                    let ended = matches!(other, Input::Ended | Input::Gone);
                    state.slots[i].input = other;
                    return if ended { Polled::Ended } else { Polled::Busy };
                }
            }
        };
        let polled = input.poll_next_unpin(&mut Context::from_waker(waker));
        let mut state = lock(&self.state);
        let slot = &mut state.slots[i];
        let over = matches!(polled, Poll::Ready(None) | Poll::Ready(Some(Err(_))));
        let gone = matches!(slot.input, Input::Gone); // its consumer left meanwhile
        let watermark = slot.watermark();
        if over || gone {
            if !gone {
                slot.input = Input::Ended;
            }
            drop(state);
            drop(input); // the producers learn the reader is gone
        } else {
            slot.input = Input::Open(input);
        }
        match polled {
            Poll::Pending => Polled::Pending,
            Poll::Ready(item) => Polled::Item(item, watermark),
        }
    }

    /// Queue what slot `i`'s input has ready now (another slot's consumer waits); whether
    /// anything was queued.
    fn read_ready(&self, i: usize, waker: &Waker) -> bool {
        let mut queued = false;
        loop {
            let (item, watermark) = match self.poll_slot(i, waker) {
                Polled::Item(item, watermark) => (item, watermark),
                Polled::Pending | Polled::Busy | Polled::Ended => return queued,
            };
            let mut state = lock(&self.state);
            let slot = &mut state.slots[i];
            if matches!(slot.input, Input::Gone) {
                return queued;
            }
            let entry = match item {
                None => Queued::End,
                Some(Err(e)) => Queued::Failed(slot.raise(e)),
                Some(Ok(batch)) => {
                    let size = batch.get_array_memory_size();
                    match slot.reservation.try_grow(size) {
                        Ok(()) => Queued::Batch {
                            batch,
                            size,
                            watermark,
                        },
                        Err(e) => {
                            let input = std::mem::replace(&mut slot.input, Input::Ended);
                            let failed = Queued::Failed(slot.raise(
                                DataFusionError::ResourcesExhausted(format!(
                                    "a query over live tables holds the rows of one input \
                                     while it waits on another (a join's build side, the \
                                     side of a time-bounded join that is behind, a scalar \
                                     subquery), and they passed the session's \
                                     memory_limit: {e}"
                                )),
                            ));
                            slot.queue.push_back(failed);
                            drop(state);
                            drop(input);
                            return true;
                        }
                    }
                }
            };
            let end = !matches!(entry, Queued::Batch { .. });
            slot.queue.push_back(entry);
            queued = true;
            if end {
                return queued;
            }
        }
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

/// A slot's input: open, being polled (the lock released meanwhile), ended (or failed), or
/// let go by its consumer.
enum Input {
    Open(SendableRecordBatchStream),
    Busy,
    Ended,
    Gone,
}

enum Polled {
    Item(Option<Result<RecordBatch>>, Option<ScalarValue>),
    Pending,
    Busy,
    Ended,
}

/// One partition of one read-ahead: its input and what was read of it while another slot's
/// consumer waited.
struct Slot {
    input: Input,
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
    fn watermark(&self) -> Option<ScalarValue> {
        self.source.as_ref().and_then(|c| c.get())
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
        let group = &self.group;
        // Registered before any input is polled: news from one polled below reaches it.
        group.wake.register(me, cx.waker());
        if let Some(item) = lock(&group.state).slots[me].take() {
            group.wake.unregister(me);
            return Poll::Ready(item);
        }
        let waker = Waker::from(Arc::clone(&group.wake));
        match group.poll_slot(me, &waker) {
            Polled::Item(item, watermark) => {
                group.wake.unregister(me);
                if let (Some(Ok(_)), Some(w)) = (&item, watermark) {
                    lock(&group.state).slots[me].cell.set(w);
                }
                return Poll::Ready(item);
            }
            Polled::Ended => {
                group.wake.unregister(me);
                return Poll::Ready(None);
            }
            // Busy: another consumer reads it into this queue, and wakes this one after.
            Polled::Pending | Polled::Busy => {}
        }
        // The operator above waits on this input: read the others meanwhile.
        let slots = lock(&group.state).slots.len();
        let mut queued = false;
        for i in (0..slots).filter(|&i| i != me) {
            queued |= group.read_ready(i, &waker);
        }
        if queued {
            // Their consumers may be waiting on what was just queued (or on this poll).
            group.wake.wake_by_ref();
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
        // The consumer left: the input goes (its producers see it), and what it held. Being
        // polled by another consumer, that poll lets it go.
        let mut state = lock(&self.group.state);
        let slot = &mut state.slots[self.slot];
        let input = std::mem::replace(&mut slot.input, Input::Gone);
        slot.queue.clear();
        slot.reservation.free();
        drop(state);
        drop(input);
        self.group.wake.unregister(self.slot);
    }
}
