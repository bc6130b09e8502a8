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
use datafusion_common::tree_node::{Transformed, TreeNode};
use datafusion_common::{DFSchema, DataFusionError, Result as DFResult};
use datafusion_execution::{SendableRecordBatchStream, TaskContext};
use datafusion_expr::expr::ScalarFunction;
use datafusion_expr::utils::conjunction;
use datafusion_expr::{col, Expr, ScalarUDF, SortExpr, TableProviderFilterPushDown, TableType};
use datafusion_ffi::proto::logical_extension_codec::FFI_LogicalExtensionCodec;
use datafusion_ffi::table_provider::FFI_TableProvider;
use datafusion_physical_expr::equivalence::project_ordering;
use datafusion_physical_expr::{
    create_physical_expr, create_physical_sort_exprs, LexOrdering, PhysicalExpr,
};
use datafusion_physical_expr::{EquivalenceProperties, Partitioning};
use datafusion_physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion_physical_plan::stream::RecordBatchStreamAdapter;
use datafusion_physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use futures::{Stream, StreamExt};
use pyo3::exceptions::{PyRuntimeError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::PyCapsule;

use crate::channel::{Channel, Markers, Reader, ReaderStream, WatermarkCell};

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
    /// The filter (over the table's columns) and the projection applied after it.
    predicate: Option<Predicate>,
    /// What the partition yields (projected).
    schema: SchemaRef,
    /// Without a predicate, the projection applied to each batch.
    projection: Option<Vec<usize>>,
    /// False for the extra partitions of an ordered table's scan: they yield nothing.
    reads: bool,
}

impl fmt::Debug for ScanPartition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ScanPartition")
            .field("table", &self.claim.source.channel.name)
            .finish()
    }
}

/// A filter evaluated on each batch as it arrives, and the columns kept after it.
#[derive(Clone)]
pub struct Predicate {
    pub expr: Arc<dyn PhysicalExpr>,
    pub projection: Option<Vec<usize>>,
}

/// `stream` with `predicate` applied batch by batch. A batch that had rows and has none
/// left is skipped (not worth a wake-up downstream); an empty input batch (a watermark
/// marker) passes on, projected.
pub fn filtered(
    stream: impl Stream<Item = DFResult<arrow::array::RecordBatch>> + Send + 'static,
    predicate: Predicate,
    schema: SchemaRef,
) -> SendableRecordBatchStream {
    let Predicate { expr, projection } = predicate;
    let out = stream.filter_map(move |item| {
        let mut marker = false;
        let out = item.and_then(|batch| {
            marker = batch.num_rows() == 0;
            let mask = expr.evaluate(&batch)?.into_array(batch.num_rows())?;
            // Copy only the columns the query reads.
            let batch = match &projection {
                Some(p) => batch.project(p)?,
                None => batch,
            };
            Ok(filter_record_batch(&batch, as_boolean_array(&mask)?)?)
        });
        futures::future::ready(match out {
            Ok(batch) if batch.num_rows() == 0 && !marker => None,
            other => Some(other),
        })
    });
    Box::pin(RecordBatchStreamAdapter::new(schema, out))
}

impl ScanPartition {
    fn execute(&self, markers: Option<Markers>) -> SendableRecordBatchStream {
        let schema = Arc::clone(&self.schema);
        if !self.reads {
            return Box::pin(RecordBatchStreamAdapter::new(
                schema,
                futures::stream::empty(),
            ));
        }
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
        self.narrow(Box::pin(ReaderStream::new(reader, markers)))
    }

    /// `whole` (the table's batches, every column) with this partition's filter and
    /// projection applied batch by batch.
    fn narrow(&self, whole: SendableRecordBatchStream) -> SendableRecordBatchStream {
        let schema = Arc::clone(&self.schema);
        match (&self.predicate, &self.projection) {
            (Some(p), _) => filtered(whole, p.clone(), schema),
            (None, None) => whole,
            (None, Some(p)) => {
                let p = p.clone();
                let projected = whole.map(move |b| Ok(b?.project(&p)?));
                Box::pin(RecordBatchStreamAdapter::new(schema, projected))
            }
        }
    }
}

/// The scan of a live table: `partitions` streams over one queue (an ordered table keeps
/// one, in order), filters evaluated as batches arrive, the declared order and boundedness.
/// Scanned by pushtable's engine, it also passes watermarks on (see [`WatermarkCell`]).
pub struct LiveScanExec {
    name: String,
    partitions: Vec<ScanPartition>,
    markers: Option<Markers>,
    limit: Option<usize>,
    props: Arc<PlanProperties>,
    /// A topic subscription's scan: aggregates over it answer with changes (its stream
    /// ends only when the topic closes).
    changes: bool,
}

impl fmt::Debug for LiveScanExec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LiveScanExec")
            .field("table", &self.name)
            .finish()
    }
}

impl LiveScanExec {
    /// The live table it scans.
    pub fn table(&self) -> &str {
        &self.name
    }

    /// Whether aggregates over this scan answer with changes even when it is bounded.
    pub fn changes(&self) -> bool {
        self.changes
    }

    /// Where this scan hands on the watermarks it passes (scanned by the engine only).
    pub fn watermark(&self) -> Option<&Arc<WatermarkCell>> {
        self.markers.as_ref().map(|m| &m.cell)
    }

    /// The table's schema (every column: what [`LiveScanExec::read_whole`] yields).
    pub fn table_schema(&self) -> SchemaRef {
        Arc::clone(&self.partitions[0].claim.source.channel.schema)
    }

    /// The table's batches as they arrive, whole (every column, no filter, no limit), read
    /// through this scan's claim on the table (so a second query still finds it consumed):
    /// the one read that several scans of one query share, each narrowing it with
    /// [`LiveScanExec::narrow`]. Its watermark markers set a cell of the read's own (returned
    /// with it), not this scan's: each scan hands a watermark on only as its consumer
    /// reaches it.
    pub fn read_whole(&self) -> (SendableRecordBatchStream, Option<Arc<WatermarkCell>>) {
        let schema = self.table_schema();
        let markers = self.markers.as_ref().map(|m| Markers {
            cell: Arc::default(),
            data_type: m.data_type.clone(),
        });
        let cell = markers.as_ref().map(|m| Arc::clone(&m.cell));
        let stream: SendableRecordBatchStream = match self.partitions[0].claim.reader() {
            Ok(Some(reader)) => Box::pin(ReaderStream::new(reader, markers)),
            Ok(None) => Box::pin(RecordBatchStreamAdapter::new(
                schema,
                futures::stream::empty(),
            )),
            Err(err) => Box::pin(RecordBatchStreamAdapter::new(
                schema,
                futures::stream::once(async { Err(err) }),
            )),
        };
        (stream, cell)
    }

    /// The registered table this scan reads (one source per registration: two scans of one
    /// table share it; two subscriptions of one topic do not).
    pub fn source_id(&self) -> usize {
        Arc::as_ptr(&self.partitions[0].claim.source) as usize
    }

    /// `whole` (the table's batches, every column, as [`LiveScanExec::read_whole`] yields
    /// them) with this scan's filter, projection and limit.
    pub fn narrow(&self, whole: SendableRecordBatchStream) -> SendableRecordBatchStream {
        let stream = self.partitions[0].narrow(whole);
        match self.limit {
            None => stream,
            Some(limit) => limited(stream, limit),
        }
    }
}

impl DisplayAs for LiveScanExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "LiveScanExec: table={}, partitions={}",
            self.name,
            self.partitions.len()
        )?;
        if let Some(o) = self.props.output_ordering() {
            write!(f, ", output_ordering=[{o}]")?;
        }
        if self.props.boundedness.is_unbounded() {
            write!(f, ", infinite_source=true")?;
        }
        if let Some(l) = self.limit {
            write!(f, ", fetch={l}")?;
        }
        Ok(())
    }
}

impl ExecutionPlan for LiveScanExec {
    plan_basics!(leaf "LiveScanExec");

    fn execute(
        &self,
        partition: usize,
        _context: Arc<TaskContext>,
    ) -> DFResult<SendableRecordBatchStream> {
        let part = self.partitions.get(partition).ok_or_else(|| {
            DataFusionError::Internal(format!("LiveScanExec has no partition {partition}"))
        })?;
        let stream = part.execute(self.markers.clone());
        Ok(match self.limit {
            None => stream,
            Some(limit) => limited(stream, limit),
        })
    }
}

/// `stream` cut after `limit` rows (empty marker batches still pass before that).
fn limited(inner: SendableRecordBatchStream, limit: usize) -> SendableRecordBatchStream {
    struct Limited {
        inner: SendableRecordBatchStream,
        left: usize,
    }
    impl Stream for Limited {
        type Item = DFResult<arrow::array::RecordBatch>;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Self::Item>> {
            if self.left == 0 {
                return std::task::Poll::Ready(None);
            }
            let item = futures::ready!(self.inner.poll_next_unpin(cx));
            std::task::Poll::Ready(item.map(|r| {
                r.map(|b| {
                    let keep = b.num_rows().min(self.left);
                    self.left -= keep;
                    b.slice(0, keep)
                })
            }))
        }
    }
    let schema = inner.schema();
    Box::pin(RecordBatchStreamAdapter::new(
        schema,
        Limited { inner, left: limit },
    ))
}

/// The table DataFusion sees: a single-scan streaming table, optionally unbounded and
/// ordered, that evaluates pushed-down filters in the scan itself.
pub struct LiveTable {
    source: Arc<ScanSource>,
    sort_order: Vec<SortExpr>,
    infinite: bool,
    changes: bool,
}

impl fmt::Debug for LiveTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LiveTable")
            .field("table", &self.source.channel.name)
            .finish()
    }
}

/// Build the DataFusion table read through `reader`, ascending on `order_by` (may be empty);
/// `changes` for a topic subscription (aggregates over it answer with changes).
pub fn live_table(
    reader: Reader,
    unbounded: bool,
    order_by: &[String],
    changes: bool,
) -> LiveTable {
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
        changes,
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
        Ok(exact_pushdown(filters))
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> DFResult<Arc<dyn ExecutionPlan>> {
        Ok(Arc::new(
            self.scan_exec(state, projection, filters, limit, false)?,
        ))
    }
}

/// Exact for every deterministic filter: the scan applies it itself, batch by batch, so
/// DataFusion plans no `FilterExec` (which would wait for `batch_size` rows) above it.
pub fn exact_pushdown(filters: &[&Expr]) -> Vec<TableProviderFilterPushDown> {
    filters
        .iter()
        .map(|f| {
            // Spark's window functions stay above the scan, where the engine's rules place
            // or refuse them (a row's windows are not a filter of the row).
            if f.is_volatile() || calls_spark_window(f) {
                TableProviderFilterPushDown::Unsupported
            } else {
                TableProviderFilterPushDown::Exact
            }
        })
        .collect()
}

fn calls_spark_window(filter: &Expr) -> bool {
    filter
        .exists(|e| {
            Ok(matches!(e, Expr::ScalarFunction(call)
                if matches!(call.func.name(), "window" | "session_window")))
        })
        .unwrap_or(false)
}

/// The pushed-down `filters` as one predicate over `schema`, planned here, not by the
/// (possibly foreign) session: evaluating a foreign expression would cross the FFI boundary
/// on every batch.
pub fn plan_predicate(
    filters: &[Expr],
    schema: &SchemaRef,
    state: &dyn Session,
) -> DFResult<Option<Arc<dyn PhysicalExpr>>> {
    let df_schema = DFSchema::try_from(Arc::clone(schema))?;
    conjunction(filters.iter().cloned())
        .map(|p| create_physical_expr(&native_functions(p)?, &df_schema, state.execution_props()))
        .transpose()
}

/// `filter` with each call of a built-in function bound to this crate's own implementation.
///
/// A filter from datafusion-python arrives with its functions as foreign UDFs, which cross the
/// FFI boundary on every batch and hand every argument over as an array: `get_field` (a
/// struct's field, `info['note']`) then refuses its field name, which must be a scalar. The
/// built-ins are the same DataFusion functions on both sides; a function this crate does not
/// have (a user's UDF) stays foreign.
fn native_functions(filter: Expr) -> DFResult<Expr> {
    static BUILT_IN: std::sync::OnceLock<std::collections::HashMap<String, Arc<ScalarUDF>>> =
        std::sync::OnceLock::new();
    let built_in = BUILT_IN.get_or_init(|| {
        datafusion::functions::all_default_functions()
            .into_iter()
            .chain(datafusion::functions_nested::all_default_nested_functions())
            .map(|f| (f.name().to_string(), f))
            .collect()
    });
    filter
        .transform_up(|e| match e {
            Expr::ScalarFunction(call) => match built_in.get(call.func.name()) {
                Some(own) => Ok(Transformed::yes(Expr::ScalarFunction(
                    ScalarFunction::new_udf(Arc::clone(own), call.args),
                ))),
                None => Ok(Transformed::no(Expr::ScalarFunction(call))),
            },
            other => Ok(Transformed::no(other)),
        })
        .map(|t| t.data)
}

impl LiveTable {
    /// Whether the table declares an order (`order_by`).
    pub fn is_ordered(&self) -> bool {
        !self.sort_order.is_empty()
    }

    /// The scan of this table; with `listen`, it passes watermarks on (the engine's scans).
    pub fn scan_exec(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
        listen: bool,
    ) -> DFResult<LiveScanExec> {
        let schema = self.schema();
        let df_schema = DFSchema::try_from(Arc::clone(&schema))?;
        let projected = match projection {
            Some(p) => Arc::new(schema.project(p)?),
            None => Arc::clone(&schema),
        };
        let ordering = if self.sort_order.is_empty() {
            vec![]
        } else {
            let sort =
                create_physical_sort_exprs(&self.sort_order, &df_schema, state.execution_props())?;
            match projection {
                // The ordering of the projected columns (none if the first key is projected away).
                Some(_) => LexOrdering::new(sort)
                    .and_then(|o| project_ordering(&o, &projected))
                    .map(|o| o.to_vec())
                    .unwrap_or_default(),
                None => sort,
            }
        };
        let predicate = plan_predicate(filters, &schema, state)?.map(|expr| Predicate {
            expr,
            projection: projection.cloned(),
        });
        // The scan has as many partitions as the session wants: DataFusion then adds no
        // round-robin repartition above it, which in DataFusion 54 gathers `batch_size` rows
        // before it passes any on (small batches of a live table would wait for thousands
        // more). They read the queue in parallel; an ordered table is read by the first alone,
        // in order, and its other partitions are empty.
        let n = state.config().target_partitions().max(1);
        let readers = if self.sort_order.is_empty() { n } else { 1 };
        let claim = Arc::new(ScanClaim {
            source: Arc::clone(&self.source),
            state: Mutex::new(ClaimState {
                reader: Weak::new(),
                claimed: false,
                refused: false,
            }),
        });
        let partitions = (0..n)
            .map(|i| ScanPartition {
                reads: i < readers,
                claim: Arc::clone(&claim),
                predicate: predicate.clone(),
                schema: Arc::clone(&projected),
                projection: if predicate.is_some() {
                    None
                } else {
                    projection.cloned()
                },
            })
            .collect();
        let markers = match (listen, self.source.channel.watermark_type()) {
            (true, Ok(data_type)) => Some(Markers {
                cell: Arc::default(),
                data_type,
            }),
            _ => None,
        };
        let eq = EquivalenceProperties::new_with_orderings(Arc::clone(&projected), [ordering]);
        let boundedness = if self.infinite {
            Boundedness::Unbounded {
                requires_infinite_memory: false,
            }
        } else {
            Boundedness::Bounded
        };
        let props = PlanProperties::new(
            eq,
            Partitioning::UnknownPartitioning(n),
            EmissionType::Incremental,
            boundedness,
        );
        Ok(LiveScanExec {
            name: self.source.channel.name.clone(),
            partitions,
            markers,
            limit,
            props: Arc::new(props),
            changes: self.changes,
        })
    }
}

/// Python handle that exports the table to a `datafusion.SessionContext` exactly once.
///
/// It gives up its reference after the first export, so the session owns the table: when
/// the session drops it unscanned, blocked producers learn at once that no reader will come.
/// It keeps a weak one, through which pushtable's engine can still scan the table.
#[pyclass(module = "pushtable._native", name = "TableProvider")]
pub struct PyTableProvider {
    table: Mutex<Option<Arc<LiveTable>>>,
    exported: Mutex<Weak<LiveTable>>,
}

impl PyTableProvider {
    pub fn new(table: LiveTable) -> Self {
        Self {
            table: Mutex::new(Some(Arc::new(table))),
            exported: Mutex::new(Weak::new()),
        }
    }

    /// The table, while its session (or this handle) still holds it.
    pub fn live(&self) -> Option<Arc<LiveTable>> {
        let table = self.table.lock().unwrap_or_else(|p| p.into_inner()).clone();
        table.or_else(|| {
            self.exported
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .upgrade()
        })
    }
}

/// Export `table` as a `datafusion_table_provider` PyCapsule for a datafusion-python
/// session whose codec is `codec` (see [`logical_codec`]); the streams it yields are polled
/// inside `runtime` when given.
pub fn export_capsule<'py>(
    py: Python<'py>,
    table: Arc<dyn TableProvider + Send>,
    codec: FFI_LogicalExtensionCodec,
    runtime: Option<tokio::runtime::Handle>,
) -> PyResult<Bound<'py, PyCapsule>> {
    let provider = FFI_TableProvider::new_with_ffi_codec(table, true, runtime, codec);
    PyCapsule::new(
        py,
        provider,
        Some(CString::from(c"datafusion_table_provider")),
    )
}

/// Read the logical extension codec out of a datafusion-python session (or a codec capsule).
pub fn logical_codec(session: &Bound<'_, PyAny>) -> PyResult<FFI_LogicalExtensionCodec> {
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

/// The value a single-scan handle holds, taken by its one export; `used` is the error after.
pub fn take_once<T>(slot: &Mutex<Option<T>>, used: &'static str) -> PyResult<T> {
    slot.lock()
        .unwrap_or_else(|p| p.into_inner())
        .take()
        .ok_or_else(|| PyRuntimeError::new_err(used))
}

#[pymethods]
impl PyTableProvider {
    fn __datafusion_table_provider__<'py>(
        &self,
        py: Python<'py>,
        session: Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyCapsule>> {
        let codec = logical_codec(&session)?;
        let table = take_once(
            &self.table,
            "this streaming table was already registered with a session",
        )?;
        *self.exported.lock().unwrap_or_else(|p| p.into_inner()) = Arc::downgrade(&table);
        export_capsule(py, table, codec, None)
    }

    /// Whether the table declares an order (False once its session dropped it).
    #[getter]
    fn ordered(&self) -> bool {
        self.live().is_some_and(|t| t.is_ordered())
    }
}
