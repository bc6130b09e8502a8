//! Wake-ups at a time: how an idle scan of an arrival-time table learns that the clock moved.
//!
//! A table stamped with arrival time has a watermark that advances with the clock even when
//! no row arrives, so its windows can close on time. An idle scan asks to be woken a few
//! milliseconds later; one thread serves every such request (no async runtime needed, since
//! scans are polled by whichever runtime runs the query).

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Condvar, Mutex, OnceLock};
use std::task::Waker;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

struct Due {
    at: Instant,
    seq: u64,
    waker: Waker,
}

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Due {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

struct Timer {
    queue: Mutex<(BinaryHeap<Reverse<Due>>, u64)>,
    changed: Condvar,
}

fn timer() -> &'static Timer {
    static TIMER: OnceLock<&'static Timer> = OnceLock::new();
    TIMER.get_or_init(|| {
        let t: &'static Timer = Box::leak(Box::new(Timer {
            queue: Mutex::new((BinaryHeap::new(), 0)),
            changed: Condvar::new(),
        }));
        std::thread::Builder::new()
            .name("pushtable-clock".into())
            .spawn(move || run(t))
            .expect("cannot start the clock thread");
        t
    })
}

fn run(t: &'static Timer) {
    let mut q = t.queue.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let now = Instant::now();
        while q.0.peek().is_some_and(|d| d.0.at <= now) {
            let Reverse(due) = q.0.pop().expect("peeked");
            due.waker.wake();
        }
        q = match q.0.peek().map(|d| d.0.at) {
            Some(at) => {
                t.changed
                    .wait_timeout(q, at.saturating_duration_since(now))
                    .unwrap_or_else(|p| p.into_inner())
                    .0
            }
            None => t.changed.wait(q).unwrap_or_else(|p| p.into_inner()),
        };
    }
}

/// Wake `waker` at `at` (or soon after).
pub fn wake_at(at: Instant, waker: Waker) {
    let t = timer();
    let mut q = t.queue.lock().unwrap_or_else(|p| p.into_inner());
    q.1 += 1;
    let seq = q.1;
    q.0.push(Reverse(Due { at, seq, waker }));
    drop(q);
    t.changed.notify_one();
}

/// Microseconds since the Unix epoch (the arrival column's unit).
pub fn now_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}
