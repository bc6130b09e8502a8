//! The bounded channel between producers and the one scan that reads a table.
//!
//! Producers block on a condition variable (outside any async runtime, GIL released by
//! the caller); the reader is a `Stream` polled by DataFusion that parks its `Waker` in
//! the shared state. One mutex guards everything, so every state change (push, pop,
//! close, fail, reader gone) is seen atomically by both sides and wakes the other side.
//!
//! Failure is a *sideband* slot, not an in-band item: `fail()` never waits for room.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use datafusion_common::{DataFusionError, Result as DFResult};
use datafusion_execution::RecordBatchStream;
use futures::Stream;

/// How often a blocked producer wakes to let its caller react (Ctrl-C) even without a state change.
const TICK: Duration = Duration::from_millis(50);

/// Why a push did not enqueue its batch.
#[derive(Debug)]
pub enum PushError<E> {
    Closed,
    Failed(String),
    ReaderGone(&'static str),
    Timeout(Duration),
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
    pub blocked: Duration,
    pub closed: bool,
    pub failed: bool,
    pub reader_gone: bool,
}

#[derive(Debug)]
struct State {
    queue: VecDeque<(RecordBatch, usize)>,
    queued_bytes: usize,
    closed: bool,
    failure: Option<String>,
    failure_delivered: bool,
    reader: ReaderState,
    waker: Option<Waker>,
    stats: Stats,
}

/// Shared state of one streaming table: the queue, its limits and its lifecycle flags.
#[derive(Debug)]
pub struct Channel {
    pub name: String,
    pub schema: SchemaRef,
    capacity: usize,
    max_bytes: Option<usize>,
    state: Mutex<State>,
    room: Condvar,
}

impl Channel {
    pub fn new(name: String, schema: SchemaRef, capacity: usize, max_bytes: Option<usize>) -> Arc<Self> {
        Arc::new(Self {
            name,
            schema,
            capacity,
            max_bytes,
            state: Mutex::new(State {
                queue: VecDeque::with_capacity(capacity.min(1024)),
                queued_bytes: 0,
                closed: false,
                failure: None,
                failure_delivered: false,
                reader: ReaderState::Unclaimed,
                waker: None,
                stats: Stats::default(),
            }),
            room: Condvar::new(),
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

    /// Enqueue `batch`, blocking while the queue is full until `deadline`.
    ///
    /// `tick` runs every [`TICK`] while blocked, *without* the lock held; an `Err` from
    /// it abandons the write (the batch is not enqueued).
    pub fn push<E>(
        &self,
        batch: RecordBatch,
        deadline: Option<Instant>,
        mut tick: impl FnMut() -> Result<(), E>,
    ) -> Result<(), PushError<E>> {
        let bytes = batch.get_array_memory_size();
        let mut blocked_since: Option<Instant> = None;
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
            if self.has_room(&st, bytes) {
                st.queued_bytes += bytes;
                st.stats.rows += batch.num_rows() as u64;
                st.stats.batches += 1;
                st.stats.bytes += bytes as u64;
                st.queue.push_back((batch, bytes));
                break Ok(st.waker.take());
            }
            let now = Instant::now();
            let since = *blocked_since.get_or_insert(now);
            let mut wait = TICK;
            if let Some(deadline) = deadline {
                if now >= deadline {
                    break Err(PushError::Timeout(now - since));
                }
                wait = wait.min(deadline - now);
            }
            let (guard, timed_out) = self
                .room
                .wait_timeout(st, wait)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            st = guard;
            if timed_out.timed_out() {
                drop(st);
                let ticked = tick();
                st = self.lock();
                if let Err(e) = ticked {
                    break Err(PushError::Interrupted(e));
                }
            }
        };
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
        if let Some(waker) = st.waker.take() {
            waker.wake();
        }
        drop(st);
        self.room.notify_all();
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
        if let Some(waker) = st.waker.take() {
            waker.wake();
        }
        drop(st);
        self.room.notify_all();
        true
    }

    pub fn stats(&self) -> Stats {
        let st = self.lock();
        Stats {
            queued_batches: st.queue.len(),
            queued_bytes: st.queued_bytes,
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
            st.waker = None;
        }
        st.reader = state;
        drop(st);
        self.room.notify_all();
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

    /// Turn the claim into the stream a scan polls.
    pub fn into_stream(mut self) -> ReaderStream {
        self.started = true;
        self.channel.set_reader(ReaderState::Reading);
        ReaderStream { reader: self, done: false }
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

/// The record-batch stream handed to DataFusion for the table's single scan.
#[derive(Debug)]
pub struct ReaderStream {
    reader: Reader,
    done: bool,
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
            drop(st);
            channel.room.notify_all();
            return Poll::Ready(Some(Ok(batch)));
        }
        if st.closed {
            drop(st);
            self.done = true;
            return Poll::Ready(None);
        }
        match &st.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => st.waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

impl RecordBatchStream for ReaderStream {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.reader.channel.schema)
    }
}
