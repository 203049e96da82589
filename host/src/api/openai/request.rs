//! Validation of OpenAI-style request bodies. A [`Validated`] request can
//! only be built here, so a handler holding one knows every field passed.

use kiln_runtime::{Message, Params, Prompt, ResponseFormat, Role};
use serde_json::{Map, Value};

use crate::api::ApiError;

/// Proof that a body was validated; only this module can make one.
#[derive(Debug, Clone)]
struct Sealed;

/// A validated request.
#[derive(Debug, Clone)]
pub(super) struct Validated {
    /// The model name.
    pub(super) model: String,
    /// Messages (`/v1/chat/completions`) or a raw prompt
    /// (`/v1/completions`).
    pub(super) input: Prompt,
    /// Sampling parameters (session from `prompt_cache_key`, if given).
    pub(super) params: Params,
    /// Whether to answer with server-sent events.
    pub(super) stream: bool,
    /// Whether a streamed answer ends with a usage chunk.
    pub(super) include_usage: bool,
    /// With `Some(n)`, each token's log-probability and the `n` most likely
    /// tokens' (chat's `logprobs: true` with `top_logprobs`, completions'
    /// `logprobs: n`).
    pub(super) logprobs: Option<u8>,
    /// Samples of the prompt to answer with (choices).
    pub(super) n: usize,
    /// What the output must be (`response_format`); free text when `None`.
    pub(super) format: Option<ResponseFormat>,
    _sealed: Sealed,
}

/// Most `top_logprobs` (and completions' `logprobs`) a request may ask for.
const MAX_TOP_LOGPROBS: u64 = kiln_engine::engine::MAX_TOP_LOGPROBS as u64;

fn top_count(param: &str, v: &Value) -> Result<u8, ApiError> {
    v.as_u64()
        .filter(|n| *n <= MAX_TOP_LOGPROBS)
        .map(|n| n as u8)
        .ok_or_else(|| {
            bad(
                param,
                format!("expected an integer from 0 to {MAX_TOP_LOGPROBS}, got {v}"),
            )
        })
}

fn bad(param: &str, msg: impl std::fmt::Display) -> ApiError {
    ApiError::invalid_param(param, format!("`{param}`: {msg}"))
}

fn uint(param: &str, v: &Value, min: u64) -> Result<u64, ApiError> {
    v.as_u64()
        .filter(|n| *n >= min)
        .ok_or_else(|| bad(param, format!("expected an integer >= {min}, got {v}")))
}

fn number(param: &str, v: &Value, ok: impl Fn(f64) -> bool, range: &str) -> Result<f32, ApiError> {
    v.as_f64()
        .filter(|n| ok(*n))
        .map(|n| n as f32)
        .ok_or_else(|| bad(param, format!("expected a number {range}, got {v}")))
}

fn string(param: &str, v: &Value) -> Result<String, ApiError> {
    v.as_str()
        .map(str::to_owned)
        .ok_or_else(|| bad(param, format!("expected a string, got {v}")))
}

/// Accepts a field only at its neutral value.
fn neutral(param: &str, v: &Value, is_neutral: bool) -> Result<(), ApiError> {
    if is_neutral {
        Ok(())
    } else {
        Err(bad(
            param,
            format!("{v} is not supported by Kiln; leave it out"),
        ))
    }
}

fn content(param: &str, v: &Value) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (i, p) in parts.iter().enumerate() {
                let at = format!("{param}[{i}]");
                match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => text.push_str(t),
                    _ => {
                        return Err(bad(
                            &at,
                            "only text parts ({\"type\": \"text\", \"text\": ...}) are supported",
                        ));
                    }
                }
            }
            Ok(text)
        }
        _ => Err(bad(param, "expected a string or an array of text parts")),
    }
}

fn messages(v: &Value) -> Result<Vec<Message>, ApiError> {
    let list = v
        .as_array()
        .filter(|l| !l.is_empty())
        .ok_or_else(|| bad("messages", "expected a non-empty array of messages"))?;
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let at = |f: &str| format!("messages[{i}].{f}");
            let obj = m
                .as_object()
                .ok_or_else(|| bad(&format!("messages[{i}]"), "expected an object"))?;
            let mut role = None;
            let mut text = None;
            for (k, v) in obj {
                match k.as_str() {
                    "role" => {
                        role = Some(match v.as_str() {
                            Some("system" | "developer") => Role::System,
                            Some("user") => Role::User,
                            Some("assistant") => Role::Assistant,
                            _ => return Err(bad(&at("role"), format!("{v} is not supported; use system, developer, user or assistant"))),
                        })
                    }
                    "content" => text = Some(content(&at("content"), v)?),
                    "name" => {}
                    other => return Err(bad(&at(other), "unknown or unsupported field")),
                }
            }
            Ok(Message {
                role: role.ok_or_else(|| bad(&at("role"), "is required"))?,
                content: text.ok_or_else(|| bad(&at("content"), "is required"))?,
            })
        })
        .collect()
}

/// OpenAI's `response_format`: `text`, `json_object`, or `json_schema`
/// with its `schema` (its `name` and `strict` accepted: Kiln's formats are
/// always strict).
fn response_format(v: &Value) -> Result<Option<ResponseFormat>, ApiError> {
    let at = |f: &str| format!("response_format.{f}");
    match v.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(ResponseFormat::JsonObject)),
        Some("json_schema") => {
            let spec = v
                .get("json_schema")
                .and_then(Value::as_object)
                .ok_or_else(|| bad(&at("json_schema"), "expected an object with a `schema`"))?;
            for (k, f) in spec {
                match k.as_str() {
                    "schema" if f.is_object() || f.is_boolean() => {}
                    "schema" => {
                        return Err(bad(
                            &at("json_schema.schema"),
                            "expected a JSON schema object",
                        ));
                    }
                    "name" | "description" | "strict" => {}
                    other => {
                        return Err(bad(&at(&format!("json_schema.{other}")), "unknown field"));
                    }
                }
            }
            let schema = spec
                .get("schema")
                .ok_or_else(|| bad(&at("json_schema.schema"), "is required"))?;
            Ok(Some(ResponseFormat::JsonSchema(schema.to_string())))
        }
        _ => Err(bad(
            &at("type"),
            format!("expected \"text\", \"json_object\" or \"json_schema\", got {v}"),
        )),
    }
}

fn stop(v: &Value) -> Result<Vec<String>, ApiError> {
    match v {
        Value::String(s) => Ok(vec![s.clone()]),
        Value::Array(a) if a.len() <= 4 => a.iter().map(|s| string("stop", s)).collect(),
        _ => Err(bad(
            "stop",
            "expected a string or an array of up to 4 strings",
        )),
    }
}

/// Validates a `/v1/chat/completions` body.
pub(super) fn chat(body: &[u8]) -> Result<Validated, ApiError> {
    validate(body, true)
}

/// Validates a `/v1/completions` body.
pub(super) fn completion(body: &[u8]) -> Result<Validated, ApiError> {
    validate(body, false)
}

fn validate(body: &[u8], chat: bool) -> Result<Validated, ApiError> {
    let map: Map<String, Value> = serde_json::from_slice(body).map_err(|e| {
        ApiError::invalid_param("body", format!("the body must be a JSON object: {e}"))
    })?;
    let mut model = None;
    let mut input = None;
    let mut params = Params {
        max_tokens: None,
        temperature: None,
        top_p: None,
        top_k: None,
        seed: None,
        stop: Vec::new(),
        session: None,
    };
    let (mut stream, mut include_usage, mut stream_options) = (false, false, false);
    let (mut logprobs, mut top_logprobs, mut n, mut format) = (None, None, 1, None);
    for (key, v) in &map {
        let k = key.as_str();
        if v.is_null() && k != "messages" && k != "prompt" && k != "model" {
            continue; // an explicit null means "the default"
        }
        match k {
            "model" => model = Some(string(k, v)?),
            "messages" if chat => input = Some(Prompt::Chat(messages(v)?)),
            "prompt" if !chat => {
                input = Some(Prompt::Text(match v {
                    Value::String(s) => s.clone(),
                    Value::Array(a) if a.len() == 1 && a[0].is_string() => string(k, &a[0])?,
                    _ => return Err(bad(k, "expected a string (or an array holding one string)")),
                }))
            }
            "max_tokens" | "max_completion_tokens" => {
                let n = uint(k, v, 1)?;
                params.max_tokens = Some(u32::try_from(n).map_err(|_| bad(k, "is too large"))?);
            }
            "temperature" => {
                params.temperature =
                    Some(number(k, v, |x| (0.0..=2.0).contains(&x), "from 0 to 2")?)
            }
            "top_p" => params.top_p = Some(number(k, v, |x| x > 0.0 && x <= 1.0, "in (0, 1]")?),
            "top_k" => {
                params.top_k = match v.as_i64() {
                    Some(-1 | 0) => None,
                    _ => Some(u32::try_from(uint(k, v, 1)?).map_err(|_| bad(k, "is too large"))?),
                }
            }
            "seed" => {
                params.seed = Some(
                    v.as_i64()
                        .map(|s| s as u64)
                        .or(v.as_u64())
                        .ok_or_else(|| bad(k, "expected an integer"))?,
                )
            }
            "stop" => params.stop = stop(v)?,
            "stream" => {
                stream = v
                    .as_bool()
                    .ok_or_else(|| bad(k, "expected true or false"))?
            }
            "stream_options" => {
                stream_options = true;
                let o = v.as_object().ok_or_else(|| bad(k, "expected an object"))?;
                for (ok, ov) in o {
                    match ok.as_str() {
                        "include_usage" => {
                            include_usage = ov.as_bool().ok_or_else(|| {
                                bad("stream_options.include_usage", "expected true or false")
                            })?
                        }
                        other => {
                            return Err(bad(
                                &format!("stream_options.{other}"),
                                "unknown or unsupported field",
                            ));
                        }
                    }
                }
            }
            "user" => {
                string(k, v)?;
            }
            "prompt_cache_key" => params.session = Some(string(k, v)?),
            "n" => {
                let most = kiln_engine::engine::MAX_SAMPLES as u64;
                n = v
                    .as_u64()
                    .filter(|n| (1..=most).contains(n))
                    .ok_or_else(|| {
                        bad(k, format!("expected an integer from 1 to {most}, got {v}"))
                    })? as usize;
            }
            "best_of" => neutral(k, v, v.as_u64() == Some(1))?,
            "presence_penalty" | "frequency_penalty" => neutral(k, v, v.as_f64() == Some(0.0))?,
            "logprobs" if chat => {
                let on = v
                    .as_bool()
                    .ok_or_else(|| bad(k, "expected true or false"))?;
                logprobs = on.then_some(0);
            }
            "top_logprobs" if chat => top_logprobs = Some(top_count(k, v)?),
            "logprobs" => {
                logprobs = (v != &Value::Bool(false))
                    .then(|| top_count(k, v))
                    .transpose()?
            }
            "echo" => neutral(k, v, v == &Value::Bool(false))?,
            "logit_bias" => neutral(k, v, v.as_object().is_some_and(Map::is_empty))?,
            "response_format" => format = response_format(v)?,
            "tools" | "tool_choice" | "functions" | "function_call" | "parallel_tool_calls" => {
                return Err(bad(
                    k,
                    "tool calling is not supported by Kiln; leave it out",
                ));
            }
            _ => return Err(bad(k, "unknown or unsupported field")),
        }
    }
    if stream_options && !stream {
        return Err(bad("stream_options", "is only allowed with `stream: true`"));
    }
    if let Some(n) = top_logprobs {
        if logprobs.is_none() {
            return Err(bad("top_logprobs", "needs `logprobs: true`"));
        }
        logprobs = Some(n);
    }
    let field = if chat { "messages" } else { "prompt" };
    Ok(Validated {
        model: model.ok_or_else(|| bad("model", "is required"))?,
        input: input.ok_or_else(|| bad(field, "is required"))?,
        params,
        stream,
        include_usage,
        logprobs,
        n,
        format,
        _sealed: Sealed,
    })
}

#[cfg(test)]
#[path = "request_fuzz.rs"]
mod fuzz;

#[cfg(test)]
#[path = "request_tests.rs"]
mod tests;
