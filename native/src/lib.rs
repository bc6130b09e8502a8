//! `pushtable._native`: the push-mode streaming table core.
//!
//! - [`channel`]: the log, its readers' cursors (one for a table, any number for a topic)
//!   and the sideband failure slot.
//! - [`schema`]: checking batches against the registered schema.
//! - [`provider`]: the single-scan `StreamingTable` and its FFI export to datafusion-python.
//! - [`ctrl_c`]: what a write blocked on Python's main thread checks while it waits.
//!
//! This file is the Python face of the sender side: importing Arrow data, releasing the GIL
//! while blocked, and raising one exception class per failure kind (the `pushtable`
//! package maps them onto its public hierarchy).

mod channel;
mod clock;
mod ctrl_c;
mod engine;
mod order;
mod provider;
mod reorder;
mod schema;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::array::RecordBatch;
use arrow::datatypes::{DataType, Schema, SchemaRef};
use arrow::ffi_stream::ArrowArrayStreamReader;
use arrow::record_batch::RecordBatchReader;
use arrow_pyarrow::{FromPyArrow, ToPyArrow};
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;

use channel::{
    CancelToken, Channel, CursorWatch, Limits, OnSlow, Prelude, PushError, Retention, Start,
};
use order::{Late, OrderGate};
use provider::PyTableProvider;
use schema::SchemaIssue;

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

/// Cancels one asynchronous write request (see `Sink.write(token=...)`).
#[pyclass(module = "pushtable._native", name = "CancelToken", frozen)]
struct PyCancelToken {
    token: CancelToken,
}

#[pymethods]
impl PyCancelToken {
    /// Cancel: no batch of the request not yet enqueued will be. Returns how many were.
    fn cancel(&self) -> usize {
        self.token.cancel()
    }

    /// Batches of the request enqueued so far.
    #[getter]
    fn written(&self) -> usize {
        self.token.written()
    }
}

/// The sending side of one streaming table or topic.
#[pyclass(module = "pushtable._native", name = "Sink", frozen)]
struct Sink {
    channel: Arc<Channel>,
    order_by: Vec<String>,
}

/// Reports one topic subscription's counters (it does not keep the subscription alive).
#[pyclass(module = "pushtable._native", name = "Subscription", frozen)]
struct PySubscription {
    watch: CursorWatch,
}

#[pymethods]
impl PySubscription {
    /// Counters as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let s = self.watch.stats();
        let d = pyo3::types::PyDict::new(py);
        d.set_item("queued_batches", s.queued_batches)?;
        d.set_item("queued_bytes", s.queued_bytes)?;
        d.set_item("read_batches", s.read_batches)?;
        d.set_item("state", s.state)?;
        d.set_item("detached_because", s.detached_because)?;
        Ok(d)
    }
}

fn check_limits(capacity: usize, max_bytes: Option<usize>) -> PyResult<()> {
    if capacity == 0 {
        return Err(PyValueError::new_err("capacity must be at least 1"));
    }
    if max_bytes == Some(0) {
        return Err(PyValueError::new_err("max_bytes must be at least 1"));
    }
    Ok(())
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

impl Sink {
    fn push(
        &self,
        py: Python<'_>,
        batch: RecordBatch,
        deadline: Option<Instant>,
        interruptible: bool,
        token: Option<&CancelToken>,
    ) -> PyResult<()> {
        let name = &self.channel.name;
        // Check what the C Data Interface can carry a lie about: null counts, UTF-8, dictionary
        // keys, offsets within the values. (It carries no buffer sizes: a batch whose lengths
        // outrun its buffers must be checked before export, as the server does for the wire.)
        for (field, column) in batch.schema().fields().iter().zip(batch.columns()) {
            column.to_data().validate_full().map_err(|e| {
                InputError::new_err(format!(
                    "streaming table '{name}': column '{}' of the batch is not valid Arrow \
                     data ({e}); nothing was queued",
                    field.name()
                ))
            })?;
        }
        let batch = schema::conform(&self.channel.input_schema, batch)
            .map_err(|i| schema_error(py, name, &i))?;
        let channel = &self.channel;
        let result = py.detach(|| {
            // Only Python's main thread receives Ctrl-C: other producers never take the GIL
            // while they wait.
            let mut check = || Python::attach(ctrl_c::check);
            let tick: Option<&mut dyn FnMut() -> PyResult<()>> = if interruptible {
                Some(&mut check)
            } else {
                None
            };
            channel.push(batch, deadline, token, tick)
        });
        result.map_err(|e| match e {
            PushError::Closed => {
                ClosedError::new_err(format!("streaming table '{name}' is closed"))
            }
            PushError::Failed(msg) => {
                ClosedError::new_err(format!("streaming table '{name}' was failed: {msg}"))
            }
            PushError::ReaderGone(why) => ReaderGoneError::new_err(format!(
                "streaming table '{name}' has no reader any more: {why}"
            )),
            PushError::Timeout(waited) => WriteTimeout::new_err(format!(
                "write to streaming table '{name}' timed out after {:.3}s with the queue full",
                waited.as_secs_f64()
            )),
            PushError::Cancelled => {
                Cancelled::new_err(format!("write to streaming table '{name}' was cancelled"))
            }
            PushError::Order(msg) => OrderError::new_err(format!("table '{name}': {msg}")),
            PushError::Interrupted(err) => err,
        })
    }

    /// Write every item of `data`; on an error, record on it how many batches were queued.
    fn write_all(
        &self,
        py: Python<'_>,
        data: &Bound<'_, PyAny>,
        deadline: Option<Instant>,
        interruptible: bool,
        token: Option<&CancelToken>,
    ) -> Result<usize, (PyErr, usize)> {
        // A hostile object's __getattr__ may raise: that too is "not Arrow data".
        let has = |name: &str| {
            data.hasattr(name)
                .map_err(|e| (InputError::new_err(e.to_string()), 0))
        };
        if has("__arrow_c_array__")? {
            let batch = guarded("cannot import the batch", || {
                RecordBatch::from_pyarrow_bound(data)
                    .map_err(|e| InputError::new_err(e.to_string()))
            })
            .map_err(|e| (e, 0))?;
            self.push(py, batch, deadline, interruptible, token)
                .map_err(|e| (e, 0))?;
            return Ok(1);
        }
        if has("__arrow_c_stream__")? {
            let mut reader = guarded("cannot import the stream", || {
                ArrowArrayStreamReader::from_pyarrow_bound(data)
                    .map_err(|e| InputError::new_err(e.to_string()))
            })
            .map_err(|e| (e, 0))?;
            // Check the stream's schema before anything is enqueued.
            let name = &self.channel.name;
            schema::check_schema(&self.channel.input_schema, &reader.schema())
                .map_err(|i| (schema_error(py, name, &i), 0))?;
            let mut written = 0;
            loop {
                // Batches are pulled one at a time: a lazy stream is read at the pace the
                // queue admits them (backpressure reaches the stream's own producer).
                let next = guarded("cannot read the stream", || Ok(reader.next()))
                    .map_err(|e| (e, written))?;
                match next {
                    None => return Ok(written),
                    Some(Err(e)) => {
                        return Err((
                            InputError::new_err(format!("reading the stream failed: {e}")),
                            written,
                        ))
                    }
                    Some(Ok(batch)) => self
                        .push(py, batch, deadline, interruptible, token)
                        .map_err(|e| (e, written))?,
                }
                written += 1;
            }
        }
        let got = data
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_default();
        Err((
            InputError::new_err(format!(
                "expected Arrow data (a pyarrow RecordBatch or Table, or an object with \
                 __arrow_c_array__ / __arrow_c_stream__), got {got}"
            )),
            0,
        ))
    }
}

/// `timeout` seconds from now; None (no limit) for None, infinity, or a deadline too far
/// away to represent.
fn deadline_from(timeout: Option<f64>) -> PyResult<Option<Instant>> {
    match timeout {
        None => Ok(None),
        Some(t) if t.is_nan() || t < 0.0 => Err(PyValueError::new_err(format!(
            "timeout must be a number >= 0 or None, got {t}"
        ))),
        Some(t) => Ok(Duration::try_from_secs_f64(t)
            .ok()
            .and_then(|d| Instant::now().checked_add(d))),
    }
}

#[pymethods]
impl Sink {
    /// Write one batch (`__arrow_c_array__`) or every batch of a stream (`__arrow_c_stream__`).
    ///
    /// `interruptible` (Python's main thread) checks for Ctrl-C while blocked; `token`
    /// makes the request cancellable from another thread. An error raised after some
    /// batches of a stream were queued carries their number as `batches_written`.
    #[pyo3(signature = (data, timeout=None, interruptible=false, token=None))]
    fn write(
        &self,
        py: Python<'_>,
        data: Bound<'_, PyAny>,
        timeout: Option<f64>,
        interruptible: bool,
        token: Option<Bound<'_, PyCancelToken>>,
    ) -> PyResult<usize> {
        let deadline = deadline_from(timeout)?;
        let token = token.as_ref().map(|t| &t.get().token);
        self.write_all(py, &data, deadline, interruptible, token)
            .map_err(|(err, written)| {
                // Best effort: an exception instance that refuses attributes keeps its message.
                let _ = err.value(py).setattr("batches_written", written);
                err
            })
    }

    /// A token that cancels one write request from another thread.
    fn token(&self) -> PyCancelToken {
        PyCancelToken {
            token: CancelToken::new(Arc::clone(&self.channel)),
        }
    }

    /// Declare that no row whose first order column is below `value` (as an integer: the
    /// column's own scale) will come. Raises ValueError where the table cannot have one.
    fn advance(&self, value: i64) -> PyResult<()> {
        let name = &self.channel.name;
        self.channel
            .watermark_type()
            .map_err(PyValueError::new_err)?;
        self.channel.advance(value).map_err(|e| match e {
            PushError::Order(msg) => PyValueError::new_err(msg),
            PushError::Failed(msg) => {
                ClosedError::new_err(format!("streaming table '{name}' was failed: {msg}"))
            }
            _ => ClosedError::new_err(format!("streaming table '{name}' is closed")),
        })
    }

    /// The schema readers see (with the arrival column, if any).
    fn table_schema<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.channel.schema.to_pyarrow(py)
    }

    /// The watermark's type (the first order column's), or None.
    fn watermark_type<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        match self.channel.watermark_type() {
            Ok(dt) => Ok(Some(dt.to_pyarrow(py)?)),
            Err(_) => Ok(None),
        }
    }

    /// End of stream. Idempotent.
    fn close(&self) {
        self.channel.close();
    }

    /// Fail the reader with `message`; never blocks. False if it came too late to matter.
    fn fail(&self, message: String) -> bool {
        self.channel.fail(message)
    }

    /// A new reader of this topic: `(subscription, provider)`. `prelude` (Arrow stream) is
    /// read before the topic's batches; `start` is "now" or "earliest".
    #[pyo3(signature = (capacity, max_bytes=None, start="now", slow_timeout=None, prelude=None, unbounded=false))]
    fn subscribe(
        &self,
        capacity: usize,
        max_bytes: Option<usize>,
        start: &str,
        slow_timeout: Option<f64>,
        prelude: Option<Bound<'_, PyAny>>,
        unbounded: bool,
    ) -> PyResult<(PySubscription, PyTableProvider)> {
        if !self.channel.is_topic() {
            return Err(PyValueError::new_err(format!(
                "'{}' is a streaming table, not a topic",
                self.channel.name
            )));
        }
        check_limits(capacity, max_bytes)?;
        let start = match start {
            "now" => Start::Now,
            "earliest" => Start::Earliest,
            other => {
                return Err(PyValueError::new_err(format!(
                    "start must be 'now' or 'earliest', got {other:?}"
                )))
            }
        };
        let on_slow = match slow_timeout {
            None => OnSlow::Block,
            Some(t) if t.is_nan() || t < 0.0 => {
                return Err(PyValueError::new_err(format!(
                    "slow_timeout must be a number >= 0, got {t}"
                )))
            }
            Some(t) => OnSlow::Detach(Duration::try_from_secs_f64(t).unwrap_or(Duration::MAX)),
        };
        let prelude: Option<Prelude> = match prelude {
            None => None,
            Some(obj) => Some(Box::new(guarded(
                "cannot import the history stream",
                || {
                    ArrowArrayStreamReader::from_pyarrow_bound(&obj)
                        .map_err(|e| InputError::new_err(e.to_string()))
                },
            )?)),
        };
        let reader = self.channel.subscribe(
            Limits {
                capacity,
                max_bytes,
                on_slow,
            },
            start,
            prelude,
        );
        let watch = reader.watch();
        let table = provider::live_table(reader, unbounded, &self.order_by);
        Ok((PySubscription { watch }, PyTableProvider::new(table)))
    }

    /// Counters as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let s = self.channel.stats();
        let d = pyo3::types::PyDict::new(py);
        d.set_item("rows", s.rows)?;
        d.set_item("batches", s.batches)?;
        d.set_item("bytes", s.bytes)?;
        d.set_item("queued_batches", s.queued_batches)?;
        d.set_item("queued_bytes", s.queued_bytes)?;
        d.set_item("waiting_writers", s.waiting_writers)?;
        d.set_item("late_rows", s.late_rows)?;
        d.set_item("held_rows", s.held_rows)?;
        d.set_item("held_bytes", s.held_bytes)?;
        d.set_item("blocked_seconds", s.blocked.as_secs_f64())?;
        d.set_item("closed", s.closed)?;
        d.set_item("failed", s.failed)?;
        d.set_item("reader_gone", s.reader_gone)?;
        if self.channel.is_topic() {
            d.set_item("subscribers", s.subscribers)?;
            d.set_item("detached", s.detached)?;
        }
        Ok(d)
    }
}

/// Bytes the queue charges for `batch` (its slice, not the buffers it shares).
#[pyfunction]
fn batch_bytes(batch: Bound<'_, PyAny>) -> PyResult<usize> {
    let batch = RecordBatch::from_pyarrow_bound(&batch)?;
    Ok(channel::batch_bytes(&batch))
}

/// Called once from an `atexit` hook: producers woken after this never re-enter Python.
#[pyfunction]
fn interpreter_finalizing() {
    channel::set_finalizing();
}

/// Create a streaming table: returns `(sink, provider)`; register the provider with a
/// datafusion-python `SessionContext` and keep the sink for the producers.
#[pyfunction]
#[pyo3(signature = (name, schema, capacity, max_bytes=None, unbounded=false, order_by=vec![], late="reject", arrival_column=None, max_delay=None))]
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
) -> PyResult<(Sink, PyTableProvider)> {
    check_limits(capacity, max_bytes)?;
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
    let table = provider::live_table(reader, unbounded, &order_by);
    Ok((Sink { channel, order_by }, PyTableProvider::new(table)))
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
#[pyo3(signature = (name, schema, retain_batches=None, retain_bytes=None, order_by=vec![], late="reject", arrival_column=None, max_delay=None))]
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
) -> PyResult<Sink> {
    let schema = Arc::new(Schema::from_pyarrow_bound(&schema)?);
    check_arrival(&schema, arrival_column.as_deref())?;
    let gate = order_gate(&schema, &order_by, late)?;
    let reorder = reorder_for(&schema, &order_by, late, max_delay)?;
    let order_by = declared_order(order_by, arrival_column.as_deref());
    let retention = Retention {
        batches: retain_batches,
        bytes: retain_bytes,
    };
    Ok(Sink {
        channel: Channel::topic(name, schema, arrival_column, gate, reorder, retention),
        order_by,
    })
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
    Ok(())
}
