//! Group values for a `GROUP BY` whose only key is the window (`GROUP BY date_bin(..., ts)`):
//! over ordered input the key never decreases, so a group is a run of equal keys and a new
//! group starts exactly where the key changes. Finding those places is one vectorised
//! comparison of the column with itself shifted by a row, instead of hashing every row into
//! a table (DataFusion's order-preserving group table interns row by row: the window
//! aggregate's main cost when the key is the window alone).

use arrow::array::{Array, ArrayRef, UInt32Array};
use arrow::compute::kernels::cmp::distinct;
use arrow::compute::{concat, take};
use datafusion::common::Result;
use datafusion::logical_expr::EmitTo;
use datafusion::physical_plan::aggregates::group_values::GroupValues;

/// One group per run of equal keys, numbered in order; the keys of the open groups are kept
/// as compact copies (never slices of an input batch, which would pin its buffers).
#[derive(Default)]
pub struct RunGroupValues {
    /// Keys of the groups not yet emitted, in chunks (one per input batch that opened groups).
    chunks: Vec<ArrayRef>,
    len: usize,
    /// The newest group's key (one row): the next batch's first row may continue it.
    last: Option<ArrayRef>,
}

impl RunGroupValues {
    pub fn new() -> Self {
        Self::default()
    }
}

impl GroupValues for RunGroupValues {
    fn intern(&mut self, cols: &[ArrayRef], groups: &mut Vec<usize>) -> Result<()> {
        let col = &cols[0];
        let n = col.len();
        groups.clear();
        if n == 0 {
            return Ok(());
        }
        // The rows that open a group: the first one unless it continues the newest group,
        // then every row whose key differs from the row before it (few: runs are long).
        let continues = match &self.last {
            Some(last) => !distinct(last, &col.slice(0, 1))?.value(0),
            None => false,
        };
        let mut starts: Vec<u32> = Vec::new();
        if !continues {
            starts.push(0);
        }
        // The key never decreases: equal ends mean one run, with no row-by-row comparison.
        if n > 1 && distinct(&col.slice(0, 1), &col.slice(n - 1, 1))?.value(0) {
            let changes = distinct(&col.slice(1, n - 1), &col.slice(0, n - 1))?;
            starts.extend(changes.values().set_indices().map(|i| i as u32 + 1));
        }
        // Row r belongs to the newest group before the batch, plus the starts at or before r.
        let mut group = self.len.wrapping_sub(1);
        let mut from = 0;
        groups.reserve(n);
        for &start in &starts {
            let start = start as usize;
            groups.extend(std::iter::repeat_n(group, start - from));
            group = group.wrapping_add(1);
            from = start;
        }
        groups.extend(std::iter::repeat_n(group, n - from));
        if !starts.is_empty() {
            self.len += starts.len();
            self.chunks
                .push(take(col.as_ref(), &UInt32Array::from(starts), None)?);
        }
        self.last = Some(concat(&[&col.slice(n - 1, 1)])?);
        Ok(())
    }

    fn size(&self) -> usize {
        self.chunks
            .iter()
            .chain(&self.last)
            .map(|a| a.get_array_memory_size())
            .sum()
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn len(&self) -> usize {
        self.len
    }

    fn emit(&mut self, emit_to: EmitTo) -> Result<Vec<ArrayRef>> {
        let parts: Vec<&dyn Array> = self.chunks.iter().map(|a| a.as_ref()).collect();
        let all = concat(&parts)?;
        self.chunks.clear();
        let out = match emit_to {
            EmitTo::All => {
                self.len = 0;
                self.last = None;
                all
            }
            EmitTo::First(n) => {
                let rest = all.slice(n, all.len() - n);
                if !rest.is_empty() {
                    self.chunks.push(concat(&[&rest])?);
                }
                self.len -= n;
                if self.len == 0 {
                    self.last = None; // a later row with the same key opens a group of its own
                }
                all.slice(0, n)
            }
        };
        Ok(vec![out])
    }

    fn clear_shrink(&mut self, _num_rows: usize) {
        self.chunks.clear();
        self.len = 0;
        self.last = None;
    }
}
