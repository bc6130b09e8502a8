//! What a write blocked on Python's main thread checks while it waits: Ctrl-C.
//!
//! Python runs signal handlers on the main thread only, when asked (`PyErr_CheckSignals`).
//! A handler that raises (Python's own `KeyboardInterrupt`, pyspark's) ends the write with
//! its exception. asyncio's is different: `asyncio.run` installs a SIGINT handler that only
//! cancels the main task and returns, so that the task sees `CancelledError` at its next
//! `await`. A *blocking* write inside a coroutine holds the loop's thread, so that `await`
//! never comes while it waits: the first Ctrl-C would be lost until the write's timeout (or
//! for good, without one). So while it waits the write watches the tasks a Ctrl-C cancels
//! (the running task and the runner's main task) and, when the handler has just cancelled
//! one, ends with `CancelledError`, as an `await` would; `asyncio.run` turns that into
//! `KeyboardInterrupt`. Everything here is C-level calls: running Python code before the
//! check would itself handle the signal, unseen.

use pyo3::prelude::*;
use pyo3::types::PyDict;

/// The check a main-thread write runs every tick while it waits.
pub fn check(py: Python<'_>) -> PyResult<()> {
    let watched = watched_tasks(py);
    let before: Vec<i64> = watched.iter().map(cancelling).collect();
    py.check_signals()?;
    for (task, was) in watched.iter().zip(before) {
        if cancelling(task) > was {
            let cancelled = py.import("asyncio")?.getattr("CancelledError")?;
            return Err(PyErr::from_value(cancelled.call1((
                "Ctrl-C cancelled the task while a write blocked its event loop",
            ))?));
        }
    }
    Ok(())
}

/// How many cancellations of `task` are pending (`Task.cancelling()`, Python 3.11+; -1 where
/// it cannot be read).
fn cancelling(task: &Bound<'_, PyAny>) -> i64 {
    task.call_method0("cancelling")
        .and_then(|n| n.extract::<i64>())
        .unwrap_or(-1)
}

/// The tasks a Ctrl-C would cancel now: none unless an asyncio event loop runs on this
/// thread. Errors read as "none": this check must never itself fail a write.
fn watched_tasks(py: Python<'_>) -> Vec<Bound<'_, PyAny>> {
    let mut tasks: Vec<Bound<'_, PyAny>> = Vec::new();
    // `_asyncio` is loaded by any running loop; absent, no loop runs (and importing it now
    // would run Python code).
    let Ok(module) = loaded(py, "_asyncio") else {
        return tasks;
    };
    let Ok(loop_) = module.call_method0("_get_running_loop") else {
        return tasks;
    };
    if loop_.is_none() {
        return tasks;
    }
    let current = match module.getattr("current_task") {
        Ok(f) => f.call1((&loop_,)).ok(), // Python 3.12+
        Err(_) => module // 3.10, 3.11: the C module's loop -> task dict
            .getattr("_current_tasks")
            .ok()
            .and_then(|d| d.cast_into::<PyDict>().ok())
            .and_then(|d| d.get_item(&loop_).ok().flatten()),
    };
    if let Some(task) = current.filter(|t| !t.is_none()) {
        tasks.push(task);
    }
    if let Some(main) = runner_main_task(py) {
        if !tasks.iter().any(|t| t.is(&main)) {
            tasks.push(main);
        }
    }
    tasks
}

/// The main task of the `asyncio.Runner` whose SIGINT handler is installed, if it is one:
/// `functools.partial(runner._on_sigint, main_task=task)` (Python 3.11+).
fn runner_main_task(py: Python<'_>) -> Option<Bound<'_, PyAny>> {
    let signal = loaded(py, "_signal").ok()?;
    let sigint = signal.getattr("SIGINT").ok()?;
    let handler = signal.call_method1("getsignal", (sigint,)).ok()?;
    let func = handler.getattr("func").ok()?;
    if func.getattr("__name__").ok()?.extract::<String>().ok()? != "_on_sigint" {
        return None;
    }
    let keywords = handler
        .getattr("keywords")
        .ok()?
        .cast_into::<PyDict>()
        .ok()?;
    keywords.get_item("main_task").ok().flatten()
}

/// A module that is already imported (`sys.modules`), without importing it.
fn loaded<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    let modules = py.import("sys")?.getattr("modules")?;
    modules
        .cast_into::<PyDict>()?
        .get_item(name)?
        .ok_or_else(|| pyo3::exceptions::PyKeyError::new_err(name.to_string()))
}
