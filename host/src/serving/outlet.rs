//! A sample's results on their way from a pool's thread to its caller,
//! counting what waits unread. The channel is unbounded (the engine's
//! thread never blocks on a caller), so a caller that stops reading, with
//! `n` samples and twenty log-probabilities a token, would otherwise let
//! the engine pile up hundreds of megabytes for it until its deadline.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::mpsc as tmpsc;

use super::engine_thread::Out;

/// Entries (a delta and each log-probability it carries) one call's
/// samples may leave unread between them, unless the server sets another
/// figure: as many as a whole answer may hold without streaming.
pub(super) const MAX_UNREAD: usize = 1 << 18;

/// The pool's end of a sample's channel.
pub(super) struct Outlet {
    tx: tmpsc::UnboundedSender<Out>,
    unread: Arc<AtomicUsize>,
    /// This sample's share of the call's unread entries.
    limit: usize,
}

/// The caller's end.
pub(super) struct Inlet {
    rx: tmpsc::UnboundedReceiver<Out>,
    unread: Arc<AtomicUsize>,
}

/// A channel for each of a call's `n` samples, which may leave `bound`
/// entries unread between them.
pub(super) fn outlets(n: usize, bound: usize) -> (Vec<Outlet>, Vec<Inlet>) {
    let limit = bound / n.max(1);
    (0..n)
        .map(|_| {
            let (tx, rx) = tmpsc::unbounded_channel();
            let unread = Arc::new(AtomicUsize::new(0));
            let outlet = Outlet {
                tx,
                unread: unread.clone(),
                limit,
            };
            (outlet, Inlet { rx, unread })
        })
        .unzip()
}

/// Entries `out` adds to what waits unread.
fn weight(out: &Out) -> usize {
    match out {
        Out::Text(_, logprobs) => 1 + logprobs.iter().map(|l| 1 + l.top.len()).sum::<usize>(),
        Out::Done { .. } | Out::Error(_) => 0,
    }
}

impl Outlet {
    /// Sends `out` (an error if the caller has gone).
    pub(super) fn send(&self, out: Out) -> Result<(), tmpsc::error::SendError<Out>> {
        self.unread.fetch_add(weight(&out), Ordering::Relaxed);
        self.tx.send(out)
    }

    /// Whether the caller has gone.
    pub(super) fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// Whether the caller has left more unread than its share.
    pub(super) fn overdue(&self) -> bool {
        self.unread.load(Ordering::Relaxed) > self.limit
    }
}

impl Inlet {
    /// The next result, once there is one (`None`: the pool has gone).
    pub(super) async fn recv(&mut self) -> Option<Out> {
        let out = self.rx.recv().await;
        self.took(out.as_ref());
        out
    }

    /// The next result if one waits.
    pub(super) fn try_recv(&mut self) -> Result<Out, tmpsc::error::TryRecvError> {
        let out = self.rx.try_recv();
        self.took(out.as_ref().ok());
        out
    }

    fn took(&self, out: Option<&Out>) {
        if let Some(out) = out {
            self.unread.fetch_sub(weight(out), Ordering::Relaxed);
        }
    }
}
