//! One read of a live table shared by every scan of it in one query.
//!
//! A query can scan one table several times: a self-join, a CTE used twice, `UNION ALL` of a
//! table with itself, `x > ANY (SELECT … FROM same_table)` (which DataFusion plans as three
//! scans). A single-scan table hands its stream out once, so the second scan would fail
//! mid-query. Here the table's stream is read once, by a task of the engine's runtime, and
//! each batch goes to every scan's queue; each scan then applies its own filter, projection
//! and limit. The task reads as the producer writes, whatever the scans poll (a hash join
//! reads its build side whole before its probe side yields a row), so what a scan has not
//! read yet waits in its queue, counted once per batch in the session's memory pool: past
//! the pool's limit (`memory_limit`) the query fails naming it, never an unbounded buffer
//! outside it. A second *query* still finds the table consumed.

use std::fmt;
use std::sync::{Arc, Mutex};

use datafusion::common::{DataFusionError, Result, ScalarValue};
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryReservation};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use futures::StreamExt;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use arrow::array::RecordBatch;

use crate::channel::WatermarkCell;
use crate::provider::LiveScanExec;

/// A batch in the scans' queues: counted in the pool until the last scan has taken it.
struct Held {
    size: usize,
    reservation: Arc<Mutex<MemoryReservation>>,
}

impl Drop for Held {
    fn drop(&mut self) {
        lock(&self.reservation).shrink(self.size);
    }
}

/// A batch for one scan, with the watermark it announces (an empty batch is a marker).
type Item = Result<(RecordBatch, Option<ScalarValue>, Arc<Held>)>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic elsewhere cannot leave these values half-changed: recover them.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The read one table's scans share: a queue per scan, filled by one task.
pub struct SharedRead {
    table: String,
    queues: Mutex<Queues>,
}

struct Queues {
    /// Taken by the first scan that runs, which starts the reading task.
    senders: Option<Vec<UnboundedSender<Item>>>,
    receivers: Vec<Option<UnboundedReceiver<Item>>>,
}

impl SharedRead {
    /// A read of `table` shared by `scans` scans.
    pub fn new(table: &str, scans: usize) -> Self {
        let (senders, receivers) = (0..scans)
            .map(|_| {
                let (tx, rx) = unbounded_channel();
                (tx, Some(rx))
            })
            .unzip();
        Self {
            table: table.to_string(),
            queues: Mutex::new(Queues {
                senders: Some(senders),
                receivers,
            }),
        }
    }

    /// Scan `slot`'s queue; the first call starts reading the table through `scan`.
    fn open(
        &self,
        slot: usize,
        scan: &LiveScanExec,
        context: &TaskContext,
    ) -> Result<UnboundedReceiver<Item>> {
        let mut queues = lock(&self.queues);
        if let Some(senders) = queues.senders.take() {
            let reservation = MemoryConsumer::new(format!("SharedScanExec[{}]", self.table))
                .register(context.memory_pool());
            let reservation = Arc::new(Mutex::new(reservation));
            let whole = scan.read_whole();
            let cell = scan.watermark().cloned();
            let table = self.table.clone();
            let runtime =
                super::runtime().map_err(|e| DataFusionError::Execution(e.to_string()))?;
            let abort = super::abort::Abort::of(context);
            runtime.spawn(pump(whole, cell, senders, reservation, table, abort));
        }
        queues
            .receivers
            .get_mut(slot)
            .and_then(Option::take)
            .ok_or_else(|| {
                DataFusionError::Internal(format!(
                    "scan {slot} of the shared read of '{}' ran twice",
                    self.table
                ))
            })
    }
}

/// Reads `whole` to its end (or until no scan listens), handing each batch to every scan.
async fn pump(
    mut whole: SendableRecordBatchStream,
    cell: Option<Arc<WatermarkCell>>,
    senders: Vec<UnboundedSender<Item>>,
    reservation: Arc<Mutex<MemoryReservation>>,
    table: String,
    abort: Option<Arc<super::abort::Abort>>,
) {
    let scans = senders.len();
    let fail = |e: DataFusionError| {
        // The whole query ends with it: a scan waiting its turn would never ask for it.
        let e = match &abort {
            Some(abort) => abort.raise(e),
            None => e,
        };
        let shared = Arc::new(e);
        for tx in &senders {
            let _ = tx.send(Err(DataFusionError::Shared(Arc::clone(&shared))));
        }
    };
    while let Some(item) = whole.next().await {
        let batch = match item {
            Ok(batch) => batch,
            Err(e) => return fail(e),
        };
        let watermark = match batch.num_rows() {
            0 => cell.as_ref().and_then(|c| c.get()),
            _ => None,
        };
        let size = batch.get_array_memory_size();
        if let Err(e) = lock(&reservation).try_grow(size) {
            return fail(DataFusionError::ResourcesExhausted(format!(
                "live table '{table}' is read by {scans} scans of this query, and the rows \
                 some of them have not read yet passed the session's memory_limit: {e}"
            )));
        }
        let held = Arc::new(Held {
            size,
            reservation: Arc::clone(&reservation),
        });
        let mut listening = 0;
        for tx in &senders {
            let sent = tx.send(Ok((batch.clone(), watermark.clone(), Arc::clone(&held))));
            listening += usize::from(sent.is_ok());
        }
        if listening == 0 {
            return; // the query is gone: dropping `whole` lets the producers know
        }
    }
}

/// One scan of a table the query scans several times, fed by the [`SharedRead`] of them all.
pub struct SharedScanExec {
    scan: Arc<dyn ExecutionPlan>,
    read: Arc<SharedRead>,
    slot: usize,
}

impl SharedScanExec {
    /// Scan `slot` of `read`; `scan` must be a [`LiveScanExec`] of the read's table.
    pub fn new(scan: Arc<dyn ExecutionPlan>, read: Arc<SharedRead>, slot: usize) -> Self {
        Self { scan, read, slot }
    }

    fn live(&self) -> &LiveScanExec {
        self.scan
            .downcast_ref::<LiveScanExec>()
            .expect("a shared scan wraps a live scan")
    }

    /// The table it scans.
    pub fn table(&self) -> &str {
        &self.read.table
    }
}

impl fmt::Debug for SharedScanExec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedScanExec")
            .field("table", &self.read.table)
            .field("slot", &self.slot)
            .finish()
    }
}

impl DisplayAs for SharedScanExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "SharedScanExec: scan {} of a shared read, ",
            self.slot + 1
        )?;
        self.scan.fmt_as(t, f)
    }
}

impl ExecutionPlan for SharedScanExec {
    fn name(&self) -> &str {
        "SharedScanExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.scan.properties()
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![]
    }

    fn with_new_children(
        self: Arc<Self>,
        _children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        Ok(self)
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let scan = self.live();
        let schema = self.scan.schema();
        if partition > 0 {
            // The engine's scans have one partition; any other would read nothing.
            return Ok(Box::pin(RecordBatchStreamAdapter::new(
                schema,
                futures::stream::empty(),
            )));
        }
        let rx = self.read.open(self.slot, scan, &context)?;
        let cell = scan.watermark().cloned();
        let batches = futures::stream::unfold(rx, move |mut rx| {
            let cell = cell.clone();
            async move {
                let item = rx.recv().await?;
                let out = item.map(|(batch, watermark, _held)| {
                    if let (Some(cell), Some(value)) = (&cell, watermark) {
                        cell.set(value); // this scan's operators read it with the marker
                    }
                    batch
                });
                Some((out, rx))
            }
        });
        let whole = RecordBatchStreamAdapter::new(scan.table_schema(), batches);
        Ok(scan.narrow(Box::pin(whole)))
    }
}
