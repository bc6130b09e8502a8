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
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use datafusion::common::{DataFusionError, Result};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use futures::{Stream, StreamExt};

use arrow::array::RecordBatch;

/// The abort cell of one engine session (a `SessionConfig` extension).
#[derive(Debug, Default)]
pub struct Abort {
    state: Mutex<AbortState>,
}

#[derive(Debug, Default)]
struct AbortState {
    error: Option<Arc<DataFusionError>>,
    waker: Option<Waker>,
}

impl Abort {
    /// The abort cell of the session that `context` runs in, if it has one.
    pub fn of(context: &TaskContext) -> Option<Arc<Abort>> {
        context.session_config().get_extension::<Abort>()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, AbortState> {
        // A panic elsewhere cannot leave the cell half-changed: recover it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// End the query with `error` (the first error raised wins); returns it, shared.
    pub fn raise(&self, error: DataFusionError) -> DataFusionError {
        let mut st = self.state();
        let error = Arc::clone(st.error.get_or_insert_with(|| Arc::new(error)));
        let waker = st.waker.take();
        drop(st);
        if let Some(w) = waker {
            w.wake();
        }
        DataFusionError::Shared(error)
    }

    fn poll_error(&self, cx: &Context<'_>) -> Option<DataFusionError> {
        let mut st = self.state();
        match &st.error {
            Some(e) => Some(DataFusionError::Shared(Arc::clone(e))),
            None => {
                st.waker = Some(cx.waker().clone());
                None
            }
        }
    }
}

/// Raises `error` on the abort cell of `context`'s session, if any; returns the error.
pub fn raise(context: &TaskContext, error: DataFusionError) -> DataFusionError {
    match Abort::of(context) {
        Some(abort) => abort.raise(error),
        None => error,
    }
}

/// `inner`, ended by the abort cell's error as soon as one is raised.
pub fn abortable(inner: SendableRecordBatchStream, abort: Arc<Abort>) -> SendableRecordBatchStream {
    struct Abortable {
        inner: SendableRecordBatchStream,
        abort: Arc<Abort>,
        done: bool,
    }
    impl Stream for Abortable {
        type Item = Result<RecordBatch>;
        fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
            if self.done {
                return Poll::Ready(None);
            }
            if let Some(e) = self.abort.poll_error(cx) {
                self.done = true;
                return Poll::Ready(Some(Err(e)));
            }
            self.inner.poll_next_unpin(cx)
        }
    }
    let schema = inner.schema();
    Box::pin(RecordBatchStreamAdapter::new(
        schema,
        Abortable {
            inner,
            abort,
            done: false,
        },
    ))
}
