//! The groups of one integer key, found without DataFusion's general hash table.
//!
//! An updating `GROUP BY k` and a session window's keys look up every row's group, and
//! DataFusion's `GroupValuesPrimitive` (a keyed hash of each key, then a probe of a table of
//! indices into its values) was half the fold's time at 1,000 keys (perf, docs/benchmarks.md
//! "Updating aggregates"). Here each slot holds the key itself beside its group: one
//! multiply-shift hash, a linear probe in a table at most half full, one comparison, and a
//! row without nulls is read straight from the values buffer.
//!
//! What stays as DataFusion has it: groups are numbered in the order of their first row, and
//! all nulls are one group. The multiplier is drawn at random for each table, so keys that a
//! remote producer chooses cannot be made to collide without knowing it (multiply-shift with a
//! random odd multiplier is universal: two keys share a slot with probability at most
//! 2 / slots).

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::Arc;

use arrow::array::{Array, ArrayRef, AsArray, Int64Array, UInt64Array};
use arrow::buffer::NullBuffer;
use arrow::compute::{can_cast_types, cast};
use arrow::datatypes::{
    ArrowPrimitiveType, DataType, Date32Type, Date64Type, DurationMicrosecondType,
    DurationMillisecondType, DurationNanosecondType, DurationSecondType, Int16Type, Int32Type,
    Int64Type, Int8Type, SchemaRef, Time32MillisecondType, Time32SecondType, Time64MicrosecondType,
    Time64NanosecondType, TimeUnit, TimestampMicrosecondType, TimestampMillisecondType,
    TimestampNanosecondType, TimestampSecondType, UInt16Type, UInt32Type, UInt64Type, UInt8Type,
};
use datafusion::common::{DataFusionError, Result};
use datafusion::logical_expr::EmitTo;
use datafusion::physical_plan::aggregates::group_values::{new_group_values, GroupValues};
use datafusion::physical_plan::aggregates::order::GroupOrdering;

/// A free slot.
const EMPTY: u32 = u32::MAX;
/// The table's first size (slots), a power of two.
const FIRST_SLOTS: usize = 64;

/// Group values for keys in no particular order: [`IntGroups`] for one integer-like key,
/// DataFusion's own for anything else.
pub fn unordered_group_values(schema: SchemaRef) -> Result<Box<dyn GroupValues>> {
    match schema.fields().iter().collect::<Vec<_>>()[..] {
        [field] if IntGroups::supports(field.data_type()) => {
            Ok(Box::new(IntGroups::new(field.data_type().clone())))
        }
        _ => new_group_values(schema, &GroupOrdering::None),
    }
}

/// A key's 64 bits: signed types sign-extended, so equal keys have equal bits and unequal
/// keys unequal ones.
trait Bits: Copy {
    fn bits(self) -> u64;
}

macro_rules! bits {
    ($($t:ty),*) => {$(
        impl Bits for $t {
            #[inline]
            fn bits(self) -> u64 {
                self as u64
            }
        }
    )*};
}
bits!(i8, i16, i32, i64, u8, u16, u32, u64);

/// The groups of one integer, date, time, timestamp or duration key (see the module's docs).
pub struct IntGroups {
    data_type: DataType,
    /// Each group's key bits, by group (0 for the null group).
    keys: Vec<u64>,
    null_group: Option<usize>,
    /// (key bits, group); group [`EMPTY`]: a free slot. Its length is a power of two.
    slots: Vec<(u64, u32)>,
    /// 64 − log2(slots): the hash is the product's top bits.
    shift: u32,
    multiplier: u64,
}

impl IntGroups {
    /// Whether one key of `data_type` is served here: integers and the types stored as them
    /// (dates, times, timestamps with or without a zone, durations).
    pub fn supports(data_type: &DataType) -> bool {
        let from = if data_type.is_unsigned_integer() {
            DataType::UInt64
        } else {
            DataType::Int64
        };
        let stored_as_integer = data_type.is_integer()
            || matches!(
                data_type,
                DataType::Date32
                    | DataType::Date64
                    | DataType::Time32(_)
                    | DataType::Time64(_)
                    | DataType::Timestamp(_, _)
                    | DataType::Duration(_)
            );
        stored_as_integer && can_cast_types(&from, data_type)
    }

    pub fn new(data_type: DataType) -> Self {
        let mut groups = Self {
            data_type,
            keys: Vec::new(),
            null_group: None,
            slots: Vec::new(),
            shift: 0,
            multiplier: RandomState::new().hash_one(0x9e37_79b9_7f4a_7c15_u64) | 1,
        };
        groups.rebuild(FIRST_SLOTS);
        groups
    }

    /// An empty table of `slots` slots (a power of two), holding every group of `keys`.
    fn rebuild(&mut self, slots: usize) {
        self.slots.clear();
        self.slots.resize(slots, (0, EMPTY));
        self.shift = 64 - slots.trailing_zeros();
        for (g, &key) in self.keys.iter().enumerate() {
            if Some(g) != self.null_group {
                let i = self.free_slot(key);
                self.slots[i] = (key, g as u32);
            }
        }
    }

    /// The slot of `key`, or the free slot where it would go.
    #[inline(always)]
    fn free_slot(&self, key: u64) -> usize {
        let mask = self.slots.len() - 1;
        let mut i = (key.wrapping_mul(self.multiplier) >> self.shift) as usize;
        loop {
            let (k, g) = self.slots[i];
            if g == EMPTY || k == key {
                return i;
            }
            i = (i + 1) & mask;
        }
    }

    /// The group of `key`, made if it is new.
    #[inline(always)]
    fn group_of(&mut self, key: u64) -> Result<usize> {
        let i = self.free_slot(key);
        match self.slots[i].1 {
            EMPTY => self.insert(i, key),
            g => Ok(g as usize),
        }
    }

    /// A new group for `key`, in free slot `i`.
    #[cold]
    #[inline(never)]
    fn insert(&mut self, i: usize, key: u64) -> Result<usize> {
        let g = self.new_group(key)?;
        self.slots[i] = (key, g as u32);
        if (self.keys.len() - usize::from(self.null_group.is_some())) * 2 > self.slots.len() {
            self.rebuild(self.slots.len() * 2);
        }
        Ok(g)
    }

    fn null(&mut self) -> Result<usize> {
        match self.null_group {
            Some(g) => Ok(g),
            None => {
                let g = self.new_group(0)?;
                self.null_group = Some(g);
                Ok(g)
            }
        }
    }

    fn new_group(&mut self, key: u64) -> Result<usize> {
        let g = self.keys.len();
        if g >= EMPTY as usize {
            return Err(DataFusionError::ResourcesExhausted(format!(
                "more than {} groups of one key",
                EMPTY - 1
            )));
        }
        self.keys.push(key);
        Ok(g)
    }

    fn intern_as<T>(&mut self, column: &ArrayRef, groups: &mut Vec<usize>) -> Result<()>
    where
        T: ArrowPrimitiveType,
        T::Native: Bits,
    {
        let array = column.as_primitive::<T>();
        groups.clear();
        groups.resize(array.len(), 0);
        let values = array.values().iter();
        match array.nulls().filter(|n| n.null_count() > 0) {
            None => {
                for (group, &v) in groups.iter_mut().zip(values) {
                    *group = self.group_of(v.bits())?;
                }
            }
            Some(nulls) => {
                for (i, (group, &v)) in groups.iter_mut().zip(values).enumerate() {
                    *group = if nulls.is_valid(i) {
                        self.group_of(v.bits())?
                    } else {
                        self.null()?
                    };
                }
            }
        }
        Ok(())
    }

    /// The first `n` groups' keys as an array of the key's type.
    fn array(&self, n: usize) -> Result<ArrayRef> {
        let nulls = self
            .null_group
            .filter(|&g| g < n)
            .map(|g| NullBuffer::from_iter((0..n).map(|i| i != g)));
        let keys = &self.keys[..n];
        let stored: ArrayRef = if self.data_type.is_unsigned_integer() {
            Arc::new(UInt64Array::new(keys.to_vec().into(), nulls))
        } else {
            let signed = keys.iter().map(|&k| k as i64).collect::<Vec<_>>();
            Arc::new(Int64Array::new(signed.into(), nulls))
        };
        Ok(cast(&stored, &self.data_type)?)
    }
}

impl GroupValues for IntGroups {
    fn intern(&mut self, cols: &[ArrayRef], groups: &mut Vec<usize>) -> Result<()> {
        let [column] = cols else {
            return Err(DataFusionError::Internal(format!(
                "IntGroups takes one key column, got {}",
                cols.len()
            )));
        };
        use TimeUnit::*;
        match column.data_type() {
            DataType::Int8 => self.intern_as::<Int8Type>(column, groups),
            DataType::Int16 => self.intern_as::<Int16Type>(column, groups),
            DataType::Int32 => self.intern_as::<Int32Type>(column, groups),
            DataType::Int64 => self.intern_as::<Int64Type>(column, groups),
            DataType::UInt8 => self.intern_as::<UInt8Type>(column, groups),
            DataType::UInt16 => self.intern_as::<UInt16Type>(column, groups),
            DataType::UInt32 => self.intern_as::<UInt32Type>(column, groups),
            DataType::UInt64 => self.intern_as::<UInt64Type>(column, groups),
            DataType::Date32 => self.intern_as::<Date32Type>(column, groups),
            DataType::Date64 => self.intern_as::<Date64Type>(column, groups),
            DataType::Time32(Second) => self.intern_as::<Time32SecondType>(column, groups),
            DataType::Time32(Millisecond) => {
                self.intern_as::<Time32MillisecondType>(column, groups)
            }
            DataType::Time64(Microsecond) => {
                self.intern_as::<Time64MicrosecondType>(column, groups)
            }
            DataType::Time64(Nanosecond) => self.intern_as::<Time64NanosecondType>(column, groups),
            DataType::Timestamp(Second, _) => self.intern_as::<TimestampSecondType>(column, groups),
            DataType::Timestamp(Millisecond, _) => {
                self.intern_as::<TimestampMillisecondType>(column, groups)
            }
            DataType::Timestamp(Microsecond, _) => {
                self.intern_as::<TimestampMicrosecondType>(column, groups)
            }
            DataType::Timestamp(Nanosecond, _) => {
                self.intern_as::<TimestampNanosecondType>(column, groups)
            }
            DataType::Duration(Second) => self.intern_as::<DurationSecondType>(column, groups),
            DataType::Duration(Millisecond) => {
                self.intern_as::<DurationMillisecondType>(column, groups)
            }
            DataType::Duration(Microsecond) => {
                self.intern_as::<DurationMicrosecondType>(column, groups)
            }
            DataType::Duration(Nanosecond) => {
                self.intern_as::<DurationNanosecondType>(column, groups)
            }
            other => Err(DataFusionError::Internal(format!(
                "IntGroups does not take keys of type {other}"
            ))),
        }
    }

    fn size(&self) -> usize {
        self.slots.capacity() * size_of::<(u64, u32)>() + self.keys.capacity() * size_of::<u64>()
    }

    fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    fn len(&self) -> usize {
        self.keys.len()
    }

    fn emit(&mut self, emit_to: EmitTo) -> Result<Vec<ArrayRef>> {
        let n = match emit_to {
            EmitTo::All => self.keys.len(),
            EmitTo::First(n) => n.min(self.keys.len()),
        };
        let out = self.array(n)?;
        self.keys.drain(..n);
        self.null_group = self.null_group.and_then(|g| g.checked_sub(n));
        self.rebuild(self.slots.len());
        Ok(vec![out])
    }

    fn clear_shrink(&mut self, _num_rows: usize) {
        self.keys = Vec::new();
        self.null_group = None;
        self.slots = Vec::new();
        self.rebuild(FIRST_SLOTS);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Date32Array, TimestampMicrosecondArray, UInt64Array};
    use arrow::datatypes::{Field, Schema};

    /// DataFusion's numbering of the same keys, batch after batch.
    fn datafusion_groups(
        data_type: &DataType,
        batches: &[ArrayRef],
    ) -> (Vec<Vec<usize>>, ArrayRef) {
        let schema = Arc::new(Schema::new(vec![Field::new("k", data_type.clone(), true)]));
        let mut values = new_group_values(schema, &GroupOrdering::None).unwrap();
        let mut out = Vec::new();
        for b in batches {
            let mut groups = Vec::new();
            values.intern(std::slice::from_ref(b), &mut groups).unwrap();
            out.push(groups);
        }
        let keys = values.emit(EmitTo::All).unwrap().remove(0);
        (out, keys)
    }

    fn check(batches: Vec<ArrayRef>) {
        let data_type = batches[0].data_type().clone();
        assert!(IntGroups::supports(&data_type), "{data_type}");
        let (want, want_keys) = datafusion_groups(&data_type, &batches);
        let mut ours = IntGroups::new(data_type);
        for (b, want) in batches.iter().zip(&want) {
            let mut groups = Vec::new();
            ours.intern(std::slice::from_ref(b), &mut groups).unwrap();
            assert_eq!(&groups, want);
        }
        assert_eq!(ours.len(), want_keys.len());
        let keys = ours.emit(EmitTo::All).unwrap().remove(0);
        assert_eq!(keys.to_data(), want_keys.to_data());
        assert!(ours.is_empty());
    }

    #[test]
    fn numbers_groups_as_datafusion_does_across_growth_and_nulls() {
        let big: Vec<Option<i64>> = (0..5_000)
            .map(|i| (i % 7 != 3).then_some((i * 7919) % 3_001 - 1_500))
            .collect();
        check(vec![
            Arc::new(Int64Array::from(big[..100].to_vec())),
            Arc::new(Int64Array::from(big[100..].to_vec())),
            Arc::new(Int64Array::from(vec![i64::MIN, i64::MAX, -1, 0, 1])),
        ]);
        check(vec![Arc::new(UInt64Array::from(vec![
            Some(u64::MAX),
            Some(0),
            None,
            Some(1 << 63),
            Some(u64::MAX),
            Some((1 << 63) - 1),
        ]))]);
        check(vec![Arc::new(Date32Array::from(vec![
            Some(-719_162),
            None,
            Some(20_000),
            Some(-719_162),
        ]))]);
        check(vec![Arc::new(
            TimestampMicrosecondArray::from(vec![
                Some(-1),
                Some(1_767_225_600_000_000),
                None,
                Some(-1),
            ])
            .with_timezone("Europe/Paris"),
        )]);
        check(vec![Arc::new(arrow::array::Int8Array::from(vec![
            Some(-128),
            Some(127),
            None,
            Some(-1),
            Some(-128),
        ]))]);
    }

    #[test]
    fn emitting_the_first_groups_renumbers_the_rest() {
        let mut ours = IntGroups::new(DataType::Int32);
        let mut groups = Vec::new();
        let keys: ArrayRef = Arc::new(arrow::array::Int32Array::from(vec![
            Some(5),
            None,
            Some(7),
            Some(9),
        ]));
        ours.intern(std::slice::from_ref(&keys), &mut groups)
            .unwrap();
        assert_eq!(groups, vec![0, 1, 2, 3]);
        let first = ours.emit(EmitTo::First(2)).unwrap().remove(0);
        assert_eq!(first.len(), 2);
        assert!(first.is_null(1));
        ours.intern(std::slice::from_ref(&keys), &mut groups)
            .unwrap();
        assert_eq!(groups, vec![2, 3, 0, 1]);
    }

    #[test]
    fn floats_and_several_keys_stay_with_datafusion() {
        assert!(!IntGroups::supports(&DataType::Float64));
        assert!(!IntGroups::supports(&DataType::Utf8));
        assert!(IntGroups::supports(&DataType::Timestamp(
            TimeUnit::Nanosecond,
            Some("UTC".into())
        )));
    }
}
