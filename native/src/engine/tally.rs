//! The state the engine's running stateful operators hold, summed per kind of operator, for
//! pushtable's stats (`pushtable.engine.live_state()`, the Prometheus gauges): each running
//! stream reports its groups and bytes as they change and takes them back when it ends.

use std::sync::atomic::{AtomicI64, Ordering};

/// One kind of operator's running streams, groups and bytes of state.
pub struct Tally {
    pub name: &'static str,
    streams: AtomicI64,
    groups: AtomicI64,
    bytes: AtomicI64,
}

impl Tally {
    const fn new(name: &'static str) -> Self {
        Self {
            name,
            streams: AtomicI64::new(0),
            groups: AtomicI64::new(0),
            bytes: AtomicI64::new(0),
        }
    }

    /// (streams, groups, bytes) now.
    pub fn read(&self) -> (i64, i64, i64) {
        (
            self.streams.load(Ordering::Relaxed),
            self.groups.load(Ordering::Relaxed),
            self.bytes.load(Ordering::Relaxed),
        )
    }
}

/// Updating aggregates (`UpdatingAggregateExec`).
pub static UPDATING: Tally = Tally::new("UpdatingAggregateExec");
/// Session windows (`SessionWindowExec`).
pub static SESSIONS: Tally = Tally::new("SessionWindowExec");
/// Every kind, in the order the stats list them.
pub static ALL: [&Tally; 2] = [&UPDATING, &SESSIONS];

/// One running stream's share of a [`Tally`]: what it last reported, taken back on drop.
pub struct Share {
    tally: &'static Tally,
    groups: i64,
    bytes: i64,
}

impl Share {
    pub fn new(tally: &'static Tally) -> Self {
        tally.streams.fetch_add(1, Ordering::Relaxed);
        Self {
            tally,
            groups: 0,
            bytes: 0,
        }
    }

    /// The stream holds `groups` groups in `bytes` bytes now.
    pub fn set(&mut self, groups: usize, bytes: usize) {
        let (groups, bytes) = (groups as i64, bytes as i64);
        self.tally
            .groups
            .fetch_add(groups - self.groups, Ordering::Relaxed);
        self.tally
            .bytes
            .fetch_add(bytes - self.bytes, Ordering::Relaxed);
        (self.groups, self.bytes) = (groups, bytes);
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        self.set(0, 0);
        self.tally.streams.fetch_sub(1, Ordering::Relaxed);
    }
}
