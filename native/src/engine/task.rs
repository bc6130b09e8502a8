//! An operator's task on the engine's runtime, whose panic is an error, never an end.
//!
//! An operator that reads its input on a task of its own (a read-ahead, a shared read, an
//! updating aggregate) hands its batches to the query through a channel. A panic inside the
//! task drops the channel's sender, which the consumer would take for the end of the input:
//! the query would answer short, or empty, with no error. So each such task runs under
//! [`spawn`], which catches the panic and hands the consumer an error naming the operator.

use std::future::Future;
use std::panic::AssertUnwindSafe;

use datafusion::error::DataFusionError;
use futures::FutureExt;

/// The error a panicked task of `operator` stands for (its message, if it had one).
pub fn panicked(operator: &str, panic: &(dyn std::any::Any + Send)) -> DataFusionError {
    let message = panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "no message".into());
    DataFusionError::Execution(format!(
        "{operator} failed: its task panicked ({message}); the query's answer would be \
         incomplete, so it ends with this error"
    ))
}

/// Run `task` on `runtime`; if it panics, `report` is called with the error naming
/// `operator` (it tells the task's consumer).
pub fn spawn<F, R>(runtime: &tokio::runtime::Runtime, operator: String, task: F, report: R)
where
    F: Future<Output = ()> + Send + 'static,
    R: FnOnce(DataFusionError) + Send + 'static,
{
    runtime.spawn(async move {
        if let Err(panic) = AssertUnwindSafe(task).catch_unwind().await {
            report(panicked(&operator, panic.as_ref()));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panicking_task_reports_an_error_naming_its_operator() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Result<(), DataFusionError>>();
        let report = tx.clone();
        spawn(
            &runtime,
            "ReadAheadExec[0]".into(),
            async move {
                let _held = tx;
                panic!("boom");
            },
            move |e| {
                let _ = report.send(Err(e));
            },
        );
        let got = runtime.block_on(rx.recv());
        let message = got.expect("an item, not the end").unwrap_err().to_string();
        assert!(
            message.contains("ReadAheadExec[0]") && message.contains("boom"),
            "{message}"
        );
        assert!(runtime.block_on(rx.recv()).is_none()); // then the end
    }

    #[test]
    fn a_task_that_ends_reports_nothing() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Result<(), DataFusionError>>();
        let report = tx.clone();
        spawn(
            &runtime,
            "op".into(),
            async move {
                let _ = tx.send(Ok(()));
            },
            move |e| {
                let _ = report.send(Err(e));
            },
        );
        assert!(matches!(runtime.block_on(rx.recv()), Some(Ok(()))));
        assert!(runtime.block_on(rx.recv()).is_none());
    }
}
