//! What Arrow data is charged: the bytes a batch or a column holds as a slice. A leaf: the
//! channel, the reorder buffer and the importer all count with it.

use arrow::array::{ArrayData, RecordBatch};

/// Bytes a batch holds *as a slice*: a 1,000-row slice of a 1,000,000-row column counts
/// its 1,000 rows, not the parent buffer (`get_array_memory_size` would).
pub fn batch_bytes(batch: &RecordBatch) -> usize {
    batch
        .columns()
        .iter()
        .map(|c| data_bytes(&c.to_data()))
        .sum()
}

/// What one column's data is charged: the bytes its slice spans.
pub fn data_bytes(data: &ArrayData) -> usize {
    data.get_slice_memory_size()
        .unwrap_or_else(|_| data.get_array_memory_size())
}
