//! Checking an incoming batch against the registered schema.
//!
//! Names and types must match field by field (nested field names and all metadata are
//! ignored); nullability is checked on the data: a column declared NOT NULL must hold no
//! nulls. A batch that passes is re-labelled with the registered schema, which the scan
//! requires to be identical for every batch.

use arrow::array::{RecordBatch, RecordBatchOptions};
use arrow::datatypes::{Schema, SchemaRef};

/// Describe why `actual` cannot be written to a table of `expected`, naming the field.
pub fn check_schema(table: &str, expected: &Schema, actual: &Schema) -> Result<(), String> {
    let want = expected.fields();
    let got = actual.fields();
    for (i, field) in want.iter().enumerate() {
        let Some(other) = got.get(i) else {
            return Err(format!(
                "table '{table}': missing field '{}' at position {i} (expected {}, the batch has {} column(s))",
                field.name(),
                field.data_type(),
                got.len()
            ));
        };
        if other.name() != field.name() {
            return Err(format!(
                "table '{table}': field {i} is named '{}' in the batch, expected '{}'",
                other.name(),
                field.name()
            ));
        }
        if !other.data_type().equals_datatype(field.data_type()) {
            return Err(format!(
                "table '{table}': field '{}' has type {} in the batch, expected {}",
                field.name(),
                other.data_type(),
                field.data_type()
            ));
        }
    }
    if let Some(extra) = got.get(want.len()) {
        return Err(format!(
            "table '{table}': unexpected field '{}' ({}) at position {}; the table has {} column(s)",
            extra.name(),
            extra.data_type(),
            want.len(),
            want.len()
        ));
    }
    Ok(())
}

/// Check `batch` and re-label it with `schema`; the error message names the offending field.
pub fn conform(table: &str, schema: &SchemaRef, batch: RecordBatch) -> Result<RecordBatch, String> {
    check_schema(table, schema, batch.schema_ref())?;
    for (field, column) in schema.fields().iter().zip(batch.columns()) {
        if !field.is_nullable() && column.null_count() > 0 {
            return Err(format!(
                "table '{table}': field '{}' is declared NOT NULL but the batch has {} null value(s) in it",
                field.name(),
                column.null_count()
            ));
        }
    }
    let options = RecordBatchOptions::new()
        .with_match_field_names(false)
        .with_row_count(Some(batch.num_rows()));
    RecordBatch::try_new_with_options(schema.clone(), batch.columns().to_vec(), &options)
        .map_err(|e| format!("table '{table}': {e}"))
}
