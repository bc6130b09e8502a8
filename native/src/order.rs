//! Enforcing a declared ordering (`order_by=`) on everything written to a table.
//!
//! DataFusion trusts a declared ordering and never checks it: a sorted aggregate fed rows
//! out of order silently emits wrong groups. So each batch is checked twice: within itself
//! (before the channel lock, O(rows)), and against the last value written (under the lock,
//! by [`OrderGate::admit`], O(1) for `late="reject"`, O(log rows) for `late="drop"`), so
//! concurrent producers cannot interleave out of order.

use std::sync::Arc;

use std::cmp::Ordering;

use arrow::array::{Array, ArrayRef, AsArray, BooleanArray, RecordBatch};
use arrow::buffer::ScalarBuffer;
use arrow::compute::{cast, filter_record_batch};
use arrow::datatypes::{DataType, Int64Type, SchemaRef};
use arrow::row::{OwnedRow, RowConverter, Rows, SortField};
use arrow::util::display::{ArrayFormatter, FormatOptions};

/// What to do with rows that arrive behind the newest value written.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Late {
    Reject,
    Drop,
}

/// The declared ordering of a table: ascending on `columns`, lexicographically.
#[derive(Debug)]
pub struct OrderGate {
    names: Vec<String>,
    indices: Vec<usize>,
    /// Compares multi-column and non-integer keys; `None` when the key is one integer-like
    /// column, compared as `i64` values (the common case, a timestamp: ~10x cheaper per row).
    converter: Option<RowConverter>,
    late: Late,
}

/// A batch's ordering keys in a comparable form.
#[derive(Debug)]
enum Keys {
    /// One integer-like column, as `i64` (order preserving: see [`integer_like`]).
    Int(ScalarBuffer<i64>),
    /// Anything else, in arrow's row format (byte-wise comparable).
    Rows(Rows),
}

/// One ordering key, kept beyond its batch.
#[derive(Debug)]
enum Key {
    Int(i64),
    Row(OwnedRow),
}

impl Keys {
    fn len(&self) -> usize {
        match self {
            Keys::Int(v) => v.len(),
            Keys::Rows(r) => r.num_rows(),
        }
    }

    fn cmp(&self, i: usize, j: usize) -> Ordering {
        match self {
            Keys::Int(v) => v[i].cmp(&v[j]),
            Keys::Rows(r) => r.row(i).cmp(&r.row(j)),
        }
    }

    fn cmp_key(&self, i: usize, key: &Key) -> Ordering {
        match (self, key) {
            (Keys::Int(v), Key::Int(k)) => v[i].cmp(k),
            (Keys::Rows(r), Key::Row(k)) => r.row(i).cmp(&k.row()),
            _ => unreachable!("a gate's keys are all of one form"),
        }
    }

    fn key(&self, i: usize) -> Key {
        match self {
            Keys::Int(v) => Key::Int(v[i]),
            Keys::Rows(r) => Key::Row(r.row(i).owned()),
        }
    }

    /// The first row that sorts before the row just above it, if any.
    fn first_descent(&self) -> Option<usize> {
        match self {
            Keys::Int(v) => {
                if ascending(v) {
                    None
                } else {
                    v.windows(2).position(|w| w[1] < w[0]).map(|i| i + 1)
                }
            }
            Keys::Rows(_) => (1..self.len()).find(|&i| self.cmp(i, i - 1) == Ordering::Less),
        }
    }
}

/// Whether `v` never decreases: branch-free passes over equal-length chunks of the column and
/// of itself shifted by one, which the compiler vectorises; with AVX2 where the CPU has it
/// (the wheel targets baseline x86-64, whose SSE2 has no 64-bit compare).
fn ascending(v: &[i64]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { ascending_avx2(v) };
    }
    ascending_portable(v)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn ascending_avx2(v: &[i64]) -> bool {
    ascending_portable(v)
}

#[inline(always)]
fn ascending_portable(v: &[i64]) -> bool {
    let n = v.len();
    n < 2
        || v[..n - 1]
            .chunks(512)
            .zip(v[1..].chunks(512))
            .all(|(a, b)| a.iter().zip(b).fold(true, |ok, (x, y)| ok & (x <= y)))
}

/// Types whose values convert to `i64` keeping their order (what a watermark is expressed in).
fn integer_like(dt: &DataType) -> bool {
    matches!(
        dt,
        DataType::Int8
            | DataType::Int16
            | DataType::Int32
            | DataType::Int64
            | DataType::UInt8
            | DataType::UInt16
            | DataType::UInt32
            | DataType::Timestamp(_, _)
            | DataType::Date32
            | DataType::Date64
    )
}

/// A batch checked within itself, waiting for [`OrderGate::admit`] under the lock.
#[derive(Debug)]
pub struct Checked {
    batch: RecordBatch,
    keys: Keys,
    /// Rows dropped within the batch (late="drop").
    pub dropped: usize,
}

impl Checked {
    pub fn batch(&self) -> &RecordBatch {
        &self.batch
    }
}

/// The newest ordering key written so far: its row form (to compare) and its values (to
/// name them in an error).
#[derive(Debug)]
pub struct Newest {
    key: Key,
    values: Vec<ArrayRef>,
}

impl OrderGate {
    pub fn new(schema: &SchemaRef, columns: &[String], late: Late) -> Result<Self, String> {
        if columns.is_empty() {
            return Err("order_by names no column".into());
        }
        let mut indices = Vec::with_capacity(columns.len());
        let mut fields = Vec::with_capacity(columns.len());
        for name in columns {
            let index = schema.index_of(name).map_err(|_| {
                format!(
                    "order_by column '{name}' is not in the schema (columns: {:?})",
                    schema.fields().iter().map(|f| f.name()).collect::<Vec<_>>()
                )
            })?;
            let dt = schema.field(index).data_type().clone();
            if !RowConverter::supports_fields(&[SortField::new(dt.clone())]) {
                return Err(format!(
                    "order_by column '{name}' has type {dt}, which cannot be ordered"
                ));
            }
            indices.push(index);
            fields.push(SortField::new(dt));
        }
        let converter = if fields.len() == 1 && integer_like(schema.field(indices[0]).data_type()) {
            None
        } else {
            Some(RowConverter::new(fields).map_err(|e| e.to_string())?)
        };
        Ok(Self {
            names: columns.to_vec(),
            indices,
            converter,
            late,
        })
    }

    fn key_columns(&self, batch: &RecordBatch) -> Vec<ArrayRef> {
        self.indices
            .iter()
            .map(|&i| Arc::clone(batch.column(i)))
            .collect()
    }

    /// `row`'s ordering key, worded: `ts=2024-01-01T00:00:01` (or `a=1, b=2`).
    fn describe(&self, columns: &[ArrayRef], row: usize) -> String {
        let options = FormatOptions::default();
        self.names
            .iter()
            .zip(columns)
            .map(|(name, col)| {
                let value = ArrayFormatter::try_new(col.as_ref(), &options)
                    .map(|f| f.value(row).to_string())
                    .unwrap_or_else(|_| "?".into());
                format!("{name}={value}")
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    fn column_list(&self) -> String {
        self.names
            .iter()
            .map(|n| format!("'{n}'"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The type of the first order column when a watermark can be declared on it (an
    /// integer or a timestamp: values that convert to `i64` keeping their order), else why not.
    pub fn watermark_type(&self, schema: &SchemaRef) -> Result<DataType, String> {
        let dt = schema.field(self.indices[0]).data_type().clone();
        if integer_like(&dt) {
            Ok(dt)
        } else {
            Err(format!(
                "a watermark needs an integer, date or timestamp order column; '{}' is {dt}",
                self.names[0]
            ))
        }
    }

    /// `columns` (the batch's key columns) in comparable form.
    fn keys(&self, columns: &[ArrayRef]) -> Result<Keys, String> {
        match &self.converter {
            None => {
                let col = cast(&columns[0], &DataType::Int64).map_err(|e| e.to_string())?;
                Ok(Keys::Int(col.as_primitive::<Int64Type>().values().clone()))
            }
            Some(converter) => Ok(Keys::Rows(
                converter
                    .convert_columns(columns)
                    .map_err(|e| e.to_string())?,
            )),
        }
    }

    /// The first order column of `batch` as `i64` values (the watermark's scale).
    fn first_as_i64(&self, batch: &RecordBatch) -> Result<arrow::array::Int64Array, String> {
        let col = batch.column(self.indices[0]);
        let col = cast(col, &DataType::Int64).map_err(|e| e.to_string())?;
        Ok(col.as_primitive::<Int64Type>().clone())
    }

    /// Check `batch` within itself: no nulls in the order columns; sorted (reject) or with
    /// the rows behind the batch's own running maximum removed (drop).
    pub fn check(&self, batch: RecordBatch) -> Result<Checked, String> {
        let columns = self.key_columns(&batch);
        for (name, col) in self.names.iter().zip(&columns) {
            if col.null_count() > 0 {
                return Err(format!(
                    "order column '{name}' holds {} null value(s); an ordered table cannot place them",
                    col.null_count()
                ));
            }
        }
        let keys = self.keys(&columns)?;
        let Some(descent) = keys.first_descent() else {
            return Ok(Checked {
                batch,
                keys,
                dropped: 0,
            });
        };
        match self.late {
            Late::Reject => Err(format!(
                "out of order on {}: row {descent} has {} after row {} with {} (the batch must be sorted ascending)",
                self.column_list(),
                self.describe(&columns, descent),
                descent - 1,
                self.describe(&columns, descent - 1)
            )),
            Late::Drop => {
                let n = keys.len();
                let mut keep = Vec::with_capacity(n);
                let mut max: Option<usize> = None;
                for i in 0..n {
                    let ok = max.is_none_or(|m| keys.cmp(i, m) != Ordering::Less);
                    if ok {
                        max = Some(i);
                    }
                    keep.push(ok);
                }
                let dropped = keep.iter().filter(|k| !**k).count();
                let batch = filter_record_batch(&batch, &BooleanArray::from(keep))
                    .map_err(|e| e.to_string())?;
                let keys = self.keys(&self.key_columns(&batch))?;
                Ok(Checked {
                    batch,
                    keys,
                    dropped,
                })
            }
        }
    }

    /// Admit a checked batch after the newest value written (call under the channel lock).
    /// Returns the batch to enqueue (late rows removed when dropping) and how many rows were
    /// dropped here; updates `newest`.
    ///
    /// `floor` is the table's watermark (see [`OrderGate::watermark_type`]): rows whose first
    /// order column is below it are late like rows behind the newest value.
    pub fn admit(
        &self,
        checked: Checked,
        newest: &mut Option<Newest>,
        floor: Option<i64>,
    ) -> Result<(RecordBatch, usize), String> {
        let Checked { batch, keys, .. } = checked;
        let n = keys.len();
        if n == 0 {
            return Ok((batch, 0));
        }
        let mut start = 0;
        if let Some(floor) = floor {
            let below = match &keys {
                Keys::Int(v) => v.partition_point(|v| *v < floor),
                Keys::Rows(_) => self
                    .first_as_i64(&batch)?
                    .values()
                    .partition_point(|v| *v < floor),
            };
            if below > 0 {
                match self.late {
                    Late::Reject => {
                        return Err(format!(
                            "out of order on {}: the batch starts at {}, behind the watermark \
                             advance() declared ({} as an integer)",
                            self.column_list(),
                            self.describe(&self.key_columns(&batch), 0),
                            floor
                        ))
                    }
                    Late::Drop => start = below,
                }
            }
        }
        if let Some(prev) = newest.as_ref() {
            if start < n && keys.cmp_key(start, &prev.key) == Ordering::Less {
                match self.late {
                    Late::Reject => {
                        return Err(format!(
                            "out of order on {}: the batch starts at {}, before the previous maximum {}",
                            self.column_list(),
                            self.describe(&self.key_columns(&batch), 0),
                            self.describe(&prev.values, 0)
                        ))
                    }
                    // The kept rows are sorted: skip the prefix behind the newest value.
                    Late::Drop => {
                        let behind = |i| keys.cmp_key(i, &prev.key) == Ordering::Less;
                        start = start.max(partition_point(n, behind))
                    }
                }
            }
        }
        let batch = if start > 0 {
            batch.slice(start, n - start)
        } else {
            batch
        };
        if batch.num_rows() > 0 {
            let last = batch.num_rows() - 1;
            let values: Vec<ArrayRef> = self
                .key_columns(&batch)
                .iter()
                .map(|c| c.slice(last, 1))
                .collect();
            *newest = Some(Newest {
                key: keys.key(n - 1),
                values,
            });
        }
        Ok((batch, start))
    }
}

/// The first index in `0..n` for which `before(i)` is false (`before` is monotone).
fn partition_point(n: usize, before: impl Fn(usize) -> bool) -> usize {
    let (mut lo, mut hi) = (0, n);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if before(mid) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}
