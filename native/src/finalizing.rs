//! The interpreter's exit, as native threads must see it.
//!
//! On Python < 3.14 a thread that re-attaches to a finalizing interpreter is ended with
//! `pthread_exit`, whose forced unwind through a Rust frame that catches panics (every
//! pyo3 entry point) aborts the process with `FATAL: exception not rethrown`. So once the
//! `atexit` hook has run, native code never hands a thread back to Python: a producer
//! returning from a write parks for good, and a scan polled after it yields nothing more,
//! so the query's thread stays in its wait. The process is about to exit either way.

use std::sync::atomic::{AtomicBool, Ordering};

use pyo3::Python;

static FINALIZING: AtomicBool = AtomicBool::new(false);

/// Mark the interpreter as finalizing (called once from an `atexit` hook).
pub fn set() {
    FINALIZING.store(true, Ordering::SeqCst);
}

/// Whether the `atexit` hook has run.
pub fn is() -> bool {
    FINALIZING.load(Ordering::SeqCst)
}

/// Park the calling thread for good.
pub fn park_forever() -> ! {
    loop {
        std::thread::park();
    }
}

/// `py.detach(f)`, except that a thread entering or finishing `f` after the interpreter
/// began to exit parks instead of going on (and re-attaching).
pub fn detach<T: Send, F: Send + FnOnce() -> T>(py: Python<'_>, f: F) -> T {
    py.detach(|| {
        if is() {
            park_forever();
        }
        let out = f();
        if is() {
            park_forever();
        }
        out
    })
}
