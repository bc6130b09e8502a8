//! The producer side of a channel: a batch's admission (ordering, the reorder buffer, the
//! arrival stamp), backpressure with producers served in arrival order, cancellation of an
//! `awrite` request, and the Ctrl-C tick of a blocked main-thread write.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::Waker;
use std::time::{Duration, Instant};

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;

use super::log::{Entry, OnSlow, ReaderState, State, Waiter};
use super::Channel;
use crate::sizing::batch_bytes;

/// How often a blocked *interruptible* producer (Python's main thread) checks for Ctrl-C.
const TICK: Duration = Duration::from_millis(50);

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

/// Room for a batch of `bytes`, or why not.
enum Room {
    Yes,
    /// No; a detachable cursor's timeout falls due at this instant (if any).
    No(Option<Instant>),
}

impl Channel {
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
        bytes: usize,
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
        // What the room check charges (`bytes`, the caller's `batch_bytes(batch)`, unless
        // the ordering check dropped rows); `append` charges what it enqueues.
        let bytes = match (&unordered, &checked) {
            (Some(_), _) => bytes,
            (None, Some(c)) => batch_bytes(c.batch()),
            (None, None) => 0,
        };
        let as_given = self.order.is_none() && self.reorder.is_none();
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
                        self.append(&mut st, batch, as_given.then_some(bytes));
                        if let Some(t) = token {
                            t.written.fetch_add(1, Ordering::SeqCst);
                        }
                        // One idle partition of each reader is enough to take the batch (each
                        // stream parks one waker, its newest: none of them is stale).
                        break Ok(st
                            .cursors
                            .iter_mut()
                            .filter_map(|c| c.wakers.pop().map(|(_, w)| w))
                            .collect());
                    }
                    Room::No(d) => due = d,
                }
            }
            if crate::finalizing::exiting_here() {
                // An exit hook run after pushtable's: no query reads any more, so the room
                // this write waits for would never come (see `finalizing`).
                break Err(PushError::ReaderGone(
                    "the interpreter is exiting (queries stopped reading at exit) and the \
                     table is full",
                ));
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
            if tick.is_none() && crate::finalizing::must_park() {
                // A daemon producer woken while the interpreter finalizes must not go back
                // to Python (see `finalizing`).
                drop(st);
                crate::finalizing::park_forever();
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
        let detached = st.take_let_go();
        drop(st);
        super::log::let_go(detached);
        // Wake the scans after releasing the lock, so the woken tasks do not queue up on it.
        outcome.map(|wakers| wakers.into_iter().for_each(Waker::wake))
    }

    /// Enqueue `batch` (stamping its arrival time, if the table has one). The caller checked
    /// for room, or is close()/advance() releasing the reorder buffer (they never block).
    /// Enqueue `batch`; `bytes` is its `batch_bytes` when the caller has it.
    pub(super) fn append(&self, st: &mut State, batch: RecordBatch, bytes: Option<usize>) {
        let (batch, bytes) = match self.arrival {
            None => {
                let bytes = bytes.unwrap_or_else(|| batch_bytes(&batch));
                (batch, bytes)
            }
            Some(_) => {
                let stamp = st.tick_clock();
                let batch = stamp_arrival(&self.schema, batch, stamp);
                let bytes = batch_bytes(&batch);
                (batch, bytes)
            }
        };
        st.stats.rows += batch.num_rows() as u64;
        st.stats.batches += 1;
        st.stats.bytes += bytes as u64;
        let before = st.admitted;
        st.admitted += bytes as u64;
        st.log.push_back(Entry { batch, before });
        st.trim(&self.retention());
    }
}
