//! Arrow streams from Python (`__arrow_c_stream__`), imported batch by batch with their
//! buffers aligned for their types.
//!
//! Arrow data read from the wire or from an IPC file can hold buffers at any address (a
//! Flight message's body lands wherever its framing puts it). arrow-pyarrow realigns (copies)
//! such buffers when it imports one batch; arrow-rs's `ArrowArrayStreamReader` does not, and
//! refuses the batch (a panic). This reader imports every batch of a stream the way a single
//! batch is imported, so `write(table)` accepts whatever `write(batch)` accepts.

use std::ffi::CStr;
use std::sync::Arc;

use arrow::array::{RecordBatch, RecordBatchOptions, RecordBatchReader, StructArray};
use arrow::datatypes::{DataType, Schema, SchemaRef};
use arrow::error::ArrowError;
use arrow::ffi::{from_ffi_and_data_type, FFI_ArrowArray, FFI_ArrowSchema};
use arrow::ffi_stream::FFI_ArrowArrayStream;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyCapsule;

/// A C stream of record batches, read with each batch's buffers aligned.
pub struct AlignedStreamReader {
    stream: FFI_ArrowArrayStream,
    schema: SchemaRef,
}

impl AlignedStreamReader {
    /// The stream of a Python object with `__arrow_c_stream__` (a pyarrow Table, a reader).
    pub fn from_pyarrow(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        let capsule = obj.call_method0("__arrow_c_stream__")?;
        let capsule = capsule.cast::<PyCapsule>().map_err(|_| {
            PyTypeError::new_err("__arrow_c_stream__ did not return a PyCapsule")
        })?;
        let ptr = capsule.pointer_checked(Some(c"arrow_array_stream"))?;
        // SAFETY: the capsule's name guarantees an FFI_ArrowArrayStream; `from_raw` moves it
        // out and marks the capsule's copy released, so it is released exactly once.
        let stream = unsafe { FFI_ArrowArrayStream::from_raw(ptr.cast().as_ptr()) };
        Self::try_new(stream).map_err(|e| PyTypeError::new_err(e.to_string()))
    }

    fn try_new(mut stream: FFI_ArrowArrayStream) -> Result<Self, ArrowError> {
        let get_schema = stream
            .get_schema
            .ok_or_else(|| ArrowError::CDataInterface("the stream is released".into()))?;
        let mut schema = FFI_ArrowSchema::empty();
        // SAFETY: a live stream's callbacks take the stream itself.
        if unsafe { get_schema(&mut stream, &mut schema) } != 0 {
            return Err(ArrowError::CDataInterface(last_error(&mut stream)));
        }
        let schema = Arc::new(Schema::try_from(&schema)?);
        Ok(Self { stream, schema })
    }
}

/// The stream's own description of its last error.
fn last_error(stream: &mut FFI_ArrowArrayStream) -> String {
    let Some(get_last_error) = stream.get_last_error else {
        return "the stream failed".into();
    };
    // SAFETY: the returned string, if any, stays valid until the next call on the stream.
    let text = unsafe { get_last_error(stream) };
    if text.is_null() {
        return "the stream failed".into();
    }
    unsafe { CStr::from_ptr(text) }
        .to_string_lossy()
        .into_owned()
}

impl Iterator for AlignedStreamReader {
    type Item = Result<RecordBatch, ArrowError>;

    fn next(&mut self) -> Option<Self::Item> {
        let get_next = self.stream.get_next?;
        let mut array = FFI_ArrowArray::empty();
        // SAFETY: a live stream's callbacks take the stream itself.
        if unsafe { get_next(&mut self.stream, &mut array) } != 0 {
            return Some(Err(ArrowError::CDataInterface(last_error(
                &mut self.stream,
            ))));
        }
        if array.is_released() {
            return None; // the end of the stream
        }
        let struct_type = DataType::Struct(self.schema.fields().clone());
        // SAFETY: the array was produced by this stream, whose schema is `self.schema`.
        let imported = unsafe { from_ffi_and_data_type(array, struct_type) };
        Some(imported.and_then(|mut data| {
            data.align_buffers(); // copies only the buffers that are not aligned
            let rows = data.len();
            let columns = StructArray::from(data).into_parts().1;
            RecordBatch::try_new_with_options(
                Arc::clone(&self.schema),
                columns,
                &RecordBatchOptions::new().with_row_count(Some(rows)),
            )
        }))
    }
}

impl RecordBatchReader for AlignedStreamReader {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.schema)
    }
}
