//! The log a channel keeps and its readers' cursors: positions, backlogs, limits, the
//! producers' waiting line, and trimming below the slowest cursor and the retention window.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::task::Waker;
use std::time::{Duration, Instant};

use arrow::array::RecordBatch;
use arrow::error::ArrowError;

use crate::order::Newest;
use crate::reorder::Held;

/// Batches a reader yields before the log (a topic subscription's history).
pub type Prelude = Box<dyn Iterator<Item = Result<RecordBatch, ArrowError>> + Send>;

/// Where a reader keeps its prelude. The channel holds a weak handle on it, so a detached
/// reader's history is let go at once (a durable topic's history holds a pinned version of
/// the store until then), not when its query next polls or ends.
pub(super) type PreludeSlot = Arc<Mutex<Option<Prelude>>>;

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
pub(super) enum ReaderState {
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
pub(super) struct Waiter {
    pub(super) wake: Condvar,
}

/// A batch in the log; `before` counts the bytes admitted before it (O(1) backlogs).
#[derive(Debug)]
pub(super) struct Entry {
    pub(super) batch: RecordBatch,
    pub(super) before: u64,
}

/// One reader's position in the log.
#[derive(Debug)]
pub(super) struct Cursor {
    pub(super) id: u64,
    pub(super) next: u64,
    pub(super) limits: Limits,
    pub(super) state: ReaderState,
    /// The scan's idle partitions, one waker each, by stream (a table's scan may read with
    /// several): a stream polled again with another waker replaces its own, so no stale
    /// waker is ever the one a new batch wakes.
    pub(super) wakers: Vec<(u64, Waker)>,
    /// The end-of-stream error (failure or detachment) was handed to a partition.
    pub(super) error_delivered: bool,
    /// Since when a producer has been waiting for this cursor without it reading.
    pub(super) full_since: Option<Instant>,
    pub(super) read_batches: u64,
    /// The newest watermark this cursor's reader was handed.
    pub(super) watermark_delivered: Option<i64>,
    /// The reader's history still to read (a topic subscription's prelude), if any.
    pub(super) prelude: Option<Weak<Mutex<Option<Prelude>>>>,
}

impl Cursor {
    /// A new reader's cursor at `next`, waiting for its query.
    pub(super) fn new(id: u64, next: u64, limits: Limits) -> Self {
        Self {
            id,
            next,
            limits,
            state: ReaderState::Unclaimed,
            wakers: Vec::new(),
            error_delivered: false,
            full_since: None,
            read_batches: 0,
            watermark_delivered: None,
            prelude: None,
        }
    }
}

#[derive(Debug)]
pub(super) struct State {
    pub(super) log: VecDeque<Entry>,
    /// Sequence number of `log[0]`.
    pub(super) first: u64,
    /// Bytes admitted so far (the `before` of the next entry).
    pub(super) admitted: u64,
    pub(super) cursors: Vec<Cursor>,
    pub(super) next_cursor: u64,
    pub(super) closed: bool,
    pub(super) failure: Option<String>,
    /// A table's reader went away (the table is exclusive to it): producers fail.
    pub(super) gone: Option<&'static str>,
    pub(super) waiters: VecDeque<Arc<Waiter>>,
    pub(super) newest: Option<Newest>,
    /// The latest watermark (`advance`): its value, and the log position it follows.
    pub(super) watermark: Option<(i64, u64)>,
    /// Arrival time (µs) never goes back: every stamp and clock watermark is at least this.
    pub(super) clock: i64,
    /// Rows of a bounded-disorder table waiting for the watermark.
    pub(super) held: Held,
    pub(super) stats: Stats,
    /// Batches each finished reader (cursor id) read in all: its stats stay readable.
    pub(super) finished_reads: HashMap<u64, u64>,
    /// Readers let go before any query read them (a closed subscription): a scan that
    /// starts on one later fails, naming why, instead of finding nothing.
    pub(super) closed_readers: std::collections::HashSet<u64>,
    /// Histories of readers detached under the lock, let go once it is released
    /// ([`State::take_let_go`]): dropping one may call back into Python.
    pub(super) let_go: LetGo,
}

/// Histories of detached readers waiting to be dropped outside the lock.
#[derive(Default)]
pub(super) struct LetGo(Vec<PreludeSlot>);

impl std::fmt::Debug for LetGo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LetGo({} histories)", self.0.len())
    }
}

impl State {
    pub(super) fn new() -> Self {
        Self {
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
            finished_reads: HashMap::new(),
            closed_readers: std::collections::HashSet::new(),
            let_go: LetGo::default(),
        }
    }

    /// The arrival clock now: never behind an earlier stamp or clock watermark.
    pub(super) fn tick_clock(&mut self) -> i64 {
        self.clock = self.clock.max(crate::clock::now_micros());
        self.clock
    }

    pub(super) fn end(&self) -> u64 {
        self.first + self.log.len() as u64
    }

    /// Bytes admitted before sequence number `seq` (which must still be in the log, or its end).
    pub(super) fn before(&self, seq: u64) -> u64 {
        match self.log.get((seq - self.first) as usize) {
            Some(e) => e.before,
            None => self.admitted,
        }
    }

    /// What `cursor` has still to read: (batches, bytes).
    pub(super) fn backlog(&self, c: &Cursor) -> (usize, usize) {
        (
            (self.end() - c.next) as usize,
            (self.admitted - self.before(c.next)) as usize,
        )
    }

    pub(super) fn cursor(&mut self, id: u64) -> Option<&mut Cursor> {
        self.cursors.iter_mut().find(|c| c.id == id)
    }

    pub(super) fn wake_all_waiters(&self) {
        for w in &self.waiters {
            w.wake.notify_one();
        }
    }

    /// Wake the producer at the head of the line (after a read, or when the head left).
    pub(super) fn wake_head(&self) {
        if let Some(head) = self.waiters.front() {
            head.wake.notify_one();
        }
    }

    pub(super) fn leave_line(&mut self, me: &Arc<Waiter>) {
        if let Some(pos) = self.waiters.iter().position(|w| Arc::ptr_eq(w, me)) {
            self.waiters.remove(pos);
        }
    }

    /// The oldest sequence number the retention window keeps.
    pub(super) fn retained_from(&self, retention: &Retention) -> u64 {
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
    pub(super) fn trim(&mut self, retention: &Retention) {
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
    pub(super) fn detach(&mut self, index: usize, message: String) {
        let c = &mut self.cursors[index];
        c.state = ReaderState::Behind(message);
        c.next = self.first + self.log.len() as u64;
        if let Some(slot) = c.prelude.take().and_then(|w| w.upgrade()) {
            self.let_go.0.push(slot);
        }
        self.stats.detached += 1;
        for (_, w) in c.wakers.drain(..) {
            w.wake();
        }
    }

    /// The histories [`State::detach`] cut loose: call [`let_go`] on them once the lock is
    /// released.
    pub(super) fn take_let_go(&mut self) -> LetGo {
        std::mem::take(&mut self.let_go)
    }
}

/// Drop the histories of detached readers (outside the channel's lock). One a stream is
/// reading this moment is left to it: it sees the detachment before its next history batch.
pub(super) fn let_go(slots: LetGo) {
    if slots.0.is_empty() {
        return;
    }
    if crate::finalizing::is() {
        std::mem::forget(slots); // at exit, nothing calls back into Python
        return;
    }
    for slot in slots.0 {
        let unread = match slot.try_lock() {
            Ok(mut prelude) => prelude.take(),
            Err(_) => None,
        };
        drop(unread);
    }
}
