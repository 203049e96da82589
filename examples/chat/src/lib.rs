//! Kiln's chat example: `POST {"messages": [{"role", "content"}], "model"?,
//! "max_tokens"?, "temperature"?}` and the reply streams back as
//! server-sent events, one `data: {"delta": "..."}` per chunk as the model
//! decodes it, then `data: {"finish_reason", "usage"}` and `data: [DONE]`.
//! The request's `x-session-affinity` header is the session of the model
//! call (Kiln does that by default) and is echoed back.

use kiln_guest::ai::{Chat, FinishReason, Role};
use kiln_guest::{Handler, Request, Response};

/// The handler.
pub struct ChatFn;

#[derive(serde::Deserialize)]
struct Body {
    messages: Vec<Msg>,
    model: Option<String>,
    max_tokens: Option<u32>,
    temperature: Option<f32>,
}

#[derive(serde::Deserialize)]
struct Msg {
    role: String,
    content: String,
}

fn error(status: u16, message: &str) -> Response {
    Response::json(
        status,
        serde_json::json!({ "error": { "message": message } }).to_string(),
    )
}

impl Handler for ChatFn {
    fn handle(req: Request) -> Response {
        if req.method() != "POST" {
            return error(
                405,
                "POST a JSON body {\"messages\": [{\"role\": \"user\", \"content\": \"...\"}]}",
            );
        }
        let body: Body = match serde_json::from_slice(&req.body()) {
            Ok(b) => b,
            Err(e) => return error(400, &format!("invalid JSON body: {e}")),
        };
        let mut chat = Chat::new(body.model.unwrap_or_else(|| "smollm2-135m-instruct".into()));
        for m in body.messages {
            let role = match m.role.as_str() {
                "system" => Role::System,
                "assistant" => Role::Assistant,
                _ => Role::User,
            };
            chat = chat.message(role, m.content);
        }
        if let Some(n) = body.max_tokens {
            chat = chat.max_tokens(n);
        }
        if let Some(t) = body.temperature {
            chat = chat.temperature(t);
        }
        let mut stream = match chat.stream() {
            Ok(s) => s,
            Err(e) => return error(502, &e.to_string()),
        };
        let session = req.session().unwrap_or("").to_owned();
        Response::stream(200, move |w| {
            for chunk in stream.by_ref() {
                let event = match chunk {
                    Ok(text) => serde_json::json!({ "delta": text }),
                    Err(e) => serde_json::json!({ "error": e.to_string() }),
                };
                // A client that went away ends the loop; dropping the
                // stream cancels the generation.
                if !w.write(format!("data: {event}\n\n").as_bytes()) {
                    return;
                }
            }
            if let Some(end) = stream.end() {
                let done = serde_json::json!({
                    "finish_reason": match end.finish_reason {
                        FinishReason::Stop => "stop",
                        FinishReason::Length => "length",
                        FinishReason::ToolCalls => "tool_calls",
                    },
                    "usage": {
                        "prompt_tokens": end.usage.prompt_tokens,
                        "completion_tokens": end.usage.completion_tokens,
                        "cached_tokens": end.usage.cached_prompt_tokens,
                    },
                });
                w.write(format!("data: {done}\n\n").as_bytes());
            }
            w.write(b"data: [DONE]\n\n");
        })
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .header("x-session-affinity", session)
    }
}

kiln_guest::export_handler!(ChatFn);
