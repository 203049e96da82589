//! Kiln's summarize example: `POST` any text (or JSON `{"text", "model"?,
//! "max_tokens"?}`) and get back `{"summary", "usage"}`. The request's
//! `x-session-affinity` header is the session of the model call (Kiln does
//! that by default), so a client summarizing pieces of one long document
//! keeps hitting the pool that caches its prefix.

use kiln_guest::ai::Chat;
use kiln_guest::{Handler, Request, Response};

/// The handler.
pub struct Summarize;

/// The default model of a Kiln server.
const MODEL: &str = "smollm2-135m-instruct";

/// Summaries longer than this many tokens are cut.
const DEFAULT_MAX_TOKENS: u32 = 128;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Body {
    text: String,
    model: Option<String>,
    max_tokens: Option<u32>,
}

fn error(status: u16, message: &str) -> Response {
    Response::json(
        status,
        serde_json::json!({ "error": { "message": message } }).to_string(),
    )
}

/// Reads the body as JSON `{"text", ...}` or, failing that, as plain text.
fn parse(raw: &[u8]) -> Result<Body, String> {
    if raw.first() == Some(&b'{') {
        return serde_json::from_slice(raw).map_err(|e| format!("invalid JSON body: {e}"));
    }
    let text = String::from_utf8(raw.to_vec()).map_err(|_| "the body is not UTF-8 text")?;
    Ok(Body {
        text,
        model: None,
        max_tokens: None,
    })
}

impl Handler for Summarize {
    fn handle(req: Request) -> Response {
        if req.method() != "POST" {
            return error(405, "POST the text to summarize as the request body");
        }
        let body = match parse(&req.body()) {
            Ok(b) => b,
            Err(e) => return error(400, &e),
        };
        if body.text.trim().is_empty() {
            return error(400, "the text to summarize is empty");
        }
        let chat = Chat::new(body.model.unwrap_or_else(|| MODEL.into()))
            .system("You summarize texts in one or two short sentences.")
            .user(format!("Summarize this text:\n\n{}", body.text))
            .max_tokens(body.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS))
            .temperature(0.0);
        match chat.send() {
            Ok(c) => Response::json(
                200,
                serde_json::json!({
                    "summary": c.text.trim(),
                    "usage": {
                        "prompt_tokens": c.usage.prompt_tokens,
                        "completion_tokens": c.usage.completion_tokens,
                        "cached_tokens": c.usage.cached_prompt_tokens,
                    },
                })
                .to_string(),
            ),
            Err(e) => error(e.http_status(), &e.to_string()),
        }
    }
}

kiln_guest::export_handler!(Summarize);
