//! A running query of the engine, handed to datafusion-python as a single-scan table.
//!
//! The caller gets an ordinary `datafusion.DataFrame` over it: executing that DataFrame
//! executes the engine's plan (once), on the engine's runtime, and whatever the caller adds
//! on top (`.filter`, `.select`, a remote client's SQL) runs in datafusion-python as usual.
//! Filters are applied here, batch by batch, so nothing above waits for `batch_size` rows.

use std::fmt;
use std::sync::{Arc, Mutex};

use arrow::datatypes::SchemaRef;
use async_trait::async_trait;
use datafusion::catalog::{Session, TableProvider};
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::{Expr, TableProviderFilterPushDown, TableType};
use datafusion::physical_expr::EquivalenceProperties;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;

use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, PlanProperties,
};
use futures::StreamExt;

use super::abort::{abortable, Abort};
use super::readahead::{ReadAheadExec, ReadGroup};
use super::shared_scan::SharedScanExec;
use crate::plan::one_partition;
use crate::provider::{exact_pushdown, filtered, plan_predicate, Predicate};

/// The engine's plan, runnable once.
struct Once {
    plan: Mutex<Option<Arc<dyn ExecutionPlan>>>,
    task: Arc<TaskContext>,
    schema: SchemaRef,
    sql: String,
}

impl Once {
    fn take(&self) -> Result<Arc<dyn ExecutionPlan>> {
        self.plan
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(|| {
                DataFusionError::Execution(format!(
                    "StreamConsumedError: the live query {:?} was already run; its result is \
                     single-scan like the live tables it reads: call ctx.sql(...) again",
                    self.sql
                ))
            })
    }
}

/// A query of the engine as a table: scanning it runs the query.
pub struct QueryTable {
    once: Arc<Once>,
    boundedness: datafusion::physical_plan::execution_plan::Boundedness,
}

impl fmt::Debug for QueryTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueryTable")
            .field("sql", &self.once.sql)
            .finish()
    }
}

impl QueryTable {
    pub fn new(plan: Arc<dyn ExecutionPlan>, task: Arc<TaskContext>, sql: &str) -> Self {
        let plan: Arc<dyn ExecutionPlan> = if plan.output_partitioning().partition_count() > 1 {
            Arc::new(CoalescePartitionsExec::new(plan))
        } else {
            plan
        };
        Self {
            boundedness: plan.boundedness(),
            once: Arc::new(Once {
                schema: plan.schema(),
                plan: Mutex::new(Some(plan)),
                task,
                sql: sql.to_string(),
            }),
        }
    }
}

#[async_trait]
impl TableProvider for QueryTable {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.once.schema)
    }

    fn table_type(&self) -> TableType {
        TableType::View
    }

    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> Result<Vec<TableProviderFilterPushDown>> {
        Ok(exact_pushdown(filters))
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        _limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let schema = self.schema();
        let predicate = plan_predicate(filters, &schema, state)?;
        let projected = match projection {
            Some(p) => Arc::new(schema.project(p)?),
            None => Arc::clone(&schema),
        };
        let props = one_partition(
            EquivalenceProperties::new(Arc::clone(&projected)),
            self.boundedness,
        );
        Ok(Arc::new(QueryScanExec {
            once: Arc::clone(&self.once),
            predicate,
            projection: projection.cloned(),
            schema: projected,
            props,
        }))
    }
}

/// Runs the engine's plan when executed (once) and yields its batches, filtered.
struct QueryScanExec {
    once: Arc<Once>,
    predicate: Option<Arc<dyn datafusion::physical_expr::PhysicalExpr>>,
    projection: Option<Vec<usize>>,
    schema: SchemaRef,
    props: Arc<PlanProperties>,
}

impl fmt::Debug for QueryScanExec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LiveQueryExec").finish()
    }
}

impl DisplayAs for QueryScanExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "LiveQueryExec: engine=pushtable, sql={:?}",
            self.once.sql
        )
    }
}

impl ExecutionPlan for QueryScanExec {
    plan_basics!(leaf "LiveQueryExec");

    fn execute(
        &self,
        _partition: usize,
        _context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let plan = self.once.take()?;
        let reads_ahead = reads_ahead(&plan);
        start_read_aheads(&plan, &self.once.task)?;
        let inner = plan.execute(0, Arc::clone(&self.once.task))?;
        let mut groups: Vec<Arc<ReadGroup>> = Vec::new();
        read_groups(&plan, &mut groups);
        drop(plan); // the stream holds the plan now: it lets go of it as it ends or fails
        let abort = match reads_ahead {
            true => Abort::of(&self.once.task),
            false => None,
        };
        let release = Box::new(move || groups.iter().for_each(|g| g.close()));
        let inner = abortable(inner, abort, release);
        // Watermark markers stay inside the engine.
        let stream: SendableRecordBatchStream = Box::pin(RecordBatchStreamAdapter::new(
            inner.schema(),
            inner.filter(|r| futures::future::ready(!matches!(r, Ok(b) if b.num_rows() == 0))),
        ));
        let schema = Arc::clone(&self.schema);
        Ok(match (&self.predicate, &self.projection) {
            (Some(expr), projection) => filtered(
                stream,
                Predicate {
                    expr: Arc::clone(expr),
                    projection: projection.clone(),
                },
                schema,
            ),
            (None, Some(p)) => {
                let p = p.clone();
                let projected = stream.map(move |b| Ok(b?.project(&p)?));
                Box::pin(RecordBatchStreamAdapter::new(schema, projected))
            }
            (None, None) => stream,
        })
    }
}

/// Whether `plan` reads ahead of its operators somewhere (a read-ahead below a join, a shared
/// scan): only there can a failure come that no operator above asks for (see [`Abort`]).
fn reads_ahead(plan: &Arc<dyn ExecutionPlan>) -> bool {
    plan.is::<ReadAheadExec>()
        || plan.is::<SharedScanExec>()
        || plan.children().into_iter().any(reads_ahead)
}

/// The read groups of `plan`'s read-aheads, each once.
fn read_groups(plan: &Arc<dyn ExecutionPlan>, out: &mut Vec<Arc<ReadGroup>>) {
    if let Some(read_ahead) = plan.downcast_ref::<ReadAheadExec>() {
        if !out.iter().any(|g| Arc::ptr_eq(g, read_ahead.group())) {
            out.push(Arc::clone(read_ahead.group()));
        }
    }
    plan.children()
        .into_iter()
        .for_each(|child| read_groups(child, out));
}

/// Starts every read-ahead of `plan` as the query starts: each reads its table from now on,
/// whenever the operator above it executes it. Bottom-up: starting an outer read-ahead
/// executes the inner ones below it, which must hand out the reads they already started.
fn start_read_aheads(plan: &Arc<dyn ExecutionPlan>, task: &Arc<TaskContext>) -> Result<()> {
    plan.children()
        .into_iter()
        .try_for_each(|child| start_read_aheads(child, task))?;
    if let Some(read_ahead) = plan.downcast_ref::<ReadAheadExec>() {
        read_ahead.start(task)?;
    }
    Ok(())
}
