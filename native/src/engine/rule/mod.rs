//! The engine's physical optimizer rules: where pushtable's operators replace DataFusion's.
//!
//! [`EmitOnWindowClose`] visits the plan bottom-up and tries, at each node:
//! - [`windows`]: a `GROUP BY` over an ordered live input whose key includes a window of the
//!   order column becomes a window aggregate (tumbling, Spark's `window`/`session_window`);
//!   window functions above it are fitted to the order it declares;
//! - [`changelog`]: any other `GROUP BY` over an unbounded live input (or with `EMIT CHANGES`)
//!   becomes an updating aggregate, and what reads its changelog is checked;
//! - [`joins`]: a join of a live table with a bounded one becomes a lookup join; a join of two
//!   live tables reads each side as it is written (a symmetric hash join when a time bound
//!   lets it prune, else the join DataFusion planned once bounded sides end), and is refused
//!   when it could never answer;
//! - [`order`]: what the rules know of an input's order and watermarks.
//!
//! It runs right after DataFusion combines partial and final aggregates and before sorting
//! is enforced (so an `ORDER BY window` above it costs nothing: the output is in window
//! order) and long before the sanity check (which would refuse an unordered aggregate over
//! an unbounded input). Two more rules run last: [`PassFilteredBatches`] keeps filters above
//! live inputs from holding rows back, and [`ShareScans`] reads a table the plan scans
//! several times once, for all its scans.

mod changelog;
mod joins;
mod order;
mod windows;

pub(crate) use order::{watermark_path, watermark_source};

use std::collections::HashMap;
use std::sync::Arc;

use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TransformedResult, TreeNode};
use datafusion::common::Result;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::repartition::RepartitionExec;
use datafusion::physical_plan::ExecutionPlan;

use super::shared_scan::{SharedRead, SharedScanExec};
use crate::provider::LiveScanExec;

/// Replaces window `GROUP BY`s over ordered input by [`WindowAggregateExec`], other
/// `GROUP BY`s over live input by [`UpdatingAggregateExec`] (see [`EmitOnWindowClose::new`]),
/// and joins as the module says.
#[derive(Debug)]
pub struct EmitOnWindowClose {
    /// Aggregates over bounded live tables emit changes too (`EMIT CHANGES`), not only at end.
    changes: bool,
    /// Bytes of state an updating aggregate may hold.
    state_limit: usize,
}

impl EmitOnWindowClose {
    /// A `GROUP BY` with no window over an unbounded live input (or over any live input with
    /// `changes`) answers as an upsert changelog holding at most `state_limit` bytes.
    pub fn new(changes: bool, state_limit: usize) -> Self {
        Self {
            changes,
            state_limit,
        }
    }
}

impl PhysicalOptimizerRule for EmitOnWindowClose {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let plan = plan
            .transform_up(|node| {
                let new = match windows::window_aggregate(&node)? {
                    Some(new) => Some(new),
                    None => {
                        match changelog::updating_aggregate(&node, self.changes, self.state_limit)?
                        {
                            Some(new) => Some(new),
                            None => match joins::join(&node)? {
                                Some(new) => Some(new),
                                None => windows::refit_window_function(&node)?,
                            },
                        }
                    }
                };
                Ok(match new {
                    Some(new) => Transformed::yes(new),
                    None => Transformed::no(node),
                })
            })
            .data()?;
        changelog::check_changelog_readers(&plan)?;
        windows::check_spark_windows_placed(&plan)?;
        Ok(plan)
    }

    fn name(&self) -> &str {
        "pushtable_emit_on_window_close"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// Lets every filtered batch above a live input go on at once.
///
/// DataFusion 54's `FilterExec` gathers its output into `batch_size`-row batches. Over a
/// live table that is harmless (the scan evaluates those filters itself), but above what
/// the engine derives from one — a `HAVING` over windows, a `WHERE` over window results or
/// a join — it would hold answers back until 8,192 rows had passed, or until `close()`.
/// A batch size of 1 makes its coalescer pass each filtered batch through whole.
#[derive(Debug, Default)]
pub struct PassFilteredBatches;

impl PhysicalOptimizerRule for PassFilteredBatches {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        plan.transform_up(|node| {
            let Some(filter) = node.downcast_ref::<FilterExec>() else {
                return Ok(Transformed::no(node));
            };
            if filter.batch_size() == 1 || !reads_live(filter.input()) {
                return Ok(Transformed::no(node));
            }
            let passing: Arc<dyn ExecutionPlan> = Arc::new(filter.with_batch_size(1)?);
            Ok(Transformed::yes(passing))
        })
        .data()
    }

    fn name(&self) -> &str {
        "pushtable_pass_filtered_batches"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// The aggregate reading raw rows behind `node` (itself, or the partial stage of a final one).
fn raw_aggregate(node: &Arc<dyn ExecutionPlan>) -> Option<&AggregateExec> {
    let agg = node.downcast_ref::<AggregateExec>()?;
    match agg.mode() {
        AggregateMode::Single | AggregateMode::SinglePartitioned => Some(agg),
        AggregateMode::Final | AggregateMode::FinalPartitioned => {
            let mut child = agg.input();
            while child.is::<CoalescePartitionsExec>() || child.is::<RepartitionExec>() {
                child = child.children()[0];
            }
            let partial = child.downcast_ref::<AggregateExec>()?;
            (*partial.mode() == AggregateMode::Partial).then_some(partial)
        }
        _ => None,
    }
}

/// Whether `plan` reads a topic subscription (whose aggregates answer with changes).
fn reads_changes(plan: &Arc<dyn ExecutionPlan>) -> bool {
    plan.downcast_ref::<LiveScanExec>()
        .is_some_and(|s| s.changes())
        || plan.children().into_iter().any(reads_changes)
}

/// Whether `plan` reads a live table.
fn reads_live(plan: &Arc<dyn ExecutionPlan>) -> bool {
    plan.is::<LiveScanExec>() || plan.children().into_iter().any(reads_live)
}

/// Puts each read-ahead back above a sort DataFusion's own rules sank below it (see
/// [`joins::reseat_read_aheads`]).
#[derive(Debug, Default)]
pub struct ReadAheadAtScans;

impl PhysicalOptimizerRule for ReadAheadAtScans {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        joins::reseat_read_aheads(plan)
    }

    fn name(&self) -> &str {
        "pushtable_read_ahead_at_scans"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// What starts the message of a query the engine refuses (never hands to another engine).
pub const REFUSED: &str = "pushtable refuses this live query: ";

/// Reads a live table the plan scans several times (a self-join, a CTE used twice, `UNION
/// ALL` of a table with itself, DataFusion's plan of `x > ANY (SELECT …)`) once, for all
/// its scans ([`SharedScanExec`]). Run last: the rules before it see plain live scans.
#[derive(Debug, Default)]
pub struct ShareScans;

impl PhysicalOptimizerRule for ShareScans {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        // Keyed by the registered table (its source), not by name: two subscriptions of one
        // topic read one channel through two cursors, each from its own start.
        let mut scans: HashMap<usize, (String, usize)> = HashMap::new();
        count_scans(&plan, &mut scans);
        let mut reads: HashMap<usize, (Arc<SharedRead>, usize)> = scans
            .into_iter()
            .filter(|(_, (_, n))| *n > 1)
            .map(|(source, (table, n))| {
                let read = Arc::new(SharedRead::new(&table, n));
                (source, (read, 0))
            })
            .collect();
        if reads.is_empty() {
            return Ok(plan);
        }
        plan.transform_up(|node| {
            let Some(scan) = node.downcast_ref::<LiveScanExec>() else {
                return Ok(Transformed::no(node));
            };
            let Some((read, next)) = reads.get_mut(&scan.source_id()) else {
                return Ok(Transformed::no(node));
            };
            let shared = SharedScanExec::new(Arc::clone(&node), Arc::clone(read), *next);
            *next += 1;
            Ok(Transformed::yes(Arc::new(shared) as Arc<dyn ExecutionPlan>))
        })
        .data()
    }

    fn name(&self) -> &str {
        "pushtable_share_scans"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

/// How many times `plan` scans each live table, by source (with the table's name).
fn count_scans(plan: &Arc<dyn ExecutionPlan>, out: &mut HashMap<usize, (String, usize)>) {
    if let Some(scan) = plan.downcast_ref::<LiveScanExec>() {
        out.entry(scan.source_id())
            .or_insert_with(|| (scan.table().to_string(), 0))
            .1 += 1;
    }
    for child in plan.children() {
        count_scans(child, out);
    }
}
