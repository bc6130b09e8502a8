//! Arrow data from Python: single batches (`__arrow_c_array__`) imported against the
//! table's known schema, and streams (`__arrow_c_stream__`) imported batch by batch with
//! their buffers aligned for their types.
//!
//! A batch of a known table needs no schema import: its C schema is compared in place
//! with the table's (format strings and top-level names, no allocation), and its arrays are
//! imported with the table's own types. Only a batch whose schema differs takes the general
//! import, whose schema the caller then compares field by field to say what is wrong.
//!
//! Arrow data read from the wire or from an IPC file can hold buffers at any address (a
//! Flight message's body lands wherever its framing puts it). arrow-pyarrow realigns (copies)
//! such buffers when it imports one batch; arrow-rs's `ArrowArrayStreamReader` does not, and
//! refuses the batch (a panic). This reader imports every batch of a stream the way a single
//! batch is imported, so `write(table)` accepts whatever `write(batch)` accepts.

use std::ffi::CStr;
use std::sync::Arc;

use arrow::array::{ArrayData, RecordBatch, RecordBatchOptions, RecordBatchReader, StructArray};
use arrow::datatypes::{DataType, Schema, SchemaRef};
use arrow::error::ArrowError;
use arrow::ffi::{from_ffi_and_data_type, FFI_ArrowArray, FFI_ArrowSchema};
use arrow::ffi_stream::FFI_ArrowArrayStream;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyTuple};

/// One node of a schema as the C Data Interface spells it: what a batch's C schema must
/// say, node by node, to be imported with the table's types.
struct Shape {
    format: String,
    children: Vec<Shape>,
    dictionary: Option<Box<Shape>>,
}

impl Shape {
    fn of(schema: &FFI_ArrowSchema) -> Self {
        Self {
            format: schema.format().to_owned(),
            children: schema.children().map(Self::of).collect(),
            dictionary: schema.dictionary().map(|d| Box::new(Self::of(d))),
        }
    }

    /// Same types, node by node (nested names, nullability flags and metadata aside, as
    /// `schema::check_schema` ignores them).
    fn matches(&self, schema: &FFI_ArrowSchema) -> bool {
        self.format == schema.format()
            && self.children.len() == schema.n_children as usize
            && self
                .children
                .iter()
                .zip(schema.children())
                .all(|(shape, child)| shape.matches(child))
            && match (&self.dictionary, schema.dictionary()) {
                (None, None) => true,
                (Some(shape), Some(dict)) => shape.matches(dict),
                _ => false,
            }
    }
}

/// Imports single batches (`__arrow_c_array__`) for a table of one schema.
pub struct BatchImporter {
    schema: SchemaRef,
    struct_type: DataType,
    names: Vec<String>,
    columns: Vec<Shape>,
}

impl BatchImporter {
    pub fn new(schema: SchemaRef) -> Result<Self, ArrowError> {
        let struct_type = DataType::Struct(schema.fields().clone());
        let exported = FFI_ArrowSchema::try_from(&struct_type)?;
        Ok(Self {
            names: schema.fields().iter().map(|f| f.name().clone()).collect(),
            columns: exported.children().map(Shape::of).collect(),
            schema,
            struct_type,
        })
    }

    /// The batch of `obj` (which has `__arrow_c_array__`): labelled with the table's schema
    /// when its C schema matches it, else with its own (for the caller's schema check).
    pub fn import(&self, obj: &Bound<'_, PyAny>) -> PyResult<Result<Imported, ImportError>> {
        let pair = obj.call_method0("__arrow_c_array__")?;
        let pair = pair.cast::<PyTuple>().map_err(|_| {
            PyTypeError::new_err("__arrow_c_array__ did not return a (schema, array) tuple")
        })?;
        if pair.len() != 2 {
            return Err(PyTypeError::new_err(
                "__arrow_c_array__ did not return a (schema, array) tuple",
            ));
        }
        let capsule =
            |index: usize, name: &CStr| -> PyResult<std::ptr::NonNull<std::ffi::c_void>> {
                let item = pair.get_item(index)?;
                let capsule = item.cast::<PyCapsule>().map_err(|_| {
                    PyTypeError::new_err("__arrow_c_array__ did not return PyCapsules")
                })?;
                capsule.pointer_checked(Some(name))
            };
        let schema_ptr = capsule(0, c"arrow_schema")?;
        let array_ptr = capsule(1, c"arrow_array")?;
        // SAFETY: the capsules' names guarantee their types; the schema capsule outlives this
        // call (the tuple holds it); `from_raw` moves the array out and marks the capsule's
        // copy released, so it is released exactly once.
        let schema = unsafe { schema_ptr.cast::<FFI_ArrowSchema>().as_ref() };
        let array = unsafe { FFI_ArrowArray::from_raw(array_ptr.cast().as_ptr()) };
        let known = self.same_as_table(schema);
        let imported = if known {
            // SAFETY: the array's C schema says the same types as `struct_type`.
            unsafe { from_ffi_and_data_type(array, self.struct_type.clone()) }
        } else {
            // SAFETY: the array and its schema come from the same export.
            unsafe { arrow::ffi::from_ffi(array, schema) }
        }
        .map_err(|e| PyTypeError::new_err(e.to_string()))?;
        let schema = if known {
            Arc::clone(&self.schema)
        } else {
            let DataType::Struct(_) = imported.data_type() else {
                return Err(PyTypeError::new_err(
                    "__arrow_c_array__ did not describe a record batch (a struct array)",
                ));
            };
            Arc::new(Schema::try_from(schema).map_err(|e| PyTypeError::new_err(e.to_string()))?)
        };
        Ok(into_batch(imported, schema))
    }

    fn same_as_table(&self, schema: &FFI_ArrowSchema) -> bool {
        schema.format() == "+s"
            && schema.n_children as usize == self.columns.len()
            && schema.dictionary().is_none()
            && self
                .columns
                .iter()
                .zip(&self.names)
                .zip(schema.children())
                .all(|((shape, name), child)| {
                    child.name() == Some(name.as_str()) && shape.matches(child)
                })
    }
}

/// A batch as imported, with what the channel charges for it.
pub struct Imported {
    pub batch: RecordBatch,
    /// The bytes its columns' slices span (`sizing::batch_bytes`), taken while importing.
    pub bytes: usize,
    /// The bytes of the buffers the import copied to align them for their types (0 for a
    /// batch built in memory; data read from the wire or a file can land at any address).
    pub realigned: usize,
}

/// Why a batch could not be imported.
pub enum ImportError {
    /// A column's buffers contradict its lengths (`ArrayData::validate`, O(1) per column).
    Column {
        name: String,
        error: ArrowError,
    },
    /// A NOT NULL column holds nulls.
    Nulls {
        name: String,
        nulls: usize,
    },
    Other(ArrowError),
}

impl From<ArrowError> for ImportError {
    fn from(error: ArrowError) -> Self {
        Self::Other(error)
    }
}

/// A struct array's columns as a batch of `schema`, its buffers aligned for their types
/// (copying only those that are not: data from the wire can land at any address), each
/// column checked against its buffers' lengths and sized, in one pass without copies.
///
/// The C Data Interface carries no buffer sizes: the importer derives them from the
/// lengths (a string column's values from its last offset), so `validate` catches a column
/// whose lengths contradict its buffers.
fn into_batch(mut data: ArrayData, schema: SchemaRef) -> Result<Imported, ImportError> {
    if data.null_count() > 0 {
        return Err(ArrowError::InvalidArgumentError(
            "the batch's struct array has top-level nulls; a record batch cannot".into(),
        )
        .into());
    }
    let mut starts = Vec::new();
    buffer_starts(&data, &mut starts);
    data.align_buffers();
    let realigned = moved_bytes(&data, &starts, &mut 0);
    let mut bytes = 0;
    for (field, column) in schema.fields().iter().zip(data.child_data()) {
        column.validate().map_err(|error| ImportError::Column {
            name: field.name().clone(),
            error,
        })?;
        if !field.is_nullable() && column.null_count() > 0 {
            return Err(ImportError::Nulls {
                name: field.name().clone(),
                nulls: column.null_count(),
            });
        }
        bytes += crate::sizing::data_bytes(column);
    }
    let rows = data.len();
    let columns = StructArray::from(data).into_parts().1;
    let batch = RecordBatch::try_new_with_options(
        schema,
        columns,
        &RecordBatchOptions::new()
            .with_row_count(Some(rows))
            .with_match_field_names(false),
    )?;
    Ok(Imported {
        batch,
        bytes,
        realigned,
    })
}

/// Where each buffer of `data` starts, children and dictionaries included, in a fixed order.
fn buffer_starts(data: &ArrayData, out: &mut Vec<*const u8>) {
    out.extend(data.buffers().iter().map(|b| b.as_ptr()));
    for child in data.child_data() {
        buffer_starts(child, out);
    }
}

/// The bytes of the buffers of `data` that no longer start where `starts` (taken in
/// `buffer_starts`' order before aligning) says: those `align_buffers` copied.
fn moved_bytes(data: &ArrayData, starts: &[*const u8], next: &mut usize) -> usize {
    let mut moved = 0;
    for buffer in data.buffers() {
        if starts.get(*next) != Some(&buffer.as_ptr()) {
            moved += buffer.len();
        }
        *next += 1;
    }
    for child in data.child_data() {
        moved += moved_bytes(child, starts, next);
    }
    moved
}

/// A C stream of record batches, read with each batch's buffers aligned.
pub struct AlignedStreamReader {
    stream: FFI_ArrowArrayStream,
    schema: SchemaRef,
}

impl AlignedStreamReader {
    /// The stream of a Python object with `__arrow_c_stream__` (a pyarrow Table, a reader).
    pub fn from_pyarrow(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        let capsule = obj.call_method0("__arrow_c_stream__")?;
        let capsule = capsule
            .cast::<PyCapsule>()
            .map_err(|_| PyTypeError::new_err("__arrow_c_stream__ did not return a PyCapsule"))?;
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

impl AlignedStreamReader {
    /// The next batch, imported as `BatchImporter::import` imports one.
    pub fn next_imported(&mut self) -> Option<Result<Imported, ImportError>> {
        let get_next = self.stream.get_next?;
        let mut array = FFI_ArrowArray::empty();
        // SAFETY: a live stream's callbacks take the stream itself.
        if unsafe { get_next(&mut self.stream, &mut array) } != 0 {
            return Some(Err(ArrowError::CDataInterface(last_error(
                &mut self.stream,
            ))
            .into()));
        }
        if array.is_released() {
            return None; // the end of the stream
        }
        let struct_type = DataType::Struct(self.schema.fields().clone());
        // SAFETY: the array was produced by this stream, whose schema is `self.schema`.
        Some(
            match unsafe { from_ffi_and_data_type(array, struct_type) } {
                Ok(data) => into_batch(data, Arc::clone(&self.schema)),
                Err(e) => Err(e.into()),
            },
        )
    }
}

impl Iterator for AlignedStreamReader {
    type Item = Result<RecordBatch, ArrowError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_imported().map(|r| {
            r.map(|i| i.batch).map_err(|e| match e {
                ImportError::Column { name, error } => ArrowError::InvalidArgumentError(format!(
                    "column '{name}' is not valid Arrow data: {error}"
                )),
                ImportError::Nulls { name, nulls } => ArrowError::InvalidArgumentError(format!(
                    "column '{name}' is declared NOT NULL but holds {nulls} null value(s)"
                )),
                ImportError::Other(error) => error,
            })
        })
    }
}

impl RecordBatchReader for AlignedStreamReader {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.schema)
    }
}
