//! What every pushtable operator answers alike for DataFusion's `ExecutionPlan`: its name, its
//! cached properties (a `props` field), its children (fields named in order) and which of
//! them it keeps the order of. [`plan_basics!`] writes those methods from one line, so each
//! operator's `impl ExecutionPlan` holds only what is its own: how it is rebuilt with new
//! children and how it runs.
//!
//! A leaf (a scan) names no children and is its own rebuild: `plan_basics!(leaf "Name")`.

/// The `ExecutionPlan` methods that only read fields (see the module's docs). Inside an
/// `impl ExecutionPlan for X` block:
///
/// - `plan_basics!("Name", [input], [false]);` one child in field `input`, its order not kept;
/// - `plan_basics!("Name", [input], [false], try_new(setting, ...));` and `with_new_children`
///   rebuilds it by `Self::try_new(<the new children>, <a clone of each setting field>)`, so its
///   properties are worked out again from the new children;
/// - `plan_basics!(leaf "Name");` no children, and `with_new_children` returns the plan itself.
macro_rules! plan_basics {
    ($name:literal, [$($child:ident),+], [$($keeps:expr),+], try_new($($field:ident),* $(,)?)) => {
        plan_basics!($name, [$($child),+], [$($keeps),+]);

        fn with_new_children(
            self: std::sync::Arc<Self>,
            children: Vec<std::sync::Arc<dyn datafusion_physical_plan::ExecutionPlan>>,
        ) -> datafusion_common::Result<std::sync::Arc<dyn datafusion_physical_plan::ExecutionPlan>>
        {
            let mut children = children.into_iter();
            $(let $child = children.next().expect("one new child per child");)+
            Ok(std::sync::Arc::new(Self::try_new(
                $($child,)+
                $(Clone::clone(&self.$field)),*
            )?))
        }
    };
    ($name:literal, [$($child:ident),*], [$($keeps:expr),*]) => {
        fn name(&self) -> &str {
            $name
        }

        fn properties(&self) -> &std::sync::Arc<datafusion_physical_plan::PlanProperties> {
            &self.props
        }

        fn children(&self) -> Vec<&std::sync::Arc<dyn datafusion_physical_plan::ExecutionPlan>> {
            vec![$(&self.$child),*]
        }

        fn maintains_input_order(&self) -> Vec<bool> {
            vec![$($keeps),*]
        }
    };
    (leaf $name:literal) => {
        plan_basics!($name, [], []);

        fn with_new_children(
            self: std::sync::Arc<Self>,
            _children: Vec<std::sync::Arc<dyn datafusion_physical_plan::ExecutionPlan>>,
        ) -> datafusion_common::Result<std::sync::Arc<dyn datafusion_physical_plan::ExecutionPlan>>
        {
            Ok(self)
        }
    };
}

use std::sync::Arc;

use datafusion_physical_expr::aggregate::AggregateFunctionExpr;
use datafusion_physical_expr::EquivalenceProperties;
use datafusion_physical_plan::aggregates::PhysicalGroupBy;
use datafusion_physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion_physical_plan::{Partitioning, PlanProperties};

/// An operator's properties when it emits incrementally from one partition: what the live
/// aggregates and the exported query scan declare (`eq`: their output schema and orderings).
pub fn one_partition(eq: EquivalenceProperties, boundedness: Boundedness) -> Arc<PlanProperties> {
    Arc::new(PlanProperties::new(
        eq,
        Partitioning::UnknownPartitioning(1),
        EmissionType::Incremental,
        boundedness,
    ))
}

/// An aggregate's group keys and aggregates as `EXPLAIN` shows them: `e as name, ...` and
/// the aggregates' names.
pub fn aggregate_display(
    group_by: Option<&PhysicalGroupBy>,
    aggr_expr: &[Arc<AggregateFunctionExpr>],
) -> (String, String) {
    let keys: Vec<String> = group_by
        .map(|g| {
            g.expr()
                .iter()
                .map(|(e, n)| format!("{e} as {n}"))
                .collect()
        })
        .unwrap_or_default();
    let aggs: Vec<&str> = aggr_expr.iter().map(|a| a.name()).collect();
    (keys.join(", "), aggs.join(", "))
}

/// What `EXPLAIN` adds for an operator that closes on the watermarks of `input` too: which
/// watermark reaches it, and through what (`, watermark from t → ReadAheadExec`).
pub fn watermark_note(input: &Arc<dyn datafusion_physical_plan::ExecutionPlan>) -> String {
    match crate::engine::watermark_path(input) {
        Some((_, path)) => format!(", watermark from {path}"),
        None => String::new(),
    }
}
