//! A query's abort: a failure found off the query's path ends the whole query at once.
//!
//! A read-ahead (below a join, or feeding the scans of a table named twice) reads its input
//! whatever the operator above polls. When it fails — its rows passed the session's
//! `memory_limit`, or its table's producer failed — the operator above may be waiting on its
//! other input (a hash join collecting its build side) and would never ask for the error:
//! the query would hang, and the producer with it. So the failure is also raised here, one
//! cell per engine session (each query has its own), and the query's output stream ends with
//! it as soon as it is raised.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use datafusion::common::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use futures::task::AtomicWaker;
use futures::{Stream, StreamExt};

use arrow::array::RecordBatch;

/// The abort cell of one engine session (a `SessionConfig` extension).
#[derive(Debug, Default)]
pub struct Abort {
    /// Set once an error is raised: read without a lock on every poll.
    raised: AtomicBool,
    error: Mutex<Option<Arc<DataFusionError>>>,
    /// The query's output stream, parked while its input has nothing.
    waker: AtomicWaker,
}

impl Abort {
    /// The abort cell of the session that `context` runs in, if it has one.
    pub fn of(context: &TaskContext) -> Option<Arc<Abort>> {
        context.session_config().get_extension::<Abort>()
    }

    /// End the query with `error` (the first error raised wins); returns it, shared.
    pub fn raise(&self, error: DataFusionError) -> DataFusionError {
        // A panic elsewhere cannot leave the cell half-changed: recover it.
        let mut held = self.error.lock().unwrap_or_else(|p| p.into_inner());
        let error = Arc::clone(held.get_or_insert_with(|| Arc::new(error)));
        drop(held);
        self.raised.store(true, Ordering::Release);
        self.waker.wake();
        DataFusionError::Shared(error)
    }

    fn error(&self) -> Option<DataFusionError> {
        if !self.raised.load(Ordering::Acquire) {
            return None;
        }
        let held = self.error.lock().unwrap_or_else(|p| p.into_inner());
        held.as_ref()
            .map(|e| DataFusionError::Shared(Arc::clone(e)))
    }
}

/// Raises `error` on the abort cell of `context`'s session, if any; returns the error.
pub fn raise(context: &TaskContext, error: DataFusionError) -> DataFusionError {
    match Abort::of(context) {
        Some(abort) => abort.raise(error),
        None => error,
    }
}

/// `inner`, ended by the abort cell's error as soon as one is raised (with `abort`), and let
/// go of at once when it ends or fails: its plan is dropped then, not when the caller drops
/// the stream, so each table it reads sees its reader gone (the producer's next write raises
/// `ReaderGoneError`) while a consumer that took the error still holds the stream.
///
/// `release` runs once as it ends, fails or is dropped (the plan's read groups let go of
/// inputs no operator executed).
pub fn abortable(
    inner: SendableRecordBatchStream,
    abort: Option<Arc<Abort>>,
    release: Box<dyn FnOnce() + Send>,
) -> SendableRecordBatchStream {
    struct Abortable {
        /// None once ended (by its end, its error or the abort's).
        inner: Option<SendableRecordBatchStream>,
        abort: Option<Arc<Abort>>,
        release: Option<Box<dyn FnOnce() + Send>>,
    }
    impl Abortable {
        fn end(&mut self, item: Option<Result<RecordBatch>>) -> Poll<Option<Result<RecordBatch>>> {
            self.inner = None;
            if let Some(release) = self.release.take() {
                release();
            }
            Poll::Ready(item)
        }
        fn raised(&self) -> Option<DataFusionError> {
            self.abort.as_ref().and_then(|a| a.error())
        }
    }
    impl Stream for Abortable {
        type Item = Result<RecordBatch>;
        fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
            if let Some(e) = self.raised() {
                // After an end, an error raised is not this query's to report.
                return match self.inner.is_some() {
                    true => self.end(Some(Err(e))),
                    false => Poll::Ready(None),
                };
            }
            let Some(inner) = self.inner.as_mut() else {
                return Poll::Ready(None);
            };
            match inner.poll_next_unpin(cx) {
                Poll::Pending => {
                    let Some(abort) = self.abort.as_ref() else {
                        return Poll::Pending;
                    };
                    // Parked, then checked again: a raise in between wakes this waker.
                    abort.waker.register(cx.waker());
                    match self.raised() {
                        Some(e) => self.end(Some(Err(e))),
                        None => Poll::Pending,
                    }
                }
                Poll::Ready(None) => self.end(None),
                Poll::Ready(Some(Err(e))) => self.end(Some(Err(e))),
                ready => ready,
            }
        }
    }
    impl Drop for Abortable {
        fn drop(&mut self) {
            self.inner = None;
            if let Some(release) = self.release.take() {
                release();
            }
        }
    }
    let schema = inner.schema();
    Box::pin(RecordBatchStreamAdapter::new(
        schema,
        Abortable {
            inner: Some(inner),
            abort,
            release: Some(release),
        },
    ))
}
