//! One request: a fresh store and instance, the guest's handler, and the
//! mapping of everything that can go wrong to an [`InvokeError`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use wasmtime::Store;
use wasmtime_wasi_http::WasiHttpView;
use wasmtime_wasi_http::p2::bindings::http::types::Scheme;

use crate::ai::AiCtx;
use crate::compile::{Deployment, Runtime};
use crate::error::{InvokeError, LimitKind};
use crate::limits::{CpuMeter, Metered, StoreLimits};
use crate::session::SessionAffinity;
use crate::state::State;

/// The body of a guest's response, streamed as the guest writes it. It
/// ends in an error, not cleanly, when the guest failed (a trap, a limit)
/// before finishing it: WASI-HTTP ends a body whose writer is dropped as
/// if it were whole, and the client would take a cut answer for a full one.
pub struct ResponseBody {
    inner: HyperOutgoingBody,
    /// Sent once the guest has failed, before its store (and so this
    /// body's writer) is dropped.
    failed: tokio::sync::oneshot::Receiver<()>,
    ended: bool,
}

type HyperOutgoingBody = wasmtime_wasi_http::p2::body::HyperOutgoingBody;

impl http_body::Body for ResponseBody {
    type Data = Bytes;
    type Error = wasmtime_wasi_http::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        use std::task::Poll;
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        match std::pin::Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(None) => {
                this.ended = true;
                match this.failed.try_recv() {
                    Ok(()) => Poll::Ready(Some(Err(Self::Error::InternalError(Some(
                        "the function failed before finishing its response".into(),
                    ))))),
                    Err(_) => Poll::Ready(None),
                }
            }
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Who an invocation runs as. Built by the host from the route; the guest
/// cannot change it.
#[derive(Debug, Clone)]
pub struct Invocation {
    /// Tenant that owns the function (from the route).
    pub tenant: String,
    /// The function's name.
    pub function: String,
    /// The request's `x-session-affinity` header, which gives the guest's
    /// model calls their session key (see [`SessionAffinity`]).
    pub session: SessionAffinity,
}

/// What became of one invocation.
pub struct InvokeOutcome {
    /// The guest's response (its body may still be streaming), or why there
    /// is none.
    pub result: Result<hyper::Response<ResponseBody>, InvokeError>,
    /// Time to get an instance, when instantiation finished.
    pub instantiate: Option<Duration>,
    /// Time from the start until the response head was ready (or failure).
    pub elapsed: Duration,
}

impl Runtime {
    /// Runs `req` through a fresh instance of `deployment`. The request's URI
    /// is what the guest sees; the body streams in and the response body
    /// streams out while the guest runs. `lease` (the caller's count of its
    /// instances) is dropped when the instance is gone, which may be long
    /// after the response head, or after the caller stopped waiting.
    pub async fn invoke<B>(
        &self,
        deployment: &Deployment,
        invocation: Invocation,
        req: hyper::Request<B>,
        lease: impl Send + 'static,
    ) -> InvokeOutcome
    where
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<wasmtime_wasi_http::Error>,
    {
        let start = Instant::now();
        let meter = Arc::new(CpuMeter::default());
        let limits = StoreLimits::new(&self.limits, meter.clone());
        let ai = AiCtx {
            tenant: invocation.tenant,
            session: invocation.session,
            backend: self.backend.clone(),
            meter: meter.clone(),
        };
        let mut store = Store::new(&self.engine, State::new(ai, limits));
        store.limiter(|s| &mut s.limits);
        store.set_hostcall_fuel(crate::state::HOSTCALL_BYTES);
        store.set_epoch_deadline(1);
        store.epoch_deadline_callback(|mut ctx| ctx.data_mut().limits.on_epoch());

        let (tx, rx) = tokio::sync::oneshot::channel();
        let handles = store
            .data_mut()
            .http()
            .new_incoming_request(Scheme::Http, req)
            .and_then(|req| Ok((req, store.data_mut().http().new_response_outparam(tx)?)));
        let (req, out) = match handles {
            Ok(h) => h,
            Err(e) => {
                return InvokeOutcome {
                    result: Err(InvokeError::Internal(format!("{e:#}"))),
                    instantiate: None,
                    elapsed: start.elapsed(),
                };
            }
        };

        let pre = deployment.pre.clone();
        let limits = self.limits.clone();
        let (inst_tx, mut inst_rx) = tokio::sync::oneshot::channel();
        let (failed, failure) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let _lease = lease;
            let run = async {
                let t = Instant::now();
                let proxy = pre.instantiate_async(&mut store).await?;
                let _ = inst_tx.send(t.elapsed());
                proxy
                    .wasi_http_incoming_handler()
                    .call_handle(&mut store, req, out)
                    .await
            };
            // Billed by the CPU its polls take: the guest's and the host's
            // work for it, not its waits.
            let outcome = tokio::time::timeout(limits.wall_time, Metered::billed(run, meter)).await;
            let result = match outcome {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(classify(&e, store.data().limits.exceeded, &limits)),
                Err(_) => Err(limit_error(LimitKind::WallTime, &limits)),
            };
            // Before the store goes, and with it the body's writer. A body
            // the guest finished before it failed is whole.
            if result.is_err() && store.data().response_unfinished() {
                let _ = failed.send(());
            }
            drop(store);
            result
        });

        let result = match rx.await {
            Ok(Ok(resp)) => {
                // The guest may still be writing the body; report late
                // failures in the log since the head has gone out.
                tokio::spawn(async move {
                    if let Ok(Err(e)) = task.await {
                        tracing::warn!("guest failed after sending its response head: {e}");
                    }
                });
                Ok(resp.map(|inner| ResponseBody {
                    inner,
                    failed: failure,
                    ended: false,
                }))
            }
            Ok(Err(code)) => Err(InvokeError::Guest(capped_debug(&code, GUEST_ERROR_BYTES))),
            Err(_) => match task.await {
                Ok(Ok(())) => Err(InvokeError::NoResponse),
                Ok(Err(e)) => Err(e),
                Err(e) => Err(InvokeError::Internal(format!("guest task failed: {e}"))),
            },
        };
        InvokeOutcome {
            result,
            instantiate: inst_rx.try_recv().ok(),
            elapsed: start.elapsed(),
        }
    }
}

/// The most of a guest's error code the host writes out (in logs, in the
/// error body): its payload is the guest's, of any size.
const GUEST_ERROR_BYTES: usize = 4 << 10;

/// `value`'s `Debug` text, cut after `cap` bytes: formatting stops there,
/// so a huge payload costs no more than its first bytes.
fn capped_debug(value: &impl std::fmt::Debug, cap: usize) -> String {
    struct Capped(String, usize);
    impl std::fmt::Write for Capped {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            let room = self.1 - self.0.len();
            if s.len() <= room {
                self.0.push_str(s);
                return Ok(());
            }
            let mut end = room;
            while !s.is_char_boundary(end) {
                end -= 1;
            }
            self.0.push_str(&s[..end]);
            Err(std::fmt::Error)
        }
    }
    let mut out = Capped(String::new(), cap);
    if std::fmt::write(&mut out, format_args!("{value:?}")).is_err() {
        out.0.push_str("... (cut)");
    }
    out.0
}

fn limit_error(kind: LimitKind, limits: &crate::Limits) -> InvokeError {
    let detail = match kind {
        LimitKind::CpuTime => format!("limit {} ms of guest CPU", limits.cpu_time.as_millis()),
        LimitKind::WallTime => format!("limit {} ms of wall time", limits.wall_time.as_millis()),
        LimitKind::Memory => format!("limit {} MiB of linear memory", limits.memory_bytes >> 20),
    };
    InvokeError::Limit { kind, detail }
}

/// Maps a wasmtime error from instantiation or the handler to what the
/// caller is told.
fn classify(
    e: &wasmtime::Error,
    exceeded: Option<LimitKind>,
    limits: &crate::Limits,
) -> InvokeError {
    if let Some(kind) = exceeded.or_else(|| e.downcast_ref::<LimitKind>().copied()) {
        return limit_error(kind, limits);
    }
    if let Some(trap) = e.downcast_ref::<wasmtime::Trap>() {
        return InvokeError::Trap(trap.to_string());
    }
    if e.downcast_ref::<wasmtime::PoolConcurrencyLimitError>()
        .is_some()
    {
        return InvokeError::Overloaded(format!("{e}"));
    }
    InvokeError::Trap(format!("{e:#}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use wasmtime_wasi_http::p2::bindings::http::types::ErrorCode;

    #[test]
    fn a_guests_error_payload_is_written_out_cut_to_a_few_kilobytes() {
        let code = ErrorCode::InternalError(Some("\u{1}".repeat(4 << 20)));
        let text = capped_debug(&code, GUEST_ERROR_BYTES);
        assert!(text.len() <= GUEST_ERROR_BYTES + 16, "{} bytes", text.len());
        assert!(text.contains("InternalError(Some(\""), "{}", &text[..40]);
        assert!(text.ends_with("... (cut)"));
        let small = ErrorCode::HttpRequestDenied;
        assert!(capped_debug(&small, GUEST_ERROR_BYTES).ends_with("HttpRequestDenied"));
    }
}
