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
    Completion, FinishReason, Inference, ModelCall, SessionAffinity, TokenLogprob, Usage,
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
            logprobs: self.v.logprobs,
            format: self.v.format.clone(),
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
    let body = read_body(req, MAX_BODY).await?;
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
    }
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
        return Ok(sse::respond(streams, sse::Shape::chat(&call)));
    }
    let answers = answers(&app, &call).await?;
    let choices: Vec<_> = (answers.iter().enumerate())
        .map(|(i, (c, lp))| {
            serde_json::json!({
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": lp.as_deref().map_or(serde_json::Value::Null, logprobs::chat),
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

/// Each sample of a call run to its end; with the tokens'
/// log-probabilities when it asked for them (those come with streams).
async fn answers(app: &App, call: &Call) -> Result<Vec<Answer>, ApiError> {
    if call.v.logprobs.is_none() && call.v.n == 1 {
        return Ok(vec![(app.ai.call(call.model_call()).await?, None)]);
    }
    let streams = app.ai.stream_samples(call.model_call(), call.v.n).await?;
    let mut out = Vec::with_capacity(streams.len());
    for s in streams {
        let (c, lp) = logprobs::collect(s).await?;
        out.push((c, call.v.logprobs.map(|_| lp)));
    }
    Ok(out)
}

/// A sample's completion and its tokens' log-probabilities if asked.
type Answer = (Completion, Option<Vec<TokenLogprob>>);

/// The usage of a call's samples: the prompt once (the samples share it),
/// every sample's completion.
fn total_usage(answers: &[Answer]) -> serde_json::Value {
    let first = answers.first().map(|(c, _)| c.usage);
    let mut u = first.unwrap_or(Usage {
        prompt_tokens: 0,
        completion_tokens: 0,
        cached_prompt_tokens: 0,
    });
    u.completion_tokens = answers.iter().map(|(c, _)| c.usage.completion_tokens).sum();
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
        return Ok(sse::respond(streams, sse::Shape::completion(&call)));
    }
    let answers = answers(&app, &call).await?;
    let choices: Vec<_> = (answers.iter().enumerate())
        .map(|(i, (c, lp))| {
            let lp = lp.as_deref().map(|lp| logprobs::completion(lp, 0).0);
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
