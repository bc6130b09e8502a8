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
//!
//! The room's parts: [`log`] (the log, its cursors and their limits), [`push`] (the producer
//! side: admission, backpressure, cancellation) and [`reader`] (the scan's side: cursors as
//! record-batch streams, watermark markers). This file holds the channel itself and its
//! lifecycle (close, fail, advance, readers coming and going).

mod log;
mod push;
mod reader;
#[cfg(test)]
mod tests;

use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Waker;

use arrow::datatypes::{DataType, SchemaRef};

use crate::order::OrderGate;
use crate::reorder::Reorder;

pub use log::Prelude;
use log::{Cursor, ReaderState, State};
pub use log::{CursorStats, Limits, OnSlow, Retention, Start, Stats};
pub use push::{CancelToken, PushError};
pub use reader::{CursorWatch, Markers, Reader, ReaderStream, WatermarkCell};

/// Whether a channel backs one table or a topic.
#[derive(Debug)]
enum Kind {
    /// One reader, created with the channel; when it goes, producers fail.
    Table,
    /// Readers subscribe at any time and leave alone; producers go on without any.
    Topic(Retention),
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
            state: Mutex::new(State::new()),
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
        let had_prelude = prelude.is_some();
        let slot: log::PreludeSlot = Arc::new(std::sync::Mutex::new(prelude));
        let mut cursor = Cursor::new(id, next, limits);
        if had_prelude {
            cursor.prelude = Some(Arc::downgrade(&slot));
        }
        st.cursors.push(cursor);
        Reader::new(Arc::clone(self), id, slot)
    }

    /// Whether reader `id` reads nothing more from the log: the producer failed, or the
    /// reader was detached (or is gone).
    fn reader_ended(&self, id: u64) -> bool {
        let st = self.lock();
        st.failure.is_some()
            || st
                .cursors
                .iter()
                .find(|c| c.id == id)
                .is_none_or(|c| matches!(c.state, ReaderState::Behind(_)))
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

    fn take_all_wakers(st: &mut State) -> Vec<Waker> {
        st.cursors
            .iter_mut()
            .flat_map(|c| c.wakers.drain(..).map(|(_, w)| w))
            .collect()
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
                Ok(Some(ready)) => self.append(&mut st, ready, None),
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
                self.append(&mut st, rest, None);
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
                read_batches: st.finished_reads.get(&id).copied().unwrap_or(0),
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

    /// Forget reader `id` if no query claimed it (a subscription closed, or whose query was
    /// refused before it scanned): whether it was forgotten.
    fn close_unclaimed(&self, id: u64) -> bool {
        let mut st = self.lock(); // one lock: no query claims it between the look and the act
        let unclaimed = st
            .cursors
            .iter()
            .any(|c| c.id == id && c.state == ReaderState::Unclaimed);
        if unclaimed {
            st.closed_readers.insert(id);
            self.remove_locked(
                &mut st,
                id,
                "the subscription was closed before any query read it",
            );
        }
        unclaimed
    }

    /// The reader `id` is gone: a table's producers fail from now on; a topic forgets it.
    fn remove_reader(&self, id: u64, why: &'static str) {
        let mut st = self.lock();
        self.remove_locked(&mut st, id, why);
    }

    fn remove_locked(&self, st: &mut State, id: u64, why: &'static str) {
        if let Some(pos) = st.cursors.iter().position(|c| c.id == id) {
            let gone = st.cursors.remove(pos);
            st.finished_reads.insert(id, gone.read_batches);
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
