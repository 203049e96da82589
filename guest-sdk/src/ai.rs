//! Model calls: builders over `kiln:ai/inference` with the host's defaults.
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

use crate::bindings::kiln::ai::inference as wit;
pub use crate::bindings::kiln::ai::inference::{
    ChatStream, Completion, Error, FinishReason, Message, ModelInfo, Params, Role, StreamEnd,
    StreamEvent, Usage,
};

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
    /// Why the stream ended and what it consumed, once it has ended.
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
            Ok(StreamEvent::Delta(text)) => Some(Ok(text)),
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
