//! `kiln:ai/inference@0.1.0` for functions built against it: each call is
//! converted to its 0.2.0 form (no format, tools or log-probabilities) and
//! served by the same host code, and each answer converted back.

use wasmtime::component::Resource;

use crate::ai::{AiView, ChatStreamHandle, KilnAi};

mod generated {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "kiln:ai/host@0.1.0",
        imports: { default: async | trappable },
        with: {
            "kiln:ai/inference@0.1.0.chat-stream": crate::ai::ChatStreamHandle,
        },
        require_store_data_send: true,
    });
}

use crate::ai::wit as v2;
use generated::kiln::ai0_1_0::inference as v1;

/// Adds `kiln:ai/inference@0.1.0` to a linker.
pub(crate) fn add_to_linker<T: Send + 'static>(
    linker: &mut wasmtime::component::Linker<T>,
    get: fn(&mut T) -> AiView<'_>,
) -> wasmtime::Result<()> {
    v1::add_to_linker::<T, KilnAi>(linker, get)
}

fn message(m: v1::Message) -> v2::Message {
    let role = match m.role {
        v1::Role::System => v2::Role::System,
        v1::Role::User => v2::Role::User,
        v1::Role::Assistant => v2::Role::Assistant,
    };
    v2::Message::text(role, m.content)
}

fn params(p: v1::Params) -> v2::Params {
    v2::Params {
        max_tokens: p.max_tokens,
        temperature: p.temperature,
        top_p: p.top_p,
        top_k: p.top_k,
        seed: p.seed,
        stop: p.stop,
        session: p.session,
        ..v2::Params::defaults()
    }
}

fn error(e: v2::Error) -> v1::Error {
    match e {
        v2::Error::ModelNotFound(m) => v1::Error::ModelNotFound(m),
        v2::Error::InvalidInput(m) => v1::Error::InvalidInput(m),
        v2::Error::QuotaExceeded(m) => v1::Error::QuotaExceeded(m),
        v2::Error::Overloaded(m) => v1::Error::Overloaded(m),
        v2::Error::Aborted(m) => v1::Error::Aborted(m),
        v2::Error::RuntimeError(m) => v1::Error::RuntimeError(m),
    }
}

fn usage(u: v2::Usage) -> v1::Usage {
    v1::Usage {
        prompt_tokens: u.prompt_tokens,
        completion_tokens: u.completion_tokens,
        cached_prompt_tokens: u.cached_prompt_tokens,
    }
}

/// A 0.1.0 call never asks for tools, so never ends in tool calls.
fn finish(f: v2::FinishReason) -> v1::FinishReason {
    match f {
        v2::FinishReason::Length => v1::FinishReason::Length,
        v2::FinishReason::Stop | v2::FinishReason::ToolCalls => v1::FinishReason::Stop,
    }
}

fn completion(c: Result<v2::Completion, v2::Error>) -> Result<v1::Completion, v1::Error> {
    let c = c.map_err(error)?;
    Ok(v1::Completion {
        text: c.text,
        finish_reason: finish(c.finish_reason),
        usage: usage(c.usage),
    })
}

impl v1::Host for AiView<'_> {
    async fn chat(
        &mut self,
        model: String,
        messages: Vec<v1::Message>,
        p: v1::Params,
    ) -> wasmtime::Result<Result<v1::Completion, v1::Error>> {
        let messages = messages.into_iter().map(message).collect();
        let out = v2::Host::chat(self, model, messages, params(p)).await?;
        Ok(completion(out))
    }

    async fn stream_chat(
        &mut self,
        model: String,
        messages: Vec<v1::Message>,
        p: v1::Params,
    ) -> wasmtime::Result<Result<Resource<ChatStreamHandle>, v1::Error>> {
        let messages = messages.into_iter().map(message).collect();
        let out = v2::Host::stream_chat(self, model, messages, params(p)).await?;
        Ok(out.map_err(error))
    }

    async fn complete(
        &mut self,
        model: String,
        prompt: String,
        p: v1::Params,
    ) -> wasmtime::Result<Result<v1::Completion, v1::Error>> {
        let out = v2::Host::complete(self, model, prompt, params(p)).await?;
        Ok(completion(out))
    }

    async fn list_models(&mut self) -> wasmtime::Result<Vec<v1::ModelInfo>> {
        let models = v2::Host::list_models(self).await?;
        Ok(models
            .into_iter()
            .map(|m| v1::ModelInfo {
                id: m.id,
                context_length: m.context_length,
            })
            .collect())
    }
}

impl v1::HostChatStream for AiView<'_> {
    async fn next(
        &mut self,
        stream: Resource<ChatStreamHandle>,
    ) -> wasmtime::Result<Result<v1::StreamEvent, v1::Error>> {
        let event = v2::HostChatStream::next(self, stream).await?;
        Ok(event.map_err(error).map(|e| match e {
            v2::StreamEvent::Delta(d) => v1::StreamEvent::Delta(d.text),
            v2::StreamEvent::Done(end) => v1::StreamEvent::Done(v1::StreamEnd {
                finish_reason: finish(end.finish_reason),
                usage: usage(end.usage),
            }),
        }))
    }

    async fn drop(&mut self, stream: Resource<ChatStreamHandle>) -> wasmtime::Result<()> {
        v2::HostChatStream::drop(self, stream).await
    }
}
