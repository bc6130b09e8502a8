//! Read-ahead: an input read as fast as it produces, whatever its consumer polls.
//!
//! DataFusion's `SymmetricHashJoinExec` polls its two inputs in turn and waits on the one it
//! chose: with a producer that writes many batches to one live table before it writes the
//! other, the join would wait on the empty table while the full one's producer blocks on
//! its queue, for good. Below each side of such a join this operator drains its input into
//! a queue of its own, counted in the session's memory pool (past the pool's limit the
//! query fails with DataFusion's "Resources exhausted" naming it, never an unbounded
//! buffer outside it), so each producer is read as it writes.

use std::fmt;
use std::sync::{Arc, Mutex};

use datafusion::common::{DataFusionError, Result};
use datafusion::execution::memory_pool::MemoryConsumer;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, ExecutionPlanProperties, PlanProperties,
};
use futures::StreamExt;

/// Reads `input` eagerly into a queue (see the module's docs); same output, same order.
pub struct ReadAheadExec {
    input: Arc<dyn ExecutionPlan>,
    /// Started when the query starts ([`ReadAheadExec::start`]), by partition: an operator
    /// above may execute its input only later (DataFusion's `ScalarSubqueryExec` runs its
    /// subqueries to their end first), and the table's producer must be read meanwhile.
    /// `None` until it starts or a partition is executed: its input is read once, by one
    /// task per partition, however often `start` is called.
    started: Mutex<Option<Vec<Option<SendableRecordBatchStream>>>>,
}

impl ReadAheadExec {
    pub fn new(input: Arc<dyn ExecutionPlan>) -> Self {
        Self {
            input,
            started: Mutex::new(None),
        }
    }

    /// What it reads ahead.
    pub fn input(&self) -> &Arc<dyn ExecutionPlan> {
        &self.input
    }

    /// Start reading every partition now; `execute` then hands each one out. Does nothing
    /// once started (or once a partition was executed): a second reader of the same input
    /// would take rows nobody reads.
    pub fn start(&self, context: &Arc<TaskContext>) -> Result<()> {
        let mut started = self.started.lock().unwrap_or_else(|p| p.into_inner());
        if started.is_some() {
            return Ok(());
        }
        let n = self.input.output_partitioning().partition_count();
        let streams = (0..n)
            .map(|p| self.read(p, Arc::clone(context)).map(Some))
            .collect::<Result<Vec<_>>>()?;
        *started = Some(streams);
        Ok(())
    }
}

impl fmt::Debug for ReadAheadExec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadAheadExec").finish()
    }
}

impl DisplayAs for ReadAheadExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "ReadAheadExec")
    }
}

impl ExecutionPlan for ReadAheadExec {
    fn name(&self) -> &str {
        "ReadAheadExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.input.properties()
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![true]
    }

    fn with_new_children(
        self: Arc<Self>,
        mut children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        Ok(Arc::new(Self::new(children.pop().expect("one child"))))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let started = {
            let mut started = self.started.lock().unwrap_or_else(|p| p.into_inner());
            // Executed before any start: a later `start` must not read the input again.
            let n = self.input.output_partitioning().partition_count();
            started
                .get_or_insert_with(|| (0..n).map(|_| None).collect())
                .get_mut(partition)
                .and_then(Option::take)
        };
        match started {
            Some(stream) => Ok(stream),
            None => self.read(partition, context),
        }
    }
}

impl ReadAheadExec {
    /// Partition `partition` of the input, read by a task of its own into a queue.
    fn read(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let mut input = self.input.execute(partition, Arc::clone(&context))?;
        let reservation = Arc::new(Mutex::new(
            MemoryConsumer::new(format!("ReadAheadExec[{partition}]"))
                .register(context.memory_pool()),
        ));
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let held = Arc::clone(&reservation);
        let task = Arc::clone(&context);
        // On the engine's runtime (the caller polls from datafusion-python's). The reader
        // stops when the input ends, fails, or the query drops the receiver.
        let runtime = super::runtime().map_err(|e| DataFusionError::Execution(e.to_string()))?;
        let report = tx.clone(); // a panic of the task reaches the query as an error
        let operator = format!("ReadAheadExec[{partition}]");
        let read = async move {
            // A dropped consumer is seen at once, even while the input is idle: dropping the
            // input tells the table's producers. One wait for it, for the whole read.
            let mut gone = Box::pin(tx.closed());
            loop {
                let item = match futures::future::select(input.next(), &mut gone).await {
                    futures::future::Either::Left((Some(item), _)) => item,
                    _ => break,
                };
                let item = item.and_then(|batch| {
                    let size = batch.get_array_memory_size();
                    let held = held.lock().unwrap_or_else(|p| p.into_inner());
                    held.try_grow(size).map_err(|e| {
                        DataFusionError::ResourcesExhausted(format!(
                            "a join of live tables holds the rows of one side until the join \
                             can use them (a hash join's build side must close first), and \
                             they passed the session's memory_limit: {e}"
                        ))
                    })?;
                    Ok((batch, size))
                });
                // A failure ends the query at once: the operator above may be waiting on
                // its other input and never ask for this one's error.
                let item = item.map_err(|e| super::abort::raise(&task, e));
                let failed = item.is_err();
                if tx.send(item).is_err() || failed {
                    break;
                }
            }
        };
        super::task::spawn(runtime, operator, read, move |e| {
            let _ = report.send(Err(e));
        });
        let schema = self.input.schema();
        let output = futures::stream::unfold(rx, move |mut rx| {
            let reservation = Arc::clone(&reservation);
            async move {
                let item = rx.recv().await?;
                Some((
                    item.map(|(batch, size)| {
                        let held = reservation.lock().unwrap_or_else(|p| p.into_inner());
                        held.shrink(size);
                        batch
                    }),
                    rx,
                ))
            }
        });
        Ok(Box::pin(RecordBatchStreamAdapter::new(schema, output)))
    }
}
