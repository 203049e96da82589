//! Streamed answers as server-sent events: one chunk per decoded piece of
//! text of a sample (its choice `index`), a last chunk per sample with its
//! finish reason, a usage chunk if asked, then `data: [DONE]`. A client
//! that goes away drops the body, which drops the samples' streams and
//! cancels their sequences; so does one that stops reading until past the
//! call's deadline.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::Frame;
use http_body_util::BodyExt;
use hyper::{Response, StatusCode, header};
use kiln_runtime::{AiError, StreamEvent, TokenStream, Usage};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio::time::{Duration, Instant};

use super::{Call, finish_reason, logprobs, tool_calls_json, usage_json};
use crate::api::{ApiError, Body, BoxError};

/// How chunks of one endpoint look.
pub(super) struct Shape {
    id: String,
    created: u64,
    model: String,
    object: &'static str,
    chat: bool,
    include_usage: bool,
    /// Whether chunks carry their tokens' log-probabilities.
    logprobs: bool,
}

impl Shape {
    /// `chat.completion.chunk`s.
    pub(super) fn chat(call: &Call) -> Self {
        Self::new(call, "chat.completion.chunk", true)
    }

    /// `text_completion` chunks.
    pub(super) fn completion(call: &Call) -> Self {
        Self::new(call, "text_completion", false)
    }

    fn new(call: &Call, object: &'static str, chat: bool) -> Self {
        Self {
            id: call.id.clone(),
            created: call.created,
            model: call.v.model.clone(),
            object,
            chat,
            include_usage: call.v.include_usage,
            logprobs: call.v.params.logprobs.is_some(),
        }
    }

    /// A chunk with choice `index`: text (as a delta in chat), the
    /// log-probabilities of its tokens and a finish reason.
    fn chunk(
        &self,
        index: usize,
        text: Option<&str>,
        role: bool,
        (finish, lp): (Option<&str>, Value),
    ) -> Value {
        self.chunk_with(index, text, role, (finish, lp), None)
    }

    /// [`Self::chunk`], in chat with a delta's `tool_calls`.
    fn chunk_with(
        &self,
        index: usize,
        text: Option<&str>,
        role: bool,
        (finish, lp): (Option<&str>, Value),
        calls: Option<Value>,
    ) -> Value {
        let choice = if self.chat {
            let mut delta = serde_json::Map::new();
            if role {
                delta.insert("role".into(), "assistant".into());
            }
            if let Some(t) = text {
                delta.insert("content".into(), t.into());
            }
            if let Some(c) = calls {
                delta.insert("tool_calls".into(), c);
            }
            json!({"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish})
        } else {
            let text = text.unwrap_or("");
            json!({"index": index, "text": text, "logprobs": lp, "finish_reason": finish})
        };
        self.wrap(json!([choice]), Value::Null)
    }

    fn wrap(&self, choices: Value, usage: Value) -> Value {
        let mut v = json!({
            "id": self.id, "object": self.object, "created": self.created,
            "model": self.model, "choices": choices,
        });
        if self.include_usage {
            v["usage"] = usage;
        }
        v
    }
}

fn event(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// A body fed from a channel; it ends in an error, not cleanly, when its
/// pump gave up on a client that stopped reading (`cut`), so the client
/// cannot take what it got for the whole answer.
struct ChannelBody {
    rx: mpsc::Receiver<Bytes>,
    cut: Arc<AtomicBool>,
}

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.rx.poll_recv(cx) {
            Poll::Ready(None) if self.cut.load(Ordering::Acquire) => Poll::Ready(Some(Err(
                "the client stopped reading past the call's deadline".into(),
            ))),
            other => other.map(|b| b.map(|b| Ok(Frame::data(b)))),
        }
    }
}

/// One sample's next event.
type Sampled = (usize, Result<StreamEvent, AiError>);

/// Forwards sample `index`'s events until it ends or nobody listens; then
/// drops `stream`, which cancels it.
async fn forward(index: usize, mut stream: Box<dyn TokenStream>, tx: mpsc::Sender<Sampled>) {
    loop {
        let ev = tokio::select! {
            ev = stream.next() => ev,
            _ = tx.closed() => return,
        };
        let end = !matches!(ev, Ok(StreamEvent::Delta(_)));
        if tx.send((index, ev)).await.is_err() || end {
            return;
        }
    }
}

/// How long past its call's deadline a stream may wait for its client to
/// read: the samples stop at the deadline, and a reading client takes
/// what is left within this.
const READ_GRACE: Duration = Duration::from_secs(10);

/// Where a stream's events go: the body's channel, until `until` (the
/// call's deadline) and [`READ_GRACE`].
struct Sink {
    tx: mpsc::Sender<Bytes>,
    until: Instant,
    cut: Arc<AtomicBool>,
}

impl Sink {
    /// Sends `b` to the client, unless it has gone or has stopped reading
    /// until [`READ_GRACE`] past the deadline (then the body ends in an
    /// error). A stalled client's samples would otherwise wait unpolled,
    /// out of reach of their deadline, while the engine generates on and
    /// their output piles up.
    async fn send(&self, b: Bytes) -> bool {
        match tokio::time::timeout_at(self.until + READ_GRACE, self.tx.send(b)).await {
            Ok(sent) => sent.is_ok(),
            Err(_) => {
                self.cut.store(true, Ordering::Release);
                false
            }
        }
    }
}

/// Pumps the samples' `streams` into SSE events, each chunk one sample's
/// choice, until every sample ends, one fails, the client leaves or it
/// stops reading past `until`.
async fn pump(streams: Vec<Box<dyn TokenStream>>, shape: Shape, sink: Sink) {
    let n = streams.len();
    if shape.chat {
        for i in 0..n {
            let first = shape.chunk(i, Some(""), true, (None, Value::Null));
            if !sink.send(event(&first)).await {
                return;
            }
        }
    }
    let (etx, mut events) = mpsc::channel(64);
    for (i, s) in streams.into_iter().enumerate() {
        tokio::spawn(forward(i, s, etx.clone()));
    }
    drop(etx);
    // Where each sample's next chunk starts in its completion.
    let mut offsets: Vec<logprobs::Offset> = (0..n).map(|_| Default::default()).collect();
    let (mut open, mut usage) = (n, None::<Usage>);
    loop {
        // A client that leaves while the samples are quiet (queued, or in
        // a long prefill) cancels them at once, not at their next event.
        let (i, ev) = tokio::select! {
            next = events.recv() => match next {
                Some(e) => e,
                None => return,
            },
            _ = sink.tx.closed() => return,
        };
        let out = match ev {
            Ok(StreamEvent::Delta(d)) => {
                let lp = match (shape.logprobs, shape.chat) {
                    (false, _) => Value::Null,
                    (true, true) => logprobs::chat(&d.logprobs),
                    (true, false) => logprobs::completion(&d.logprobs, &mut offsets[i]),
                };
                vec![event(&shape.chunk(i, Some(&d.text), false, (None, lp)))]
            }
            Ok(StreamEvent::Done(end)) => {
                open -= 1;
                let mut v = Vec::new();
                if !end.tool_calls.is_empty() {
                    let calls = tool_calls_json(&end.tool_calls, true).into();
                    let c = shape.chunk_with(i, None, false, (None, Value::Null), Some(calls));
                    v.push(event(&c));
                }
                let finish = Some(finish_reason(end.finish_reason));
                v.push(event(&shape.chunk(i, None, false, (finish, Value::Null))));
                // The prompt once (the samples share it), every completion.
                let total = usage.get_or_insert(Usage {
                    completion_tokens: 0,
                    ..end.usage
                });
                total.completion_tokens += end.usage.completion_tokens;
                if open == 0 {
                    if shape.include_usage {
                        v.push(event(&shape.wrap(json!([]), usage_json(total))));
                    }
                    v.push(Bytes::from_static(b"data: [DONE]\n\n"));
                }
                v
            }
            Err(e) => vec![
                event(&ApiError::from(e).json()),
                Bytes::from_static(b"data: [DONE]\n\n"),
            ],
        };
        let last = out.last().is_some_and(|b| b.starts_with(b"data: [DONE]"));
        for b in out {
            if !sink.send(b).await {
                return; // the client went away: the samples are cancelled
            }
        }
        if last {
            return;
        }
    }
}

/// A `text/event-stream` response fed by the samples' `streams`, whose
/// call ends at `until`.
pub(super) fn respond(
    streams: Vec<Box<dyn TokenStream>>,
    shape: Shape,
    until: Instant,
) -> Response<Body> {
    let (tx, rx) = mpsc::channel(64);
    let cut = Arc::new(AtomicBool::new(false));
    let sink = Sink {
        tx,
        until,
        cut: cut.clone(),
    };
    tokio::spawn(pump(streams, shape, sink));
    let mut resp = Response::new(ChannelBody { rx, cut }.boxed_unsync());
    *resp.status_mut() = StatusCode::OK;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/event-stream"),
    );
    h.insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-cache"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use kiln_runtime::{BoxFuture, TextDelta};

    use super::*;

    /// Deltas without end; sets its flag when dropped (its call cancelled).
    struct Endless(Arc<AtomicBool>);

    impl TokenStream for Endless {
        fn next(&mut self) -> BoxFuture<'_, Result<StreamEvent, AiError>> {
            Box::pin(async {
                Ok(StreamEvent::Delta(TextDelta {
                    text: "x".into(),
                    logprobs: Vec::new(),
                }))
            })
        }
    }

    impl Drop for Endless {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_stops_reading_has_its_samples_cancelled_after_the_deadline() {
        let dropped = Arc::new(AtomicBool::new(false));
        let shape = Shape {
            id: "chatcmpl-1".into(),
            created: 0,
            model: "m".into(),
            object: "chat.completion.chunk",
            chat: true,
            include_usage: false,
            logprobs: false,
        };
        let until = Instant::now() + Duration::from_secs(120);
        let stream = Box::new(Endless(dropped.clone())) as Box<dyn TokenStream>;
        // The body is held and never read: the channels fill up.
        let resp = respond(vec![stream], shape, until);
        tokio::time::sleep(Duration::from_secs(119)).await;
        assert!(
            !dropped.load(Ordering::SeqCst),
            "cancelled before its deadline"
        );
        tokio::time::sleep(READ_GRACE + Duration::from_secs(2)).await;
        assert!(
            dropped.load(Ordering::SeqCst),
            "still generating for a stalled client"
        );
        // What was sent arrives, then an error: not a clean end.
        let read = resp.into_body().collect().await;
        assert!(read.is_err(), "a cut stream ended as if whole");
    }
}
