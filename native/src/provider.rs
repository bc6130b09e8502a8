//! The table DataFusion sees: a one-partition streaming scan whose partition hands out the
//! channel's single `Reader` once, evaluates pushed-down filters on each batch as it
//! arrives, and declares the table's ordering and boundedness; exported to
//! datafusion-python as an `FFI_TableProvider` PyCapsule.

use std::ffi::CString;
use std::fmt;
use std::sync::{Arc, Mutex, Weak};

use arrow::compute::filter_record_batch;
use arrow::datatypes::SchemaRef;
use async_trait::async_trait;
use datafusion_catalog::{Session, TableProvider};
use datafusion_common::cast::as_boolean_array;
use datafusion_common::{DFSchema, DataFusionError, Result as DFResult};
use datafusion_execution::{SendableRecordBatchStream, TaskContext};
use datafusion_expr::utils::conjunction;
use datafusion_expr::{col, Expr, SortExpr, TableProviderFilterPushDown, TableType};
use datafusion_ffi::proto::logical_extension_codec::FFI_LogicalExtensionCodec;
use datafusion_ffi::table_provider::FFI_TableProvider;
use datafusion_physical_expr::equivalence::project_ordering;
use datafusion_physical_expr::{
    create_physical_expr, create_physical_sort_exprs, LexOrdering, PhysicalExpr,
};
use datafusion_physical_plan::stream::RecordBatchStreamAdapter;
use datafusion_physical_plan::streaming::{PartitionStream, StreamingTableExec};
use datafusion_physical_plan::ExecutionPlan;
use futures::StreamExt;
use pyo3::exceptions::{PyRuntimeError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::PyCapsule;

use crate::channel::{Channel, Reader, ReaderStream};

/// The table's single right to read its channel, handed to the first scan that executes.
struct ScanSource {
    channel: Arc<Channel>,
    reader: Mutex<Option<Reader>>,
}

impl ScanSource {
    fn consumed_error(&self) -> DataFusionError {
        DataFusionError::Execution(format!(
            "StreamConsumedError: streaming table '{}' is single-scan and was already \
             consumed by an earlier scan; register a new streaming table to query again",
            self.channel.name
        ))
    }
}

/// One scan's claim on the source, shared by its partitions: the first partition to execute
/// takes the reader, the others share it. The claim keeps only a weak reference, so the
/// reader is gone as soon as every partition stream that was opened is dropped (a failed
/// or cancelled query never leaves it behind in a plan that lingers).
struct ScanClaim {
    source: Arc<ScanSource>,
    state: Mutex<ClaimState>,
}

struct ClaimState {
    reader: Weak<Reader>,
    claimed: bool,
    refused: bool,
}

impl ScanClaim {
    /// The shared reader, or None when the scan's other partitions already finished with it.
    fn reader(&self) -> DFResult<Option<Arc<Reader>>> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.refused {
            return Err(self.source.consumed_error());
        }
        if st.claimed {
            return Ok(st.reader.upgrade());
        }
        match self
            .source
            .reader
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            Some(reader) => {
                let shared = reader.start();
                st.reader = Arc::downgrade(&shared);
                st.claimed = true;
                Ok(Some(shared))
            }
            None => {
                st.refused = true;
                Err(self.source.consumed_error())
            }
        }
    }
}

/// One partition of a scan: reads the shared queue, applying the pushed-down filters to
/// each batch as it arrives (so nothing above the scan waits for `batch_size` rows, as
/// DataFusion's `FilterExec` would).
struct ScanPartition {
    claim: Arc<ScanClaim>,
    /// The filter (over the table's columns) and the projection applied after it; with a
    /// filter, the partition yields `schema` (the projected one) itself.
    predicate: Option<(Arc<dyn PhysicalExpr>, Option<Vec<usize>>)>,
    schema: SchemaRef,
}

impl fmt::Debug for ScanPartition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ScanPartition")
            .field("table", &self.claim.source.channel.name)
            .field(
                "predicate",
                &self.predicate.as_ref().map(|(p, _)| p.to_string()),
            )
            .finish()
    }
}

impl PartitionStream for ScanPartition {
    fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    fn execute(&self, _ctx: Arc<TaskContext>) -> SendableRecordBatchStream {
        let schema = Arc::clone(self.schema());
        let reader = match self.claim.reader() {
            Ok(Some(reader)) => reader,
            // The other partitions read the stream to its end (or stopped) before this one
            // started: nothing is left for it.
            Ok(None) => {
                return Box::pin(RecordBatchStreamAdapter::new(
                    schema,
                    futures::stream::empty(),
                ))
            }
            Err(err) => {
                return Box::pin(RecordBatchStreamAdapter::new(
                    schema,
                    futures::stream::once(async { Err(err) }),
                ))
            }
        };
        let stream = ReaderStream::new(reader);
        let Some((predicate, projection)) = self.predicate.clone() else {
            return Box::pin(stream);
        };
        let filtered = stream.filter_map(move |item| {
            let out = item.and_then(|batch| {
                let mask = predicate.evaluate(&batch)?.into_array(batch.num_rows())?;
                // Copy only the columns the query reads.
                let batch = match &projection {
                    Some(p) => batch.project(p)?,
                    None => batch,
                };
                Ok(filter_record_batch(&batch, as_boolean_array(&mask)?)?)
            });
            // A batch with no matching row is not worth a wake-up downstream.
            futures::future::ready(match out {
                Ok(batch) if batch.num_rows() == 0 => None,
                other => Some(other),
            })
        });
        Box::pin(RecordBatchStreamAdapter::new(schema, filtered))
    }
}

/// The table DataFusion sees: a single-scan streaming table, optionally unbounded and
/// ordered, that evaluates pushed-down filters in the scan itself.
pub struct LiveTable {
    source: Arc<ScanSource>,
    sort_order: Vec<SortExpr>,
    infinite: bool,
}

impl fmt::Debug for LiveTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LiveTable")
            .field("table", &self.source.channel.name)
            .finish()
    }
}

/// Build the DataFusion table read through `reader`, ascending on `order_by` (may be empty).
pub fn live_table(reader: Reader, unbounded: bool, order_by: &[String]) -> LiveTable {
    let channel = Arc::clone(reader.channel());
    let source = ScanSource {
        reader: Mutex::new(Some(reader)),
        channel,
    };
    let sort_order = order_by
        .iter()
        .map(|c| col(c.as_str()).sort(true, false))
        .collect();
    LiveTable {
        source: Arc::new(source),
        sort_order,
        infinite: unbounded,
    }
}

#[async_trait]
impl TableProvider for LiveTable {
    fn schema(&self) -> SchemaRef {
        Arc::clone(&self.source.channel.schema)
    }

    fn table_type(&self) -> TableType {
        TableType::View
    }

    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> DFResult<Vec<TableProviderFilterPushDown>> {
        // Exact: the scan applies every deterministic filter itself, so DataFusion plans no
        // FilterExec above it.
        Ok(filters
            .iter()
            .map(|f| {
                if f.is_volatile() {
                    TableProviderFilterPushDown::Unsupported
                } else {
                    TableProviderFilterPushDown::Exact
                }
            })
            .collect())
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> DFResult<Arc<dyn ExecutionPlan>> {
        let schema = self.schema();
        let df_schema = DFSchema::try_from(Arc::clone(&schema))?;
        let ordering = if self.sort_order.is_empty() {
            vec![]
        } else {
            let sort =
                create_physical_sort_exprs(&self.sort_order, &df_schema, state.execution_props())?;
            match projection {
                // The ordering of the projected columns (none if the first key is projected away).
                Some(p) => {
                    let projected = Arc::new(schema.project(p)?);
                    LexOrdering::new(sort)
                        .and_then(|o| project_ordering(&o, &projected))
                        .map(|o| o.to_vec())
                        .unwrap_or_default()
                }
                None => sort,
            }
        };
        // Planned here, not by the (foreign) session: evaluating a foreign expression would
        // cross the FFI boundary on every batch.
        let predicate = conjunction(filters.iter().cloned())
            .map(|p| create_physical_expr(&p, &df_schema, state.execution_props()))
            .transpose()?;
        // With a filter the partitions project (after evaluating it, before copying rows);
        // without one, StreamingTableExec projects each batch by index.
        let (exec_schema, exec_projection, partition_schema) = match (&predicate, projection) {
            (Some(_), Some(p)) => (
                Arc::new(schema.project(p)?),
                None,
                Arc::new(schema.project(p)?),
            ),
            _ => (Arc::clone(&schema), projection, Arc::clone(&schema)),
        };
        // Several partitions read the queue in parallel (DataFusion then needs no round-robin
        // repartition, which would hold rows back); an ordered table keeps one, in order.
        let partitions = if self.sort_order.is_empty() {
            state.config().target_partitions().max(1)
        } else {
            1
        };
        let claim = Arc::new(ScanClaim {
            source: Arc::clone(&self.source),
            state: Mutex::new(ClaimState {
                reader: Weak::new(),
                claimed: false,
                refused: false,
            }),
        });
        let streams = (0..partitions)
            .map(|_| {
                Arc::new(ScanPartition {
                    claim: Arc::clone(&claim),
                    predicate: predicate.clone().map(|p| (p, projection.cloned())),
                    schema: Arc::clone(&partition_schema),
                }) as Arc<dyn PartitionStream>
            })
            .collect();
        // The limit applies after the filter (StreamingTableExec limits what a partition yields).
        Ok(Arc::new(StreamingTableExec::try_new(
            exec_schema,
            streams,
            exec_projection,
            LexOrdering::new(ordering),
            self.infinite,
            limit,
        )?))
    }
}

/// Python handle that exports the table to a `datafusion.SessionContext` exactly once.
///
/// It gives up its reference after the first export, so the session owns the table: when
/// the session drops it unscanned, blocked producers learn at once that no reader will come.
#[pyclass(module = "pushtable._native", name = "TableProvider")]
pub struct PyTableProvider {
    table: Mutex<Option<Arc<LiveTable>>>,
}

impl PyTableProvider {
    pub fn new(table: LiveTable) -> Self {
        Self {
            table: Mutex::new(Some(Arc::new(table))),
        }
    }
}

/// Read the logical extension codec out of a datafusion-python session (or a codec capsule).
fn logical_codec(session: &Bound<'_, PyAny>) -> PyResult<FFI_LogicalExtensionCodec> {
    let name = c"datafusion_logical_extension_codec";
    let capsule_obj = if session.hasattr("__datafusion_logical_extension_codec__")? {
        session.call_method0("__datafusion_logical_extension_codec__")?
    } else {
        session.clone()
    };
    let capsule = capsule_obj.cast::<PyCapsule>().map_err(|_| {
        PyTypeError::new_err(format!(
            "expected a datafusion SessionContext (or a '{}' PyCapsule), got {}",
            name.to_string_lossy(),
            session
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ))
    })?;
    let ptr = capsule.pointer_checked(Some(name))?;
    // SAFETY: the capsule name guarantees the pointee is an FFI_LogicalExtensionCodec
    // (datafusion-python creates it so); we clone it and never keep the reference.
    let codec = unsafe { ptr.cast::<FFI_LogicalExtensionCodec>().as_ref() };
    Ok(codec.clone())
}

#[pymethods]
impl PyTableProvider {
    fn __datafusion_table_provider__<'py>(
        &self,
        py: Python<'py>,
        session: Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyCapsule>> {
        let codec = logical_codec(&session)?;
        let table = self
            .table
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(|| {
                PyRuntimeError::new_err(
                    "this streaming table was already registered with a session",
                )
            })?;
        let provider = FFI_TableProvider::new_with_ffi_codec(table, true, None, codec);
        PyCapsule::new(
            py,
            provider,
            Some(CString::from(c"datafusion_table_provider")),
        )
    }
}
