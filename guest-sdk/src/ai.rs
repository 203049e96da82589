//! Model calls: builders over `kiln:ai/inference@0.2.0` with the host's
//! defaults: chats, raw completions, output formats (a JSON schema or a
//! grammar), tools and log-probabilities.
//!
//! Parameters left unset are filled in by the host: max-tokens 256,
//! temperature 0.7, top-p 0.9 (the host defines them once, as
//! `GenerateParams::DEFAULT_*` in `host/src/engine/request.rs`; this crate
//! cannot depend on the host, so keep these numbers in step).
//!
//! A request's `x-session-affinity` header is the session of every model
//! call made for it; a session set here counts only for requests without
//! that header (the host's one precedence, the same as for
//! `prompt_cache_key` on its OpenAI-compatible API).

use crate::bindings::kiln::ai0_2_0::inference as wit;
pub use crate::bindings::kiln::ai0_2_0::inference::{
    ChatStream, Completion, Error, FinishReason, Message, ModelInfo, OutputFormat, Params, Role,
    StreamEnd, StreamEvent, TextDelta, TokenLogprob, Tool, ToolCall, ToolChoice, TopLogprob, Usage,
};

impl Error {
    /// The HTTP status a function would answer this error with: 404 for
    /// an unknown model, 400 for bad input, 429 for a used-up quota, 503
    /// when the engine is full, 502 otherwise.
    pub fn http_status(&self) -> u16 {
        match self {
            Error::ModelNotFound(_) => 404,
            Error::InvalidInput(_) => 400,
            Error::QuotaExceeded(_) => 429,
            Error::Overloaded(_) => 503,
            Error::Aborted(_) | Error::RuntimeError(_) => 502,
        }
    }
}

/// The models this function's tenant may call.
pub fn models() -> Vec<ModelInfo> {
    wit::list_models()
}

fn empty_params() -> Params {
    Params {
        max_tokens: None,
        temperature: None,
        top_p: None,
        top_k: None,
        seed: None,
        stop: Vec::new(),
        session: None,
        format: None,
        tools: Vec::new(),
        tool_choice: None,
        parallel_tool_calls: None,
        logprobs: None,
    }
}

macro_rules! param_setters {
    () => {
        /// Most tokens to generate.
        pub fn max_tokens(mut self, n: u32) -> Self {
            self.params.max_tokens = Some(n);
            self
        }
        /// Sampling temperature; 0 is greedy.
        pub fn temperature(mut self, t: f32) -> Self {
            self.params.temperature = Some(t);
            self
        }
        /// Nucleus-sampling threshold.
        pub fn top_p(mut self, p: f32) -> Self {
            self.params.top_p = Some(p);
            self
        }
        /// Keep only the k most likely tokens.
        pub fn top_k(mut self, k: u32) -> Self {
            self.params.top_k = Some(k);
            self
        }
        /// Seed: the same seed gives the same output.
        pub fn seed(mut self, seed: u64) -> Self {
            self.params.seed = Some(seed);
            self
        }
        /// Stop before this string would be generated (may repeat).
        pub fn stop(mut self, s: impl Into<String>) -> Self {
            self.params.stop.push(s.into());
            self
        }
        /// Session-affinity key, for requests without an
        /// `x-session-affinity` header (the header wins).
        pub fn session(mut self, key: impl Into<String>) -> Self {
            self.params.session = Some(key.into());
            self
        }
        /// The output must be a JSON object.
        pub fn json_object(mut self) -> Self {
            self.params.format = Some(OutputFormat::JsonObject);
            self
        }
        /// The output must be JSON that `schema` (a JSON schema's text)
        /// accepts.
        pub fn json_schema(mut self, schema: impl Into<String>) -> Self {
            self.params.format = Some(OutputFormat::JsonSchema(schema.into()));
            self
        }
        /// The output must be text that `lark` (a grammar in llguidance's
        /// Lark syntax) accepts.
        pub fn grammar(mut self, lark: impl Into<String>) -> Self {
            self.params.format = Some(OutputFormat::Grammar(lark.into()));
            self
        }
        /// Each generated token's log-probability, with the `top` (0 to
        /// 20) most likely tokens at its place, in the completion's
        /// `logprobs`.
        pub fn logprobs(mut self, top: u8) -> Self {
            self.params.logprobs = Some(top);
            self
        }
    };
}

/// A chat call being built.
#[derive(Debug, Clone)]
pub struct Chat {
    model: String,
    messages: Vec<Message>,
    params: Params,
}

impl Chat {
    /// A chat with `model` and no messages yet.
    pub fn new(model: impl Into<String>) -> Self {
        Self {
            model: model.into(),
            messages: Vec::new(),
            params: empty_params(),
        }
    }

    /// Appends a message.
    pub fn message(mut self, role: Role, content: impl Into<String>) -> Self {
        self.messages.push(Message {
            role,
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        });
        self
    }

    /// Appends a function the model may call: its name, what it does, and
    /// a JSON schema (as text) of its arguments.
    pub fn tool(
        mut self,
        name: impl Into<String>,
        description: impl Into<String>,
        parameters: impl Into<String>,
    ) -> Self {
        self.params.tools.push(Tool {
            name: name.into(),
            description: Some(description.into()),
            parameters: Some(parameters.into()),
        });
        self
    }

    /// Whether and which tools the model calls (`auto` unless set).
    pub fn tool_choice(mut self, choice: ToolChoice) -> Self {
        self.params.tool_choice = Some(choice);
        self
    }

    /// Whether one reply may call several tools (yes unless set).
    pub fn parallel_tool_calls(mut self, allowed: bool) -> Self {
        self.params.parallel_tool_calls = Some(allowed);
        self
    }

    /// Appends the model's reply that called tools (a completion's
    /// `tool-calls`), before their results.
    pub fn assistant_calls(mut self, calls: Vec<ToolCall>) -> Self {
        self.messages.push(Message {
            role: Role::Assistant,
            content: String::new(),
            tool_calls: calls,
            tool_call_id: None,
        });
        self
    }

    /// Appends the result of the tool call `call_id`.
    pub fn tool_result(mut self, call_id: impl Into<String>, content: impl Into<String>) -> Self {
        self.messages.push(Message {
            role: Role::Tool,
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: Some(call_id.into()),
        });
        self
    }

    /// Appends a system message.
    pub fn system(self, content: impl Into<String>) -> Self {
        self.message(Role::System, content)
    }

    /// Appends a user message.
    pub fn user(self, content: impl Into<String>) -> Self {
        self.message(Role::User, content)
    }

    /// Appends an assistant message.
    pub fn assistant(self, content: impl Into<String>) -> Self {
        self.message(Role::Assistant, content)
    }

    param_setters!();

    /// Generates the whole reply.
    pub fn send(&self) -> Result<Completion, Error> {
        wit::chat(&self.model, &self.messages, &self.params)
    }

    /// Starts generating; iterate the result for text as it is decoded.
    pub fn stream(&self) -> Result<TextStream, Error> {
        let inner = wit::stream_chat(&self.model, &self.messages, &self.params)?;
        Ok(TextStream {
            inner,
            end: None,
            done: false,
        })
    }
}

/// A raw-prompt completion being built.
#[derive(Debug, Clone)]
pub struct Complete {
    model: String,
    prompt: String,
    params: Params,
}

impl Complete {
    /// A completion of `prompt` by `model`.
    pub fn new(model: impl Into<String>, prompt: impl Into<String>) -> Self {
        Self {
            model: model.into(),
            prompt: prompt.into(),
            params: empty_params(),
        }
    }

    param_setters!();

    /// Generates the continuation.
    pub fn send(&self) -> Result<Completion, Error> {
        wit::complete(&self.model, &self.prompt, &self.params)
    }
}

/// Text of a streaming chat, chunk by chunk. Dropping it cancels generation.
pub struct TextStream {
    inner: ChatStream,
    end: Option<StreamEnd>,
    done: bool,
}

impl TextStream {
    /// Why the stream ended, what it consumed and the tools the model
    /// called, once it has ended.
    pub fn end(&self) -> Option<&StreamEnd> {
        self.end.as_ref()
    }
}

impl Iterator for TextStream {
    type Item = Result<String, Error>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        match self.inner.next() {
            Ok(StreamEvent::Delta(d)) => Some(Ok(d.text)),
            Ok(StreamEvent::Done(end)) => {
                self.done = true;
                self.end = Some(end);
                None
            }
            Err(e) => {
                self.done = true;
                Some(Err(e))
            }
        }
    }
}
