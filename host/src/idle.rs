//! What a connection has in flight, so that one with nothing in flight can
//! be closed: HTTP/2 answers pings but has no idle timeout of its own, so
//! a client that opens connections and sends no request (or one request
//! long ago) would hold `--max-connections` slots for as long as it likes.

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
}

impl Activity {
    /// A connection that has just opened, with nothing in flight.
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            open: AtomicUsize::new(0),
            last: Mutex::new(Instant::now()),
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
}

/// A request in flight on a connection, from its head to its body's end.
#[derive(Debug)]
pub struct InFlight(Arc<Activity>);

impl InFlight {
    /// `body`, holding this request in flight until it ends or drops.
    pub fn hold(self, body: Body) -> Body {
        Body::new(Held {
            body,
            _flight: self,
        })
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        *self.0.last.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request in flight.
struct Held {
    body: Body,
    _flight: InFlight,
}

impl http_body::Body for Held {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.body).poll_frame(cx)
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
}
