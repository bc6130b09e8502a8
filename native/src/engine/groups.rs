//! Pieces the live engine's aggregates share: the keys of their groups, kept as compact
//! copies, and the current values of some groups read without draining the accumulators.

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, RecordBatch, UInt32Array};
use arrow::compute::{concat, interleave, take};
use datafusion::common::{Result, ScalarValue};
use datafusion::logical_expr::{ColumnarValue, EmitTo, GroupsAccumulator};
use datafusion::physical_expr::aggregate::AggregateFunctionExpr;
use datafusion::physical_expr::PhysicalExpr;

use super::window::group_accumulator;

/// Literal arguments as arrays, made once and sliced to each batch's length.
///
/// `count(*)` is `count(1)`: DataFusion's `into_array` would allocate and fill an array of
/// ones for every batch (8,192 rows: 64 KiB, fresh pages each time). One array per literal,
/// as long as the longest batch seen, is kept instead (bounded by the aggregate's literals
/// times the batch size).
#[derive(Default)]
pub struct Literals(Vec<(ScalarValue, ArrayRef)>);

impl Literals {
    fn array(&mut self, value: ColumnarValue, n: usize) -> Result<ArrayRef> {
        let scalar = match value {
            ColumnarValue::Array(array) => return Ok(array),
            ColumnarValue::Scalar(scalar) => scalar,
        };
        // The same value of another type is another literal: `ScalarValue`'s equality ignores
        // a timestamp's zone, and an array of the wrong zone breaks the aggregate that reads it.
        let same = |v: &ScalarValue| v == &scalar && v.data_type() == scalar.data_type();
        if let Some((_, array)) = self.0.iter().find(|(v, a)| same(v) && a.len() >= n) {
            return Ok(array.slice(0, n));
        }
        self.0.retain(|(v, _)| !same(v));
        let array = scalar.to_array_of_size(n)?;
        self.0.push((scalar, Arc::clone(&array)));
        Ok(array)
    }
}

/// Fold `batch` into `accumulators` (one per aggregate, with its arguments and `FILTER`),
/// row `r` into group `groups[r]` of `total`.
pub fn update_all(
    literals: &mut Literals,
    accumulators: &mut [Box<dyn GroupsAccumulator>],
    arguments: &[Vec<std::sync::Arc<dyn PhysicalExpr>>],
    filters: &[Option<std::sync::Arc<dyn PhysicalExpr>>],
    batch: &RecordBatch,
    groups: &[usize],
    total: usize,
) -> Result<()> {
    let n = batch.num_rows();
    for ((acc, args), filter) in accumulators.iter_mut().zip(arguments).zip(filters) {
        let filter = match filter {
            Some(f) => Some(literals.array(f.evaluate(batch)?, n)?),
            None => None,
        };
        let values = args
            .iter()
            .map(|e| literals.array(e.evaluate(batch)?, n))
            .collect::<Result<Vec<_>>>()?;
        acc.update_batch(
            &values,
            groups,
            filter.as_ref().map(|f| f.as_boolean()),
            total,
        )?;
    }
    Ok(())
}

/// The groups `picks` of `acc` (of `total` groups) merged into a fresh accumulator as groups
/// `0..picks.len()`; `acc` keeps every group. DataFusion's `evaluate` drains what it returns,
/// so `acc` hands out its state (the partial-aggregate form DataFusion merges across
/// partitions) and is rebuilt from it.
pub fn copy_groups(
    acc: &mut Box<dyn GroupsAccumulator>,
    expr: &std::sync::Arc<AggregateFunctionExpr>,
    picks: &[u32],
    total: usize,
) -> Result<Box<dyn GroupsAccumulator>> {
    let state = acc.state(EmitTo::All)?;
    let all: Vec<usize> = (0..total).collect();
    acc.merge_batch(&state, &all, None, total)?;
    if picks.len() == total && picks.iter().enumerate().all(|(i, &p)| p as usize == i) {
        // Every group, in order (an updating aggregate whose batches touch every key): the
        // state as it is, with no copy of its rows.
        let mut copy = group_accumulator(expr)?;
        copy.merge_batch(&state, &all, None, total)?;
        return Ok(copy);
    }
    let indices = UInt32Array::from(picks.to_vec());
    let picked = state
        .iter()
        .map(|s| take(s.as_ref(), &indices, None))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let mut copy = group_accumulator(expr)?;
    let groups: Vec<usize> = (0..picks.len()).collect();
    copy.merge_batch(&picked, &groups, None, picks.len())?;
    Ok(copy)
}

/// The group keys, one row per group in creation order, as compact chunks.
#[derive(Default)]
pub struct Keys {
    /// Per chunk, one array per key column.
    chunks: Vec<Vec<ArrayRef>>,
    /// Per group: (chunk, row).
    pub at: Vec<(u32, u32)>,
    bytes: usize,
}

impl Keys {
    /// Keep the keys of the rows `rows` of `columns` (the new groups, in creation order).
    pub fn push(&mut self, columns: &[ArrayRef], rows: &[u32]) -> Result<()> {
        let indices = UInt32Array::from(rows.to_vec());
        let chunk = columns
            .iter()
            .map(|c| take(c.as_ref(), &indices, None))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        self.bytes += chunk
            .iter()
            .map(|c| c.get_array_memory_size())
            .sum::<usize>();
        let n = self.chunks.len() as u32;
        self.at.extend((0..rows.len() as u32).map(|r| (n, r)));
        self.chunks.push(chunk);
        if self.chunks.len() > 64 {
            self.compact()?;
        }
        Ok(())
    }

    /// One chunk instead of many (so an emission interleaves from few arrays).
    fn compact(&mut self) -> Result<()> {
        let width = self.chunks[0].len();
        let merged = (0..width)
            .map(|c| {
                let parts: Vec<&dyn Array> = self.chunks.iter().map(|k| k[c].as_ref()).collect();
                concat(&parts)
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        self.bytes = merged.iter().map(|c| c.get_array_memory_size()).sum();
        self.chunks = vec![merged];
        for (i, at) in self.at.iter_mut().enumerate() {
            *at = (0, i as u32);
        }
        Ok(())
    }

    /// The key columns of `groups`.
    pub fn rows(&self, groups: &[u32], width: usize) -> Result<Vec<ArrayRef>> {
        let picks: Vec<(usize, usize)> = groups
            .iter()
            .map(|&g| {
                let (c, r) = self.at[g as usize];
                (c as usize, r as usize)
            })
            .collect();
        (0..width)
            .map(|c| {
                let parts: Vec<&dyn Array> = self.chunks.iter().map(|k| k[c].as_ref()).collect();
                Ok(interleave(&parts, &picks)?)
            })
            .collect()
    }

    pub fn size(&self) -> usize {
        self.bytes + self.at.capacity() * 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_of_one_value_in_two_zones_are_two_arrays() {
        let mut literals = Literals::default();
        let at = |zone: &str| {
            ColumnarValue::Scalar(ScalarValue::TimestampSecond(
                Some(1_767_225_600),
                Some(zone.into()),
            ))
        };
        let utc = literals.array(at("UTC"), 3).unwrap();
        let tokyo = literals.array(at("Asia/Tokyo"), 3).unwrap();
        assert_eq!(utc.data_type(), &at_type("UTC"));
        assert_eq!(tokyo.data_type(), &at_type("Asia/Tokyo"));
        let again = literals.array(at("UTC"), 2).unwrap();
        assert_eq!(again.data_type(), &at_type("UTC"));
    }

    fn at_type(zone: &str) -> arrow::datatypes::DataType {
        arrow::datatypes::DataType::Timestamp(arrow::datatypes::TimeUnit::Second, Some(zone.into()))
    }
}
