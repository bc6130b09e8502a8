//! An updating `GROUP BY` (an upsert changelog keyed by its group columns), and the check
//! that nothing but a projection reads such a changelog.

use std::sync::Arc;

use datafusion::common::{plan_err, Result};
use datafusion::physical_optimizer::output_requirements::OutputRequirementExec;
use datafusion::physical_plan::coalesce_partitions::CoalescePartitionsExec;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::{ExecutionPlan, ExecutionPlanProperties};

use super::{raw_aggregate, reads_changes, reads_live, REFUSED};
use crate::engine::updating::UpdatingAggregateExec;

/// A `GROUP BY` (or `DISTINCT`, or a whole-input aggregate) over a live input that found
/// no window of its order: an [`UpdatingAggregateExec`] holding at most `state_limit` bytes
/// when the input is unbounded (it would never answer otherwise) or when `changes` were
/// asked for.
pub(super) fn updating_aggregate(
    node: &Arc<dyn ExecutionPlan>,
    changes: bool,
    state_limit: usize,
) -> Result<Option<Arc<dyn ExecutionPlan>>> {
    let Some(raw) = raw_aggregate(node) else {
        return Ok(None);
    };
    let input = raw.input();
    let asked = changes || input.boundedness().is_unbounded() || reads_changes(input);
    if !reads_live(input) || !asked {
        return Ok(None);
    }
    if raw.group_expr().has_grouping_set() {
        return plan_err!(
            "{REFUSED}AggregateExec: GROUPING SETS, CUBE and ROLLUP over a live table have \
             no updating form; GROUP BY the keys of one grouping set at a time"
        );
    }
    let input: Arc<dyn ExecutionPlan> = if input.output_partitioning().partition_count() > 1 {
        Arc::new(CoalescePartitionsExec::new(Arc::clone(input)))
    } else {
        Arc::clone(input)
    };
    let exec = UpdatingAggregateExec::try_new(
        input,
        raw.group_expr().clone(),
        raw.aggr_expr().to_vec(),
        raw.filter_expr().to_vec(),
        state_limit,
        node.schema(),
    )?;
    Ok(Some(Arc::new(exec)))
}

/// Operators that pass an updating aggregate's changes on as they are, row for row (the
/// output requirement is the planner's marker, removed before the plan runs).
fn passes_changes(node: &Arc<dyn ExecutionPlan>) -> bool {
    node.is::<ProjectionExec>()
        || node.is::<CoalescePartitionsExec>()
        || node.is::<OutputRequirementExec>()
}

/// Whether `node`'s output is an updating aggregate's changelog.
fn emits_changes(node: &Arc<dyn ExecutionPlan>) -> bool {
    node.is::<UpdatingAggregateExec>()
        || (passes_changes(node) && node.children().into_iter().any(emits_changes))
}

/// A changelog goes to the query's output through projections only: any other reader would
/// take a group's new value for another row (an aggregate over it would count a group once
/// per change), and a filter (a `HAVING`) would leave a group's last row standing when the
/// group stops matching: a stale row, silently. Refused, naming the operator.
pub(super) fn check_changelog_readers(plan: &Arc<dyn ExecutionPlan>) -> Result<()> {
    let reads_changes = !passes_changes(plan) && plan.children().into_iter().any(emits_changes);
    if reads_changes && plan.is::<FilterExec>() {
        return plan_err!(
            "{REFUSED}FilterExec: a HAVING (or a filter) over an updating GROUP BY would leave \
             a group's last row standing once the group stops matching; select the aggregates \
             without HAVING and filter the changes as they come, or GROUP BY a window of the \
             table's order (each window is final when it closes, so HAVING is exact there)"
        );
    }
    if reads_changes {
        let name = plan.name();
        return plan_err!(
            "{REFUSED}{name}: {name} over an updating GROUP BY would read its changelog (each \
             changed group again, with its new value) as if it were rows; read the changes as \
             they come, or GROUP BY a window of the table's order (each window is final when \
             it closes)"
        );
    }
    plan.children()
        .into_iter()
        .try_for_each(check_changelog_readers)
}
