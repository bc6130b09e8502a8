//! Checking an incoming batch against the registered schema.
//!
//! Names and types must match field by field (nested field names and all metadata are
//! ignored); nullability is checked on the data: a column declared NOT NULL must hold no
//! nulls. A batch that passes is re-labelled with the registered schema, which the scan
//! requires to be identical for every batch.
//!
//! Problems are returned as [`SchemaIssue`] values and worded by the caller, which knows
//! how the user spells types (pyarrow's `int32`, not arrow-rs's `Int32`).

use arrow::array::{RecordBatch, RecordBatchOptions};
use arrow::datatypes::{DataType, Schema, SchemaRef};

/// Why a batch cannot be written to a table, naming the field.
#[derive(Debug)]
pub enum SchemaIssue {
    Missing {
        index: usize,
        name: String,
        expected: DataType,
        columns: usize,
    },
    Renamed {
        index: usize,
        got: String,
        expected: String,
    },
    Retyped {
        name: String,
        got: DataType,
        expected: DataType,
    },
    Extra {
        index: usize,
        name: String,
        got: DataType,
        columns: usize,
    },
    Nulls {
        name: String,
        nulls: usize,
    },
    Invalid(String),
}

impl SchemaIssue {
    /// The message for table `table`, with types spelled by `type_name`.
    pub fn describe(&self, table: &str, type_name: impl Fn(&DataType) -> String) -> String {
        match self {
            Self::Missing { index, name, expected, columns } => format!(
                "table '{table}': missing field '{name}' at position {index} (expected {}, the batch has {columns} column(s))",
                type_name(expected)
            ),
            Self::Renamed { index, got, expected } => {
                format!("table '{table}': field {index} is named '{got}' in the batch, expected '{expected}'")
            }
            Self::Retyped { name, got, expected } => format!(
                "table '{table}': field '{name}' has type {} in the batch, expected {}",
                type_name(got),
                type_name(expected)
            ),
            Self::Extra { index, name, got, columns } => format!(
                "table '{table}': unexpected field '{name}' ({}) at position {index}; the table has {columns} column(s)",
                type_name(got)
            ),
            Self::Nulls { name, nulls } => format!(
                "table '{table}': field '{name}' is declared NOT NULL but the batch has {nulls} null value(s) in it"
            ),
            Self::Invalid(msg) => format!("table '{table}': {msg}"),
        }
    }
}

/// Check that data of schema `actual` can be written to a table of schema `expected`.
pub fn check_schema(expected: &Schema, actual: &Schema) -> Result<(), SchemaIssue> {
    let want = expected.fields();
    let got = actual.fields();
    for (index, field) in want.iter().enumerate() {
        let Some(other) = got.get(index) else {
            return Err(SchemaIssue::Missing {
                index,
                name: field.name().clone(),
                expected: field.data_type().clone(),
                columns: got.len(),
            });
        };
        if other.name() != field.name() {
            return Err(SchemaIssue::Renamed {
                index,
                got: other.name().clone(),
                expected: field.name().clone(),
            });
        }
        if !other.data_type().equals_datatype(field.data_type()) {
            return Err(SchemaIssue::Retyped {
                name: field.name().clone(),
                got: other.data_type().clone(),
                expected: field.data_type().clone(),
            });
        }
    }
    if let Some(extra) = got.get(want.len()) {
        return Err(SchemaIssue::Extra {
            index: want.len(),
            name: extra.name().clone(),
            got: extra.data_type().clone(),
            columns: want.len(),
        });
    }
    Ok(())
}

/// Check `batch` and re-label it with `schema`.
pub fn conform(schema: &SchemaRef, batch: RecordBatch) -> Result<RecordBatch, SchemaIssue> {
    check_schema(schema, batch.schema_ref())?;
    for (field, column) in schema.fields().iter().zip(batch.columns()) {
        if !field.is_nullable() && column.null_count() > 0 {
            return Err(SchemaIssue::Nulls {
                name: field.name().clone(),
                nulls: column.null_count(),
            });
        }
    }
    let options = RecordBatchOptions::new()
        .with_match_field_names(false)
        .with_row_count(Some(batch.num_rows()));
    RecordBatch::try_new_with_options(schema.clone(), batch.columns().to_vec(), &options)
        .map_err(|e| SchemaIssue::Invalid(e.to_string()))
}
