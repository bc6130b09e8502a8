//! Unit tests of the channel's wake-ups: every poll that returns `Pending` must be woken
//! by the next batch, whichever task (waker) polled last and however many streams read one
//! cursor. A lost wake-up is a query that hangs with data queued.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use arrow::array::{Int64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Schema};
use futures::task::{waker, ArcWake};
use futures::Stream;

use super::{Channel, ReaderStream};

#[derive(Default)]
struct Count(AtomicUsize);

impl ArcWake for Count {
    fn wake_by_ref(me: &Arc<Self>) {
        me.0.fetch_add(1, Ordering::SeqCst);
    }
}

impl Count {
    fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

fn table() -> (Arc<Channel>, Arc<super::Reader>) {
    let schema = Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, true)]));
    let (channel, reader) = Channel::table("t".into(), schema, None, 8, None, None, None);
    (channel, reader.start())
}

fn write(channel: &Channel, x: i64) {
    let schema = Arc::clone(&channel.schema);
    let batch = RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from(vec![x]))]).unwrap();
    channel
        .push::<()>(batch, 8, None, None, None)
        .unwrap_or_else(|_| panic!("push refused"));
}

fn poll(stream: &mut ReaderStream, count: &Arc<Count>) -> Poll<Option<i64>> {
    let w = waker(Arc::clone(count));
    let mut cx = Context::from_waker(&w);
    std::pin::Pin::new(stream).poll_next(&mut cx).map(|item| {
        item.map(|batch| {
            let batch = batch.expect("a batch");
            let col = batch
                .column(0)
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap();
            col.value(0)
        })
    })
}

#[test]
fn a_stream_polled_again_from_another_task_is_woken_through_the_newer_waker() {
    let (channel, reader) = table();
    let mut stream = ReaderStream::new(reader, None);
    let (first, second) = (Arc::new(Count::default()), Arc::new(Count::default()));
    assert!(poll(&mut stream, &first).is_pending());
    // The first task gave up (a cancelled `__anext__`, a `select!` that moved on): the
    // stream is polled again from another task, whose waker is the one that must fire.
    assert!(poll(&mut stream, &second).is_pending());
    write(&channel, 1);
    assert_eq!(
        second.get(),
        1,
        "the newest waker was not woken: a lost wake-up"
    );
    assert_eq!(poll(&mut stream, &second), Poll::Ready(Some(1)));
}

#[test]
fn a_stream_polled_many_times_by_one_task_parks_one_waker() {
    let (channel, reader) = table();
    let mut stream = ReaderStream::new(reader, None);
    let count = Arc::new(Count::default());
    for _ in 0..5 {
        assert!(poll(&mut stream, &count).is_pending());
    }
    write(&channel, 1);
    assert_eq!(count.get(), 1);
    assert_eq!(poll(&mut stream, &count), Poll::Ready(Some(1)));
    assert!(poll(&mut stream, &count).is_pending());
    write(&channel, 2);
    assert_eq!(count.get(), 2, "the second batch's wake-up was lost");
}

#[test]
fn two_streams_of_one_cursor_are_each_woken_by_a_batch_of_their_own() {
    let (channel, reader) = table();
    let mut a = ReaderStream::new(Arc::clone(&reader), None);
    let mut b = ReaderStream::new(reader, None);
    let (wa, wb) = (Arc::new(Count::default()), Arc::new(Count::default()));
    assert!(poll(&mut a, &wa).is_pending());
    assert!(poll(&mut b, &wb).is_pending());
    // `b` is polled again from a second task: still one waker for `b`, the newer one.
    let wb2 = Arc::new(Count::default());
    assert!(poll(&mut b, &wb2).is_pending());
    write(&channel, 1);
    write(&channel, 2);
    assert_eq!(
        wa.get() + wb2.get(),
        2,
        "two batches, two idle streams: both must wake"
    );
    assert_eq!(
        wb.get(),
        0,
        "a stale waker was woken in place of a live one"
    );
    let mut got = Vec::new();
    for (s, w) in [(&mut a, &wa), (&mut b, &wb2)] {
        if let Poll::Ready(Some(x)) = poll(s, w) {
            got.push(x);
        }
    }
    got.sort();
    assert_eq!(got, vec![1, 2]);
}

#[test]
fn close_wakes_every_parked_stream() {
    let (channel, reader) = table();
    let mut a = ReaderStream::new(Arc::clone(&reader), None);
    let mut b = ReaderStream::new(reader, None);
    let (wa, wb) = (Arc::new(Count::default()), Arc::new(Count::default()));
    assert!(poll(&mut a, &wa).is_pending());
    assert!(poll(&mut b, &wb).is_pending());
    channel.close();
    assert_eq!((wa.get(), wb.get()), (1, 1));
    assert_eq!(poll(&mut a, &wa), Poll::Ready(None));
    assert_eq!(poll(&mut b, &wb), Poll::Ready(None));
}
