//! The scan's side of a channel: a reader's claim on its cursor, the record-batch stream
//! DataFusion polls (with the failure and detachment errors, and watermark markers), and
//! the cell that hands watermarks on to the operators above.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use arrow::array::RecordBatch;
use arrow::datatypes::{DataType, SchemaRef};
use datafusion_common::{DataFusionError, Result as DFResult, ScalarValue};
use datafusion_execution::RecordBatchStream;
use futures::Stream;

use super::log::{CursorStats, PreludeSlot, ReaderState};
use super::Channel;
use crate::schema;

/// How often an idle reader of an arrival-time table learns that the clock moved.
const CLOCK_TICK: Duration = Duration::from_millis(5);

/// The right to read a channel through one cursor. Dropping it (unscanned, or after the
/// scan ends early) removes the cursor; for a table, blocked producers learn "reader gone".
pub struct Reader {
    channel: Arc<Channel>,
    id: u64,
    started: bool,
    prelude: PreludeSlot,
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
    pub(super) fn new(channel: Arc<Channel>, id: u64, prelude: PreludeSlot) -> Self {
        Self {
            channel,
            id,
            started: false,
            prelude,
        }
    }

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
    /// Let go of the cursor if no query has claimed it yet: the topic's producers stop
    /// waiting for it at once. Whether it was let go (one a query reads goes with the query).
    pub fn close(&self) -> bool {
        self.channel
            .upgrade()
            .is_some_and(|ch| ch.close_unclaimed(self.id))
    }

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
    /// This stream's own key among its cursor's parked wakers.
    id: u64,
    reader: Arc<Reader>,
    done: bool,
    markers: Option<Markers>,
    /// When an idle reader of an arrival-time table next hands on the clock.
    next_clock: Instant,
    /// Opened after the interpreter began to exit: by an exit hook (see `poll_next`).
    opened_exiting: bool,
}

impl ReaderStream {
    pub fn new(reader: Arc<Reader>, markers: Option<Markers>) -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        Self {
            id: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            reader,
            done: false,
            markers,
            next_clock: Instant::now(),
            opened_exiting: crate::finalizing::is(),
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
        prelude.as_ref()?;
        if channel.reader_ended(self.reader.id) {
            // Failed or detached: the log's side says so; the history is let go unread.
            let unread = prelude.take();
            drop(prelude);
            drop(unread);
            return None;
        }
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
        if crate::finalizing::is() {
            if self.opened_exiting {
                // A query an exit hook started after pushtable's own hook ran (the thread
                // that runs them may go back to Python): no producer writes any more, so it
                // ends with an error naming why, and the process exits.
                self.done = true;
                return Poll::Ready(Some(Err(DataFusionError::Execution(format!(
                    "pushtable: live table '{}' is read no more: the interpreter is exiting \
                     (its producers were stopped when pushtable's exit hook ran); read it \
                     before exit, or register the exit hook after importing pushtable",
                    self.reader.channel.name
                )))));
            }
            // The interpreter is exiting: the thread waiting on this query must stay in its
            // wait, not return to Python (see `finalizing`). Never woken, by design.
            return Poll::Pending;
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
            let closed = st.closed_readers.contains(&id);
            drop(st);
            self.done = true;
            return Poll::Ready(closed.then(|| {
                Err(DataFusionError::Execution(format!(
                    "pushtable: the subscription of '{}' was closed before this query read it",
                    channel.name
                )))
            }));
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
        let stream = self.id;
        match c.wakers.iter_mut().find(|(s, _)| *s == stream) {
            // Polled again, perhaps from another task: the newest waker replaces its own.
            Some((_, w)) if !w.will_wake(cx.waker()) => *w = cx.waker().clone(),
            Some(_) => {}
            None => c.wakers.push((stream, cx.waker().clone())),
        }
        Poll::Pending
    }
}

impl RecordBatchStream for ReaderStream {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.reader.channel.schema)
    }
}
