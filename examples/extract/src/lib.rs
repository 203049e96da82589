//! Kiln's extraction example: `POST` a text (or JSON `{"text", "schema"?,
//! "model"?}`) and get back the data in it as JSON that the schema accepts:
//! by default a contact, `{"name", "email", "company"}`. The model writes
//! under the schema (`kiln:ai@0.2.0` output formats), so the answer always
//! parses and validates, whatever the model.

use kiln_guest::ai::Chat;
use kiln_guest::{Handler, Request, Response};

/// The handler.
pub struct Extract;

/// The default model of a Kiln server.
const MODEL: &str = "smollm2-135m-instruct";

/// What is extracted unless the request gives its own schema.
const CONTACT: &str = r#"{
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 64},
    "email": {"type": ["string", "null"], "maxLength": 64},
    "company": {"type": ["string", "null"], "maxLength": 64}
  },
  "required": ["name", "email", "company"],
  "additionalProperties": false
}"#;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Body {
    text: String,
    schema: Option<serde_json::Value>,
    model: Option<String>,
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
        schema: None,
        model: None,
    })
}

impl Handler for Extract {
    fn handle(req: Request) -> Response {
        if req.method() != "POST" {
            return error(
                405,
                "POST the text to extract data from as the request body",
            );
        }
        let body = match parse(&req.body()) {
            Ok(b) => b,
            Err(e) => return error(400, &e),
        };
        let schema = body
            .schema
            .map_or_else(|| CONTACT.to_owned(), |s| s.to_string());
        let reply = Chat::new(body.model.unwrap_or_else(|| MODEL.into()))
            .system(format!(
                "Extract the data in the user's text as JSON matching this schema:\n{schema}"
            ))
            .user(body.text)
            .json_schema(schema)
            .temperature(0.0)
            .max_tokens(256)
            .send();
        let done = match reply {
            Ok(d) => d,
            Err(e) => return error(e.http_status(), &e.to_string()),
        };
        let data: serde_json::Value = match serde_json::from_str(&done.text) {
            Ok(v) => v,
            // Only when the reply ran out of tokens before the JSON ended.
            Err(e) => return error(502, &format!("the model's reply is not complete JSON: {e}")),
        };
        let out = serde_json::json!({
            "data": data,
            "usage": {
                "prompt_tokens": done.usage.prompt_tokens,
                "completion_tokens": done.usage.completion_tokens,
            },
        });
        Response::json(200, out.to_string())
    }
}

kiln_guest::export_handler!(Extract);
