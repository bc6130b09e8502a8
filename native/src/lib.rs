//! `pushtable._native`: the push-mode streaming table core. The modules follow the data:
//!
//! - [`sink`]: the Python face of the sending side (`Sink.write` and friends).
//! - [`schema`], [`order`], [`reorder`]: what a batch is checked against before it is queued
//!   (the table's schema, its declared ordering, a bounded-disorder reorder buffer).
//! - [`channel`]: the log, its readers' cursors (one for a table, any number for a topic)
//!   and the sideband failure slot.
//! - [`provider`]: the single-scan `StreamingTable` and its FFI export to datafusion-python.
//! - [`engine`]: the embedded DataFusion that plans and runs queries needing a stream's order.
//! - [`clock`], [`ctrl_c`]: arrival time, and what a write blocked on Python's main thread
//!   checks while it waits.
//!
//! This file creates tables and topics, and raises one exception class per failure kind
//! (the `pushtable` package maps them onto its public hierarchy).

#[macro_use]
mod plan;

mod channel;
mod clock;
mod ctrl_c;
mod engine;
mod finalizing;
mod import;
mod order;
mod provider;
mod reorder;
mod schema;
mod sink;
mod sizing;

/// A batch is imported on the producer's thread and dropped on the reader's: glibc's
/// allocator serialises those frees on the producer's arena lock; mimalloc frees across
/// threads without a lock.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::{DataType, Schema, SchemaRef};
use arrow_pyarrow::{FromPyArrow, ToPyArrow};
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;

use channel::{Channel, Retention};
use order::{Late, OrderGate};
use provider::PyTableProvider;
use schema::SchemaIssue;
use sink::{check_limits, PyCancelToken, PySubscription, Sink};

create_exception!(
    _native,
    NativeError,
    PyException,
    "Base of the native core's errors."
);
create_exception!(
    _native,
    ClosedError,
    NativeError,
    "Write after close() or fail()."
);
create_exception!(
    _native,
    ReaderGoneError,
    NativeError,
    "The table's reader went away."
);
create_exception!(
    _native,
    SchemaError,
    NativeError,
    "A batch does not match the table schema."
);
create_exception!(
    _native,
    WriteTimeout,
    NativeError,
    "A write's timeout elapsed while blocked."
);
create_exception!(
    _native,
    InputError,
    NativeError,
    "The object is not Arrow data."
);
create_exception!(
    _native,
    Cancelled,
    NativeError,
    "The write's CancelToken was cancelled."
);
create_exception!(
    _native,
    OrderError,
    NativeError,
    "A batch breaks the table's declared ordering."
);
create_exception!(
    _native,
    InvalidQuery,
    NativeError,
    "A bad argument of a function of the live engine's (window(), session_window())."
);

create_exception!(
    _native,
    QueryRefused,
    NativeError,
    "The live engine refuses a query that would never answer (no engine may run it)."
);

/// Run a conversion that third-party data can make panic (arrow-rs asserts on some
/// malformed input) and turn a panic into a Python error instead of an abort.
fn guarded<T>(what: &str, f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(InputError::new_err(format!("{what}: {msg}")))
        }
    }
}

/// A type as a Python user spells it: pyarrow's `str()` (`int32`, `timestamp[us, tz=UTC]`).
fn pyarrow_type_name(py: Python<'_>, dt: &DataType) -> String {
    dt.to_pyarrow(py)
        .and_then(|t| t.str().map(|s| s.to_string()))
        .unwrap_or_else(|_| dt.to_string())
}

fn schema_error(py: Python<'_>, table: &str, issue: &SchemaIssue) -> PyErr {
    SchemaError::new_err(issue.describe(table, |dt| pyarrow_type_name(py, dt)))
}

fn order_gate(schema: &SchemaRef, order_by: &[String], late: &str) -> PyResult<Option<OrderGate>> {
    let late = match late {
        "reject" => Late::Reject,
        "drop" => Late::Drop,
        other => {
            return Err(PyValueError::new_err(format!(
                "late must be 'reject' or 'drop', got {other:?}"
            )))
        }
    };
    if order_by.is_empty() {
        return Ok(None);
    }
    Ok(Some(
        OrderGate::new(schema, order_by, late).map_err(PyValueError::new_err)?,
    ))
}

/// Bytes the queue charges for `batch` (its slice, not the buffers it shares).
#[pyfunction]
fn batch_bytes(batch: Bound<'_, PyAny>) -> PyResult<usize> {
    let batch = RecordBatch::from_pyarrow_bound(&batch)?;
    Ok(sizing::batch_bytes(&batch))
}

/// Called once from an `atexit` hook: producers woken after this never re-enter Python.
#[pyfunction]
fn interpreter_finalizing() {
    finalizing::set();
}

/// Create a streaming table: returns `(sink, provider)`; register the provider with a
/// datafusion-python `SessionContext` and keep the sink for the producers.
#[pyfunction]
#[pyo3(signature = (name, schema, capacity, max_bytes=None, unbounded=false, order_by=vec![], late="reject", arrival_column=None, max_delay=None, validate="basic"))]
#[allow(clippy::too_many_arguments)]
fn streaming_table(
    name: String,
    schema: Bound<'_, PyAny>,
    capacity: usize,
    max_bytes: Option<usize>,
    unbounded: bool,
    order_by: Vec<String>,
    late: &str,
    arrival_column: Option<String>,
    max_delay: Option<i64>,
    validate: &str,
) -> PyResult<(Sink, PyTableProvider)> {
    check_limits(capacity, max_bytes)?;
    let full_check = full_check(validate)?;
    let schema = Arc::new(Schema::from_pyarrow_bound(&schema)?);
    check_arrival(&schema, arrival_column.as_deref())?;
    let gate = order_gate(&schema, &order_by, late)?;
    let reorder = reorder_for(&schema, &order_by, late, max_delay)?;
    let order_by = declared_order(order_by, arrival_column.as_deref());
    let (channel, reader) = Channel::table(
        name,
        schema,
        arrival_column,
        capacity,
        max_bytes,
        gate,
        reorder,
    );
    let table = provider::live_table(reader, unbounded, &order_by, false);
    Ok((
        Sink::new(channel, order_by, full_check)?,
        PyTableProvider::new(table),
    ))
}

/// The reorder buffer of a bounded-disorder table (`max_delay`), which needs one order column.
fn reorder_for(
    schema: &SchemaRef,
    order_by: &[String],
    late: &str,
    max_delay: Option<i64>,
) -> PyResult<Option<reorder::Reorder>> {
    let Some(delay) = max_delay else {
        return Ok(None);
    };
    let [column] = order_by else {
        return Err(PyValueError::new_err(
            "max_delay needs exactly one order_by column (the one rows may arrive late on)",
        ));
    };
    let late = if late == "drop" {
        Late::Drop
    } else {
        Late::Reject
    };
    reorder::Reorder::new(schema, column, delay, late)
        .map(Some)
        .map_err(PyValueError::new_err)
}

/// An arrival column must be a new column name.
fn check_arrival(schema: &Schema, arrival: Option<&str>) -> PyResult<()> {
    match arrival {
        Some(name) if schema.index_of(name).is_ok() => Err(PyValueError::new_err(format!(
            "arrival_column '{name}' is already a column of the schema: name a new column"
        ))),
        Some("") => Err(PyValueError::new_err(
            "arrival_column must be a non-empty name",
        )),
        _ => Ok(()),
    }
}

/// The order readers see: `order_by`, or else the arrival column (ordered by construction).
fn declared_order(order_by: Vec<String>, arrival: Option<&str>) -> Vec<String> {
    match arrival {
        Some(a) if order_by.is_empty() => vec![a.to_string()],
        _ => order_by,
    }
}

/// Create a topic: a sink whose `subscribe` adds readers at any time. `retain_batches` /
/// `retain_bytes` keep recent batches for subscribers starting at the earliest.
#[pyfunction]
#[pyo3(signature = (name, schema, retain_batches=None, retain_bytes=None, order_by=vec![], late="reject", arrival_column=None, max_delay=None, validate="basic"))]
#[allow(clippy::too_many_arguments)]
fn topic(
    name: String,
    schema: Bound<'_, PyAny>,
    retain_batches: Option<usize>,
    retain_bytes: Option<usize>,
    order_by: Vec<String>,
    late: &str,
    arrival_column: Option<String>,
    max_delay: Option<i64>,
    validate: &str,
) -> PyResult<Sink> {
    let full_check = full_check(validate)?;
    let schema = Arc::new(Schema::from_pyarrow_bound(&schema)?);
    check_arrival(&schema, arrival_column.as_deref())?;
    let gate = order_gate(&schema, &order_by, late)?;
    let reorder = reorder_for(&schema, &order_by, late, max_delay)?;
    let order_by = declared_order(order_by, arrival_column.as_deref());
    let retention = Retention {
        batches: retain_batches,
        bytes: retain_bytes,
    };
    Sink::new(
        Channel::topic(name, schema, arrival_column, gate, reorder, retention),
        order_by,
        full_check,
    )
}

/// `validate="basic"` (the default: O(columns) per write) or `"full"` (every value checked).
fn full_check(validate: &str) -> PyResult<bool> {
    match validate {
        "basic" => Ok(false),
        "full" => Ok(true),
        other => Err(PyValueError::new_err(format!(
            "validate must be 'basic' or 'full', got {other:?}"
        ))),
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Sink>()?;
    m.add_class::<PyTableProvider>()?;
    m.add_class::<PyCancelToken>()?;
    m.add_class::<PySubscription>()?;
    m.add_function(wrap_pyfunction!(batch_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(interpreter_finalizing, m)?)?;
    m.add_function(wrap_pyfunction!(streaming_table, m)?)?;
    m.add_function(wrap_pyfunction!(topic, m)?)?;
    engine::register(m)?;
    m.add("NativeError", py.get_type::<NativeError>())?;
    m.add("ClosedError", py.get_type::<ClosedError>())?;
    m.add("ReaderGoneError", py.get_type::<ReaderGoneError>())?;
    m.add("SchemaError", py.get_type::<SchemaError>())?;
    m.add("WriteTimeout", py.get_type::<WriteTimeout>())?;
    m.add("InputError", py.get_type::<InputError>())?;
    m.add("Cancelled", py.get_type::<Cancelled>())?;
    m.add("OrderError", py.get_type::<OrderError>())?;
    m.add("QueryRefused", py.get_type::<QueryRefused>())?;
    m.add("InvalidQuery", py.get_type::<InvalidQuery>())?;
    Ok(())
}
