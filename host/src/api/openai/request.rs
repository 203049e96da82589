//! Validation of OpenAI-style request bodies. A [`Validated`] request can
//! only be built here, so a handler holding one knows every field passed.

use kiln_runtime::{Message, OutputFormat, Params, Prompt, Role, Tool, ToolCall, ToolChoice};
use serde_json::{Map, Value};

use crate::api::ApiError;
use crate::engine::GenerateParams;

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
    /// Sampling parameters (session from `prompt_cache_key`, if given),
    /// output format, tools and log-probabilities (`Some(n)`: each token's
    /// and the `n` most likely tokens'; chat's `logprobs: true` with
    /// `top_logprobs`, completions' `logprobs: n`).
    pub(super) params: Params,
    /// Whether to answer with server-sent events.
    pub(super) stream: bool,
    /// Whether a streamed answer ends with a usage chunk.
    pub(super) include_usage: bool,
    /// Samples of the prompt to answer with (choices).
    pub(super) n: usize,
    _sealed: Sealed,
}

/// Most log-probabilities (each token's and its alternatives') an answer
/// without streaming may hold: it is built whole in memory, at hundreds of
/// bytes each, before it is sent. A stream has no such bound.
pub(super) const MAX_WHOLE_LOGPROBS: u64 = 1 << 18;

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
            let mut m = Message::text(Role::User, "");
            let mut text = None;
            for (k, v) in obj {
                match k.as_str() {
                    "role" => {
                        role = Some(match v.as_str() {
                            Some("system" | "developer") => Role::System,
                            Some("user") => Role::User,
                            Some("assistant") => Role::Assistant,
                            Some("tool") => Role::Tool,
                            _ => return Err(bad(&at("role"), format!("{v} is not supported; use system, developer, user, assistant or tool"))),
                        })
                    }
                    "content" if v.is_null() => {}
                    "content" => text = Some(content(&at("content"), v)?),
                    "tool_calls" => m.tool_calls = tool_calls(&at("tool_calls"), v)?,
                    "tool_call_id" => m.tool_call_id = Some(string(&at("tool_call_id"), v)?),
                    "name" | "refusal" => {}
                    other => return Err(bad(&at(other), "unknown or unsupported field")),
                }
            }
            m.role = role.ok_or_else(|| bad(&at("role"), "is required"))?;
            match (m.role, &text) {
                (Role::Assistant, None) if !m.tool_calls.is_empty() => {}
                (_, None) => return Err(bad(&at("content"), "is required")),
                _ => {}
            }
            if m.role == Role::Tool && m.tool_call_id.is_none() {
                return Err(bad(&at("tool_call_id"), "is required in a tool message"));
            }
            m.content = text.unwrap_or_default();
            Ok(m)
        })
        .collect()
}

/// An assistant message's `tool_calls`.
fn tool_calls(param: &str, v: &Value) -> Result<Vec<ToolCall>, ApiError> {
    let list = v
        .as_array()
        .ok_or_else(|| bad(param, "expected an array"))?;
    list.iter()
        .enumerate()
        .map(|(i, c)| {
            let at = |f: &str| format!("{param}[{i}].{f}");
            let f = c
                .get("function")
                .ok_or_else(|| bad(&at("function"), "is required"))?;
            Ok(ToolCall {
                id: c
                    .get("id")
                    .map(|v| string(&at("id"), v))
                    .transpose()?
                    .unwrap_or_default(),
                name: string(&at("function.name"), f.get("name").unwrap_or(&Value::Null))?,
                arguments: match f.get("arguments") {
                    Some(Value::String(s)) => s.clone(),
                    Some(v @ Value::Object(_)) => v.to_string(),
                    _ => return Err(bad(&at("function.arguments"), "expected a JSON string")),
                },
            })
        })
        .collect()
}

/// OpenAI's `tools`: functions only.
fn tools(v: &Value) -> Result<Vec<Tool>, ApiError> {
    let list = v
        .as_array()
        .ok_or_else(|| bad("tools", "expected an array"))?;
    list.iter()
        .enumerate()
        .map(|(i, t)| {
            let at = |f: &str| format!("tools[{i}].{f}");
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(bad(&at("type"), "only \"function\" tools are supported"));
            }
            let f = t
                .get("function")
                .and_then(Value::as_object)
                .ok_or_else(|| bad(&at("function"), "expected an object"))?;
            let mut tool = Tool {
                name: String::new(),
                description: None,
                parameters: None,
            };
            for (k, v) in f {
                match k.as_str() {
                    "name" => tool.name = string(&at("function.name"), v)?,
                    "description" => {
                        tool.description = Some(string(&at("function.description"), v)?)
                    }
                    "parameters" if v.is_object() => tool.parameters = Some(v.to_string()),
                    "parameters" => {
                        return Err(bad(
                            &at("function.parameters"),
                            "expected a JSON schema object",
                        ));
                    }
                    "strict" => {}
                    other => return Err(bad(&at(&format!("function.{other}")), "unknown field")),
                }
            }
            if tool.name.is_empty() {
                return Err(bad(&at("function.name"), "is required"));
            }
            Ok(tool)
        })
        .collect()
}

/// OpenAI's `tool_choice`.
fn tool_choice(v: &Value) -> Result<ToolChoice, ApiError> {
    match v {
        Value::String(s) if s == "auto" => Ok(ToolChoice::Auto),
        Value::String(s) if s == "none" => Ok(ToolChoice::None),
        Value::String(s) if s == "required" => Ok(ToolChoice::Required),
        Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .unwrap_or(&Value::Null);
            Ok(ToolChoice::Function(string(
                "tool_choice.function.name",
                name,
            )?))
        }
        _ => Err(bad(
            "tool_choice",
            format!(
                "expected \"auto\", \"none\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {v}"
            ),
        )),
    }
}

/// OpenAI's `response_format`: `text`, `json_object`, or `json_schema`
/// with its `schema` (its `name` and `strict` accepted: Kiln's formats are
/// always strict).
fn response_format(v: &Value) -> Result<Option<OutputFormat>, ApiError> {
    let at = |f: &str| format!("response_format.{f}");
    match v.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(OutputFormat::JsonObject)),
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
            Ok(Some(OutputFormat::JsonSchema(schema.to_string())))
        }
        _ => Err(bad(
            &at("type"),
            format!("expected \"text\", \"json_object\" or \"json_schema\", got {v}"),
        )),
    }
}

fn stop(v: &Value) -> Result<Vec<String>, ApiError> {
    let stop = match v {
        Value::String(s) => vec![s.clone()],
        Value::Array(a) if a.len() <= GenerateParams::MAX_STOPS => a
            .iter()
            .map(|s| string("stop", s))
            .collect::<Result<_, _>>()?,
        _ => {
            return Err(bad(
                "stop",
                format!(
                    "expected a string or an array of up to {} strings",
                    GenerateParams::MAX_STOPS
                ),
            ));
        }
    };
    GenerateParams::check_stop(&stop).map_err(|m| bad("stop", m))?;
    Ok(stop)
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
    let mut params = Params::defaults();
    let (mut stream, mut include_usage, mut stream_options) = (false, false, false);
    let (mut logprobs, mut top_logprobs, mut n) = (None, None, 1);
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
            "response_format" => params.format = response_format(v)?,
            "tools" if chat => params.tools = tools(v)?,
            "tool_choice" if chat => params.tool_choice = Some(tool_choice(v)?),
            "parallel_tool_calls" if chat => {
                params.parallel_tool_calls = Some(
                    v.as_bool()
                        .ok_or_else(|| bad(k, "expected true or false"))?,
                )
            }
            "functions" | "function_call" if chat => {
                return Err(bad(
                    k,
                    "is deprecated and not supported; use `tools` and `tool_choice`",
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
    params.logprobs = logprobs;
    if let (Some(top), false) = (logprobs, stream) {
        let tokens = params.max_tokens.map_or(
            kiln_engine::engine::GenerateParams::DEFAULT_MAX_TOKENS as u64,
            u64::from,
        );
        let whole = n as u64 * tokens * (u64::from(top) + 1);
        if whole > MAX_WHOLE_LOGPROBS {
            return Err(bad(
                "max_tokens",
                format!(
                    "n ({n}) x max_tokens ({tokens}) x (top log-probabilities ({top}) + 1) \
                     come to {whole} log-probabilities, and an answer without streaming holds \
                     at most {MAX_WHOLE_LOGPROBS}: stream it (`stream: true`) or ask for fewer"
                ),
            ));
        }
    }
    let field = if chat { "messages" } else { "prompt" };
    Ok(Validated {
        model: model.ok_or_else(|| bad("model", "is required"))?,
        input: input.ok_or_else(|| bad(field, "is required"))?,
        params,
        stream,
        include_usage,
        n,
        _sealed: Sealed,
    })
}

#[cfg(test)]
#[path = "request_fuzz.rs"]
mod fuzz;

#[cfg(test)]
#[path = "request_tests.rs"]
mod tests;
