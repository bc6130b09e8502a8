//! The interpreter's exit, as native threads must see it.
//!
//! On Python < 3.14 a thread that re-attaches to a finalizing interpreter is ended with
//! `pthread_exit`, whose forced unwind through a Rust frame that catches panics (every
//! pyo3 entry point) aborts the process with `FATAL: exception not rethrown`. So once the
//! `atexit` hook has run, native code never hands another thread back to Python: a producer
//! returning from a write parks for good, and a scan polled after it yields nothing more,
//! so the query's thread stays in its wait. The process is about to exit either way.
//!
//! The thread that runs the exit hooks is the one exception: it finalizes the interpreter
//! itself, so it may always re-attach, and it must never park (the process would never
//! exit). An exit hook registered before pushtable's runs after it: its writes go on, and a
//! write that would wait for room fails at once instead, since no query reads any more.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::thread::ThreadId;

use pyo3::Python;

static FINALIZING: AtomicBool = AtomicBool::new(false);
static EXIT_THREAD: OnceLock<ThreadId> = OnceLock::new();

/// Mark the interpreter as finalizing (called once from an `atexit` hook, on the thread that
/// runs the exit hooks).
pub fn set() {
    let _ = EXIT_THREAD.set(std::thread::current().id());
    FINALIZING.store(true, Ordering::SeqCst);
}

/// Whether the `atexit` hook has run.
pub fn is() -> bool {
    FINALIZING.load(Ordering::SeqCst)
}

/// Whether the `atexit` hook has run and the calling thread is the one running exit hooks:
/// it must not wait for a reader (none reads any more) and must never park.
pub fn exiting_here() -> bool {
    is() && EXIT_THREAD.get() == Some(&std::thread::current().id())
}

/// Whether a thread must park instead of going back to Python: the interpreter is exiting
/// and this thread is not the one that finalizes it.
pub fn must_park() -> bool {
    is() && !exiting_here()
}

/// Park the calling thread for good.
pub fn park_forever() -> ! {
    loop {
        std::thread::park();
    }
}

/// Park the calling thread for good unless it may go back to Python (see the module's docs).
pub fn park_unless_exiting_here() {
    if must_park() {
        park_forever();
    }
}

/// `py.detach(f)`, except that a thread other than the exit hooks' entering or finishing `f`
/// after the interpreter began to exit parks instead of going on (and re-attaching).
pub fn detach<T: Send, F: Send + FnOnce() -> T>(py: Python<'_>, f: F) -> T {
    py.detach(|| {
        park_unless_exiting_here();
        let out = f();
        park_unless_exiting_here();
        out
    })
}
