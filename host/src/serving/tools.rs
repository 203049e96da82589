//! Tool calls (OpenAI's `tools`). The model sees the tools through its
//! chat template, or, when the template knows no tools, through a system
//! message in the Hermes style that most open models learned: a call is
//! `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. The reply is
//! generated under a grammar that lets a call name only a given tool and
//! give only arguments its schema accepts; the calls are then read back out
//! of the text.

use kiln_runtime::{AiError, Message, Params, Role, Tool, ToolCall, ToolChoice};
use rand::RngCore;
use serde_json::{Value, json};

use crate::model::ChatMessage;

/// What opens and closes a call in the model's text.
pub(super) const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// Most tools one call may offer.
const MAX_TOOLS: usize = 128;

/// A call's tools and choice, validated.
#[derive(Debug)]
pub(super) struct Tools {
    list: Vec<(Tool, Value)>,
    choice: ToolChoice,
    parallel: bool,
}

fn invalid(msg: impl Into<String>) -> AiError {
    AiError::InvalidInput(msg.into())
}

fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl Tools {
    /// The tools `p` offers with its choice; `None` when there are none to
    /// call (no tools, or `tool-choice` none).
    pub(super) fn from_params(p: &Params) -> Result<Option<Self>, AiError> {
        let choice = p.tool_choice.clone().unwrap_or(ToolChoice::Auto);
        if p.tools.is_empty() {
            return match choice {
                ToolChoice::Auto | ToolChoice::None => Ok(None),
                _ => Err(invalid(
                    "tool-choice asks for a tool call but the request has no tools: add `tools`",
                )),
            };
        }
        if p.tools.len() > MAX_TOOLS {
            return Err(invalid(format!("at most {MAX_TOOLS} tools may be given")));
        }
        let mut list = Vec::with_capacity(p.tools.len());
        for t in &p.tools {
            if !valid_name(&t.name) {
                return Err(invalid(format!(
                    "tool name `{}` is not valid: use 1 to 64 letters, digits, `_` or `-`",
                    t.name
                )));
            }
            if list.iter().any(|(o, _): &(Tool, Value)| o.name == t.name) {
                return Err(invalid(format!("tool `{}` is given twice", t.name)));
            }
            let schema = match &t.parameters {
                None => json!({"type": "object"}),
                Some(text) => serde_json::from_str::<Value>(text)
                    .ok()
                    .filter(|v| v.is_object())
                    .ok_or_else(|| {
                        invalid(format!(
                            "the parameters of tool `{}` must be a JSON schema object",
                            t.name
                        ))
                    })?,
            };
            list.push((t.clone(), schema));
        }
        if let ToolChoice::Function(name) = &choice
            && !list.iter().any(|(t, _)| &t.name == name)
        {
            return Err(invalid(format!(
                "tool-choice names `{name}`, which is not among the tools"
            )));
        }
        if matches!(choice, ToolChoice::None) {
            return Ok(None);
        }
        if p.format.is_some() {
            return Err(invalid(
                "a call may not ask for both an output format and tool calls: \
                 drop the format, or set tool-choice to none",
            ));
        }
        Ok(Some(Self {
            list,
            choice,
            parallel: p.parallel_tool_calls.unwrap_or(true),
        }))
    }

    /// The tools in OpenAI's shape, as chat templates take them.
    pub(super) fn template_json(&self) -> Vec<Value> {
        self.list
            .iter()
            .map(|(t, schema)| {
                let mut f = json!({"name": t.name, "parameters": schema});
                if let Some(d) = &t.description {
                    f["description"] = json!(d);
                }
                json!({"type": "function", "function": f})
            })
            .collect()
    }

    /// The system text that shows the tools to a model whose template
    /// knows none.
    pub(super) fn system_text(&self) -> String {
        let mut s = String::from(
            "You may call one or more functions to assist with the user query. \
             The functions are listed within <tools></tools>:\n<tools>\n",
        );
        for t in self.template_json() {
            s.push_str(&t.to_string());
            s.push('\n');
        }
        s.push_str(
            "</tools>\nTo call a function, reply with a JSON object holding its name and \
             arguments within <tool_call></tool_call> tags:\n<tool_call>\n\
             {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
        );
        s
    }

    /// The grammar (llguidance's Lark syntax) of a reply: text or calls
    /// (`auto`), or calls only, of any tool or the one named; one call
    /// when a tool is named or parallel calls are off.
    pub(super) fn grammar(&self) -> String {
        let allowed: Vec<Value> = self
            .list
            .iter()
            .filter(|(t, _)| match &self.choice {
                ToolChoice::Function(name) => &t.name == name,
                _ => true,
            })
            .map(|(t, schema)| {
                json!({
                    "type": "object",
                    "properties": {"name": {"const": t.name}, "arguments": schema},
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                })
            })
            .collect();
        // Compact JSON: a small model may otherwise pad with whitespace
        // until it runs out of tokens.
        let schema = json!({
            "anyOf": allowed,
            "x-guidance": {
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            },
        });
        // A named tool is called once (as OpenAI does).
        let many = self.parallel && !matches!(self.choice, ToolChoice::Function(_));
        let calls = if many { "call (\"\\n\" call)*" } else { "call" };
        let start = match self.choice {
            ToolChoice::Auto => "start: TEXT | calls",
            _ => "start: calls",
        };
        format!(
            "{start}\ncalls: {calls}\ncall: \"{OPEN}\\n\" %json {schema} \"\\n{CLOSE}\"\n\
             TEXT: /[^<][\\s\\S]*/\n"
        )
    }
}

/// A conversation as the chat template sees it, and the tools to give the
/// template. A template that `knows_tools` gets tool calls and results as
/// they are; otherwise calls are written into the assistant's text and
/// results are user messages, both in the Hermes style, and the tools are
/// described in the system message.
pub(super) fn chat_messages(
    messages: Vec<Message>,
    tools: Option<&Tools>,
    knows_tools: bool,
) -> (Vec<ChatMessage>, Option<Vec<Value>>) {
    let mut out: Vec<ChatMessage> = messages
        .into_iter()
        .map(|m| {
            let role = match m.role {
                Role::System => "system",
                Role::User => "user",
                Role::Assistant => "assistant",
                Role::Tool if knows_tools => "tool",
                Role::Tool => "user",
            };
            let mut c = ChatMessage::text(role, m.content);
            if knows_tools {
                c.tool_call_id = m.tool_call_id;
                c.tool_calls = m.tool_calls.iter().map(template_call).collect();
            } else if m.role == Role::Tool {
                c.content = format!("<tool_response>\n{}\n</tool_response>", c.content);
            } else {
                for call in &m.tool_calls {
                    let f = template_call(call)["function"].clone();
                    c.content.push_str(&format!("\n{OPEN}\n{f}\n{CLOSE}"));
                }
                c.content = c.content.trim_start().to_owned();
            }
            c
        })
        .collect();
    let Some(tools) = tools else {
        return (out, None);
    };
    if knows_tools {
        return (out, Some(tools.template_json()));
    }
    let text = tools.system_text();
    match out.first_mut() {
        Some(first) if first.role == "system" => {
            first.content = format!("{}\n\n{text}", first.content);
        }
        _ => out.insert(0, ChatMessage::text("system", text)),
    }
    (out, None)
}

/// A call in Hugging Face's template shape, its arguments as an object
/// when they parse (templates write them with `tojson`).
fn template_call(c: &ToolCall) -> Value {
    let arguments =
        serde_json::from_str::<Value>(&c.arguments).unwrap_or(Value::String(c.arguments.clone()));
    json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": arguments}})
}

/// A fresh call id, as OpenAI's look.
fn call_id() -> String {
    let mut b = [0u8; 12];
    rand::rng().fill_bytes(&mut b);
    format!("call_{}", hex::encode(b))
}

/// The call in one `<tool_call>` block's JSON, if it is one.
fn call_of(json: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(json.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_owned();
    let arguments = match v.get("arguments") {
        Some(Value::String(s)) => s.clone(),
        Some(a) => a.to_string(),
        None => "{}".into(),
    };
    Some(ToolCall {
        id: call_id(),
        name,
        arguments,
    })
}

/// A reply's text without its calls, and its calls.
pub(super) fn parse(text: &str) -> (String, Vec<ToolCall>) {
    let mut rest = text;
    let (mut content, mut calls) = (String::new(), Vec::new());
    while let Some(at) = rest.find(OPEN) {
        let body = &rest[at + OPEN.len()..];
        let Some(end) = body.find(CLOSE) else { break };
        match call_of(&body[..end]) {
            Some(c) => {
                content.push_str(&rest[..at]);
                calls.push(c);
            }
            None => content.push_str(&rest[..at + OPEN.len() + end + CLOSE.len()]),
        }
        rest = &body[end + CLOSE.len()..];
    }
    content.push_str(rest);
    let content = if calls.is_empty() {
        content
    } else {
        content.trim().to_owned()
    };
    (content, calls)
}

/// A streamed reply that may be calls: text passes through as it comes
/// unless the reply begins as a call, whose text is held to the end.
#[derive(Debug, Default)]
pub(super) struct CallFilter {
    held: String,
    /// Decided: `Some(true)` calls, `Some(false)` text.
    calls: Option<bool>,
}

impl CallFilter {
    /// The part of `delta` to send on now.
    pub(super) fn push(&mut self, delta: &str) -> String {
        match self.calls {
            Some(false) => return delta.to_owned(),
            Some(true) => {
                self.held.push_str(delta);
                return String::new();
            }
            None => self.held.push_str(delta),
        }
        let start = self.held.trim_start();
        if start.starts_with(OPEN) {
            self.calls = Some(true);
            String::new()
        } else if OPEN.starts_with(start) {
            String::new() // could still become a call
        } else {
            self.calls = Some(false);
            std::mem::take(&mut self.held)
        }
    }

    /// At the end: the text still held, and the calls.
    pub(super) fn finish(&mut self) -> (String, Vec<ToolCall>) {
        parse(&std::mem::take(&mut self.held))
    }
}

#[cfg(test)]
#[path = "tools_tests.rs"]
mod tests;
