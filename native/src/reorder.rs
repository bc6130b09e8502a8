//! Bounded disorder (`order_by="ts", max_delay=...`): rows may arrive up to `max_delay` behind
//! the newest seen; the sink holds them in a reorder buffer and releases them in order once the
//! watermark (newest − max_delay, or a later `advance`) passes them. Rows behind the watermark
//! are late and follow `late=`; nothing inside a batch is dropped silently.

use arrow::array::{Array, AsArray, RecordBatch};
use arrow::compute::{cast, concat_batches, sort_to_indices, take_record_batch};
use arrow::datatypes::{DataType, Int64Type, SchemaRef};

use crate::order::Late;

/// The policy: which column, how far behind, what to do with late rows.
#[derive(Debug)]
pub struct Reorder {
    column: usize,
    name: String,
    delay: i64,
    late: Late,
}

/// What the buffer holds (under the channel lock).
#[derive(Debug, Default)]
pub struct Held {
    batches: Vec<RecordBatch>,
    pub rows: usize,
    pub bytes: usize,
    newest: Option<i64>,
    /// Everything below this was released: a row below it is late.
    released: Option<i64>,
}

/// What admitting a batch gives: rows to enqueue now (in order) and rows dropped as late.
pub struct Admitted {
    pub ready: Option<RecordBatch>,
    pub late: usize,
}

fn keys(batch: &RecordBatch, column: usize) -> Result<arrow::array::Int64Array, String> {
    let col = cast(batch.column(column), &DataType::Int64).map_err(|e| e.to_string())?;
    Ok(col.as_primitive::<Int64Type>().clone())
}

impl Reorder {
    /// `delay` is in the order column's integer scale (its unit for timestamps).
    pub fn new(schema: &SchemaRef, column: &str, delay: i64, late: Late) -> Result<Self, String> {
        if delay < 0 {
            return Err(format!("max_delay must be >= 0, got {delay}"));
        }
        let index = schema
            .index_of(column)
            .map_err(|_| format!("order_by column '{column}' is not in the schema"))?;
        Ok(Self {
            column: index,
            name: column.to_string(),
            delay,
            late,
        })
    }

    /// Take `batch` (checked against the schema, any order within `max_delay`) into `held`,
    /// with `floor` the table's `advance` watermark; release what the watermark passed.
    pub fn admit(
        &self,
        held: &mut Held,
        batch: RecordBatch,
        floor: Option<i64>,
    ) -> Result<Admitted, String> {
        let k = keys(&batch, self.column)?;
        if k.null_count() > 0 {
            return Err(format!(
                "order column '{}' holds {} null value(s); an ordered table cannot place them",
                self.name,
                k.null_count()
            ));
        }
        let behind = held.released.max(floor);
        let late_mask: Vec<bool> = k
            .values()
            .iter()
            .map(|v| behind.is_some_and(|b| *v < b))
            .collect();
        let late = late_mask.iter().filter(|l| **l).count();
        let batch = if late > 0 {
            if self.late == Late::Reject {
                let first = late_mask.iter().position(|l| *l).unwrap_or(0);
                return Err(format!(
                    "out of order on '{}': row {first} has {} (as an integer), behind the \
                     watermark {} (newest seen minus max_delay, or advance()): it is late",
                    self.name,
                    k.value(first),
                    behind.unwrap_or_default()
                ));
            }
            let keep =
                arrow::array::BooleanArray::from(late_mask.iter().map(|l| !l).collect::<Vec<_>>());
            arrow::compute::filter_record_batch(&batch, &keep).map_err(|e| e.to_string())?
        } else {
            batch
        };
        if batch.num_rows() > 0 {
            let max = keys(&batch, self.column)?
                .values()
                .iter()
                .copied()
                .max()
                .expect("rows");
            held.newest = Some(held.newest.map_or(max, |n| n.max(max)));
            held.rows += batch.num_rows();
            held.bytes += crate::sizing::batch_bytes(&batch);
            held.batches.push(batch);
        }
        let watermark = held.newest.map(|n| n.saturating_sub(self.delay)).max(floor);
        let ready = match watermark {
            Some(w) => self.release(held, Some(w))?,
            None => None,
        };
        Ok(Admitted { ready, late })
    }

    /// Release the held rows at or below `upto` (all of them for None), sorted.
    pub fn release(
        &self,
        held: &mut Held,
        upto: Option<i64>,
    ) -> Result<Option<RecordBatch>, String> {
        if held.batches.is_empty() {
            if let Some(u) = upto {
                held.released = Some(held.released.map_or(u, |r| r.max(u)));
            }
            return Ok(None);
        }
        let schema = held.batches[0].schema();
        let all = concat_batches(&schema, &held.batches).map_err(|e| e.to_string())?;
        let order =
            sort_to_indices(all.column(self.column), None, None).map_err(|e| e.to_string())?;
        let sorted = take_record_batch(&all, &order).map_err(|e| e.to_string())?;
        let k = keys(&sorted, self.column)?;
        let cut = match upto {
            Some(u) => k.values().partition_point(|v| *v <= u),
            None => sorted.num_rows(),
        };
        let (out, rest) = (
            sorted.slice(0, cut),
            sorted.slice(cut, sorted.num_rows() - cut),
        );
        held.batches.clear();
        held.rows = rest.num_rows();
        held.bytes = crate::sizing::batch_bytes(&rest);
        if rest.num_rows() > 0 {
            held.batches.push(rest);
        }
        let released_to = match upto {
            Some(u) => Some(u),
            None => k.values().last().copied(),
        };
        if let Some(u) = released_to {
            held.released = Some(held.released.map_or(u, |r| r.max(u)));
        }
        Ok((cut > 0).then_some(out))
    }
}
