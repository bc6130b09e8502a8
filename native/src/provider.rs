//! The table DataFusion sees: a one-partition `StreamingTable` whose partition hands out
//! the channel's single `Reader` once, exported to datafusion-python as an
//! `FFI_TableProvider` PyCapsule.

use std::ffi::CString;
use std::fmt;
use std::sync::{Arc, Mutex};

use arrow::datatypes::SchemaRef;
use datafusion_catalog::streaming::StreamingTable;
use datafusion_common::DataFusionError;
use datafusion_execution::{SendableRecordBatchStream, TaskContext};
use datafusion_ffi::proto::logical_extension_codec::FFI_LogicalExtensionCodec;
use datafusion_ffi::table_provider::FFI_TableProvider;
use datafusion_physical_plan::stream::RecordBatchStreamAdapter;
use datafusion_physical_plan::streaming::PartitionStream;
use pyo3::exceptions::{PyRuntimeError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::PyCapsule;

use crate::channel::{Channel, Reader};

/// The table's only partition. Owns the reader until the first `execute` takes it.
pub struct SingleScanPartition {
    channel: Arc<Channel>,
    reader: Mutex<Option<Reader>>,
}

impl fmt::Debug for SingleScanPartition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SingleScanPartition").field("table", &self.channel.name).finish()
    }
}

impl PartitionStream for SingleScanPartition {
    fn schema(&self) -> &SchemaRef {
        &self.channel.schema
    }

    fn execute(&self, _ctx: Arc<TaskContext>) -> SendableRecordBatchStream {
        let claimed = self.reader.lock().unwrap_or_else(|p| p.into_inner()).take();
        let schema = Arc::clone(&self.channel.schema);
        match claimed {
            Some(reader) => Box::pin(reader.into_stream()),
            None => {
                let err = DataFusionError::Execution(format!(
                    "StreamConsumedError: streaming table '{}' is single-scan and was already \
                     consumed by an earlier scan; register a new streaming table to query again",
                    self.channel.name
                ));
                Box::pin(RecordBatchStreamAdapter::new(schema, futures::stream::once(async { Err(err) })))
            }
        }
    }
}

/// Build the DataFusion table over `channel`.
pub fn streaming_table(channel: Arc<Channel>, unbounded: bool) -> datafusion_common::Result<StreamingTable> {
    let partition = SingleScanPartition {
        reader: Mutex::new(Some(Reader::new(Arc::clone(&channel)))),
        channel: Arc::clone(&channel),
    };
    Ok(StreamingTable::try_new(Arc::clone(&channel.schema), vec![Arc::new(partition)])?
        .with_infinite_table(unbounded))
}

/// Python handle that exports the table to a `datafusion.SessionContext` exactly once.
///
/// It gives up its reference after the first export, so the session owns the table: when
/// the session drops it unscanned, blocked producers learn at once that no reader will come.
#[pyclass(module = "pushtable._native", name = "TableProvider")]
pub struct PyTableProvider {
    table: Mutex<Option<Arc<StreamingTable>>>,
}

impl PyTableProvider {
    pub fn new(table: StreamingTable) -> Self {
        Self { table: Mutex::new(Some(Arc::new(table))) }
    }
}

/// Read the logical extension codec out of a datafusion-python session (or a codec capsule).
fn logical_codec(session: &Bound<'_, PyAny>) -> PyResult<FFI_LogicalExtensionCodec> {
    let name = c"datafusion_logical_extension_codec";
    let capsule_obj = if session.hasattr("__datafusion_logical_extension_codec__")? {
        session.call_method0("__datafusion_logical_extension_codec__")?
    } else {
        session.clone()
    };
    let capsule = capsule_obj.cast::<PyCapsule>().map_err(|_| {
        PyTypeError::new_err(format!(
            "expected a datafusion SessionContext (or a '{}' PyCapsule), got {}",
            name.to_string_lossy(),
            session.get_type().name().map(|n| n.to_string()).unwrap_or_default()
        ))
    })?;
    let ptr = capsule.pointer_checked(Some(name))?;
    // SAFETY: the capsule name guarantees the pointee is an FFI_LogicalExtensionCodec
    // (datafusion-python creates it so); we clone it and never keep the reference.
    let codec = unsafe { ptr.cast::<FFI_LogicalExtensionCodec>().as_ref() };
    Ok(codec.clone())
}

#[pymethods]
impl PyTableProvider {
    fn __datafusion_table_provider__<'py>(
        &self,
        py: Python<'py>,
        session: Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyCapsule>> {
        let codec = logical_codec(&session)?;
        let table = self.table.lock().unwrap_or_else(|p| p.into_inner()).take().ok_or_else(|| {
            PyRuntimeError::new_err("this streaming table was already registered with a session")
        })?;
        let provider = FFI_TableProvider::new_with_ffi_codec(table, false, None, codec);
        PyCapsule::new(py, provider, Some(CString::from(c"datafusion_table_provider")))
    }
}
