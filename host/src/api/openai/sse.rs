//! Streamed answers as server-sent events: one chunk per decoded piece of
//! text, a last chunk with the finish reason, a usage chunk if asked, then
//! `data: [DONE]`. A client that goes away drops the body, which drops the
//! model stream and cancels the sequence.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::Frame;
use http_body_util::BodyExt;
use hyper::{Response, StatusCode, header};
use kiln_runtime::{StreamEvent, TokenStream};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::{Call, finish_reason, logprobs, usage_json};
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
            logprobs: call.v.logprobs.is_some(),
        }
    }

    /// A chunk with one choice: text (as a delta in chat), the
    /// log-probabilities of its tokens and a finish reason.
    fn chunk(&self, text: Option<&str>, role: bool, finish: Option<&str>, lp: Value) -> Value {
        let choice = if self.chat {
            let mut delta = serde_json::Map::new();
            if role {
                delta.insert("role".into(), "assistant".into());
            }
            if let Some(t) = text {
                delta.insert("content".into(), t.into());
            }
            json!({"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish})
        } else {
            json!({"index": 0, "text": text.unwrap_or(""), "logprobs": lp, "finish_reason": finish})
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

/// A body fed from a channel.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.0.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
    }
}

/// Pumps `stream` into SSE events until it ends or the client leaves.
async fn pump(mut stream: Box<dyn TokenStream>, shape: Shape, tx: mpsc::Sender<Bytes>) {
    if shape.chat
        && tx
            .send(event(&shape.chunk(Some(""), true, None, Value::Null)))
            .await
            .is_err()
    {
        return;
    }
    // Where the next chunk's text starts in the completion (characters).
    let mut offset = 0;
    loop {
        let out = match stream.next().await {
            Ok(StreamEvent::Delta(t)) => {
                let tokens = stream.logprobs();
                let lp = match (shape.logprobs, shape.chat) {
                    (false, _) => Value::Null,
                    (true, true) => logprobs::chat(&tokens),
                    (true, false) => {
                        let (v, next) = logprobs::completion(&tokens, offset);
                        offset = next;
                        v
                    }
                };
                vec![event(&shape.chunk(Some(&t), false, None, lp))]
            }
            Ok(StreamEvent::Done(end)) => {
                let finish = Some(finish_reason(end.finish_reason));
                let mut v = vec![event(&shape.chunk(None, false, finish, Value::Null))];
                if shape.include_usage {
                    v.push(event(&shape.wrap(json!([]), usage_json(&end.usage))));
                }
                v.push(Bytes::from_static(b"data: [DONE]\n\n"));
                v
            }
            Err(e) => vec![
                event(&ApiError::from(e).json()),
                Bytes::from_static(b"data: [DONE]\n\n"),
            ],
        };
        let last = out.last().is_some_and(|b| b.starts_with(b"data: [DONE]"));
        for b in out {
            if tx.send(b).await.is_err() {
                return; // the client went away: dropping `stream` cancels
            }
        }
        if last {
            return;
        }
    }
}

/// A `text/event-stream` response fed by `stream`.
pub(super) fn respond(stream: Box<dyn TokenStream>, shape: Shape) -> Response<Body> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(pump(stream, shape, tx));
    let mut resp = Response::new(ChannelBody(rx).boxed_unsync());
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
