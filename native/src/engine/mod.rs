//! pushtable's embedded engine: DataFusion 54 planning the queries that need a live
//! table's order, where that order is a real column ordering.
//!
//! datafusion-python sees an ordered table through the FFI with its ordering turned into
//! opaque foreign expressions, so it can neither stream a `GROUP BY` window nor a running
//! window function over it. Here the live tables are native providers: the planner knows
//! their order, [`rule::EmitOnWindowClose`] turns window aggregates into
//! [`window::WindowAggregateExec`] (emit on window close and on watermarks), and the result
//! goes back to datafusion-python as a single-scan table ([`export::QueryTable`]).
//!
//! - [`window`]: the window aggregate operator ([`runs`]: its groups when the window is
//!   the only key);
//! - [`join`]: the lookup join of a live table with a bounded one;
//! - [`readahead`]: each side of a join of two live tables, read as it is written;
//! - [`shared_scan`]: one read of a table the query scans several times, shared by its scans;
//! - [`rule`]: where they replace DataFusion's operators;
//! - [`export`]: a running query as a table of the caller's session ([`abort`]: ended at once
//!   by a failure its read-aheads find).

mod abort;
mod bins;
mod export;
mod frames;
mod groups;
mod int_groups;
mod join;
mod readahead;
mod rule;
mod runs;
mod session;
mod shared_scan;
mod spark_windows;
mod tally;
mod task;
mod updating;
mod watermark_rows;
mod window;

pub(crate) use rule::watermark_path;

use std::ffi::CString;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

use arrow::record_batch::RecordBatchReader;
use async_trait::async_trait;
use datafusion::catalog::{MemTable, Session, TableProvider};
use datafusion::common::{JoinType, NullEquality, Result as DFResult};
use datafusion::execution::disk_manager::{DiskManagerBuilder, DiskManagerMode};
use datafusion::execution::memory_pool::FairSpillPool;
use datafusion::execution::runtime_env::RuntimeEnvBuilder;
use datafusion::execution::{SessionStateBuilder, TaskContext, TaskContextProvider};
use datafusion::logical_expr::{Expr, TableProviderFilterPushDown, TableType};
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_optimizer::optimizer::PhysicalOptimizer;
use datafusion::physical_plan::aggregates::AggregateExec;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::joins::{HashJoinExec, SymmetricHashJoinExec};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::sorts::sort::SortExec;
use datafusion::physical_plan::windows::BoundedWindowAggExec;
use datafusion::physical_plan::{displayable, ExecutionPlan, InputOrderMode};
use datafusion::prelude::{SQLOptions, SessionConfig, SessionContext};
use datafusion_ffi::proto::logical_extension_codec::FFI_LogicalExtensionCodec;
use datafusion_ffi::table_provider::FFI_TableProvider;
use pyo3::exceptions::{PyKeyError, PyOSError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyCapsule;

use crate::import::AlignedStreamReader;
use crate::provider::{
    export_capsule, logical_codec, take_once, LiveScanExec, LiveTable, PyTableProvider,
};

/// The environment variable that sets the engine's worker threads (default: the cores this
/// process may use, `available_parallelism`).
pub const THREADS_VAR: &str = "PUSHTABLE_ENGINE_THREADS";

/// How many worker threads the engine's runtime gets: `PUSHTABLE_ENGINE_THREADS` if set,
/// else the cores this process may use (its CPU affinity and cgroup quota included).
pub fn engine_threads() -> Result<usize, String> {
    match std::env::var(THREADS_VAR) {
        Ok(text) => match text.trim().parse::<usize>() {
            Ok(n) if n >= 1 => Ok(n),
            _ => Err(format!(
                "{THREADS_VAR}={text:?}: expected a whole number of threads >= 1"
            )),
        },
        Err(_) => Ok(std::thread::available_parallelism().map_or(1, |n| n.get())),
    }
}

/// The engine's tokio runtime: plans are made and run on it (a query's own work runs in
/// whichever thread polls it). Sized by [`engine_threads`] on first use. A runtime that
/// cannot start is an error for every query that needs it, never a panic: `ValueError` for
/// a bad setting, `OSError` when the threads cannot be started (neither is DataFusion's
/// planning error, so no query falls back to another engine because of it).
pub fn runtime() -> PyResult<&'static tokio::runtime::Runtime> {
    enum Failure {
        Setting(String),
        Start(String),
    }
    static RUNTIME: OnceLock<Result<tokio::runtime::Runtime, Failure>> = OnceLock::new();
    let built = RUNTIME.get_or_init(|| {
        let threads = engine_threads().map_err(Failure::Setting)?;
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("pushtable-engine")
            .enable_all()
            .build()
            .map_err(|e| {
                Failure::Start(format!(
                    "cannot start the live engine's runtime ({threads} threads): {e}"
                ))
            })
    });
    built.as_ref().map_err(|failure| match failure {
        Failure::Setting(msg) => PyValueError::new_err(msg.clone()),
        Failure::Start(msg) => PyOSError::new_err(msg.clone()),
    })
}

/// A live table as the engine scans it: like datafusion-python's scan, but passing
/// watermarks on to the operators above.
#[derive(Debug)]
struct EngineTable(Arc<LiveTable>);

#[async_trait]
impl TableProvider for EngineTable {
    fn schema(&self) -> arrow::datatypes::SchemaRef {
        self.0.schema()
    }

    fn table_type(&self) -> TableType {
        TableType::View
    }

    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> DFResult<Vec<TableProviderFilterPushDown>> {
        self.0.supports_filters_pushdown(filters)
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> DFResult<Arc<dyn ExecutionPlan>> {
        Ok(Arc::new(
            self.0.scan_exec(state, projection, filters, limit, true)?,
        ))
    }
}

fn session(
    batch_size: usize,
    memory_limit: Option<usize>,
    changes: bool,
) -> DFResult<SessionContext> {
    let mut config = SessionConfig::new()
        .with_extension(Arc::new(abort::Abort::default()))
        .with_target_partitions(1)
        .with_batch_size(batch_size)
        .with_information_schema(false);
    // A join of two live tables reads both in one partition (no hash repartition holding
    // rows back until it has a batch of them).
    config.options_mut().optimizer.repartition_joins = false;
    let mut rules = PhysicalOptimizer::new().rules;
    // After partial and final aggregates are combined, before sorting is enforced.
    let at = rules
        .iter()
        .position(|r| r.name() == "EnforceSorting")
        .unwrap_or(rules.len() - 1);
    // An updating aggregate's state is held to the session's memory limit, else a default.
    let state_limit = memory_limit.unwrap_or(updating::DEFAULT_STATE_LIMIT);
    rules.insert(
        at,
        Arc::new(rule::EmitOnWindowClose::new(changes, state_limit)),
    );
    // Last, so no later rule rebuilds a filter with the session's batch size.
    rules.push(Arc::new(rule::PassFilteredBatches));
    rules.push(Arc::new(rule::ReadAheadAtScans));
    // After every rule that looks for live scans: they see each scan as a plain one.
    rules.push(Arc::new(rule::ShareScans));
    let mut builder = SessionStateBuilder::new();
    if let Some(limit) = memory_limit {
        // The session's memory pool, as in the caller's datafusion-python session: fair
        // shares, and no spilling to disk (an operator over its share fails instead).
        let runtime = RuntimeEnvBuilder::new()
            .with_memory_pool(Arc::new(FairSpillPool::new(limit)))
            .with_disk_manager_builder(
                DiskManagerBuilder::default().with_mode(DiskManagerMode::Disabled),
            )
            .build_arc()?;
        builder = builder.with_runtime_env(runtime);
    }
    let state = builder
        .with_config(config)
        .with_default_features()
        .with_physical_optimizer_rules(rules)
        .build();
    let ctx = SessionContext::new_with_state(state);
    // Spark's window functions, by Spark's names.
    ctx.register_udf(spark_windows::SparkWindow::udf());
    ctx.register_udf(spark_windows::SessionWindow::udf());
    Ok(ctx)
}

/// Why a plan needs the engine: the operators in it that use a live table's order, and how
/// each answers ("<mode>: <why>", the mode as `explain_live` names it).
fn uses_of_order(plan: &Arc<dyn ExecutionPlan>, out: &mut Vec<String>) -> bool {
    let mut live = plan.is::<LiveScanExec>();
    for child in plan.children() {
        live |= uses_of_order(child, out);
    }
    let reason = if let Some(shared) = plan.downcast_ref::<shared_scan::SharedScanExec>() {
        Some(format!(
            "incremental: the query scans live table '{}' several times; it is read once and \
             shared by its {} scans, at the pace of the fastest scan's consumer (a paused \
             query holds the producer); rows a slower scan has not read yet wait in the \
             session's memory pool",
            shared.table(),
            shared.scans()
        ))
    } else if !live {
        return false;
    } else if plan.is::<window::WindowAggregateExec>() || plan.is::<session::SessionWindowExec>() {
        // Which watermark reaches it, and through what: each comes after the rows before it.
        Some(match rule::watermark_path(plan.children()[0]) {
            Some((_, path)) => format!(
                "incremental: windows emit as they close (and on the watermarks of {path}, \
                 each after every row before it)"
            ),
            None => "incremental: windows emit as they close (no watermark reaches them here: \
                     they close on later rows and at the end)"
                .to_string(),
        })
    } else if let Some(join) = plan.downcast_ref::<join::LookupJoinExec>() {
        let read_ahead = join.probe().is::<readahead::ReadAheadExec>();
        Some(format!(
            "incremental: a lookup join ({}; {}) streams joined rows as they arrive{}",
            join_kind(&join.join_type()),
            null_rule(join.null_equality()),
            match read_ahead {
                true =>
                    ", once its bounded live side has closed (the other side is read \
                         ahead meanwhile, in the session's memory pool)",
                false => "",
            }
        ))
    } else if let Some(join) = plan.downcast_ref::<SymmetricHashJoinExec>() {
        Some(format!(
            "incremental: a join of two live tables ({}; {}) emits each match once both rows \
             are in; its state is pruned by the time bound between their orders",
            join_kind(join.join_type()),
            null_rule(join.null_equality()),
        ))
    } else if plan.children().len() > 1 && plan.children().into_iter().any(reads_ahead) {
        let kind = match plan.downcast_ref::<HashJoinExec>() {
            Some(j) => format!(
                "a join of live tables ({}; {})",
                join_kind(j.join_type()),
                null_rule(j.null_equality())
            ),
            None if plan.name() == "ScalarSubqueryExec" => {
                "a scalar subquery over a live table, in a query over another,".to_string()
            }
            None => format!("a join of live tables ({})", plan.name()),
        };
        Some(format!(
            "at_end: {kind} reads each table while it waits on another (held in the \
             session's memory pool; a paused query holds the producers) and answers once the \
             bounded table it needs whole has closed"
        ))
    } else if plan.is::<updating::UpdatingAggregateExec>() {
        Some(
            "incremental: an updating aggregate emits the groups changed by each batch with \
             their current values (an upsert changelog keyed by the GROUP BY columns)"
                .to_string(),
        )
    } else if plan.is::<BoundedWindowAggExec>() {
        // Over a sort of the live input (a table without that order) it waits for the
        // whole input like the sort: nothing to claim.
        (!sorted_below(plan))
            .then(|| "incremental: window functions stream in the table's order".to_string())
    } else if let Some(agg) = plan.downcast_ref::<AggregateExec>() {
        (*agg.input_order_mode() != InputOrderMode::Linear && !sorted_below(plan))
            .then(|| "incremental: the aggregate streams in the table's order".to_string())
    } else {
        None
    };
    if let Some(r) = reason {
        if !out.contains(&r) {
            out.push(r);
        }
    }
    true
}

/// Whether `plan` reads a live table through a read-ahead (operators between them pass each
/// batch on: the read-ahead sits right above the scan).
fn reads_ahead(plan: &Arc<dyn ExecutionPlan>) -> bool {
    plan.is::<readahead::ReadAheadExec>()
        || (!plan.is::<SymmetricHashJoinExec>()
            && !plan.is::<join::LookupJoinExec>()
            && plan.children().into_iter().any(reads_ahead))
}

/// A join type as `explain_live` says it.
fn join_kind(join_type: &JoinType) -> String {
    format!("{join_type} join")
}

/// How a join compares NULL keys, as `explain_live` says it.
fn null_rule(null_equality: NullEquality) -> &'static str {
    match null_equality {
        NullEquality::NullEqualsNothing => "a NULL key matches nothing",
        NullEquality::NullEqualsNull => "NULL keys match each other",
    }
}

/// Whether a sort stands between `plan` and a live scan below it (it reads its whole input
/// before its first row).
fn sorted_below(plan: &Arc<dyn ExecutionPlan>) -> bool {
    plan.children()
        .into_iter()
        .any(|child| (child.is::<SortExec>() && reads_live_scan(child)) || sorted_below(child))
}

fn reads_live_scan(plan: &Arc<dyn ExecutionPlan>) -> bool {
    plan.is::<LiveScanExec>()
        || plan.is::<shared_scan::SharedScanExec>()
        || plan.children().into_iter().any(reads_live_scan)
}

/// The output columns (indices) that key an updating aggregate's changelog at the root of
/// `plan`, through projections that keep every key; None when the root is anything else.
fn upsert_key(plan: &Arc<dyn ExecutionPlan>) -> Option<Vec<usize>> {
    if let Some(agg) = plan.downcast_ref::<updating::UpdatingAggregateExec>() {
        return Some((0..agg.group_count()).collect());
    }
    if let Some(projection) = plan.downcast_ref::<ProjectionExec>() {
        let below = upsert_key(projection.input())?;
        return below
            .iter()
            .map(|&k| {
                projection.expr().iter().position(|p| {
                    p.expr
                        .downcast_ref::<Column>()
                        .is_some_and(|c| c.index() == k)
                })
            })
            .collect();
    }
    if plan.is::<CoalescePartitionsExec>() {
        return upsert_key(plan.children()[0]);
    }
    None
}

/// The engine of one `ctx.sql(...)` call: the caller's tables, registered natively.
#[pyclass(module = "pushtable._native", name = "Engine")]
pub struct PyEngine {
    ctx: Arc<SessionContext>,
}

/// A query planned by the engine: what it would run, and whether it needs to.
#[pyclass(module = "pushtable._native", name = "LivePlan")]
pub struct PyLivePlan {
    plan: Mutex<Option<Arc<dyn ExecutionPlan>>>,
    task: Arc<TaskContext>,
    sql: String,
    /// Why the engine must run it (empty: datafusion-python runs it as well).
    #[pyo3(get)]
    reasons: Vec<String>,
    /// The physical plan, indented.
    #[pyo3(get)]
    display: String,
    /// For an updating aggregate: the output columns that key its upsert changelog (empty:
    /// one row, which each change replaces); None for every other query.
    #[pyo3(get)]
    upsert_key: Option<Vec<String>>,
    /// The result's column names as DataFusion gives them (two may be alike: `SELECT l.a,
    /// r.a`; the table the query is read through names such columns apart).
    #[pyo3(get)]
    names: Vec<String>,
}

impl fmt::Debug for PyEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engine").finish()
    }
}

fn py_err(e: impl fmt::Display) -> PyErr {
    PyRuntimeError::new_err(e.to_string())
}

#[pymethods]
impl PyEngine {
    #[new]
    #[pyo3(signature = (batch_size=8192, memory_limit=None, changes=false))]
    fn new(batch_size: usize, memory_limit: Option<usize>, changes: bool) -> PyResult<Self> {
        let ctx = session(batch_size.max(1), memory_limit, changes)
            .map_err(|e| py_err(format!("cannot build the live engine's session: {e}")))?;
        Ok(Self { ctx: Arc::new(ctx) })
    }

    /// Register a live table (a streaming table or a topic subscription) under `name`.
    fn register_live(&self, name: &str, provider: PyRef<'_, PyTableProvider>) -> PyResult<()> {
        let table = provider.live().ok_or_else(|| {
            PyKeyError::new_err(format!(
                "the live table '{name}' was dropped from its session"
            ))
        })?;
        self.ctx
            .register_table(name, Arc::new(EngineTable(table)))
            .map_err(py_err)?;
        Ok(())
    }

    /// Register an object with `__datafusion_table_provider__` (a Lance dataset's provider,
    /// any FFI table provider of DataFusion 54).
    fn register_provider(&self, py: Python<'_>, name: &str, obj: Bound<'_, PyAny>) -> PyResult<()> {
        let task: Arc<dyn TaskContextProvider> = Arc::clone(&self.ctx) as _;
        let codec = FFI_LogicalExtensionCodec::new_default(&task);
        let session = PyCapsule::new(
            py,
            codec,
            Some(CString::from(c"datafusion_logical_extension_codec")),
        )?;
        let capsule = obj.call_method1("__datafusion_table_provider__", (session,))?;
        let capsule = capsule.cast::<PyCapsule>().map_err(|_| {
            PyTypeError::new_err(format!(
                "'{name}': __datafusion_table_provider__ did not return a PyCapsule"
            ))
        })?;
        let ptr = capsule.pointer_checked(Some(c"datafusion_table_provider"))?;
        // SAFETY: the capsule's name guarantees an FFI_TableProvider; it is cloned (the
        // clone keeps the provider alive), and the reference is not kept.
        let ffi = unsafe { ptr.cast::<FFI_TableProvider>().as_ref() };
        let provider: Arc<dyn TableProvider> = ffi.into();
        self.ctx.register_table(name, provider).map_err(py_err)?;
        Ok(())
    }

    /// Register Arrow data (`__arrow_c_stream__`: a pyarrow Table, a reader) in memory.
    fn register_arrow(&self, name: &str, data: Bound<'_, PyAny>) -> PyResult<()> {
        let reader = AlignedStreamReader::from_pyarrow(&data)?;
        let schema = reader.schema();
        let batches = reader
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| PyValueError::new_err(format!("'{name}': {e}")))?;
        let table = MemTable::try_new(schema, vec![batches]).map_err(py_err)?;
        self.ctx
            .register_table(name, Arc::new(table))
            .map_err(py_err)?;
        Ok(())
    }

    /// Plan a query (no DDL, DML or SET: those never reach the engine).
    fn plan(&self, py: Python<'_>, sql: &str) -> PyResult<PyLivePlan> {
        let ctx = Arc::clone(&self.ctx);
        let text = sql.to_string();
        let runtime = runtime()?;
        let planned = crate::finalizing::detach(py, move || {
            runtime.block_on(async move {
                let options = SQLOptions::new()
                    .with_allow_ddl(false)
                    .with_allow_dml(false)
                    .with_allow_statements(false);
                let df = ctx.sql_with_options(&text, options).await?;
                let qualified: Vec<String> = df
                    .schema()
                    .iter()
                    .map(|(q, f)| match q {
                        Some(q) => format!("{q}.{}", f.name()),
                        None => f.name().clone(),
                    })
                    .collect();
                Ok((df.create_physical_plan().await?, qualified))
            })
        });
        let (plan, qualified) = planned.map_err(|e: datafusion::error::DataFusionError| {
            let text = e.to_string();
            match text.find(rule::REFUSED) {
                // A refusal, not a planning failure: no other engine may run it either.
                // "<operator>: <why>", raised as (why, operator).
                Some(at) => {
                    let refusal = &text[at + rule::REFUSED.len()..];
                    let (operator, why) = refusal.split_once(": ").unwrap_or(("", refusal));
                    crate::QueryRefused::new_err((why.to_string(), operator.to_string()))
                }
                None => match text.find(spark_windows::INVALID) {
                    // A bad argument of a function of ours: the caller's mistake.
                    Some(at) => crate::InvalidQuery::new_err(
                        text[at + spark_windows::INVALID.len()..].to_string(),
                    ),
                    None => py_err(text),
                },
            }
        })?;
        let names: Vec<String> = plan
            .schema()
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .collect();
        let plan = with_unique_names(plan, &names, &qualified).map_err(py_err)?;
        let mut reasons = Vec::new();
        uses_of_order(&plan, &mut reasons);
        let display = displayable(plan.as_ref()).indent(true).to_string();
        let upsert_key = upsert_key(&plan).map(|keys| {
            let schema = plan.schema();
            keys.into_iter()
                .map(|i| schema.field(i).name().clone())
                .collect()
        });
        Ok(PyLivePlan {
            display,
            plan: Mutex::new(Some(plan)),
            task: self.ctx.task_ctx(),
            sql: sql.to_string(),
            reasons,
            upsert_key,
            names,
        })
    }
}

/// `plan` with its columns renamed where two share a name (`SELECT l.a, r.a`), so that a
/// datafusion-python session can read it as a table; each such column is named by its
/// qualified name (`l.a`), then numbered if that is still taken. The caller's DataFrame
/// gives the columns their own names back (`LivePlan.names`).
fn with_unique_names(
    plan: Arc<dyn ExecutionPlan>,
    names: &[String],
    qualified: &[String],
) -> DFResult<Arc<dyn ExecutionPlan>> {
    let repeated = |n: &String| names.iter().filter(|m| *m == n).count() > 1;
    if !names.iter().any(repeated) {
        return Ok(plan);
    }
    let mut taken: Vec<String> = names.iter().filter(|n| !repeated(n)).cloned().collect();
    let schema = plan.schema();
    let columns = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let mut unique = name.clone();
            if repeated(name) {
                unique = qualified.get(i).cloned().unwrap_or_else(|| name.clone());
                let base = unique.clone();
                let mut k = 1;
                while taken.contains(&unique) {
                    k += 1;
                    unique = format!("{base}#{k}");
                }
                taken.push(unique.clone());
            }
            let column: Arc<dyn datafusion::physical_expr::PhysicalExpr> =
                Arc::new(Column::new(schema.field(i).name(), i));
            (column, unique)
        })
        .collect::<Vec<_>>();
    Ok(Arc::new(ProjectionExec::try_new(columns, plan)?))
}

/// The plan's result as a table for a datafusion-python session (`ctx.read_table`).
#[pyclass(module = "pushtable._native", name = "LiveQuery")]
pub struct PyLiveQuery {
    table: Mutex<Option<Arc<export::QueryTable>>>,
}

#[pymethods]
impl PyLivePlan {
    /// The running query as a single-scan table (once).
    fn query(&self) -> PyResult<PyLiveQuery> {
        let plan = self
            .plan
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(|| PyRuntimeError::new_err("this plan was already turned into a query"))?;
        let table = export::QueryTable::new(plan, Arc::clone(&self.task), &self.sql);
        Ok(PyLiveQuery {
            table: Mutex::new(Some(Arc::new(table))),
        })
    }
}

#[pymethods]
impl PyLiveQuery {
    fn __datafusion_table_provider__<'py>(
        &self,
        py: Python<'py>,
        session: Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyCapsule>> {
        let codec = logical_codec(&session)?;
        let table = take_once(&self.table, "this live query was already read")?;
        export_capsule(py, table, codec, Some(runtime()?.handle().clone()))
    }
}

/// The live engine's worker threads (see [`engine_threads`]); a bad setting raises.
#[pyfunction(name = "engine_threads")]
fn threads() -> PyResult<usize> {
    engine_threads().map_err(PyValueError::new_err)
}

/// The tables `sql` reads (CTEs excluded); empty when it does not parse. A table of the
/// default catalog and schema (`datafusion.public`) by its name; any other qualified, as
/// written (`information_schema.columns`): never mistaken for a table of that name.
///
/// With `strict`, a text that does not parse, or whose references cannot be resolved, raises
/// `ValueError` naming why: a caller that authorizes by the tables a text reads refuses what
/// it cannot check (fail closed) rather than read "no table" into it.
#[pyfunction]
#[pyo3(signature = (sql, strict = false))]
fn table_references(sql: &str, strict: bool) -> PyResult<Vec<String>> {
    let statements = match datafusion::sql::parser::DFParser::parse_sql(sql) {
        Ok(statements) => statements,
        Err(e) if strict => {
            return Err(PyValueError::new_err(format!(
                "the query does not parse: {e}"
            )));
        }
        Err(_) => return Ok(Vec::new()),
    };
    let mut names = Vec::new();
    for statement in &statements {
        let resolved = datafusion::sql::resolve::resolve_table_references(statement, true);
        if let (Err(e), true) = (&resolved, strict) {
            return Err(PyValueError::new_err(format!(
                "the tables the query reads cannot be resolved: {e}"
            )));
        }
        if let Ok((tables, _)) = resolved {
            names.extend(tables.into_iter().map(|t| {
                let default = t.schema().is_none_or(|s| s == "public")
                    && t.catalog().is_none_or(|c| c == "datafusion");
                match default {
                    true => t.table().to_string(),
                    false => t.to_string(),
                }
            }));
        }
    }
    names.sort();
    names.dedup();
    Ok(names)
}

/// `sql` with each positional `?` placeholder numbered `$1`, `$2`, … in order, found by the
/// SQL parser's own tokenizer (so a `?` inside a string, a dollar-quoted string, a quoted
/// identifier or a comment is left alone), and the count numbered. A text the tokenizer
/// refuses raises `ValueError`: a rewrite it cannot check is not made.
#[pyfunction]
fn number_placeholders(sql: &str) -> PyResult<(String, usize)> {
    use datafusion::sql::sqlparser::dialect::GenericDialect;
    use datafusion::sql::sqlparser::tokenizer::{Token, Tokenizer};
    let tokens = Tokenizer::new(&GenericDialect {}, sql)
        .tokenize()
        .map_err(|e| PyValueError::new_err(format!("the query does not tokenize: {e}")))?;
    if !tokens
        .iter()
        .any(|t| matches!(t, Token::Placeholder(p) if p == "?"))
    {
        return Ok((sql.to_string(), 0)); // nothing to number: the text as it came
    }
    let mut out = String::with_capacity(sql.len() + 8);
    let mut count = 0usize;
    for token in &tokens {
        match token {
            Token::Placeholder(p) if p == "?" => {
                count += 1;
                out.push_str(&format!("${count}"));
            }
            other => out.push_str(&other.to_string()),
        }
    }
    Ok((out, count))
}

/// Add the engine's classes to the module.
/// The state of the engine's running stateful operators: per kind, (running streams, groups,
/// bytes of state).
#[pyfunction]
fn live_state() -> Vec<(&'static str, i64, i64, i64)> {
    tally::ALL
        .iter()
        .map(|t| {
            let (streams, groups, bytes) = t.read();
            (t.name, streams, groups, bytes)
        })
        .collect()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(live_state, m)?)?;
    m.add_function(wrap_pyfunction!(table_references, m)?)?;
    m.add_function(wrap_pyfunction!(number_placeholders, m)?)?;
    m.add_function(wrap_pyfunction!(threads, m)?)?;
    m.add_class::<PyEngine>()?;
    m.add_class::<PyLivePlan>()?;
    m.add_class::<PyLiveQuery>()?;
    Ok(())
}
