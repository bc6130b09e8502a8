//! The Python face of a streaming table's or topic's sending side: `Sink.write` imports
//! Arrow data, checks it, and enqueues it with the GIL released while it waits for room
//! (checking for Ctrl-C on the main thread); `advance`, `close`, `fail`, `subscribe` and
//! `stats` map the channel's outcomes onto the module's exception classes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow::array::RecordBatch;
use arrow::error::ArrowError;
use arrow::record_batch::RecordBatchReader;
use arrow_pyarrow::ToPyArrow;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::channel::{
    CancelToken, Channel, CursorWatch, Limits, OnSlow, Prelude, PushError, Start,
};
use crate::import::{AlignedStreamReader, BatchImporter, ImportError, Imported};
use crate::provider::{self, PyTableProvider};
use crate::{ctrl_c, guarded, schema, schema_error};
use crate::{Cancelled, ClosedError, InputError, OrderError, ReaderGoneError, WriteTimeout};

/// Cancels one asynchronous write request (see `Sink.write(token=...)`).
#[pyclass(module = "pushtable._native", name = "CancelToken", frozen)]
pub struct PyCancelToken {
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
pub struct Sink {
    channel: Arc<Channel>,
    order_by: Vec<String>,
    /// `validate="full"`: every value of every batch is checked (UTF-8, offsets, dictionary
    /// keys), work proportional to the batch's bytes. Otherwise a write checks what costs
    /// O(columns): the schema, nullability, and that each column's buffers are as long as
    /// its length says, as DataFusion and DuckDB do for data from the same process.
    full_check: bool,
    importer: BatchImporter,
    /// Batches (and bytes) whose buffers the import copied to align them.
    realigned_batches: AtomicU64,
    realigned_bytes: AtomicU64,
}

/// Reports one topic subscription's counters (it does not keep the subscription alive).
#[pyclass(module = "pushtable._native", name = "Subscription", frozen)]
pub struct PySubscription {
    watch: CursorWatch,
}

#[pymethods]
impl PySubscription {
    /// Let go of the subscription's cursor unless a query reads it (then the query's end
    /// does): whether it was let go.
    fn close(&self) -> bool {
        self.watch.close()
    }

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

pub fn check_limits(capacity: usize, max_bytes: Option<usize>) -> PyResult<()> {
    if capacity == 0 {
        return Err(PyValueError::new_err("capacity must be at least 1"));
    }
    if max_bytes == Some(0) {
        return Err(PyValueError::new_err("max_bytes must be at least 1"));
    }
    Ok(())
}

impl Sink {
    pub fn new(channel: Arc<Channel>, order_by: Vec<String>, full_check: bool) -> PyResult<Self> {
        let importer = BatchImporter::new(Arc::clone(&channel.input_schema))
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(Self {
            channel,
            order_by,
            full_check,
            importer,
            realigned_batches: AtomicU64::new(0),
            realigned_bytes: AtomicU64::new(0),
        })
    }

    /// Check a batch the importer took (its columns' lengths are checked against their
    /// buffers there) and enqueue it.
    fn push(
        &self,
        py: Python<'_>,
        imported: Result<Imported, ImportError>,
        deadline: Option<Instant>,
        interruptible: bool,
        token: Option<&CancelToken>,
    ) -> PyResult<()> {
        let name = &self.channel.name;
        let Imported {
            batch,
            bytes,
            realigned,
        } = imported.map_err(|e| match e {
            ImportError::Column {
                name: column,
                error,
            } => invalid_column(name, &column, &error),
            ImportError::Nulls {
                name: column,
                nulls,
            } => schema_error(
                py,
                name,
                &schema::SchemaIssue::Nulls {
                    name: column,
                    nulls,
                },
            ),
            ImportError::Other(error) => InputError::new_err(error.to_string()),
        })?;
        if realigned > 0 {
            self.realigned_batches.fetch_add(1, Ordering::Relaxed);
            self.realigned_bytes
                .fetch_add(realigned as u64, Ordering::Relaxed);
        }
        // A batch the importer labelled with the table's own schema was checked on import.
        let batch = if Arc::ptr_eq(batch.schema_ref(), &self.channel.input_schema) {
            batch
        } else {
            schema::conform(&self.channel.input_schema, batch)
                .map_err(|i| schema_error(py, name, &i))?
        };
        if self.full_check {
            // Every value (UTF-8, offsets, dictionary keys): work per byte, so without the GIL.
            crate::finalizing::detach(py, || check_values(&batch))
                .map_err(|(column, e)| invalid_column(name, &column, &e))?;
        }
        let channel = &self.channel;
        let result = crate::finalizing::detach(py, || {
            // Only Python's main thread receives Ctrl-C: other producers never take the GIL
            // while they wait.
            let mut check = || Python::attach(ctrl_c::check);
            let tick: Option<&mut dyn FnMut() -> PyResult<()>> = if interruptible {
                Some(&mut check)
            } else {
                None
            };
            channel.push(batch, bytes, deadline, token, tick)
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
                self.importer
                    .import(data)
                    .map_err(|e| InputError::new_err(e.to_string()))
            })
            .map_err(|e| (e, 0))?;
            self.push(py, batch, deadline, interruptible, token)
                .map_err(|e| (e, 0))?;
            return Ok(1);
        }
        if has("__arrow_c_stream__")? {
            let mut reader = guarded("cannot import the stream", || {
                AlignedStreamReader::from_pyarrow(data)
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
                // queue admits them (backpressure reaches the stream's own producer). Without
                // the GIL, as pyarrow's own readers pull a stream: a stream from the network
                // (a Flight DoPut) waits for its next message here, and an import may copy a
                // misaligned batch; a stream that needs Python takes the GIL itself.
                let next = guarded("cannot read the stream", || {
                    Ok(crate::finalizing::detach(py, || reader.next_imported()))
                })
                .map_err(|e| (e, written))?;
                match next {
                    None => return Ok(written),
                    Some(Err(ImportError::Other(e))) => {
                        return Err((
                            InputError::new_err(format!("reading the stream failed: {e}")),
                            written,
                        ))
                    }
                    Some(imported) => self
                        .push(py, imported, deadline, interruptible, token)
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

/// `validate="full"`'s check of every value of every column: the first column that fails.
fn check_values(batch: &RecordBatch) -> Result<(), (String, ArrowError)> {
    let schema = batch.schema();
    for (field, column) in schema.fields().iter().zip(batch.columns()) {
        column
            .to_data()
            .validate_full()
            .map_err(|e| (field.name().clone(), e))?;
    }
    Ok(())
}

fn invalid_column(table: &str, column: &str, error: &ArrowError) -> PyErr {
    InputError::new_err(format!(
        "streaming table '{table}': column '{column}' of the batch is not valid Arrow data \
         ({error}); nothing was queued"
    ))
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
                    AlignedStreamReader::from_pyarrow(&obj)
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
        let table = provider::live_table(reader, unbounded, &self.order_by, true);
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
        d.set_item(
            "realigned_batches",
            self.realigned_batches.load(Ordering::Relaxed),
        )?;
        d.set_item(
            "realigned_bytes",
            self.realigned_bytes.load(Ordering::Relaxed),
        )?;
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
