//! The OpenAI-compatible API, scoped by the tenant's API key:
//! `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`.
//!
//! Calls go through the same policy gateway as guests' calls. The tenant
//! comes from the key; the session from `x-session-affinity`, else
//! `prompt_cache_key` (the precedence of [`SessionAffinity`], the same as
//! for guests).

mod logprobs;
mod request;
mod sse;

use std::sync::Arc;

use bytes::Bytes;
use hyper::{Request, Response, StatusCode};
use kiln_runtime::{
    Completion, FinishReason, Inference, ModelCall, SessionAffinity, ToolCall, Usage,
};
use rand::RngCore;

use super::control::read_body;
use super::{ApiError, Body, BoxError, json, tenant_of};
use crate::app::App;
use request::Validated;

/// Largest request body accepted.
const MAX_BODY: usize = 4 << 20;

/// `GET /v1/models`: the models this tenant may call.
pub(super) fn models<B>(app: &App, req: &Request<B>) -> Result<Response<Body>, ApiError> {
    let tenant = tenant_of(app, req)?;
    let data: Vec<_> = app
        .ai
        .list_models(&tenant)
        .into_iter()
        .map(|m| {
            serde_json::json!({
                "id": m.id, "object": "model", "created": 0, "owned_by": "kiln",
                "context_length": m.context_length,
            })
        })
        .collect();
    Ok(json(
        StatusCode::OK,
        serde_json::json!({"object": "list", "data": data}),
    ))
}

/// What a handler needs of one call.
struct Call {
    tenant: String,
    id: String,
    created: u64,
    v: Validated,
}

impl Call {
    /// The call as the model backend takes it.
    fn model_call(&self) -> ModelCall {
        ModelCall {
            tenant: self.tenant.clone(),
            model: self.v.model.clone(),
            prompt: self.v.input.clone(),
            params: self.v.params.clone(),
        }
    }
}

async fn prepare<B>(
    app: &App,
    req: Request<B>,
    validate: fn(&[u8]) -> Result<Validated, ApiError>,
    prefix: &str,
) -> Result<Call, ApiError>
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let tenant = tenant_of(app, &req)?;
    let affinity = SessionAffinity::from_headers(req.headers());
    let body = {
        let _arriving = app.body_slot(&tenant).await?;
        read_body(req, MAX_BODY, None, app.config.net.body_read_timeout).await?
    };
    let mut v = validate(&body)?;
    v.params.session = affinity.session(v.params.session.take());
    let mut id = [0u8; 12];
    rand::rng().fill_bytes(&mut id);
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    Ok(Call {
        tenant,
        id: format!("{prefix}-{}", hex::encode(id)),
        created,
        v,
    })
}

fn finish_reason(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::ToolCalls => "tool_calls",
    }
}

/// Tool calls in OpenAI's shape; with `index` for a stream's delta.
fn tool_calls_json(calls: &[ToolCall], index: bool) -> Vec<serde_json::Value> {
    (calls.iter().enumerate())
        .map(|(i, c)| {
            let mut v = serde_json::json!({
                "id": c.id, "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            });
            if index {
                v["index"] = i.into();
            }
            v
        })
        .collect()
}

fn usage_json(u: &Usage) -> serde_json::Value {
    serde_json::json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
    })
}

/// `POST /v1/chat/completions`.
pub(super) async fn chat<B>(app: Arc<App>, req: Request<B>) -> Result<Response<Body>, ApiError>
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let call = prepare(&app, req, request::chat, "chatcmpl").await?;
    if call.v.stream {
        let streams = app.ai.stream_samples(call.model_call(), call.v.n).await?;
        let until = tokio::time::Instant::now() + app.config.model_deadline;
        return Ok(sse::respond(streams, sse::Shape::chat(&call), until));
    }
    let answers = answers(&app, &call).await?;
    let asked = call.v.params.logprobs.is_some();
    let choices: Vec<_> = (answers.iter().enumerate())
        .map(|(i, c)| {
            let mut message = serde_json::json!({"role": "assistant", "content": c.text});
            if !c.tool_calls.is_empty() {
                message["tool_calls"] = tool_calls_json(&c.tool_calls, false).into();
                if c.text.is_empty() {
                    message["content"] = serde_json::Value::Null;
                }
            }
            serde_json::json!({
                "index": i,
                "message": message,
                "logprobs": if asked { logprobs::chat(&c.logprobs) } else { serde_json::Value::Null },
                "finish_reason": finish_reason(c.finish_reason),
            })
        })
        .collect();
    Ok(json(
        StatusCode::OK,
        serde_json::json!({
            "id": call.id, "object": "chat.completion", "created": call.created,
            "model": call.v.model, "choices": choices, "usage": total_usage(&answers),
        }),
    ))
}

/// Each sample of a call run to its end.
async fn answers(app: &App, call: &Call) -> Result<Vec<Completion>, ApiError> {
    if call.v.n == 1 {
        return Ok(vec![app.ai.call(call.model_call()).await?]);
    }
    let streams = app.ai.stream_samples(call.model_call(), call.v.n).await?;
    Ok(kiln_runtime::complete_samples(streams).await?)
}

/// The usage of a call's samples: the prompt once (the samples share it),
/// every sample's completion.
fn total_usage(answers: &[Completion]) -> serde_json::Value {
    let first = answers.first().map(|c| c.usage);
    let mut u = first.unwrap_or(Usage {
        prompt_tokens: 0,
        completion_tokens: 0,
        cached_prompt_tokens: 0,
    });
    u.completion_tokens = answers.iter().map(|c| c.usage.completion_tokens).sum();
    usage_json(&u)
}

/// `POST /v1/completions`.
pub(super) async fn completions<B>(
    app: Arc<App>,
    req: Request<B>,
) -> Result<Response<Body>, ApiError>
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let call = prepare(&app, req, request::completion, "cmpl").await?;
    if call.v.stream {
        let streams = app.ai.stream_samples(call.model_call(), call.v.n).await?;
        let until = tokio::time::Instant::now() + app.config.model_deadline;
        return Ok(sse::respond(streams, sse::Shape::completion(&call), until));
    }
    let answers = answers(&app, &call).await?;
    let asked = call.v.params.logprobs.is_some();
    let choices: Vec<_> = (answers.iter().enumerate())
        .map(|(i, c)| {
            let lp = asked.then(|| logprobs::completion(&c.logprobs, &mut Default::default()));
            serde_json::json!({
                "index": i, "text": c.text, "logprobs": lp,
                "finish_reason": finish_reason(c.finish_reason),
            })
        })
        .collect();
    Ok(json(
        StatusCode::OK,
        serde_json::json!({
            "id": call.id, "object": "text_completion", "created": call.created,
            "model": call.v.model, "choices": choices, "usage": total_usage(&answers),
        }),
    ))
}
