//! Watermarks as rows, so that a join of two live tables prunes by `advance(ts)` too.
//!
//! DataFusion's `SymmetricHashJoinExec` prunes one side's state (and emits its unmatched rows
//! in an outer join) when a batch from the other side proves that no later row can match
//! them: it reads the bound from that batch's order column. A watermark declared with
//! `advance(ts)` carries no row, so on its own it would prune nothing. Below each side of
//! such a join this operator turns the watermark its live scan announces (an empty batch,
//! the value in a [`WatermarkCell`]) into one marker row: the order column at the watermark,
//! a marker column `true` (every other row `false`). The rule joins the marker columns as
//! one more equal key, so a marker meets only markers, and drops the rows that carry one
//! above the join.

use std::fmt;
use std::sync::Arc;

use arrow::array::{new_null_array, ArrayRef, BooleanArray, RecordBatch};
use arrow::buffer::BooleanBuffer;
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::common::{Result, ScalarValue};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::EquivalenceProperties;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, PlanProperties,
};
use futures::StreamExt;

/// The name of the marker column this operator appends.
pub const MARKER: &str = "__pushtable_watermark";

/// `input` with a marker column, and a marker row for each new watermark (module docs).
pub struct WatermarkRowsExec {
    input: Arc<dyn ExecutionPlan>,
    order: usize,
    schema: SchemaRef,
    props: Arc<PlanProperties>,
}

impl WatermarkRowsExec {
    /// Marker rows for the watermarks of `input` (ordered on column `order`): those of what
    /// is right below it when it runs (see `watermark_source`).
    pub fn try_new(input: Arc<dyn ExecutionPlan>, order: usize) -> Result<Self> {
        let mut fields: Vec<Arc<Field>> = input.schema().fields().iter().cloned().collect();
        fields.push(Arc::new(Field::new(MARKER, DataType::Boolean, false)));
        let schema = Arc::new(Schema::new_with_metadata(
            fields,
            input.schema().metadata().clone(),
        ));
        // The input's order, over the same columns (the marker comes after them).
        let eq = EquivalenceProperties::new_with_orderings(
            Arc::clone(&schema),
            input.output_ordering().cloned(),
        );
        let props = PlanProperties::new(
            eq,
            input.output_partitioning().clone(),
            input.pipeline_behavior(),
            input.boundedness(),
        );
        Ok(Self {
            input,
            order,
            schema,
            props: Arc::new(props),
        })
    }
}

impl fmt::Debug for WatermarkRowsExec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WatermarkRowsExec").finish()
    }
}

impl DisplayAs for WatermarkRowsExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        let from = crate::plan::watermark_note(&self.input);
        write!(f, "WatermarkRowsExec: order={}{from}", self.order)
    }
}

impl ExecutionPlan for WatermarkRowsExec {
    plan_basics!("WatermarkRowsExec", [input], [true], try_new(order));

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let cell = super::rule::watermark_source(&self.input);
        let input = self.input.execute(partition, context)?;
        let schema = Arc::clone(&self.schema);
        let order = self.order;
        let mut last: Option<ScalarValue> = None;
        let out_schema = Arc::clone(&schema);
        let output = input.map(move |item| {
            let batch = item?;
            if batch.num_rows() == 0 {
                // The scan announced a watermark just now (same poll): mark it once.
                if let Some(w) = cell.as_ref().and_then(|c| c.get()) {
                    if last.as_ref() != Some(&w) {
                        last = Some(w.clone());
                        return marker_row(&out_schema, order, &w);
                    }
                }
            }
            let n = batch.num_rows();
            let mut columns = batch.columns().to_vec();
            columns.push(Arc::new(BooleanArray::new(
                BooleanBuffer::new_unset(n),
                None,
            )));
            Ok(RecordBatch::try_new(Arc::clone(&out_schema), columns)?)
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, output)))
    }
}

/// One row: the order column at `watermark`, the marker `true`, every other column null
/// (or its type's default where the column is not nullable: the marker keeps it unmatched).
fn marker_row(schema: &SchemaRef, order: usize, watermark: &ScalarValue) -> Result<RecordBatch> {
    let last = schema.fields().len() - 1;
    let columns = schema
        .fields()
        .iter()
        .enumerate()
        .map(|(i, field)| -> Result<ArrayRef> {
            if i == last {
                return Ok(Arc::new(BooleanArray::from(vec![true])));
            }
            if i == order {
                return watermark.cast_to(field.data_type())?.to_array_of_size(1);
            }
            if field.is_nullable() {
                return Ok(new_null_array(field.data_type(), 1));
            }
            ScalarValue::new_default(field.data_type())?.to_array_of_size(1)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(RecordBatch::try_new(Arc::clone(schema), columns)?)
}
