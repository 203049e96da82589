//! What a connection has in flight, so that one with nothing in flight can
//! be closed: HTTP/2 answers pings but has no idle timeout of its own, so
//! a client that opens connections and sends no request (or one request
//! long ago) would hold `--max-connections` slots for as long as it likes.
//! And whether its responses move: a client that stops taking a response
//! (a full TCP buffer, an HTTP/2 window it never opens) would hold its
//! connection, with the request in flight, as long.

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use crate::api::{Body, BoxError};

/// One connection's requests in flight and when the last one ended.
#[derive(Debug)]
pub struct Activity {
    open: AtomicUsize,
    last: Mutex<Instant>,
    /// Response bodies waiting for the connection to take their next frame
    /// (new, or with a frame just taken): since when, by body.
    owed: Mutex<Owed>,
}

impl Activity {
    /// A connection that has just opened, with nothing in flight.
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            open: AtomicUsize::new(0),
            last: Mutex::new(Instant::now()),
            owed: Mutex::default(),
        })
    }

    /// Counts a request in flight until the returned guard drops.
    pub fn begin(self: &Arc<Self>) -> InFlight {
        self.open.fetch_add(1, Ordering::AcqRel);
        InFlight(self.clone())
    }

    /// Restarts the idle clock (serving begins now).
    pub fn touch(&self) {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }

    /// Resolves once nothing has been in flight for `idle`.
    pub async fn idle(&self, idle: Duration) {
        loop {
            // `open` first: a request that ended after this read has set
            // `last` before its count went down.
            let busy = self.open.load(Ordering::Acquire) > 0;
            let since = *self.last.lock().unwrap_or_else(|p| p.into_inner());
            if !busy && since.elapsed() >= idle {
                return;
            }
            // Busy: look again after a while (the end of a request only
            // moves the deadline later).
            let wake = if busy {
                Instant::now() + idle
            } else {
                since + idle
            };
            tokio::time::sleep_until(wake).await;
        }
    }

    /// Resolves once a response body has waited `limit` for the
    /// connection to take its next frame.
    pub async fn stalled(&self, limit: Duration) {
        loop {
            let oldest = self.owed().since.values().min().copied();
            let wake = match oldest {
                Some(since) if since.elapsed() >= limit => return,
                Some(since) => since + limit,
                None => Instant::now() + limit,
            };
            tokio::time::sleep_until(wake).await;
        }
    }

    fn owed(&self) -> std::sync::MutexGuard<'_, Owed> {
        self.owed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A body waits for the connection from now; its ticket.
    fn owe(&self) -> u64 {
        let mut owed = self.owed();
        let ticket = owed.next;
        owed.next += 1;
        owed.since.insert(ticket, Instant::now());
        ticket
    }

    /// The connection asked the body holding `ticket` for its next frame.
    fn taken(&self, ticket: u64) {
        self.owed().since.remove(&ticket);
    }
}

/// Bodies that wait for their connection to take a frame.
#[derive(Debug, Default)]
struct Owed {
    next: u64,
    since: std::collections::BTreeMap<u64, Instant>,
}

/// A request in flight on a connection, from its head to its body's end.
#[derive(Debug)]
pub struct InFlight(Arc<Activity>);

impl InFlight {
    /// `body`, holding this request in flight until it ends or drops.
    pub fn hold(self, body: Body) -> Body {
        let owed = Some(self.0.owe());
        Body::new(Held {
            body,
            flight: self,
            owed,
        })
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        *self.0.last.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request in flight, and tells its
/// connection whether it waits for the connection to take a frame.
struct Held {
    body: Body,
    flight: InFlight,
    /// Its ticket while it waits for the connection.
    owed: Option<u64>,
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(ticket) = self.owed {
            self.flight.0.taken(ticket);
        }
    }
}

impl http_body::Body for Held {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        if let Some(ticket) = self.owed.take() {
            self.flight.0.taken(ticket);
        }
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        // A frame handed over: the next poll is the connection's to make.
        // Pending is the body's own wait (the guest, the model).
        if let Poll::Ready(Some(Ok(_))) = &polled {
            self.owed = Some(self.flight.0.owe());
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_connection_is_idle_only_after_its_last_request_ends_and_the_time_passes() {
        let a = Activity::new();
        let idle = Duration::from_secs(10);
        let flight = a.begin();
        // Busy past the idle time: not idle.
        let early = tokio::time::timeout(Duration::from_secs(30), a.idle(idle)).await;
        assert!(early.is_err(), "idle with a request in flight");
        drop(flight);
        let started = Instant::now();
        a.idle(idle).await;
        assert_eq!(started.elapsed(), idle, "idle from the request's end");
    }

    /// A body with this many frames ready, then waiting forever.
    struct Frames(usize);

    impl http_body::Body for Frames {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
            if self.0 == 0 {
                return Poll::Pending;
            }
            self.0 -= 1;
            Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::from_static(b"x")))))
        }
    }

    fn body(frames: usize) -> Body {
        Body::new(Frames(frames))
    }

    async fn poll_once(body: &mut Body) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        use http_body::Body as _;
        std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut *body).poll_frame(cx))).await
    }

    #[tokio::test(start_paused = true)]
    async fn only_a_body_whose_data_waits_for_the_connection_stalls_it() {
        let a = Activity::new();
        let limit = Duration::from_secs(60);
        // Waiting on its own source (a guest, a model) is not a stall.
        let mut waiting = a.begin().hold(body(0));
        assert!(poll_once(&mut waiting).await.is_pending());
        let early = tokio::time::timeout(limit * 10, a.stalled(limit)).await;
        assert!(early.is_err(), "a body waiting on its source stalled");
        // A frame taken, the next never asked for: stalled after the limit,
        // though the other body is asked for its frames all along.
        let mut taken = a.begin().hold(body(2));
        assert!(poll_once(&mut taken).await.is_ready());
        let started = Instant::now();
        for _ in 0..10 {
            tokio::time::sleep(limit / 10).await;
            assert!(poll_once(&mut waiting).await.is_pending());
        }
        let now = tokio::time::timeout(Duration::ZERO, a.stalled(limit)).await;
        assert!(now.is_ok(), "a busy body hid a stalled one");
        assert_eq!(started.elapsed(), limit);
        // Asked again, and dropped: nothing waits on the connection.
        assert!(poll_once(&mut taken).await.is_ready());
        drop(taken);
        let after = tokio::time::timeout(limit * 10, a.stalled(limit)).await;
        assert!(after.is_err(), "a dropped body still stalls");
        drop(waiting);
    }
}
