//! Spark's window function, `window(ts, size[, slide[, start]])`, by Spark's name and
//! semantics: a row at `ts` belongs to every window `[s, s + size)` with `s = start + n * slide`
//! that covers it (one window when there is no slide, or when it equals the size); the value is
//! Spark's `struct<start, end>`. Durations are Spark's strings ('10 seconds', '1 minute',
//! '1 day 12 hours': weeks, days, hours, minutes, seconds, milliseconds, microseconds; no
//! months) or fixed-length `INTERVAL` literals; a bad one is refused at planning, naming the
//! argument.
//!
//! A `GROUP BY window(ts, ...)` over a table ordered by `ts` is answered by the window
//! aggregate (each window once, as it closes): the rule hands it a [`Windowing`], with which
//! it expands each row into its windows' starts, and rebuilds the struct above it
//! ([`WindowEnvelope`]). Evaluated anywhere else (a projection, a bounded aggregate), a
//! tumbling window is a plain function of `ts`; a sliding one, which puts a row in several
//! windows, needs the window aggregate and fails naming what to do.
//!
//! `session_window(ts, gap)` is answered by the session aggregate (`session.rs`); its gap is
//! checked here, at planning, as `window()`'s durations are.

use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, Int64Array, StructArray, UInt32Array};
use arrow::compute::cast;
use arrow::datatypes::{DataType, Field, FieldRef, Fields, Int64Type, TimeUnit};
use datafusion::common::{exec_err, plan_err, Result, ScalarValue};
use datafusion::logical_expr::sort_properties::{ExprProperties, SortProperties};
use datafusion::logical_expr::{
    ColumnarValue, ReturnFieldArgs, ScalarFunctionArgs, ScalarUDF, ScalarUDFImpl, Signature,
    Volatility,
};

/// What starts the message of a query refused for a bad argument (raised as `ValueError`).
pub const INVALID: &str = "pushtable: invalid query: ";

/// The arguments of `window` after the time column, by Spark's names.
const ARGUMENTS: [&str; 3] = ["windowDuration", "slideDuration", "startTime"];

/// At most this many windows per row (`size / slide`): each row is copied into each.
const MAX_OVERLAP: i64 = 10_000;

/// Tumbling or sliding windows over a time column, in that column's ticks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Windowing {
    pub size: i64,
    pub slide: i64,
    pub offset: i64,
}

impl Windowing {
    /// The windows of `window(ts, args...)` for a time column of `ts_type`, from the literal
    /// arguments (None: not a literal); refused naming the argument.
    pub fn from_arguments(ts_type: &DataType, args: &[Option<&ScalarValue>]) -> Result<Self> {
        let DataType::Timestamp(unit, _) = ts_type else {
            return plan_err!(
                "{INVALID}window(timeColumn, ...) needs a timestamp column, got {ts_type}"
            );
        };
        if args.is_empty() || args.len() > 3 {
            return plan_err!(
                "{INVALID}window(timeColumn, windowDuration[, slideDuration[, startTime]]) takes 2 to 4 \
                 arguments, got {}",
                args.len() + 1
            );
        }
        let mut ticks = [0i64; 3];
        for (i, arg) in args.iter().enumerate() {
            let name = ARGUMENTS[i];
            let Some(value) = arg else {
                return plan_err!("{INVALID}window(): {name} must be a literal duration");
            };
            ticks[i] = duration_ticks(value, *unit).map_err(|why| {
                datafusion::common::DataFusionError::Plan(format!(
                    "{INVALID}window(): {name} {why}"
                ))
            })?;
            if i < 2 && ticks[i] <= 0 {
                return plan_err!("{INVALID}window(): {name} must be positive, got {value}");
            }
        }
        let size = ticks[0];
        let slide = if args.len() >= 2 { ticks[1] } else { size };
        if slide > size {
            return plan_err!(
                "{INVALID}window(): slideDuration ({}) must not be longer than windowDuration ({})",
                args[1].map(|v| v.to_string()).unwrap_or_default(),
                args[0].map(|v| v.to_string()).unwrap_or_default()
            );
        }
        if (size + slide - 1) / slide > MAX_OVERLAP {
            return plan_err!(
                "{INVALID}window(): windowDuration / slideDuration puts each row in more than \
                 {MAX_OVERLAP} windows; use a longer slide"
            );
        }
        Ok(Self {
            size,
            slide,
            offset: if args.len() == 3 { ticks[2] } else { 0 },
        })
    }

    /// The latest window start at or before `ts`.
    pub fn newest(&self, ts: i64) -> i64 {
        ts - (ts - self.offset).rem_euclid(self.slide)
    }

    /// The earliest window start whose window still holds `ts` (every later row's windows
    /// start at or after it, since rows come in time order).
    pub fn oldest(&self, ts: i64) -> i64 {
        let newest = self.newest(ts);
        // windows newest - j * slide hold ts while newest - j * slide + size > ts
        let behind = (newest + self.size - ts - 1) / self.slide;
        newest - behind * self.slide
    }

    /// Whether a row is in one window only.
    pub fn tumbling(&self) -> bool {
        self.slide == self.size
    }

    /// Each row of `ts` (a timestamp column) copied into each of its windows, oldest first:
    /// the rows to take and their windows' starts (as `ts`'s type).
    pub fn expand(&self, ts: &ArrayRef) -> Result<(UInt32Array, ArrayRef)> {
        let ticks = cast(ts, &DataType::Int64)?;
        let ticks = ticks.as_primitive::<Int64Type>();
        let mut rows = Vec::with_capacity(ticks.len());
        let mut starts = Vec::with_capacity(ticks.len());
        for (row, &t) in ticks.values().iter().enumerate() {
            let mut s = self.oldest(t);
            let newest = self.newest(t);
            while s <= newest {
                rows.push(row as u32);
                starts.push(s);
                s += self.slide;
            }
        }
        let starts = cast(&Int64Array::from(starts), ts.data_type())?;
        Ok((UInt32Array::from(rows), starts))
    }

    /// `value` (ticks) as a scalar of the time column's type.
    pub fn scalar(value: i64, ts_type: &DataType) -> Result<ScalarValue> {
        let one = cast(&Int64Array::from(vec![value]), ts_type)?;
        ScalarValue::try_from_array(&one, 0)
    }

    /// A scalar of the time column's type as ticks.
    pub fn ticks(value: &ScalarValue) -> Result<i64> {
        match value.cast_to(&DataType::Int64)? {
            ScalarValue::Int64(Some(v)) => Ok(v),
            other => exec_err!("a window watermark must be a time, got {other}"),
        }
    }
}

/// Spark's `struct<start, end>` for a time column of `ts_type`.
fn window_struct(ts_type: &DataType) -> DataType {
    DataType::Struct(Fields::from(vec![
        Field::new("start", ts_type.clone(), true),
        Field::new("end", ts_type.clone(), true),
    ]))
}

/// The struct of windows starting at `starts` (a time column), each `size` ticks long.
fn envelope(starts: &ArrayRef, size: i64) -> Result<ArrayRef> {
    let ticks = cast(starts, &DataType::Int64)?;
    let ends: Int64Array = ticks
        .as_primitive::<Int64Type>()
        .unary(|s| s.saturating_add(size));
    envelope_of(starts, &cast(&ends, starts.data_type())?)
}

/// Spark's `struct<start, end>` of two time columns of one type.
pub fn envelope_of(starts: &ArrayRef, ends: &ArrayRef) -> Result<ArrayRef> {
    let DataType::Struct(fields) = window_struct(starts.data_type()) else {
        unreachable!("window_struct is a struct")
    };
    let nulls = starts.nulls().cloned();
    Ok(Arc::new(StructArray::try_new(
        fields,
        vec![Arc::clone(starts), Arc::clone(ends)],
        nulls,
    )?))
}

/// The gap of `session_window(ts, gapDuration)` in ticks of `ts_type`, from its literal.
pub fn session_gap(ts_type: &DataType, args: &[Option<&ScalarValue>]) -> Result<i64> {
    let DataType::Timestamp(unit, _) = ts_type else {
        return plan_err!(
            "{INVALID}session_window(timeColumn, gapDuration) needs a timestamp column, got \
             {ts_type}"
        );
    };
    let [arg] = args else {
        return plan_err!(
            "{INVALID}session_window(timeColumn, gapDuration) takes 2 arguments, got {}",
            args.len() + 1
        );
    };
    let Some(value) = arg else {
        return plan_err!(
            "{INVALID}session_window(): gapDuration must be a literal duration (a gap per row \
             is not supported)"
        );
    };
    let gap = duration_ticks(value, *unit).map_err(|why| {
        datafusion::common::DataFusionError::Plan(format!(
            "{INVALID}session_window(): gapDuration {why}"
        ))
    })?;
    if gap <= 0 {
        return plan_err!("{INVALID}session_window(): gapDuration must be positive, got {value}");
    }
    Ok(gap)
}

/// A duration literal (Spark's string or a fixed-length interval) in ticks of `unit`.
fn duration_ticks(value: &ScalarValue, unit: TimeUnit) -> std::result::Result<i64, String> {
    let nanos: i128 = match value {
        ScalarValue::Utf8(Some(s))
        | ScalarValue::LargeUtf8(Some(s))
        | ScalarValue::Utf8View(Some(s)) => spark_duration_nanos(s)?,
        ScalarValue::IntervalMonthDayNano(Some(v)) => {
            if v.months != 0 {
                return Err(format!("{value} has months, which have no fixed length"));
            }
            v.days as i128 * 86_400_000_000_000 + v.nanoseconds as i128
        }
        ScalarValue::IntervalDayTime(Some(v)) => {
            v.days as i128 * 86_400_000_000_000 + v.milliseconds as i128 * 1_000_000
        }
        ScalarValue::IntervalYearMonth(_) => {
            return Err(format!("{value} is in months, which have no fixed length"))
        }
        other => {
            return Err(format!(
                "must be a duration such as '10 seconds', got {other}"
            ))
        }
    };
    let per_tick: i128 = match unit {
        TimeUnit::Second => 1_000_000_000,
        TimeUnit::Millisecond => 1_000_000,
        TimeUnit::Microsecond => 1_000,
        TimeUnit::Nanosecond => 1,
    };
    if nanos % per_tick != 0 {
        return Err(format!(
            "{value} is finer than the time column's unit ({unit:?})"
        ));
    }
    i64::try_from(nanos / per_tick).map_err(|_| format!("{value} is too long"))
}

/// Spark's duration text ('10 seconds', '1 day 12 hours', 'interval 5 minutes') in nanoseconds.
fn spark_duration_nanos(text: &str) -> std::result::Result<i128, String> {
    let lower = text.trim().to_ascii_lowercase();
    let body = lower.strip_prefix("interval").unwrap_or(&lower);
    let words: Vec<&str> = body.split_whitespace().collect();
    if words.is_empty() || !words.len().is_multiple_of(2) {
        return Err(format!(
            "'{text}' is not a duration such as '10 seconds' or '1 day 12 hours'"
        ));
    }
    let mut total: i128 = 0;
    for pair in words.chunks(2) {
        let amount: i128 = pair[0]
            .parse()
            .map_err(|_| format!("'{text}': '{}' is not a whole number", pair[0]))?;
        let unit = pair[1].strip_suffix('s').unwrap_or(pair[1]);
        let nanos: i128 = match unit {
            "week" => 604_800_000_000_000,
            "day" => 86_400_000_000_000,
            "hour" => 3_600_000_000_000,
            "minute" => 60_000_000_000,
            "second" => 1_000_000_000,
            "millisecond" => 1_000_000,
            "microsecond" => 1_000,
            "month" | "year" => {
                return Err(format!(
                    "'{text}': {unit}s have no fixed length (Spark refuses them too)"
                ))
            }
            _ => return Err(format!("'{text}': unknown unit '{}'", pair[1])),
        };
        total += amount * nanos;
    }
    Ok(total)
}

/// Spark's `struct<start, end>` for a call of `call` whose first argument has `arg_types[0]`.
fn struct_of_time(call: &str, arg_types: &[DataType]) -> Result<DataType> {
    match arg_types.first() {
        Some(ts @ DataType::Timestamp(_, _)) => Ok(window_struct(ts)),
        other => plan_err!(
            "{INVALID}{call} needs a timestamp column, got {}",
            other.map(|t| t.to_string()).unwrap_or("no argument".into())
        ),
    }
}

/// The result field of a window function, once `check` has passed its time column's type
/// and its literal arguments after the time column.
fn checked_field(
    udf: &dyn ScalarUDFImpl,
    args: ReturnFieldArgs,
    check: impl FnOnce(&DataType, &[Option<&ScalarValue>]) -> Result<()>,
) -> Result<FieldRef> {
    let ts_type = args.arg_fields.first().map(|f| f.data_type().clone());
    let ts_type = ts_type.unwrap_or(DataType::Null);
    check(
        &ts_type,
        &args.scalar_arguments[1.min(args.scalar_arguments.len())..],
    )?;
    Ok(Arc::new(Field::new(
        udf.name(),
        udf.return_type(&[ts_type])?,
        true,
    )))
}

/// `window(timeColumn, windowDuration[, slideDuration[, startTime]])`, Spark's.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct SparkWindow {
    signature: Signature,
}

impl Default for SparkWindow {
    fn default() -> Self {
        Self {
            signature: Signature::variadic_any(Volatility::Immutable),
        }
    }
}

impl SparkWindow {
    /// The function, for a session's `register_udf`.
    pub fn udf() -> ScalarUDF {
        ScalarUDF::new_from_impl(Self::default())
    }
}

impl ScalarUDFImpl for SparkWindow {
    fn name(&self) -> &str {
        "window"
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        struct_of_time("window(timeColumn, ...)", arg_types)
    }

    fn return_field_from_args(&self, args: ReturnFieldArgs) -> Result<FieldRef> {
        // Checked here, at planning: a bad duration never reaches a running query.
        checked_field(self, args, |ts_type, rest| {
            Windowing::from_arguments(ts_type, rest).map(|_| ())
        })
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let ts_type = args.arg_fields[0].data_type().clone();
        let literals: Vec<Option<&ScalarValue>> = args.args[1..]
            .iter()
            .map(|a| match a {
                ColumnarValue::Scalar(s) => Some(s),
                ColumnarValue::Array(_) => None,
            })
            .collect();
        let windowing = Windowing::from_arguments(&ts_type, &literals)?;
        if !windowing.tumbling() {
            return exec_err!(
                "window() with a slideDuration shorter than its windowDuration puts a row in \
                 several windows: pushtable answers it in a GROUP BY over a live table ordered \
                 by the time column (order_by=), where each window is emitted as it closes"
            );
        }
        let ts = args.args[0].to_array(args.number_rows)?;
        let ticks = cast(&ts, &DataType::Int64)?;
        let starts: Int64Array = ticks
            .as_primitive::<Int64Type>()
            .unary(|t| windowing.newest(t));
        let starts = cast(&starts, &ts_type)?;
        Ok(ColumnarValue::Array(envelope(&starts, windowing.size)?))
    }

    fn output_ordering(&self, inputs: &[ExprProperties]) -> Result<SortProperties> {
        // Tumbling windows never decrease along their time column; sliding ones are expanded
        // by the window aggregate, which the rule sets up itself.
        Ok(inputs
            .first()
            .map_or(SortProperties::Unordered, |i| i.sort_properties))
    }
}

/// The struct of the window starting at its argument (a time column): what the window
/// aggregate's window starts become above it.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct WindowEnvelope {
    signature: Signature,
    size: i64,
}

impl WindowEnvelope {
    pub fn udf(size: i64) -> ScalarUDF {
        ScalarUDF::new_from_impl(Self {
            signature: Signature::any(1, Volatility::Immutable),
            size,
        })
    }
}

impl ScalarUDFImpl for WindowEnvelope {
    fn name(&self) -> &str {
        "window"
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        Ok(window_struct(&arg_types[0]))
    }

    fn invoke_with_args(&self, args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        let starts = args.args[0].to_array(args.number_rows)?;
        Ok(ColumnarValue::Array(envelope(&starts, self.size)?))
    }
}

/// `session_window(timeColumn, gapDuration)`, Spark's: answered by the session window
/// aggregate in a `GROUP BY` over a table ordered by the time column.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct SessionWindow {
    signature: Signature,
}

impl SessionWindow {
    pub fn udf() -> ScalarUDF {
        ScalarUDF::new_from_impl(Self {
            signature: Signature::variadic_any(Volatility::Immutable),
        })
    }
}

impl ScalarUDFImpl for SessionWindow {
    fn name(&self) -> &str {
        "session_window"
    }

    fn signature(&self) -> &Signature {
        &self.signature
    }

    fn return_type(&self, arg_types: &[DataType]) -> Result<DataType> {
        struct_of_time("session_window(timeColumn, gapDuration)", arg_types)
    }

    fn return_field_from_args(&self, args: ReturnFieldArgs) -> Result<FieldRef> {
        checked_field(self, args, |ts_type, rest| {
            session_gap(ts_type, rest).map(|_| ())
        })
    }

    fn invoke_with_args(&self, _args: ScalarFunctionArgs) -> Result<ColumnarValue> {
        exec_err!(
            "session_window() is answered in a GROUP BY over a live table ordered by its time \
             column (order_by=): a session's end depends on the rows after it"
        )
    }
}
