//! The log between producers and the scans that read it.
//!
//! A channel is an append-only log of batches read through *cursors*, one per reader. A
//! streaming table has exactly one cursor (its single scan); a topic has one per
//! subscription, added at any time. Each batch is stored once and shared (an `Arc`'d
//! `RecordBatch`): a cursor's backlog is the log from its position to the end, so memory
//! grows with queued (and retained) batches, never with the number of readers. The log
//! is trimmed below the slowest cursor and the topic's retention window.
//!
//! Producers block on a condition variable (outside any async runtime, GIL released by the
//! caller) while some cursor's backlog is at its capacity; a cursor that may be detached
//! (`OnSlow::Detach`) is cut loose instead once a write has waited its timeout for it. A
//! reader is a `Stream` polled by DataFusion that parks its `Waker` in its cursor. One
//! mutex guards everything, so every state change (append, read, close, fail, reader gone,
//! cancel) is seen atomically by both sides and wakes the other.
//!
//! Blocked producers wait in FIFO order, each on its own condition variable: a read wakes
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
use arrow::datatypes::{DataType, SchemaRef};
use arrow::error::ArrowError;
use datafusion_common::{DataFusionError, Result as DFResult, ScalarValue};
use datafusion_execution::RecordBatchStream;
use futures::Stream;

use crate::order::{Newest, OrderGate};
use crate::reorder::{Held, Reorder};
use crate::schema;

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

/// What a full cursor does to producers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OnSlow {
    /// Producers wait for it (the slowest reader paces them).
    Block,
    /// A write waits at most this long for it; then the cursor is detached and its reader
    /// fails with "fell behind".
    Detach(Duration),
}

/// How much one reader may have queued, and what happens when it is full.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub capacity: usize,
    pub max_bytes: Option<usize>,
    pub on_slow: OnSlow,
}

/// What a topic keeps for subscribers that start at the earliest batch (or subscribe after
/// `close()`), beyond what its cursors still have to read.
#[derive(Debug, Clone, Copy, Default)]
pub struct Retention {
    pub batches: Option<usize>,
    pub bytes: Option<usize>,
}

/// Where a new subscription starts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Start {
    /// With the next batch written.
    Now,
    /// With the oldest batch the retention window still holds.
    Earliest,
}

/// Where a reader is in its life.
#[derive(Debug, Clone, PartialEq)]
enum ReaderState {
    Unclaimed,
    Reading,
    /// Detached for falling behind; the message is its reader's error.
    Behind(String),
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
    /// Rows (and bytes) a bounded-disorder table holds until the watermark passes them.
    pub held_rows: usize,
    pub held_bytes: usize,
    pub blocked: Duration,
    pub closed: bool,
    pub failed: bool,
    pub reader_gone: bool,
    pub subscribers: usize,
    pub detached: u64,
}

/// One reader's counters (a topic subscription's `stats`).
#[derive(Debug, Default, Clone)]
pub struct CursorStats {
    pub queued_batches: usize,
    pub queued_bytes: usize,
    pub read_batches: u64,
    pub state: &'static str,
    pub detached_because: Option<String>,
}

/// One blocked producer's place in line.
#[derive(Debug, Default)]
struct Waiter {
    wake: Condvar,
}

/// A batch in the log; `before` counts the bytes admitted before it (O(1) backlogs).
#[derive(Debug)]
struct Entry {
    batch: RecordBatch,
    before: u64,
}

/// One reader's position in the log.
#[derive(Debug)]
struct Cursor {
    id: u64,
    next: u64,
    limits: Limits,
    state: ReaderState,
    /// The scan's idle partitions (one waker each; a table's scan may read with several).
    wakers: Vec<Waker>,
    /// The end-of-stream error (failure or detachment) was handed to a partition.
    error_delivered: bool,
    /// Since when a producer has been waiting for this cursor without it reading.
    full_since: Option<Instant>,
    read_batches: u64,
    /// The newest watermark this cursor's reader was handed.
    watermark_delivered: Option<i64>,
}

#[derive(Debug)]
struct State {
    log: VecDeque<Entry>,
    /// Sequence number of `log[0]`.
    first: u64,
    /// Bytes admitted so far (the `before` of the next entry).
    admitted: u64,
    cursors: Vec<Cursor>,
    next_cursor: u64,
    closed: bool,
    failure: Option<String>,
    /// A table's reader went away (the table is exclusive to it): producers fail.
    gone: Option<&'static str>,
    waiters: VecDeque<Arc<Waiter>>,
    newest: Option<Newest>,
    /// The latest watermark (`advance`): its value, and the log position it follows.
    watermark: Option<(i64, u64)>,
    /// Arrival time (µs) never goes back: every stamp and clock watermark is at least this.
    clock: i64,
    /// Rows of a bounded-disorder table waiting for the watermark.
    held: Held,
    stats: Stats,
}

impl State {
    /// The arrival clock now: never behind an earlier stamp or clock watermark.
    fn tick_clock(&mut self) -> i64 {
        self.clock = self.clock.max(crate::clock::now_micros());
        self.clock
    }
}

impl State {
    fn end(&self) -> u64 {
        self.first + self.log.len() as u64
    }

    /// Bytes admitted before sequence number `seq` (which must still be in the log, or its end).
    fn before(&self, seq: u64) -> u64 {
        match self.log.get((seq - self.first) as usize) {
            Some(e) => e.before,
            None => self.admitted,
        }
    }

    /// What `cursor` has still to read: (batches, bytes).
    fn backlog(&self, c: &Cursor) -> (usize, usize) {
        (
            (self.end() - c.next) as usize,
            (self.admitted - self.before(c.next)) as usize,
        )
    }

    fn cursor(&mut self, id: u64) -> Option<&mut Cursor> {
        self.cursors.iter_mut().find(|c| c.id == id)
    }

    fn wake_all_waiters(&self) {
        for w in &self.waiters {
            w.wake.notify_one();
        }
    }

    /// Wake the producer at the head of the line (after a read, or when the head left).
    fn wake_head(&self) {
        if let Some(head) = self.waiters.front() {
            head.wake.notify_one();
        }
    }

    fn leave_line(&mut self, me: &Arc<Waiter>) {
        if let Some(pos) = self.waiters.iter().position(|w| Arc::ptr_eq(w, me)) {
            self.waiters.remove(pos);
        }
    }

    /// The oldest sequence number the retention window keeps.
    fn retained_from(&self, retention: &Retention) -> u64 {
        let end = self.end();
        if retention.batches.is_none() && retention.bytes.is_none() {
            return end;
        }
        // Each limit given keeps at most that much; both given, both apply.
        let by_batches = retention
            .batches
            .map_or(self.first, |n| end.saturating_sub(n as u64));
        let by_bytes = retention.bytes.map_or(self.first, |max| {
            // The first entry from which the rest of the log fits in `max` bytes.
            let keep_after = self.admitted.saturating_sub(max as u64);
            self.first + self.log.partition_point(|e| e.before < keep_after) as u64
        });
        by_batches.max(by_bytes).max(self.first)
    }

    /// Drop what no cursor needs and the retention window does not keep.
    fn trim(&mut self, retention: &Retention) {
        // A detached cursor reads nothing more, so it holds nothing back.
        let needed = self
            .cursors
            .iter()
            .filter(|c| !matches!(c.state, ReaderState::Behind(_)))
            .map(|c| c.next)
            .min();
        let keep = needed
            .unwrap_or(u64::MAX)
            .min(self.retained_from(retention));
        while self.first < keep && !self.log.is_empty() {
            self.log.pop_front();
            self.first += 1;
        }
    }

    /// Take the cursor out of the producers' way: it reads nothing more from the log.
    fn detach(&mut self, index: usize, message: String) {
        let c = &mut self.cursors[index];
        c.state = ReaderState::Behind(message);
        c.next = self.first + self.log.len() as u64;
        self.stats.detached += 1;
        for w in c.wakers.drain(..) {
            w.wake();
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
        Self {
            channel,
            cancelled: AtomicBool::new(false),
            written: Default::default(),
        }
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

/// `batch` with the arrival column (the last of `schema`) holding `stamp` on every row.
fn stamp_arrival(schema: &SchemaRef, batch: RecordBatch, stamp: i64) -> RecordBatch {
    let n = batch.num_rows();
    let column = arrow::array::TimestampMicrosecondArray::from_value(stamp, n).with_timezone("UTC");
    let mut columns = batch.columns().to_vec();
    columns.push(Arc::new(column));
    RecordBatch::try_new_with_options(
        Arc::clone(schema),
        columns,
        &arrow::array::RecordBatchOptions::new().with_row_count(Some(n)),
    )
    .expect("the arrival column matches the table's schema")
}

/// Bytes a batch holds *as a slice*: a 1,000-row slice of a 1,000,000-row column counts
/// its 1,000 rows, not the parent buffer (`get_array_memory_size` would).
pub fn batch_bytes(batch: &RecordBatch) -> usize {
    batch
        .columns()
        .iter()
        .map(|c| {
            let data = c.to_data();
            data.get_slice_memory_size()
                .unwrap_or_else(|_| c.get_array_memory_size())
        })
        .sum()
}

/// Whether a channel backs one table or a topic.
#[derive(Debug)]
enum Kind {
    /// One reader, created with the channel; when it goes, producers fail.
    Table,
    /// Readers subscribe at any time and leave alone; producers go on without any.
    Topic(Retention),
}

/// Room for a batch of `bytes`, or why not.
enum Room {
    Yes,
    /// No; a detachable cursor's timeout falls due at this instant (if any).
    No(Option<Instant>),
}

/// Shared state of one streaming table or topic: the log, its readers and its lifecycle.
#[derive(Debug)]
pub struct Channel {
    pub name: String,
    /// What readers see (with the arrival column, if any).
    pub schema: SchemaRef,
    /// What producers write (without the arrival column).
    pub input_schema: SchemaRef,
    order: Option<OrderGate>,
    /// Bounded disorder: rows up to `max_delay` behind are held and released in order.
    reorder: Option<Reorder>,
    /// The arrival column's index in `schema`: each batch is stamped at admission.
    arrival: Option<usize>,
    kind: Kind,
    state: Mutex<State>,
}

/// How often an idle reader of an arrival-time table learns that the clock moved.
const CLOCK_TICK: Duration = Duration::from_millis(5);

impl Channel {
    fn with_kind(
        name: String,
        input_schema: SchemaRef,
        arrival: Option<String>,
        order: Option<OrderGate>,
        reorder: Option<Reorder>,
        kind: Kind,
    ) -> Arc<Self> {
        let (schema, arrival) = match arrival {
            None => (Arc::clone(&input_schema), None),
            Some(column) => {
                let mut fields: Vec<_> = input_schema.fields().iter().cloned().collect();
                fields.push(Arc::new(arrow::datatypes::Field::new(
                    column,
                    DataType::Timestamp(
                        arrow::datatypes::TimeUnit::Microsecond,
                        Some("UTC".into()),
                    ),
                    false,
                )));
                let n = fields.len() - 1;
                (Arc::new(arrow::datatypes::Schema::new(fields)), Some(n))
            }
        };
        Arc::new(Self {
            name,
            schema,
            input_schema,
            order,
            reorder,
            arrival,
            kind,
            state: Mutex::new(State {
                log: VecDeque::new(),
                first: 0,
                admitted: 0,
                cursors: Vec::new(),
                next_cursor: 0,
                closed: false,
                failure: None,
                gone: None,
                waiters: VecDeque::new(),
                newest: None,
                watermark: None,
                clock: i64::MIN,
                held: Held::default(),
                stats: Stats::default(),
            }),
        })
    }

    /// A streaming table's channel and its single reader; with `arrival`, a column of that
    /// name is added to `schema` and stamped with each batch's admission time.
    pub fn table(
        name: String,
        schema: SchemaRef,
        arrival: Option<String>,
        capacity: usize,
        max_bytes: Option<usize>,
        order: Option<OrderGate>,
        reorder: Option<Reorder>,
    ) -> (Arc<Self>, Reader) {
        let channel = Self::with_kind(name, schema, arrival, order, reorder, Kind::Table);
        let limits = Limits {
            capacity,
            max_bytes,
            on_slow: OnSlow::Block,
        };
        let reader = channel.add_reader(limits, Start::Now, None);
        (channel, reader)
    }

    /// A topic's channel: readers come with [`Channel::subscribe`].
    pub fn topic(
        name: String,
        schema: SchemaRef,
        arrival: Option<String>,
        order: Option<OrderGate>,
        reorder: Option<Reorder>,
        retention: Retention,
    ) -> Arc<Self> {
        Self::with_kind(
            name,
            schema,
            arrival,
            order,
            reorder,
            Kind::Topic(retention),
        )
    }

    /// Whether batches are stamped with their arrival time.
    pub fn has_arrival(&self) -> bool {
        self.arrival.is_some()
    }

    pub fn is_topic(&self) -> bool {
        matches!(self.kind, Kind::Topic(_))
    }

    fn retention(&self) -> Retention {
        match self.kind {
            Kind::Table => Retention::default(),
            Kind::Topic(r) => r,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the log half-updated (every mutation
        // is a single push/pop/field store), so a poisoned lock is still safe to use.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn add_reader(
        self: &Arc<Self>,
        limits: Limits,
        start: Start,
        prelude: Option<Prelude>,
    ) -> Reader {
        let mut st = self.lock();
        let next = match start {
            Start::Now => st.end(),
            Start::Earliest => st.retained_from(&self.retention()),
        };
        let id = st.next_cursor;
        st.next_cursor += 1;
        st.cursors.push(Cursor {
            id,
            next,
            limits,
            state: ReaderState::Unclaimed,
            wakers: Vec::new(),
            error_delivered: false,
            full_since: None,
            read_batches: 0,
            watermark_delivered: None,
        });
        Reader {
            channel: Arc::clone(self),
            id,
            started: false,
            prelude: Mutex::new(prelude),
        }
    }

    /// A new reader of a topic, from `start`; `prelude` (if any) is read before the log.
    pub fn subscribe(
        self: &Arc<Self>,
        limits: Limits,
        start: Start,
        prelude: Option<Prelude>,
    ) -> Reader {
        debug_assert!(self.is_topic());
        self.add_reader(limits, start, prelude)
    }

    /// Whether every reader can take a batch of `bytes`; detaches cursors whose timeout
    /// for this write ran out.
    fn room(&self, st: &mut State, bytes: usize, now: Instant) -> Room {
        let mut due: Option<Instant> = None;
        let mut full = false;
        let mut i = 0;
        while i < st.cursors.len() {
            let c = &st.cursors[i];
            if matches!(c.state, ReaderState::Behind(_)) {
                i += 1;
                continue;
            }
            let (batches, queued) = st.backlog(c);
            let limited = batches >= c.limits.capacity
                // An empty backlog always admits one batch, or a batch larger than the
                // budget could never be written.
                || c.limits.max_bytes.is_some_and(|max| batches > 0 && queued + bytes > max);
            if limited {
                match c.limits.on_slow {
                    OnSlow::Block => full = true,
                    OnSlow::Detach(timeout) => {
                        let since = *st.cursors[i].full_since.get_or_insert(now);
                        if now >= since + timeout {
                            let msg = format!(
                                "fell behind: it had {batches} batch(es) queued and took none for {:.3}s \
                                 while a write waited (on_slow='detach')",
                                timeout.as_secs_f64()
                            );
                            st.detach(i, msg);
                        } else {
                            full = true;
                            due = Some(due.map_or(since + timeout, |d| d.min(since + timeout)));
                        }
                    }
                }
            }
            i += 1;
        }
        if full {
            Room::No(due)
        } else {
            Room::Yes
        }
    }

    /// Enqueue `batch`, blocking while a reader is full until `deadline` (None: no limit).
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
        let (mut unordered, mut checked) = match (&self.order, &self.reorder) {
            (Some(gate), None) => (None, Some(gate.check(batch).map_err(PushError::Order)?)),
            _ => (Some(batch), None),
        };
        // What the room check charges (the enqueued batch is charged again by `append`).
        let bytes = match (&unordered, &checked) {
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
            if let Some(why) = st.gone {
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
            let now = Instant::now();
            let mut due = None;
            if my_turn {
                match self.room(&mut st, bytes, now) {
                    Room::Yes => {
                        let batch = match (unordered.take(), &self.order, checked.take()) {
                            (Some(batch), _, _) => batch,
                            (None, Some(gate), Some(c)) => {
                                let late_in_batch = c.dropped;
                                let offered = c.batch().num_rows() + late_in_batch;
                                let floor = st.watermark.map(|(w, _)| w);
                                match gate.admit(c, &mut st.newest, floor) {
                                    Ok((admitted, late)) => {
                                        st.stats.late_rows += (late_in_batch + late) as u64;
                                        if admitted.num_rows() == 0 && offered > 0 {
                                            break Ok(Vec::new()); // every row was late: nothing to enqueue
                                        }
                                        admitted
                                    }
                                    Err(msg) => break Err(PushError::Order(msg)),
                                }
                            }
                            _ => unreachable!("a batch is either unordered or checked"),
                        };
                        let batch = match &self.reorder {
                            None => batch,
                            Some(r) => {
                                let floor = st.watermark.map(|(w, _)| w);
                                match r.admit(&mut st.held, batch, floor) {
                                    Ok(a) => {
                                        st.stats.late_rows += a.late as u64;
                                        match a.ready {
                                            Some(ready) => ready,
                                            // Held (or all late): nothing to enqueue yet.
                                            None => break Ok(Vec::new()),
                                        }
                                    }
                                    Err(msg) => break Err(PushError::Order(msg)),
                                }
                            }
                        };
                        self.append(&mut st, batch);
                        if let Some(t) = token {
                            t.written.fetch_add(1, Ordering::SeqCst);
                        }
                        // One idle partition of each reader is enough to take the batch.
                        break Ok(st
                            .cursors
                            .iter_mut()
                            .filter_map(|c| c.wakers.pop())
                            .collect());
                    }
                    Room::No(d) => due = d,
                }
            }
            let since = *blocked_since.get_or_insert(now);
            let waiter = Arc::clone(me.get_or_insert_with(|| {
                let w = Arc::new(Waiter::default());
                st.waiters.push_back(Arc::clone(&w));
                w
            }));
            let mut wait: Option<Duration> = due.map(|d| d.saturating_duration_since(now));
            if let Some(deadline) = deadline {
                if now >= deadline {
                    break Err(PushError::Timeout(now - since));
                }
                wait = Some(wait.map_or(deadline - now, |w| w.min(deadline - now)));
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
                Some(d) => {
                    waiter
                        .wake
                        .wait_timeout(st, d)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
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
            st.wake_head();
        }
        if let Some(since) = blocked_since {
            st.stats.blocked += since.elapsed();
        }
        drop(st);
        // Wake the scans after releasing the lock, so the woken tasks do not queue up on it.
        outcome.map(|wakers| wakers.into_iter().for_each(Waker::wake))
    }

    fn take_all_wakers(st: &mut State) -> Vec<Waker> {
        st.cursors
            .iter_mut()
            .flat_map(|c| c.wakers.drain(..))
            .collect()
    }

    /// Enqueue `batch` (stamping its arrival time, if the table has one). The caller checked
    /// for room, or is close()/advance() releasing the reorder buffer (they never block).
    fn append(&self, st: &mut State, batch: RecordBatch) {
        let batch = match self.arrival {
            None => batch,
            Some(_) => {
                let stamp = st.tick_clock();
                stamp_arrival(&self.schema, batch, stamp)
            }
        };
        let bytes = batch_bytes(&batch);
        st.stats.rows += batch.num_rows() as u64;
        st.stats.batches += 1;
        st.stats.bytes += bytes as u64;
        let before = st.admitted;
        st.admitted += bytes as u64;
        st.log.push_back(Entry { batch, before });
        st.trim(&self.retention());
    }

    /// The type a watermark of this channel is expressed in (its first order column), or why
    /// it cannot have one.
    pub fn watermark_type(&self) -> Result<DataType, String> {
        match (&self.order, self.arrival) {
            (Some(gate), _) => gate.watermark_type(&self.schema),
            (None, Some(i)) => Ok(self.schema.field(i).data_type().clone()),
            (None, None) => Err(format!(
                "'{}' declares no order_by column, so it cannot have a watermark",
                self.name
            )),
        }
    }

    /// Declare that no row whose first order column is below `value` will come: readers that
    /// listen for watermarks get it after every batch written before it, and later rows below
    /// it are late. A watermark at or below the current one changes nothing.
    pub fn advance(&self, value: i64) -> Result<(), PushError<()>> {
        if self.order.is_none() {
            return Err(PushError::Order(format!(
                "'{}' is ordered by arrival time, whose watermark is the clock: advance() \
                 applies to an order_by column",
                self.name
            )));
        }
        let mut st = self.lock();
        if let Some(msg) = &st.failure {
            return Err(PushError::Failed(msg.clone()));
        }
        if st.closed {
            return Err(PushError::Closed);
        }
        if st.watermark.is_some_and(|(w, _)| value <= w) {
            return Ok(());
        }
        if let Some(r) = &self.reorder {
            // Rows the watermark passes leave the buffer first, in order, before it.
            match r.release(&mut st.held, Some(value)) {
                Ok(Some(ready)) => self.append(&mut st, ready),
                Ok(None) => {}
                Err(msg) => return Err(PushError::Order(msg)),
            }
        }
        st.watermark = Some((value, st.end()));
        let wakers = Self::take_all_wakers(&mut st);
        drop(st);
        wakers.into_iter().for_each(Waker::wake);
        Ok(())
    }

    /// End of stream: queued batches stay readable, blocked and later writes fail.
    pub fn close(&self) {
        let mut st = self.lock();
        if let Some(r) = &self.reorder {
            // End of stream: what the buffer holds goes out, in order.
            if let Ok(Some(rest)) = r.release(&mut st.held, None) {
                self.append(&mut st, rest);
            }
        }
        st.closed = true;
        let wakers = Self::take_all_wakers(&mut st);
        st.wake_all_waiters();
        drop(st);
        wakers.into_iter().for_each(Waker::wake);
    }

    /// Record a failure for the readers. Never blocks. Returns false when it came too late
    /// to matter (a table's reader already finished or is gone) or a failure was already set.
    pub fn fail(&self, message: String) -> bool {
        let mut st = self.lock();
        if st.gone.is_some() || st.failure.is_some() {
            return false;
        }
        st.failure = Some(message);
        st.closed = true;
        let end = st.end();
        st.first = end;
        st.log.clear();
        for c in st.cursors.iter_mut() {
            c.next = end;
        }
        let wakers = Self::take_all_wakers(&mut st);
        st.wake_all_waiters();
        drop(st);
        wakers.into_iter().for_each(Waker::wake);
        true
    }

    pub fn stats(&self) -> Stats {
        let st = self.lock();
        // A table's queue is its reader's backlog; a topic holds its log (queued + retained).
        let queued_bytes = (st.admitted - st.before(st.first)) as usize;
        Stats {
            queued_batches: st.log.len(),
            queued_bytes,
            waiting_writers: st.waiters.len(),
            held_rows: st.held.rows,
            held_bytes: st.held.bytes,
            closed: st.closed,
            failed: st.failure.is_some(),
            reader_gone: st.gone.is_some(),
            subscribers: st
                .cursors
                .iter()
                .filter(|c| !matches!(c.state, ReaderState::Behind(_)))
                .count(),
            ..st.stats
        }
    }

    fn cursor_stats(&self, id: u64) -> CursorStats {
        let st = self.lock();
        let Some(c) = st.cursors.iter().find(|c| c.id == id) else {
            return CursorStats {
                state: "finished",
                ..Default::default()
            };
        };
        let (queued_batches, queued_bytes) = if matches!(c.state, ReaderState::Behind(_)) {
            (0, 0)
        } else {
            st.backlog(c)
        };
        let (state, why) = match &c.state {
            ReaderState::Unclaimed => ("waiting for a query", None),
            ReaderState::Reading => ("reading", None),
            ReaderState::Behind(msg) => ("detached", Some(msg.clone())),
        };
        CursorStats {
            queued_batches,
            queued_bytes,
            read_batches: c.read_batches,
            state,
            detached_because: why,
        }
    }

    fn start_reading(&self, id: u64) {
        let mut st = self.lock();
        if let Some(c) = st.cursor(id) {
            if c.state == ReaderState::Unclaimed {
                c.state = ReaderState::Reading;
            }
        }
    }

    /// The reader `id` is gone: a table's producers fail from now on; a topic forgets it.
    fn remove_reader(&self, id: u64, why: &'static str) {
        let mut st = self.lock();
        if let Some(pos) = st.cursors.iter().position(|c| c.id == id) {
            st.cursors.remove(pos);
        }
        if !self.is_topic() {
            st.gone = Some(why);
            st.first = st.end();
            st.log.clear();
        }
        st.trim(&self.retention());
        st.wake_all_waiters();
    }
}

/// Batches a reader yields before the log (a topic subscription's history).
pub type Prelude = Box<dyn Iterator<Item = Result<RecordBatch, ArrowError>> + Send>;

/// The right to read a channel through one cursor. Dropping it (unscanned, or after the
/// scan ends early) removes the cursor; for a table, blocked producers learn "reader gone".
pub struct Reader {
    channel: Arc<Channel>,
    id: u64,
    started: bool,
    prelude: Mutex<Option<Prelude>>,
}

impl std::fmt::Debug for Reader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reader")
            .field("table", &self.channel.name)
            .field("cursor", &self.id)
            .finish()
    }
}

impl Reader {
    pub fn channel(&self) -> &Arc<Channel> {
        &self.channel
    }

    /// Start reading: the returned claim is shared by the scan's partition streams, and the
    /// reader is gone when the last of them is dropped.
    pub fn start(mut self) -> Arc<Reader> {
        self.started = true;
        self.channel.start_reading(self.id);
        Arc::new(self)
    }

    /// A handle that reports this reader's counters without keeping it alive.
    pub fn watch(&self) -> CursorWatch {
        CursorWatch {
            channel: Arc::downgrade(&self.channel),
            id: self.id,
        }
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        let why = if self.started {
            "the query reading it stopped before the end of the stream (LIMIT reached, stream dropped or the query failed)"
        } else {
            "the table was dropped before any query scanned it"
        };
        self.channel.remove_reader(self.id, why);
    }
}

/// Reports one reader's counters (a subscription's `stats`).
#[derive(Debug, Clone)]
pub struct CursorWatch {
    channel: std::sync::Weak<Channel>,
    id: u64,
}

impl CursorWatch {
    pub fn stats(&self) -> CursorStats {
        match self.channel.upgrade() {
            Some(ch) => ch.cursor_stats(self.id),
            None => CursorStats {
                state: "finished",
                ..Default::default()
            },
        }
    }
}

/// Where a stream hands on the watermark it passed, for the operators above it: the engine's
/// window aggregates read it when the (empty) marker batch that follows reaches them.
#[derive(Debug, Default)]
pub struct WatermarkCell(Mutex<Option<ScalarValue>>);

impl WatermarkCell {
    pub fn get(&self) -> Option<ScalarValue> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn set(&self, value: ScalarValue) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(value);
    }
}

/// A scan that listens for watermarks: the cell it hands them to, and their type.
#[derive(Debug, Clone)]
pub struct Markers {
    pub cell: Arc<WatermarkCell>,
    pub data_type: DataType,
}

impl Markers {
    /// Hand on watermark `w` (in the order column's integer scale): set the cell, and return
    /// the empty batch that makes the operators above read it.
    fn announce(&self, w: i64, schema: &SchemaRef) -> DFResult<RecordBatch> {
        let value = ScalarValue::Int64(Some(w))
            .cast_to(&self.data_type)
            .map_err(|e| DataFusionError::Execution(e.to_string()))?;
        self.cell.set(value);
        Ok(RecordBatch::new_empty(Arc::clone(schema)))
    }
}

/// One partition of the scan: a record-batch stream over a reader's cursor. Several may
/// read one cursor concurrently (each batch goes to exactly one of them).
///
/// With `markers`, a watermark reached in the log is handed to the cell and announced by an
/// empty batch, after every batch written before it and before any written after it.
#[derive(Debug)]
pub struct ReaderStream {
    reader: Arc<Reader>,
    done: bool,
    markers: Option<Markers>,
    /// When an idle reader of an arrival-time table next hands on the clock.
    next_clock: Instant,
}

impl ReaderStream {
    pub fn new(reader: Arc<Reader>, markers: Option<Markers>) -> Self {
        Self {
            reader,
            done: false,
            markers,
            next_clock: Instant::now(),
        }
    }

    /// The next batch of the reader's prelude, if it still has one.
    fn prelude_next(&self) -> Option<DFResult<RecordBatch>> {
        let mut prelude = self
            .reader
            .prelude
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let channel = &self.reader.channel;
        let item = prelude.as_mut()?.next();
        match item {
            None => {
                *prelude = None;
                None
            }
            Some(Ok(batch)) => Some(schema::conform(&channel.schema, batch).map_err(|issue| {
                DataFusionError::Execution(format!(
                    "pushtable: the history of '{}' does not match its schema: {}",
                    channel.name,
                    issue.describe(&channel.name, |dt| dt.to_string())
                ))
            })),
            Some(Err(e)) => {
                *prelude = None;
                Some(Err(DataFusionError::Execution(format!(
                    "pushtable: reading the history of '{}' failed: {e}",
                    channel.name
                ))))
            }
        }
    }
}

impl Stream for ReaderStream {
    type Item = DFResult<RecordBatch>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        if let Some(item) = self.prelude_next() {
            if item.is_err() {
                self.done = true;
            }
            return Poll::Ready(Some(item));
        }
        let channel = Arc::clone(&self.reader.channel);
        let retention = channel.retention();
        let id = self.reader.id;
        let mut st = channel.lock();
        let failure = st.failure.clone();
        let first = st.first;
        let watermark = st.watermark;
        let Some(c) = st.cursor(id) else {
            drop(st);
            self.done = true;
            return Poll::Ready(None);
        };
        let error = match (&failure, &c.state) {
            (Some(msg), _) => Some(format!(
                "pushtable: the producer of streaming table '{}' failed: {msg}",
                channel.name
            )),
            (None, ReaderState::Behind(msg)) => Some(format!(
                "pushtable: SlowSubscriberError: the subscriber of '{}' {msg}",
                channel.name
            )),
            _ => None,
        };
        if let Some(err) = error {
            let delivered = std::mem::replace(&mut c.error_delivered, true);
            drop(st);
            self.done = true;
            return Poll::Ready(if delivered {
                None
            } else {
                Some(Err(DataFusionError::Execution(err)))
            });
        }
        let seq = c.next;
        if let (Some(markers), Some((w, at))) = (&self.markers, watermark) {
            if seq >= at && c.watermark_delivered.is_none_or(|d| d < w) {
                c.watermark_delivered = Some(w);
                drop(st);
                return Poll::Ready(Some(markers.announce(w, &channel.schema)));
            }
        }
        if seq < first + st.log.len() as u64 {
            let batch = st.log[(seq - first) as usize].batch.clone();
            let c = st.cursor(id).expect("cursor present");
            c.next += 1;
            c.read_batches += 1;
            c.full_since = None;
            st.trim(&retention);
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
        // Idle on an arrival-time table: the clock is the watermark (every later row is
        // stamped at or after it), handed on every CLOCK_TICK so windows close on time.
        let clock = match (&self.markers, channel.has_arrival()) {
            (Some(markers), true) => Some(markers.clone()),
            _ => None,
        };
        if let Some(markers) = clock {
            let now = Instant::now();
            if now >= self.next_clock {
                let w = st.tick_clock();
                drop(st);
                self.next_clock = now + CLOCK_TICK;
                return Poll::Ready(Some(markers.announce(w, &channel.schema)));
            }
            crate::clock::wake_at(self.next_clock, cx.waker().clone());
        }
        let c = st.cursor(id).expect("cursor present");
        if !c.wakers.iter().any(|w| w.will_wake(cx.waker())) {
            c.wakers.push(cx.waker().clone());
        }
        Poll::Pending
    }
}

impl RecordBatchStream for ReaderStream {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.reader.channel.schema)
    }
}
