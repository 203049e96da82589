//! The host side of `kiln:ai/inference`: bindings, the backend trait the
//! host implements, and the glue that fixes the tenant of every call.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use wasmtime::component::{HasData, Resource, ResourceTable};

use crate::session::SessionAffinity;

mod generated {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "kiln:ai/host",
        imports: { default: async | trappable },
        with: {
            "kiln:ai/inference.chat-stream": super::ChatStreamHandle,
        },
        require_store_data_send: true,
    });
}

use generated::kiln::ai::inference as wit;
pub use wit::{
    Completion, Error as AiError, FinishReason, Message, ModelInfo, Params, Role, StreamEnd,
    StreamEvent, Usage,
};

/// A boxed, sendable future, as returned by [`Inference`] methods.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A chat call, with the tenant the host attached to it.
#[derive(Debug, Clone)]
pub struct ChatRequest {
    /// Tenant that owns the call (from the invoking route, never the guest).
    pub tenant: String,
    /// Model name.
    pub model: String,
    /// The conversation.
    pub messages: Vec<Message>,
    /// Sampling parameters as the guest gave them.
    pub params: Params,
}

/// A raw completion call, with the tenant the host attached to it.
#[derive(Debug, Clone)]
pub struct CompleteRequest {
    /// Tenant that owns the call.
    pub tenant: String,
    /// Model name.
    pub model: String,
    /// The prompt, used verbatim.
    pub prompt: String,
    /// Sampling parameters as the guest gave them.
    pub params: Params,
}

/// Text arriving from a streaming generation. Dropping it cancels the
/// generation.
pub trait TokenStream: Send {
    /// The next event: a text delta, or the end of the stream.
    fn next(&mut self) -> BoxFuture<'_, Result<StreamEvent, AiError>>;
}

/// The model backend behind `kiln:ai/inference`, implemented by the host.
pub trait Inference: Send + Sync + 'static {
    /// Runs a chat completion to the end.
    fn chat(&self, req: ChatRequest) -> BoxFuture<'_, Result<Completion, AiError>>;
    /// Starts a chat completion whose text arrives as it is decoded.
    fn stream_chat(&self, req: ChatRequest)
    -> BoxFuture<'_, Result<Box<dyn TokenStream>, AiError>>;
    /// Continues a raw prompt.
    fn complete(&self, req: CompleteRequest) -> BoxFuture<'_, Result<Completion, AiError>>;
    /// Continues a raw prompt, text arriving as it is decoded (the HTTP
    /// API's streaming completions; guests have no such import).
    fn stream_complete(
        &self,
        req: CompleteRequest,
    ) -> BoxFuture<'_, Result<Box<dyn TokenStream>, AiError>> {
        let _ = req;
        Box::pin(async {
            Err(AiError::RuntimeError(
                "this model backend does not stream raw completions; use `stream: false`".into(),
            ))
        })
    }
    /// The models `tenant` may call.
    fn list_models(&self, tenant: &str) -> Vec<ModelInfo>;
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
    fn chat(&self, req: ChatRequest) -> BoxFuture<'_, Result<Completion, AiError>> {
        Box::pin(async move { Err(Self::error(&req.model)) })
    }
    fn stream_chat(
        &self,
        req: ChatRequest,
    ) -> BoxFuture<'_, Result<Box<dyn TokenStream>, AiError>> {
        Box::pin(async move { Err(Self::error(&req.model)) })
    }
    fn complete(&self, req: CompleteRequest) -> BoxFuture<'_, Result<Completion, AiError>> {
        Box::pin(async move { Err(Self::error(&req.model)) })
    }
    fn stream_complete(
        &self,
        req: CompleteRequest,
    ) -> BoxFuture<'_, Result<Box<dyn TokenStream>, AiError>> {
        Box::pin(async move { Err(Self::error(&req.model)) })
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
    /// Restarts the CPU meter when a model call returns: waiting for the
    /// model is not guest CPU time.
    pub(crate) cpu: crate::limits::CpuMark,
}

impl AiCtx {
    /// The guest's params with the session key that [`SessionAffinity`]'s
    /// precedence gives the call.
    fn params(&self, mut params: Params) -> Params {
        self.session.apply(&mut params);
        params
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

/// Adds `kiln:ai/inference` to a linker.
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
        let req = ChatRequest {
            tenant: self.ctx.tenant.clone(),
            model,
            messages,
            params: self.ctx.params(params),
        };
        let out = self.ctx.backend.chat(req).await;
        self.ctx.cpu.resume();
        Ok(out)
    }

    async fn stream_chat(
        &mut self,
        model: String,
        messages: Vec<Message>,
        params: Params,
    ) -> wasmtime::Result<Result<Resource<ChatStreamHandle>, AiError>> {
        let req = ChatRequest {
            tenant: self.ctx.tenant.clone(),
            model,
            messages,
            params: self.ctx.params(params),
        };
        let started = self.ctx.backend.stream_chat(req).await;
        self.ctx.cpu.resume();
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
        let req = CompleteRequest {
            tenant: self.ctx.tenant.clone(),
            model,
            prompt,
            params: self.ctx.params(params),
        };
        let out = self.ctx.backend.complete(req).await;
        self.ctx.cpu.resume();
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
        let event = handle.stream.next().await;
        self.ctx.cpu.resume();
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
