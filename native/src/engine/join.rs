//! The lookup join: a live table (probe) joined with a bounded one (build), each probe batch
//! joined and passed on at once.
//!
//! DataFusion 54's `HashJoinExec` coalesces its output to `batch_size` rows, so a live row
//! could wait for thousands of later ones before it leaves the join. This operator builds a
//! hash table of the bounded side once and emits every probe batch's matches as soon as the
//! batch arrives, keeping the probe side's order (so a window aggregate can sit above it) and
//! passing watermark markers (empty batches) on. A condition beyond the equal keys (a join
//! filter) is evaluated on each batch's candidate pairs.

use std::collections::HashMap;
use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use arrow::array::AsArray;
use arrow::array::{Array, ArrayRef, RecordBatch, UInt32Array, UInt32Builder};
use arrow::compute::{concat_batches, take};
use arrow::datatypes::SchemaRef;
use arrow::row::{RowConverter, SortField};
use datafusion::common::{JoinSide, JoinType, NullEquality, Result};
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryReservation};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::{EquivalenceProperties, PhysicalExprRef, PhysicalSortExpr};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::common::collect;
use datafusion::physical_plan::execution_plan::EmissionType;
use datafusion::physical_plan::joins::utils::JoinFilter;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, PlanProperties,
};
use futures::future::BoxFuture;
use futures::{FutureExt, Stream, StreamExt};

/// Joins each batch of `probe` (the live side) with the rows of `build` (bounded).
pub struct LookupJoinExec {
    build: Arc<dyn ExecutionPlan>,
    probe: Arc<dyn ExecutionPlan>,
    on: Vec<(PhysicalExprRef, PhysicalExprRef)>,
    join_type: JoinType,
    /// A condition beyond the equal keys (`AND d.valid_from <= t.ts`, `AND t.v > d.limit`):
    /// a pair of rows matches when it holds too.
    filter: Option<JoinFilter>,
    /// Columns kept from the join's full output (build columns, then probe columns).
    projection: Option<Vec<usize>>,
    join_schema: SchemaRef,
    /// Whether a NULL key matches a NULL key (`IS NOT DISTINCT FROM`, `EXCEPT`, `INTERSECT`)
    /// or nothing (`=`), as the join it replaces said.
    null_equality: NullEquality,
    schema: SchemaRef,
    props: Arc<PlanProperties>,
}

impl fmt::Debug for LookupJoinExec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LookupJoinExec")
            .field("join_type", &self.join_type)
            .field("null_equality", &self.null_equality)
            .finish()
    }
}

impl LookupJoinExec {
    /// The join types it runs: those that emit only from probe rows.
    pub fn supports(join_type: JoinType) -> bool {
        matches!(
            join_type,
            JoinType::Inner | JoinType::Right | JoinType::RightSemi | JoinType::RightAnti
        )
    }

    /// `join_schema` is the unprojected output (build then probe columns for inner and
    /// right joins; probe columns for semi and anti joins).
    #[allow(clippy::too_many_arguments)] // the settings of the hash join it replaces
    pub fn try_new(
        build: Arc<dyn ExecutionPlan>,
        probe: Arc<dyn ExecutionPlan>,
        on: Vec<(PhysicalExprRef, PhysicalExprRef)>,
        join_type: JoinType,
        filter: Option<JoinFilter>,
        projection: Option<Vec<usize>>,
        join_schema: SchemaRef,
        null_equality: NullEquality,
    ) -> Result<Self> {
        let build: Arc<dyn ExecutionPlan> = if build.output_partitioning().partition_count() > 1 {
            Arc::new(CoalescePartitionsExec::new(build))
        } else {
            build
        };
        let schema = match &projection {
            Some(p) => Arc::new(join_schema.project(p)?),
            None => Arc::clone(&join_schema),
        };
        // The probe side's order, carried to the output columns that hold it.
        let offset = match join_type {
            JoinType::Inner | JoinType::Right => build.schema().fields().len(),
            _ => 0,
        };
        let position = |probe_index: usize| -> Option<usize> {
            let joined = offset + probe_index;
            match &projection {
                Some(p) => p.iter().position(|&i| i == joined),
                None => Some(joined),
            }
        };
        let mut ordering = Vec::new();
        if let Some(order) = probe.output_ordering() {
            for sort in order.iter() {
                let Some(c) = sort.expr.downcast_ref::<Column>() else {
                    break;
                };
                let Some(at) = position(c.index()) else {
                    break;
                };
                ordering.push(PhysicalSortExpr::new(
                    Arc::new(Column::new(schema.field(at).name(), at)),
                    sort.options,
                ));
            }
        }
        let eq = EquivalenceProperties::new_with_orderings(Arc::clone(&schema), [ordering]);
        let props = PlanProperties::new(
            eq,
            probe.output_partitioning().clone(),
            EmissionType::Incremental,
            probe.boundedness(),
        );
        Ok(Self {
            build,
            probe,
            on,
            join_type,
            filter,
            projection,
            join_schema,
            null_equality,
            schema,
            props: Arc::new(props),
        })
    }

    /// The live side.
    pub fn probe(&self) -> &Arc<dyn ExecutionPlan> {
        &self.probe
    }

    /// Its join type.
    pub fn join_type(&self) -> JoinType {
        self.join_type
    }

    /// Whether NULL keys match each other.
    pub fn null_equality(&self) -> NullEquality {
        self.null_equality
    }
}

impl DisplayAs for LookupJoinExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let on: Vec<String> = self.on.iter().map(|(l, r)| format!("({l}, {r})")).collect();
        write!(
            f,
            "LookupJoinExec: join_type={:?}, on=[{}]{}, null_equality={:?}, emit=per probe batch",
            self.join_type,
            on.join(", "),
            match &self.filter {
                Some(f) => format!(", filter={}", f.expression()),
                None => String::new(),
            },
            self.null_equality,
        )
    }
}

#[rustfmt::skip::macros(plan_basics)] // its settings stay on a line or two
impl ExecutionPlan for LookupJoinExec {
    plan_basics!("LookupJoinExec", [build, probe], [false, true],
        try_new(on, join_type, filter, projection, join_schema, null_equality));

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let probe = self.probe.execute(partition, Arc::clone(&context))?;
        let reservation = MemoryConsumer::new(format!("LookupJoinExec[{partition}]"))
            .register(context.memory_pool());
        let build_input = self.build.execute(0, context)?;
        let keys: Vec<PhysicalExprRef> = self.on.iter().map(|(l, _)| Arc::clone(l)).collect();
        let nulls_match = self.null_equality == NullEquality::NullEqualsNull;
        let building =
            async move { BuildTable::collect(build_input, keys, nulls_match, reservation).await }
                .boxed();
        let stream = JoinStream {
            probe,
            state: State::Building(building),
            probe_keys: self.on.iter().map(|(_, r)| Arc::clone(r)).collect(),
            join_type: self.join_type,
            filter: self.filter.clone(),
            projection: self.projection.clone(),
            join_schema: Arc::clone(&self.join_schema),
            nulls_match,
        };
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            Arc::clone(&self.schema),
            stream,
        )))
    }
}

/// The bounded side, concatenated, with its rows by join key.
struct BuildTable {
    batch: RecordBatch,
    converter: RowConverter,
    rows: HashMap<Box<[u8]>, Vec<u32>>,
    /// The table's memory, counted against the session's pool while the join runs.
    _reservation: MemoryReservation,
}

fn has_null(keys: &[ArrayRef], row: usize) -> bool {
    keys.iter().any(|k| k.is_null(row))
}

impl BuildTable {
    async fn collect(
        input: SendableRecordBatchStream,
        keys: Vec<PhysicalExprRef>,
        nulls_match: bool,
        reservation: MemoryReservation,
    ) -> Result<Self> {
        let schema = input.schema();
        let batches = collect(input).await?;
        let batch = concat_batches(&schema, &batches)?;
        reservation.try_grow(batch.get_array_memory_size())?;
        let columns = keys
            .iter()
            .map(|k| k.evaluate(&batch)?.into_array(batch.num_rows()))
            .collect::<Result<Vec<_>>>()?;
        let fields = columns
            .iter()
            .map(|c| SortField::new(c.data_type().clone()))
            .collect();
        let converter = RowConverter::new(fields)?;
        let converted = converter.convert_columns(&columns)?;
        let mut rows: HashMap<Box<[u8]>, Vec<u32>> = HashMap::new();
        for i in 0..batch.num_rows() {
            // `=`: a null key matches nothing; `IS NOT DISTINCT FROM`: it matches a null key
            // (the row format encodes nulls alike, so equal bytes mean equal keys).
            if nulls_match || !has_null(&columns, i) {
                rows.entry(converted.row(i).as_ref().into())
                    .or_default()
                    .push(i as u32);
            }
        }
        let index: usize = rows.keys().map(|k| k.len() + 48).sum::<usize>() + 4 * batch.num_rows();
        reservation.try_grow(converted.size() + index)?;
        Ok(Self {
            batch,
            converter,
            rows,
            _reservation: reservation,
        })
    }
}

enum State {
    Building(BoxFuture<'static, Result<BuildTable>>),
    Probing(BuildTable),
    Done,
}

struct JoinStream {
    probe: SendableRecordBatchStream,
    state: State,
    probe_keys: Vec<PhysicalExprRef>,
    join_type: JoinType,
    filter: Option<JoinFilter>,
    projection: Option<Vec<usize>>,
    join_schema: SchemaRef,
    /// Whether a null key matches a null key (else it matches nothing).
    nulls_match: bool,
}

impl JoinStream {
    /// Which candidate pairs (build row, probe row) satisfy the join's filter (all of them
    /// without one; a null is false, as in SQL).
    fn kept(
        &self,
        build: &BuildTable,
        batch: &RecordBatch,
        pairs: &[(u32, u32)],
    ) -> Result<Vec<bool>> {
        let Some(filter) = &self.filter else {
            return Ok(vec![true; pairs.len()]);
        };
        let build_rows = UInt32Array::from_iter_values(pairs.iter().map(|p| p.0));
        let probe_rows = UInt32Array::from_iter_values(pairs.iter().map(|p| p.1));
        let columns = filter
            .column_indices()
            .iter()
            .map(|c| match c.side {
                JoinSide::Left => take(build.batch.column(c.index).as_ref(), &build_rows, None),
                _ => take(batch.column(c.index).as_ref(), &probe_rows, None),
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let rows = RecordBatch::try_new_with_options(
            Arc::clone(filter.schema()),
            columns,
            &arrow::array::RecordBatchOptions::new().with_row_count(Some(pairs.len())),
        )?;
        let mask = filter
            .expression()
            .evaluate(&rows)?
            .into_array(pairs.len())?;
        let mask = mask.as_boolean();
        Ok((0..pairs.len())
            .map(|i| mask.is_valid(i) && mask.value(i))
            .collect())
    }

    fn join(&self, build: &BuildTable, batch: &RecordBatch) -> Result<RecordBatch> {
        let n = batch.num_rows();
        let keys = self
            .probe_keys
            .iter()
            .map(|k| k.evaluate(batch)?.into_array(n))
            .collect::<Result<Vec<_>>>()?;
        let rows = build.converter.convert_columns(&keys)?;
        // Candidate pairs by equal keys, in probe order; `starts[i]..starts[i + 1]` are row i's.
        let mut pairs: Vec<(u32, u32)> = Vec::with_capacity(n);
        let mut starts = Vec::with_capacity(n + 1);
        for i in 0..n {
            starts.push(pairs.len());
            if self.nulls_match || !has_null(&keys, i) {
                if let Some(m) = build.rows.get(rows.row(i).as_ref()) {
                    pairs.extend(m.iter().map(|&b| (b, i as u32)));
                }
            }
        }
        starts.push(pairs.len());
        let kept = self.kept(build, batch, &pairs)?;
        let mut build_idx = UInt32Builder::with_capacity(n);
        let mut probe_idx = UInt32Builder::with_capacity(n);
        for i in 0..n {
            let mine = starts[i]..starts[i + 1];
            let matched = mine.clone().any(|p| kept[p]);
            match self.join_type {
                JoinType::Inner | JoinType::Right => {
                    for p in mine.filter(|&p| kept[p]) {
                        build_idx.append_value(pairs[p].0);
                        probe_idx.append_value(i as u32);
                    }
                    if !matched && self.join_type == JoinType::Right {
                        build_idx.append_null();
                        probe_idx.append_value(i as u32);
                    }
                }
                JoinType::RightSemi if matched => probe_idx.append_value(i as u32),
                JoinType::RightAnti if !matched => probe_idx.append_value(i as u32),
                _ => {}
            }
        }
        let probe_idx: UInt32Array = probe_idx.finish();
        let mut columns: Vec<ArrayRef> = Vec::with_capacity(self.join_schema.fields().len());
        if matches!(self.join_type, JoinType::Inner | JoinType::Right) {
            let build_idx: UInt32Array = build_idx.finish();
            for c in build.batch.columns() {
                columns.push(take(c.as_ref(), &build_idx, None)?);
            }
        }
        for c in batch.columns() {
            columns.push(take(c.as_ref(), &probe_idx, None)?);
        }
        let joined = RecordBatch::try_new_with_options(
            Arc::clone(&self.join_schema),
            columns,
            &arrow::array::RecordBatchOptions::new().with_row_count(Some(probe_idx.len())),
        )?;
        Ok(match &self.projection {
            Some(p) => joined.project(p)?,
            None => joined,
        })
    }
}

impl Stream for JoinStream {
    type Item = Result<RecordBatch>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            match &mut self.state {
                State::Done => return Poll::Ready(None),
                State::Building(fut) => match futures::ready!(fut.poll_unpin(cx)) {
                    Ok(table) => self.state = State::Probing(table),
                    Err(e) => {
                        self.state = State::Done;
                        return Poll::Ready(Some(Err(e)));
                    }
                },
                State::Probing(_) => {
                    let item = futures::ready!(self.probe.poll_next_unpin(cx));
                    let State::Probing(table) = &self.state else {
                        unreachable!()
                    };
                    return Poll::Ready(match item {
                        None => {
                            self.state = State::Done;
                            None
                        }
                        Some(Err(e)) => Some(Err(e)),
                        Some(Ok(batch)) => {
                            let out = self.join(table, &batch);
                            Some(out)
                        }
                    });
                }
            }
        }
    }
}
