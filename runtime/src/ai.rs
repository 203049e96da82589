//! The host side of `kiln:ai/inference@0.2.0`: bindings, the backend trait
//! the host implements, and the glue that fixes the tenant of every call.
//! Its types are the runtime's currency; `kiln:ai@0.1.0` guests are served
//! through `ai_legacy`, which converts.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use wasmtime::component::{HasData, Resource, ResourceTable};

use crate::session::SessionAffinity;

mod generated {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "kiln:ai/host@0.2.0",
        imports: { default: async | trappable },
        additional_derives: [PartialEq],
        with: {
            "kiln:ai/inference@0.2.0.chat-stream": super::ChatStreamHandle,
        },
        require_store_data_send: true,
    });
}

pub(crate) use generated::kiln::ai0_2_0::inference as wit;
pub use wit::{
    Completion, Error as AiError, FinishReason, Message, ModelInfo, OutputFormat, Params, Role,
    StreamEnd, StreamEvent, TextDelta, TokenLogprob, Tool, ToolCall, ToolChoice, TopLogprob, Usage,
};

/// A boxed, sendable future, as returned by [`Inference`] methods.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a model is asked to continue.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// A conversation, formatted by the model's chat template.
    Chat(Vec<Message>),
    /// Text, used verbatim.
    Text(String),
}

/// One model call, from a guest or from the HTTP API, with the tenant the
/// host attached to it.
#[derive(Debug, Clone)]
pub struct ModelCall {
    /// Tenant that owns the call (from the invoking route or the API key,
    /// never from the guest).
    pub tenant: String,
    /// Model name.
    pub model: String,
    /// What the model continues.
    pub prompt: Prompt,
    /// Sampling parameters, output format, tools and log-probabilities as
    /// the caller gave them, with the session key that [`SessionAffinity`]
    /// gives the call.
    pub params: Params,
}

impl Params {
    /// No parameters: the host's defaults for everything.
    pub fn defaults() -> Self {
        Self {
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
}

impl Message {
    /// A message of plain text.
    pub fn text(role: Role, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
}

impl From<&str> for TextDelta {
    /// A delta of text alone.
    fn from(text: &str) -> Self {
        Self {
            text: text.into(),
            logprobs: Vec::new(),
        }
    }
}

/// Text arriving from a streaming generation. Dropping it cancels the
/// generation.
pub trait TokenStream: Send {
    /// The next event: a text delta, or the end of the stream. A call that
    /// asked for log-probabilities also gets a delta (perhaps of no text)
    /// for each step that generated tokens.
    fn next(&mut self) -> BoxFuture<'_, Result<StreamEvent, AiError>>;

    /// Takes what the stream's source produced that no one has read yet,
    /// so that a stream dropped early pays for the tokens generated, read
    /// or not (default: the source buffers nothing).
    fn take_unread(&mut self) -> Unread {
        Unread::Deltas(0)
    }

    /// The prompt's tokens as the model counts them, where the source knows
    /// them (default: it does not), so that a stream that ends without its
    /// usage pays for its real prompt rather than an estimate.
    fn prompt_tokens(&self) -> Option<u64> {
        None
    }
}

/// What a stream's source produced beyond what its reader took.
#[derive(Debug, Clone)]
pub enum Unread {
    /// Deltas waiting, each of at least one token.
    Deltas(u64),
    /// The generation had ended: its whole usage.
    Done(Usage),
}

/// Runs `stream` to its end: its text, log-probabilities and tool calls
/// as one completion.
pub async fn complete_stream(stream: &mut dyn TokenStream) -> Result<Completion, AiError> {
    let (mut text, mut logprobs) = (String::new(), Vec::new());
    loop {
        match stream.next().await? {
            StreamEvent::Delta(d) => {
                text.push_str(&d.text);
                logprobs.extend(d.logprobs);
            }
            StreamEvent::Done(end) => {
                return Ok(Completion {
                    text,
                    finish_reason: end.finish_reason,
                    usage: end.usage,
                    tool_calls: end.tool_calls,
                    logprobs,
                });
            }
        }
    }
}

/// Runs every sample of a call to its end, side by side: each sample's
/// tokens count as they arrive, so a call dropped part-way pays for all of
/// them (dropping this future drops every stream). In the samples' order.
pub async fn complete_samples(
    streams: Vec<Box<dyn TokenStream>>,
) -> Result<Vec<Completion>, AiError> {
    let n = streams.len();
    let mut reads = tokio::task::JoinSet::new();
    for (i, mut s) in streams.into_iter().enumerate() {
        reads.spawn(async move { (i, complete_stream(s.as_mut()).await) });
    }
    let mut out: Vec<Option<Completion>> = (0..n).map(|_| None).collect();
    while let Some(read) = reads.join_next().await {
        let (i, c) = read.map_err(|e| AiError::RuntimeError(format!("reading a sample: {e}")))?;
        out[i] = Some(c?);
    }
    Ok(out.into_iter().flatten().collect())
}

/// How loaded one served model is, for a gateway choosing among servers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelLoad {
    /// The model.
    pub model: String,
    /// Requests in a step now.
    pub running: usize,
    /// Requests held but not yet running.
    pub waiting: usize,
    /// KV pages in all.
    pub kv_pages: usize,
    /// KV pages an allocation can take (reusable cached ones included).
    pub kv_pages_free: usize,
    /// Tokens a KV page holds.
    pub page_tokens: usize,
}

/// The model backend behind `kiln:ai/inference` and the OpenAI-compatible
/// API, implemented by the host.
pub trait Inference: Send + Sync + 'static {
    /// Runs a call to the end.
    fn call(&self, call: ModelCall) -> BoxFuture<'_, Result<Completion, AiError>>;
    /// Starts a call whose text arrives as it is decoded.
    fn stream(&self, call: ModelCall) -> BoxFuture<'_, Result<Box<dyn TokenStream>, AiError>>;
    /// Starts `n` samples of one call, each a stream; sample `i` draws
    /// with the call's seed plus `i`. This default starts `n` calls; a
    /// backend may let the samples share the prompt's work.
    fn stream_samples(
        &self,
        call: ModelCall,
        n: usize,
    ) -> BoxFuture<'_, Result<Vec<Box<dyn TokenStream>>, AiError>> {
        Box::pin(async move {
            let mut streams = Vec::with_capacity(n);
            for i in 0..n as u64 {
                let mut one = call.clone();
                one.params.seed = call.params.seed.map(|s| s.wrapping_add(i));
                streams.push(self.stream(one).await?);
            }
            Ok(streams)
        })
    }
    /// The models `tenant` may call.
    fn list_models(&self, tenant: &str) -> Vec<ModelInfo>;
    /// Sets `tenant`'s share of shared model capacity while tenants
    /// compete: running slots and prompt tokens in proportion to `weight`
    /// (1 unless set). A backend with nothing shared ignores it.
    fn set_share_weight(&self, _tenant: &str, _weight: u32) {}
    /// The load of every served model (none for a backend that serves no
    /// models).
    fn load(&self) -> Vec<ModelLoad> {
        Vec::new()
    }
    /// Ends every call in flight with an error, refuses new ones and
    /// releases the backend's devices; returns once they are released. The
    /// server calls it when it shuts down, after draining.
    fn close(&self) {}
}

/// The backend of a server that serves no models: every call says so.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoModels;

impl NoModels {
    fn error(model: &str) -> AiError {
        AiError::ModelNotFound(format!(
            "model `{model}` is not served: this Kiln server serves no models \
             (start `kiln serve` without `--no-models`, or with `--model NAME=PATH`)"
        ))
    }
}

impl Inference for NoModels {
    fn call(&self, call: ModelCall) -> BoxFuture<'_, Result<Completion, AiError>> {
        Box::pin(async move { Err(Self::error(&call.model)) })
    }
    fn stream(&self, call: ModelCall) -> BoxFuture<'_, Result<Box<dyn TokenStream>, AiError>> {
        Box::pin(async move { Err(Self::error(&call.model)) })
    }
    fn list_models(&self, _tenant: &str) -> Vec<ModelInfo> {
        Vec::new()
    }
}

/// The guest's handle on a streaming generation.
pub struct ChatStreamHandle {
    stream: Box<dyn TokenStream>,
    finished: bool,
}

/// Per-invocation `kiln:ai` state: who is calling and which backend serves.
pub(crate) struct AiCtx {
    pub(crate) tenant: String,
    pub(crate) session: SessionAffinity,
    pub(crate) backend: Arc<dyn Inference>,
    /// The request's CPU meter, which model calls are kept off.
    pub(crate) meter: Arc<crate::limits::CpuMeter>,
}

impl AiCtx {
    /// `call` kept off the request's CPU time.
    fn unbilled<F: std::future::Future>(&self, call: F) -> crate::limits::Metered<F> {
        crate::limits::Metered::unbilled(call, self.meter.clone())
    }

    /// A model call started, kept off the request's CPU time unless it ends
    /// in a refusal (a prompt past the context, the quota spent, no room),
    /// which nearly always comes before the model does any work: then its
    /// preparation bought nothing, and is the guest's, or a guest could
    /// loop refused calls on host CPU it never pays for. (A rare refusal
    /// after a prompt was computed, a decode pool full, is billed too.)
    async fn start<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, AiError>>,
    ) -> Result<T, AiError> {
        // A guest's host calls run one at a time: what the meter takes off
        // meanwhile is this call's.
        let before = self.meter.unbilled_ns();
        let out = self.unbilled(call).await;
        if let Err(
            AiError::InvalidInput(_)
            | AiError::ModelNotFound(_)
            | AiError::QuotaExceeded(_)
            | AiError::Overloaded(_),
        ) = &out
        {
            self.meter.bill(self.meter.unbilled_ns() - before);
        }
        out
    }

    /// A guest's call as the backend gets it: the invocation's tenant, and
    /// the session key that [`SessionAffinity`]'s precedence gives it.
    fn model_call(&self, model: String, prompt: Prompt, mut params: Params) -> ModelCall {
        params.session = self.session.session(params.session.take());
        ModelCall {
            tenant: self.tenant.clone(),
            model,
            prompt,
            params,
        }
    }
}

/// Borrowed view of the store used by the generated host traits.
pub(crate) struct AiView<'a> {
    pub(crate) ctx: &'a mut AiCtx,
    pub(crate) table: &'a mut ResourceTable,
}

/// [`HasData`] marker for [`AiView`].
pub(crate) struct KilnAi;

impl HasData for KilnAi {
    type Data<'a> = AiView<'a>;
}

/// Adds `kiln:ai/inference@0.2.0` to a linker.
pub(crate) fn add_to_linker<T: Send + 'static>(
    linker: &mut wasmtime::component::Linker<T>,
    get: fn(&mut T) -> AiView<'_>,
) -> wasmtime::Result<()> {
    wit::add_to_linker::<T, KilnAi>(linker, get)
}

impl wit::Host for AiView<'_> {
    async fn chat(
        &mut self,
        model: String,
        messages: Vec<Message>,
        params: Params,
    ) -> wasmtime::Result<Result<Completion, AiError>> {
        let call = self.ctx.model_call(model, Prompt::Chat(messages), params);
        let out = self.ctx.start(self.ctx.backend.call(call)).await;
        Ok(out)
    }

    async fn stream_chat(
        &mut self,
        model: String,
        messages: Vec<Message>,
        params: Params,
    ) -> wasmtime::Result<Result<Resource<ChatStreamHandle>, AiError>> {
        let call = self.ctx.model_call(model, Prompt::Chat(messages), params);
        let started = self.ctx.start(self.ctx.backend.stream(call)).await;
        match started {
            Ok(stream) => {
                let handle = ChatStreamHandle {
                    stream,
                    finished: false,
                };
                Ok(Ok(self.table.push(handle)?))
            }
            Err(e) => Ok(Err(e)),
        }
    }

    async fn complete(
        &mut self,
        model: String,
        prompt: String,
        params: Params,
    ) -> wasmtime::Result<Result<Completion, AiError>> {
        let call = self.ctx.model_call(model, Prompt::Text(prompt), params);
        let out = self.ctx.start(self.ctx.backend.call(call)).await;
        Ok(out)
    }

    async fn list_models(&mut self) -> wasmtime::Result<Vec<ModelInfo>> {
        Ok(self.ctx.backend.list_models(&self.ctx.tenant))
    }
}

impl wit::HostChatStream for AiView<'_> {
    async fn next(
        &mut self,
        stream: Resource<ChatStreamHandle>,
    ) -> wasmtime::Result<Result<StreamEvent, AiError>> {
        let handle = self.table.get_mut(&stream)?;
        if handle.finished {
            return Ok(Err(AiError::InvalidInput(
                "the stream has already ended: do not call `next` after `done`".into(),
            )));
        }
        let event = self.ctx.unbilled(handle.stream.next()).await;
        if matches!(event, Ok(StreamEvent::Done(_)) | Err(_)) {
            handle.finished = true;
        }
        Ok(event)
    }

    async fn drop(&mut self, stream: Resource<ChatStreamHandle>) -> wasmtime::Result<()> {
        // Dropping the handle drops the backend stream, which cancels it.
        self.table.delete(stream)?;
        Ok(())
    }
}
