//! One read of a live table shared by every scan of it in one query.
//!
//! A query can scan one table several times: a self-join, a CTE used twice, `UNION ALL` of a
//! table with itself, `x > ANY (SELECT … FROM same_table)` (which DataFusion plans as three
//! scans). A single-scan table hands its stream out once, so the second scan would fail
//! mid-query. Here the table's stream is read once, by a task of the engine's runtime, and
//! each batch goes to every scan's queue; each scan then applies its own filter, projection
//! and limit, and hands on the watermarks to its own operators only as its consumer reaches
//! them (one scan's windows never close on another's progress).
//!
//! The read keeps a single scan's promises:
//! - *Backpressure.* It reads only while some scan waits for a batch with none queued (the
//!   fastest consumer's pace): a query whose consumer pauses stops reading, and the table's
//!   own bound holds the producer. What a slower scan has not read yet (a hash join's probe
//!   side while its build side is read whole) waits in its queue, counted once per batch in
//!   the session's memory pool: past the pool's limit (`memory_limit`) the query fails
//!   naming it, never an unbounded buffer outside it. (Waiting for the slowest scan instead
//!   would deadlock a self-join: its probe side is read only once its build side ends.)
//! - *A dropped consumer.* Once every scan's stream is dropped the read ends at once, even
//!   with the producer idle, so the producer's next write learns the reader is gone.
//! - *End and errors* reach every scan, in order after the batches before them.
//!
//! Scans share a read only when they scan the same registered table (one source): two
//! subscriptions of one topic are two tables, each with its own start and cursor. A second
//! *query* still finds the table consumed.

use std::fmt;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use datafusion::common::{DataFusionError, Result, ScalarValue};
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryReservation};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use futures::future::Either;
use futures::{Stream, StreamExt};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::sync::Notify;

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

/// Which scans wait for a batch with none queued: the read goes on only while one does.
///
/// A scan sets its `waiting` when its consumer asks and its queue is empty, and clears it
/// when it takes a batch; the read counts what it queued for each scan (`queued`), and the
/// scan what it took. Only the scan writes its flag: the read clearing it after a send could
/// race with the scan taking that batch and asking again, leaving it waiting unseen.
struct Demand {
    waiting: Vec<AtomicBool>,
    queued: Vec<AtomicUsize>,
    /// Wakes the read when a scan starts waiting or its stream is dropped.
    wake: Notify,
}

impl Demand {
    fn new(scans: usize) -> Self {
        Self {
            waiting: (0..scans).map(|_| AtomicBool::new(false)).collect(),
            queued: (0..scans).map(|_| AtomicUsize::new(0)).collect(),
            wake: Notify::new(),
        }
    }

    /// Whether some scan waits with nothing queued for it.
    fn any(&self) -> bool {
        self.waiting
            .iter()
            .zip(&self.queued)
            .any(|(w, q)| w.load(Ordering::SeqCst) && q.load(Ordering::SeqCst) == 0)
    }
}

/// The read one table's scans share: a queue per scan, filled by one task.
pub struct SharedRead {
    table: String,
    queues: Mutex<Queues>,
    demand: Arc<Demand>,
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
            demand: Arc::new(Demand::new(scans)),
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
            // The read's own watermark cell: each scan's is set only as its consumer reaches
            // the marker (see the scan's stream).
            let (whole, cell) = scan.read_whole();
            let runtime =
                super::runtime().map_err(|e| DataFusionError::Execution(e.to_string()))?;
            let pump = Pump {
                cell,
                senders,
                reservation,
                table: self.table.clone(),
                abort: super::abort::Abort::of(context),
                demand: Arc::clone(&self.demand),
            };
            let operator = format!("SharedScanExec[{}]", self.table);
            let pump = Arc::new(pump);
            let reporter = Arc::clone(&pump); // a panic of the read fails every scan
            super::task::spawn(
                runtime,
                operator,
                async move { pump.run(whole).await },
                move |e| reporter.fail(e),
            );
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

/// The task that reads the table for every scan.
struct Pump {
    cell: Option<Arc<WatermarkCell>>,
    senders: Vec<UnboundedSender<Item>>,
    reservation: Arc<Mutex<MemoryReservation>>,
    table: String,
    abort: Option<Arc<super::abort::Abort>>,
    demand: Arc<Demand>,
}

impl Pump {
    fn gone(&self) -> bool {
        self.senders.iter().all(UnboundedSender::is_closed)
    }

    fn fail(&self, e: DataFusionError) {
        // The whole query ends with it: a scan waiting its turn would never ask for it.
        let e = match &self.abort {
            Some(abort) => abort.raise(e),
            None => e,
        };
        let shared = Arc::new(e);
        for (tx, queued) in self.senders.iter().zip(&self.demand.queued) {
            queued.fetch_add(1, Ordering::SeqCst); // taken as any item is
            let _ = tx.send(Err(DataFusionError::Shared(Arc::clone(&shared))));
        }
    }

    /// Reads `whole` to its end (or until no scan listens), a batch at a time while some
    /// scan waits, handing each batch to every scan. Returning drops `whole` (the producers
    /// learn the reader is gone); the task's end drops the senders (the scans see the end).
    async fn run(&self, mut whole: SendableRecordBatchStream) {
        let scans = self.senders.len();
        // The producer may be idle for long: a dropped query is seen meanwhile too. One wait
        // for every scan's stream to be dropped, for the whole read.
        let closed = futures::future::join_all(self.senders.iter().map(|tx| tx.closed()));
        let mut closed = std::pin::pin!(closed);
        loop {
            loop {
                if self.gone() {
                    return;
                }
                if self.demand.any() {
                    break;
                }
                self.demand.wake.notified().await;
            }
            let item = match futures::future::select(whole.next(), closed.as_mut()).await {
                Either::Left((item, _)) => item,
                Either::Right(_) => return,
            };
            let Some(item) = item else { return };
            let batch = match item {
                Ok(batch) => batch,
                Err(e) => return self.fail(e),
            };
            let watermark = match batch.num_rows() {
                0 => self.cell.as_ref().and_then(|c| c.get()),
                _ => None,
            };
            let size = batch.get_array_memory_size();
            if let Err(e) = lock(&self.reservation).try_grow(size) {
                return self.fail(DataFusionError::ResourcesExhausted(format!(
                    "live table '{}' is read by {scans} scans of this query, and the rows \
                     some of them have not read yet passed the session's memory_limit: {e}",
                    self.table
                )));
            }
            let held = Arc::new(Held {
                size,
                reservation: Arc::clone(&self.reservation),
            });
            for (tx, queued) in self.senders.iter().zip(&self.demand.queued) {
                // Counted before it is sent: the scan may take it at once.
                queued.fetch_add(1, Ordering::SeqCst);
                let item = Ok((batch.clone(), watermark.clone(), Arc::clone(&held)));
                if tx.send(item).is_err() {
                    queued.fetch_sub(1, Ordering::SeqCst);
                }
            }
        }
    }
}

/// One scan's side of the shared read: its queue, its demand, its own watermark cell.
struct ScanQueue {
    rx: UnboundedReceiver<Item>,
    slot: usize,
    demand: Arc<Demand>,
    cell: Option<Arc<WatermarkCell>>,
}

impl Stream for ScanQueue {
    type Item = Result<RecordBatch>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        match self.rx.poll_recv(cx) {
            Poll::Ready(item) => Poll::Ready(item.map(|item| {
                self.demand.queued[self.slot].fetch_sub(1, Ordering::SeqCst);
                self.demand.waiting[self.slot].store(false, Ordering::SeqCst);
                item.map(|(batch, watermark, _held)| {
                    if let (Some(cell), Some(value)) = (&self.cell, watermark) {
                        cell.set(value); // this scan's operators read it with the marker
                    }
                    batch
                })
            })),
            Poll::Pending => {
                // Nothing queued and this scan's consumer asks: the read may go on.
                if !self.demand.waiting[self.slot].swap(true, Ordering::SeqCst) {
                    self.demand.wake.notify_one();
                }
                Poll::Pending
            }
        }
    }
}

impl Drop for ScanQueue {
    fn drop(&mut self) {
        self.demand.waiting[self.slot].store(false, Ordering::SeqCst);
        self.rx.close(); // the read sees it gone (`is_closed`) before it wakes
        self.demand.wake.notify_one();
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

    /// Where it hands on the watermarks of its share of the read, each as its consumer
    /// reaches it (the cell of the scan it stands for).
    pub fn watermark(&self) -> Option<Arc<WatermarkCell>> {
        self.live().watermark().cloned()
    }

    /// How many scans share its read.
    pub fn scans(&self) -> usize {
        self.read.demand.waiting.len()
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
        let batches = ScanQueue {
            rx,
            slot: self.slot,
            demand: Arc::clone(&self.read.demand),
            cell: scan.watermark().cloned(),
        };
        let whole = RecordBatchStreamAdapter::new(scan.table_schema(), batches);
        Ok(scan.narrow(Box::pin(whole)))
    }
}
