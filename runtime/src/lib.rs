//! Kiln's WebAssembly runtime.
//!
//! Every request runs in a fresh wasmtime instance drawn from a pooling
//! allocator, under per-request limits on linear memory, guest CPU time and
//! wall time. Guests are components exporting `wasi:http/incoming-handler`;
//! they may import Kiln's `kiln:ai/inference` interface, served by whatever
//! [`Inference`] backend the host plugs in. The tenant of every host call is
//! fixed by the host when the invocation starts ([`Invocation::tenant`]); a
//! guest never chooses it.

mod ai;
mod ai_legacy;
mod compile;
mod error;
mod invoke;
mod limits;
mod session;
mod state;

pub use ai::{
    AiError, BoxFuture, Completion, FinishReason, Inference, Message, ModelCall, ModelInfo,
    ModelLoad, NoModels, OutputFormat, Params, Prompt, Role, StreamEnd, StreamEvent, TextDelta,
    TokenLogprob, TokenStream, Tool, ToolCall, ToolChoice, TopLogprob, Unread, Usage,
    complete_samples, complete_stream,
};
pub use compile::{Deployment, Runtime};
pub use error::{InvokeError, LimitKind, RuntimeError};
pub use invoke::{Invocation, InvokeOutcome, ResponseBody};
pub use limits::Limits;
pub use session::{SESSION_HEADER, SessionAffinity};
/// The error type of request and response bodies crossing into guests.
pub use wasmtime_wasi_http::Error as BodyError;
