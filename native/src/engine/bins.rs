//! Where `date_bin`'s windows start in a batch of ordered timestamps, found by arithmetic and
//! binary search on the order column's raw values instead of by evaluating the key.
//!
//! A window aggregate whose input batch spans several windows must cut it where the window
//! key changes. Evaluating `date_bin` to find those rows costs a `take` and the function on
//! hundreds of sampled rows a batch; when the key is `date_bin(<fixed interval>, ts[,
//! <origin>])` of the order column, each window's end is one binary search away. The answer
//! is a guess the caller confirms by evaluating the key itself on the first and last row of
//! every part (see `WindowStream::windows_of`): arithmetic that disagrees with DataFusion's
//! `date_bin` anywhere costs only the fallback, never a wrong window.

use arrow::array::{Array, ArrayRef, AsArray};
use arrow::datatypes::{
    DataType, TimeUnit, TimestampMicrosecondType, TimestampMillisecondType,
    TimestampNanosecondType, TimestampSecondType,
};
use datafusion::common::ScalarValue;
use datafusion::physical_expr::expressions::{CastExpr, Column, Literal};
use datafusion::physical_expr::{PhysicalExpr, ScalarFunctionExpr};
use std::sync::Arc;

/// `date_bin(stride, ts, origin)` of the order column, in nanoseconds.
#[derive(Debug, Clone, Copy)]
pub struct Bins {
    /// The order column (index in the batch).
    column: usize,
    /// Nanoseconds in one tick of the column's unit.
    per_tick: i128,
    stride: i128,
    origin: i128,
}

impl Bins {
    /// The bins of `key` when it is `date_bin` of a fixed-length interval over the timestamp
    /// column `order_column` (with an optional literal origin); None for any other key.
    pub fn of(
        key: &Arc<dyn PhysicalExpr>,
        order_column: usize,
        data_type: &DataType,
    ) -> Option<Self> {
        let DataType::Timestamp(unit, _) = data_type else {
            return None;
        };
        let call = key.downcast_ref::<ScalarFunctionExpr>()?;
        if call.name() != "date_bin" || !(2..=3).contains(&call.args().len()) {
            return None;
        }
        // DataFusion casts a timestamp of another unit to nanoseconds first: a cast to a
        // finer unit multiplies, so the bins of the cast values are those of the raw ones.
        let per_tick = nanos_per_tick(*unit);
        let time = &call.args()[1];
        let column = match time.downcast_ref::<CastExpr>() {
            Some(cast) => match cast.cast_type() {
                DataType::Timestamp(to, _) if per_tick % nanos_per_tick(*to) == 0 => {
                    cast.expr().downcast_ref::<Column>()
                }
                _ => None,
            },
            None => time.downcast_ref::<Column>(),
        };
        let on_order = column.is_some_and(|c| c.index() == order_column);
        let stride = match call.args()[0].downcast_ref::<Literal>()?.value() {
            ScalarValue::IntervalMonthDayNano(Some(v)) if v.months == 0 => {
                i128::from(v.days) * 86_400_000_000_000 + i128::from(v.nanoseconds)
            }
            ScalarValue::IntervalDayTime(Some(v)) => {
                i128::from(v.days) * 86_400_000_000_000 + i128::from(v.milliseconds) * 1_000_000
            }
            _ => return None,
        };
        let origin = match call.args().get(2) {
            None => 0,
            Some(arg) => match arg.downcast_ref::<Literal>()?.value() {
                ScalarValue::TimestampSecond(Some(v), _) => i128::from(*v) * 1_000_000_000,
                ScalarValue::TimestampMillisecond(Some(v), _) => i128::from(*v) * 1_000_000,
                ScalarValue::TimestampMicrosecond(Some(v), _) => i128::from(*v) * 1_000,
                ScalarValue::TimestampNanosecond(Some(v), _) => i128::from(*v),
                _ => return None,
            },
        };
        (on_order && stride > 0).then_some(Self {
            column: order_column,
            per_tick,
            stride,
            origin,
        })
    }

    /// The order column of the batch the bins are read from.
    pub fn column(&self) -> usize {
        self.column
    }

    /// The rows of `column` (non-decreasing timestamps) where a new bin starts, after the
    /// first row; None when the column holds nulls, is not a timestamp, or has more bins
    /// than a quarter of its rows (evaluating the key row by row is then cheaper).
    pub fn starts(&self, column: &ArrayRef) -> Option<Vec<usize>> {
        if column.null_count() > 0 {
            return None;
        }
        let values: &[i64] = match column.data_type() {
            DataType::Timestamp(TimeUnit::Second, _) => {
                column.as_primitive::<TimestampSecondType>().values()
            }
            DataType::Timestamp(TimeUnit::Millisecond, _) => {
                column.as_primitive::<TimestampMillisecondType>().values()
            }
            DataType::Timestamp(TimeUnit::Microsecond, _) => {
                column.as_primitive::<TimestampMicrosecondType>().values()
            }
            DataType::Timestamp(TimeUnit::Nanosecond, _) => {
                column.as_primitive::<TimestampNanosecondType>().values()
            }
            _ => return None,
        };
        let ns = |v: i64| i128::from(v) * self.per_tick;
        let n = values.len();
        let mut starts = Vec::new();
        let mut row = 0;
        // Rows of the last bin found: the next bin is looked for that far ahead first.
        let mut width = 1;
        while row < n {
            let since = ns(values[row]) - self.origin;
            let next = self.origin + (since.div_euclid(self.stride) + 1) * self.stride;
            let end = row + first_at_or_after(&values[row..], width, |v| ns(v) >= next);
            if end >= n {
                break;
            }
            starts.push(end);
            if starts.len() * 4 > n {
                return None;
            }
            width = end - row;
            row = end;
        }
        Some(starts)
    }
}

/// The first index of `values` where `reached` holds (`values.len()` if none; once it holds
/// it holds for every later index), searched outwards from `guess` and then by bisection: a few probes when
/// the guess is near, which for bins of even width it is — each probe of a column the
/// producer just wrote is a cache miss.
fn first_at_or_after(values: &[i64], guess: usize, reached: impl Fn(i64) -> bool) -> usize {
    let n = values.len();
    let guess = guess.min(n - 1);
    // lo: an index where it does not hold (or 0); hi: one where it holds (or n).
    let (mut lo, mut hi) = if guess < n && reached(values[guess]) {
        let mut step = 1;
        let mut hi = guess;
        loop {
            let probe = hi.saturating_sub(step);
            if probe == 0 || !reached(values[probe]) {
                break (probe, hi);
            }
            hi = probe;
            step *= 2;
        }
    } else {
        let mut step = 1;
        let mut lo = guess;
        loop {
            let probe = lo + step;
            if probe >= n {
                break (lo, n);
            }
            if reached(values[probe]) {
                break (lo, probe);
            }
            lo = probe;
            step *= 2;
        }
    };
    if lo == 0 && reached(values[0]) {
        return 0;
    }
    // Invariant: values[lo] does not reach, values[hi] does (or hi == n).
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if reached(values[mid]) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    hi
}

/// Nanoseconds in one tick of `unit`.
fn nanos_per_tick(unit: TimeUnit) -> i128 {
    match unit {
        TimeUnit::Second => 1_000_000_000,
        TimeUnit::Millisecond => 1_000_000,
        TimeUnit::Microsecond => 1_000,
        TimeUnit::Nanosecond => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::TimestampMillisecondArray;

    fn bins(stride_ms: i128, origin_ms: i128) -> Bins {
        Bins {
            column: 0,
            per_tick: 1_000_000,
            stride: stride_ms * 1_000_000,
            origin: origin_ms * 1_000_000,
        }
    }

    #[test]
    fn finds_each_bin_start_across_negative_times_and_origins() {
        // Each value four times: rows 4i..4i+3 hold the i-th.
        let values = [-1500, -1001, -1000, -1, 0, 999, 1000, 1000, 2500];
        let ts: ArrayRef = Arc::new(
            TimestampMillisecondArray::from(
                values.iter().flat_map(|&v| [v; 4]).collect::<Vec<i64>>(),
            )
            .with_timezone("Europe/Paris"),
        );
        assert_eq!(bins(1000, 0).starts(&ts), Some(vec![8, 16, 24, 32]));
        // Bins of 1 s starting at 0.5 s: [-1.5, -0.5), [-0.5, 0.5), [0.5, 1.5), [2.5, 3.5)
        assert_eq!(bins(1000, 500).starts(&ts), Some(vec![12, 20, 32]));
    }

    #[test]
    fn the_search_from_a_guess_finds_what_bisection_finds() {
        let values: Vec<i64> = (0..300).map(|i| (i * 7) / 5).collect();
        for bound in [-5, 0, 1, 7, 100, 418, 419, 1000] {
            let want = values.partition_point(|&v| v < bound);
            for guess in [0, 1, 2, 3, 50, 150, 299, 300, 1000] {
                let got = first_at_or_after(&values, guess, |v| v >= bound);
                assert_eq!(got, want, "bound {bound}, guess {guess}");
            }
        }
        assert_eq!(first_at_or_after(&[5], 1, |v| v >= 6), 1);
        assert_eq!(first_at_or_after(&[5], 1, |v| v >= 5), 0);
    }

    #[test]
    fn gives_up_on_nulls_and_on_a_window_every_few_rows() {
        let with_null: ArrayRef = Arc::new(TimestampMillisecondArray::from(vec![Some(0), None]));
        assert_eq!(bins(1000, 0).starts(&with_null), None);
        let every_row: ArrayRef = Arc::new(TimestampMillisecondArray::from(
            (0..64).map(|i| i * 1000).collect::<Vec<_>>(),
        ));
        assert_eq!(bins(1000, 0).starts(&every_row), None);
    }
}
