//! The bounded channel between producers and the one scan that reads a table.
//!
//! Producers block on a condition variable (outside any async runtime, GIL released by
//! the caller); the reader is a `Stream` polled by DataFusion that parks its `Waker` in
//! the shared state. One mutex guards everything, so every state change (push, pop,
//! close, fail, reader gone, cancel) is seen atomically by both sides and wakes the other.
//!
//! Blocked producers wait in FIFO order, each on its own condition variable: a pop wakes
//! only the producer at the head of the line (no thundering herd), and a later arrival
//! never overtakes an earlier one.
//!
//! Failure is a *sideband* slot, not an in-band item: `fail()` never waits for room.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use arrow::array::{Array, RecordBatch};
use arrow::datatypes::SchemaRef;
use datafusion_common::{DataFusionError, Result as DFResult};
use datafusion_execution::RecordBatchStream;
use futures::Stream;

use crate::order::{Newest, OrderGate};

/// How often a blocked *interruptible* producer (Python's main thread) checks for Ctrl-C.
const TICK: Duration = Duration::from_millis(50);

/// Set when the interpreter is finalizing: a producer woken after that never returns to
/// Python (re-attaching a thread to a finalizing interpreter is undefined behaviour).
static FINALIZING: AtomicBool = AtomicBool::new(false);

/// Mark the interpreter as finalizing (called from an `atexit` hook).
pub fn set_finalizing() {
    FINALIZING.store(true, Ordering::SeqCst);
}

/// Why a push did not enqueue its batch.
#[derive(Debug)]
pub enum PushError<E> {
    Closed,
    Failed(String),
    ReaderGone(&'static str),
    Timeout(Duration),
    /// The request's [`CancelToken`] was cancelled.
    Cancelled,
    /// The batch breaks the table's declared ordering (the message says how).
    Order(String),
    /// The caller's tick callback asked to stop (e.g. a pending KeyboardInterrupt).
    Interrupted(E),
}

/// Where the table's single reader is in its life.
#[derive(Debug, Clone, Copy, PartialEq)]
enum ReaderState {
    Unclaimed,
    Reading,
    Gone(&'static str),
}

/// Counters reported by `sink.stats`.
#[derive(Debug, Default, Clone, Copy)]
pub struct Stats {
    pub rows: u64,
    pub batches: u64,
    pub bytes: u64,
    pub queued_batches: usize,
    pub queued_bytes: usize,
    pub waiting_writers: usize,
    pub late_rows: u64,
    pub blocked: Duration,
    pub closed: bool,
    pub failed: bool,
    pub reader_gone: bool,
}

/// One blocked producer's place in line.
#[derive(Debug, Default)]
struct Waiter {
    wake: Condvar,
}

#[derive(Debug)]
struct State {
    queue: VecDeque<(RecordBatch, usize)>,
    queued_bytes: usize,
    closed: bool,
    failure: Option<String>,
    failure_delivered: bool,
    reader: ReaderState,
    /// The scan's idle partitions (one waker each; a table's scan may read with several).
    wakers: Vec<Waker>,
    waiters: VecDeque<Arc<Waiter>>,
    newest: Option<Newest>,
    stats: Stats,
}

impl State {
    fn wake_all_waiters(&self) {
        for w in &self.waiters {
            w.wake.notify_one();
        }
    }

    fn leave_line(&mut self, me: &Arc<Waiter>) {
        if let Some(pos) = self.waiters.iter().position(|w| Arc::ptr_eq(w, me)) {
            self.waiters.remove(pos);
        }
    }
}

/// A cancellable write request (an `awrite` call): cancelling it, under the channel lock,
/// guarantees that none of its batches not yet enqueued will be.
#[derive(Debug)]
pub struct CancelToken {
    channel: Arc<Channel>,
    cancelled: AtomicBool,
    written: std::sync::atomic::AtomicUsize,
}

impl CancelToken {
    pub fn new(channel: Arc<Channel>) -> Self {
        Self { channel, cancelled: AtomicBool::new(false), written: Default::default() }
    }

    /// Cancel the request; returns how many of its batches were enqueued before that.
    pub fn cancel(&self) -> usize {
        let st = self.channel.lock();
        self.cancelled.store(true, Ordering::SeqCst);
        st.wake_all_waiters();
        self.written.load(Ordering::SeqCst)
    }

    pub fn written(&self) -> usize {
        self.written.load(Ordering::SeqCst)
    }
}

/// Bytes a batch holds *as a slice*: a 1,000-row slice of a 1,000,000-row column counts
/// its 1,000 rows, not the parent buffer (`get_array_memory_size` would).
pub fn batch_bytes(batch: &RecordBatch) -> usize {
    batch
        .columns()
        .iter()
        .map(|c| {
            let data = c.to_data();
            data.get_slice_memory_size().unwrap_or_else(|_| c.get_array_memory_size())
        })
        .sum()
}

/// Shared state of one streaming table: the queue, its limits and its lifecycle flags.
#[derive(Debug)]
pub struct Channel {
    pub name: String,
    pub schema: SchemaRef,
    capacity: usize,
    max_bytes: Option<usize>,
    order: Option<OrderGate>,
    state: Mutex<State>,
}

impl Channel {
    pub fn new(
        name: String,
        schema: SchemaRef,
        capacity: usize,
        max_bytes: Option<usize>,
        order: Option<OrderGate>,
    ) -> Arc<Self> {
        Arc::new(Self {
            name,
            schema,
            capacity,
            max_bytes,
            order,
            state: Mutex::new(State {
                queue: VecDeque::with_capacity(capacity.min(1024)),
                queued_bytes: 0,
                closed: false,
                failure: None,
                failure_delivered: false,
                reader: ReaderState::Unclaimed,
                wakers: Vec::new(),
                waiters: VecDeque::new(),
                newest: None,
                stats: Stats::default(),
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the queue half-updated (every
        // mutation is a single push/pop), so a poisoned lock is still safe to use.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn has_room(&self, st: &State, bytes: usize) -> bool {
        if st.queue.len() >= self.capacity {
            return false;
        }
        match self.max_bytes {
            // An empty queue always admits one batch, or a batch larger than the
            // budget could never be written.
            Some(max) => st.queue.is_empty() || st.queued_bytes + bytes <= max,
            None => true,
        }
    }

    /// Wake the producer at the head of the line (after a pop, or when the head left).
    fn wake_head(st: &State) {
        if let Some(head) = st.waiters.front() {
            head.wake.notify_one();
        }
    }

    /// Enqueue `batch`, blocking while the queue is full until `deadline` (None: no limit).
    ///
    /// Producers are served in arrival order. With `tick` (Python's main thread), the
    /// caller's callback runs at least every [`TICK`] while blocked, *without* the lock
    /// held, however often the producer is woken; an `Err` from it abandons the write.
    /// Without `tick` the producer sleeps until a state change or its deadline.
    pub fn push<E>(
        &self,
        batch: RecordBatch,
        deadline: Option<Instant>,
        token: Option<&CancelToken>,
        mut tick: Option<&mut dyn FnMut() -> Result<(), E>>,
    ) -> Result<(), PushError<E>> {
        // The ordering is checked within the batch before the lock, and against the newest
        // value written when the batch is admitted, under it.
        let (mut unordered, mut checked) = match &self.order {
            Some(gate) => (None, Some(gate.check(batch).map_err(PushError::Order)?)),
            None => (Some(batch), None),
        };
        let mut bytes = match (&unordered, &checked) {
            (Some(b), _) => batch_bytes(b),
            (None, Some(c)) => batch_bytes(c.batch()),
            (None, None) => 0,
        };
        let mut blocked_since: Option<Instant> = None;
        let mut me: Option<Arc<Waiter>> = None;
        let mut next_tick = Instant::now() + TICK;
        let mut st = self.lock();
        let outcome = loop {
            if let Some(msg) = &st.failure {
                break Err(PushError::Failed(msg.clone()));
            }
            if st.closed {
                break Err(PushError::Closed);
            }
            if let ReaderState::Gone(why) = st.reader {
                break Err(PushError::ReaderGone(why));
            }
            if token.is_some_and(|t| t.cancelled.load(Ordering::SeqCst)) {
                break Err(PushError::Cancelled);
            }
            let my_turn = match (&me, st.waiters.front()) {
                (_, None) => true,
                (Some(me), Some(head)) => Arc::ptr_eq(me, head),
                (None, Some(_)) => false,
            };
            if my_turn && self.has_room(&st, bytes) {
                let batch = match (unordered.take(), &self.order, checked.take()) {
                    (Some(batch), _, _) => batch,
                    (None, Some(gate), Some(c)) => {
                        let late_in_batch = c.dropped;
                        let offered = c.batch().num_rows() + late_in_batch;
                        match gate.admit(c, &mut st.newest) {
                            Ok((admitted, late)) => {
                                st.stats.late_rows += (late_in_batch + late) as u64;
                                if late > 0 {
                                    bytes = batch_bytes(&admitted);
                                }
                                if admitted.num_rows() == 0 && offered > 0 {
                                    break Ok(None); // every row was late: nothing to enqueue
                                }
                                admitted
                            }
                            Err(msg) => break Err(PushError::Order(msg)),
                        }
                    }
                    _ => unreachable!("a batch is either unordered or checked"),
                };
                st.queued_bytes += bytes;
                st.stats.rows += batch.num_rows() as u64;
                st.stats.batches += 1;
                st.stats.bytes += bytes as u64;
                st.queue.push_back((batch, bytes));
                if let Some(t) = token {
                    t.written.fetch_add(1, Ordering::SeqCst);
                }
                // One idle partition is enough to take the batch.
                break Ok(st.wakers.pop());
            }
            let now = Instant::now();
            let since = *blocked_since.get_or_insert(now);
            let waiter = Arc::clone(me.get_or_insert_with(|| {
                let w = Arc::new(Waiter::default());
                st.waiters.push_back(Arc::clone(&w));
                w
            }));
            let mut wait: Option<Duration> = None;
            if let Some(deadline) = deadline {
                if now >= deadline {
                    break Err(PushError::Timeout(now - since));
                }
                wait = Some(deadline - now);
            }
            if tick.is_some() {
                if now >= next_tick {
                    drop(st);
                    let ticked = tick.as_mut().map_or(Ok(()), |f| f());
                    st = self.lock();
                    next_tick = Instant::now() + TICK;
                    if let Err(e) = ticked {
                        break Err(PushError::Interrupted(e));
                    }
                    continue;
                }
                let until_tick = next_tick - now;
                wait = Some(wait.map_or(until_tick, |w| w.min(until_tick)));
            }
            st = match wait {
                Some(d) => waiter.wake.wait_timeout(st, d).unwrap_or_else(|p| p.into_inner()).0,
                None => waiter.wake.wait(st).unwrap_or_else(|p| p.into_inner()),
            };
            if FINALIZING.load(Ordering::SeqCst) && tick.is_none() {
                // A daemon producer woken while the interpreter finalizes must not go back
                // to Python: park it for good; the process is about to exit.
                drop(st);
                loop {
                    std::thread::park();
                }
            }
        };
        if let Some(me) = &me {
            st.leave_line(me);
            // Whoever is at the head now may have room (we took none, or left some).
            if self.has_room(&st, 0) {
                Self::wake_head(&st);
            }
        }
        if let Some(since) = blocked_since {
            st.stats.blocked += since.elapsed();
        }
        drop(st);
        // Wake the scan after releasing the lock, so the woken task does not queue up on it.
        outcome.map(|waker| waker.map_or((), Waker::wake))
    }

    /// End of stream: queued batches stay readable, blocked and later writes fail.
    pub fn close(&self) {
        let mut st = self.lock();
        st.closed = true;
        let wakers = std::mem::take(&mut st.wakers);
        st.wake_all_waiters();
        drop(st);
        wakers.into_iter().for_each(Waker::wake);
    }

    /// Record a failure for the reader. Never blocks. Returns false when it came too late
    /// to matter (the reader already finished or is gone) or a failure was already set.
    pub fn fail(&self, message: String) -> bool {
        let mut st = self.lock();
        let finished = matches!(st.reader, ReaderState::Gone(_));
        if finished || st.failure.is_some() {
            return false;
        }
        st.failure = Some(message);
        st.closed = true;
        st.queue.clear();
        st.queued_bytes = 0;
        let wakers = std::mem::take(&mut st.wakers);
        st.wake_all_waiters();
        drop(st);
        wakers.into_iter().for_each(Waker::wake);
        true
    }

    pub fn stats(&self) -> Stats {
        let st = self.lock();
        Stats {
            queued_batches: st.queue.len(),
            queued_bytes: st.queued_bytes,
            waiting_writers: st.waiters.len(),
            closed: st.closed,
            failed: st.failure.is_some(),
            reader_gone: matches!(st.reader, ReaderState::Gone(_)),
            ..st.stats
        }
    }

    fn set_reader(&self, state: ReaderState) {
        let mut st = self.lock();
        if let ReaderState::Gone(_) = state {
            st.queue.clear();
            st.queued_bytes = 0;
            st.wakers.clear();
        }
        st.reader = state;
        st.wake_all_waiters();
    }
}

/// The right to read a channel. Exactly one exists per table; dropping it (unscanned, or
/// after the scan ends early) releases every blocked producer with "reader gone".
#[derive(Debug)]
pub struct Reader {
    channel: Arc<Channel>,
    started: bool,
}

impl Reader {
    pub fn new(channel: Arc<Channel>) -> Self {
        Self { channel, started: false }
    }

    /// Start reading: the returned claim is shared by the scan's partition streams, and the
    /// reader is gone when the last of them is dropped.
    pub fn start(mut self) -> Arc<Reader> {
        self.started = true;
        self.channel.set_reader(ReaderState::Reading);
        Arc::new(self)
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        let why = if self.started {
            "the query reading it stopped before the end of the stream (LIMIT reached, stream dropped or the query failed)"
        } else {
            "the table was dropped before any query scanned it"
        };
        self.channel.set_reader(ReaderState::Gone(why));
    }
}

/// One partition of the scan: a record-batch stream over the shared queue. Several may read
/// one channel concurrently (each batch goes to exactly one of them).
#[derive(Debug)]
pub struct ReaderStream {
    reader: Arc<Reader>,
    done: bool,
}

impl ReaderStream {
    pub fn new(reader: Arc<Reader>) -> Self {
        Self { reader, done: false }
    }
}

impl Stream for ReaderStream {
    type Item = DFResult<RecordBatch>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        let channel = Arc::clone(&self.reader.channel);
        let mut st = channel.lock();
        if let Some(msg) = &st.failure {
            if st.failure_delivered {
                return Poll::Ready(None);
            }
            let err = DataFusionError::Execution(format!(
                "pushtable: the producer of streaming table '{}' failed: {msg}",
                channel.name
            ));
            st.failure_delivered = true;
            drop(st);
            self.done = true;
            return Poll::Ready(Some(Err(err)));
        }
        if let Some((batch, bytes)) = st.queue.pop_front() {
            st.queued_bytes -= bytes;
            let head = st.waiters.front().cloned();
            drop(st);
            // Only the producer at the head of the line can use the room (FIFO).
            if let Some(head) = head {
                head.wake.notify_one();
            }
            return Poll::Ready(Some(Ok(batch)));
        }
        if st.closed {
            drop(st);
            self.done = true;
            return Poll::Ready(None);
        }
        if !st.wakers.iter().any(|w| w.will_wake(cx.waker())) {
            st.wakers.push(cx.waker().clone());
        }
        Poll::Pending
    }
}

impl RecordBatchStream for ReaderStream {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.reader.channel.schema)
    }
}
