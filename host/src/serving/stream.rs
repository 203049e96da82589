//! What a call submitted to a pool reads: a stream of its results per
//! sample, as the engine's thread sends them, and what each used.

use std::time::Instant;

use kiln_runtime::{
    AiError, Completion, FinishReason, StreamEnd, StreamEvent, TextDelta, TokenStream, ToolCall,
    Usage,
};
use prometheus_client::metrics::histogram::Histogram;

use super::engine_thread::Out;
use super::outlet;
use super::tools::CallFilter;
use crate::engine::Finish;

/// A call handed to a pool: a channel per sample, whether replies may be
/// tool calls, and the histogram its first tokens' latency goes to.
pub(super) struct Submitted {
    pub(super) rxs: Vec<outlet::Inlet>,
    pub(super) tools: bool,
    pub(super) first_token: (Histogram, Instant),
    /// The prompt's tokens.
    pub(super) prompt: usize,
}

impl Submitted {
    pub(super) fn streams(self) -> impl Iterator<Item = Stream> {
        let (tools, first, prompt) = (self.tools, self.first_token, self.prompt);
        (self.rxs.into_iter())
            .map(move |rx| Stream::new(rx, tools, Some(first.clone()), Some(prompt)))
    }

    pub(super) fn one(self) -> Result<Stream, AiError> {
        self.streams().next().ok_or_else(dropped)
    }
}

/// Why a generation ended; tool calls when it stopped after making any.
fn finish_reason(f: &Finish, calls: &[ToolCall]) -> Result<FinishReason, AiError> {
    match f {
        Finish::Aborted(why) => Err(AiError::Aborted(why.clone())),
        Finish::Length => Ok(FinishReason::Length),
        Finish::Stop if calls.is_empty() => Ok(FinishReason::Stop),
        Finish::Stop => Ok(FinishReason::ToolCalls),
    }
}

fn usage(prompt: usize, completion: usize, cached: usize) -> Usage {
    Usage {
        prompt_tokens: prompt as u32,
        completion_tokens: completion as u32,
        cached_prompt_tokens: cached as u32,
    }
}

fn dropped() -> AiError {
    AiError::RuntimeError("the engine dropped the request".into())
}

pub(super) async fn collect(mut stream: Stream) -> Result<Completion, AiError> {
    kiln_runtime::complete_stream(&mut stream).await
}

/// A request's results as they come; a reply that may be tool calls goes
/// through a [`CallFilter`].
pub(super) struct Stream {
    rx: outlet::Inlet,
    calls: Option<CallFilter>,
    /// The end, held while the text a filter held goes out first.
    end: Option<StreamEnd>,
    /// What an aborted request used (its end is an error).
    aborted: Option<Usage>,
    /// Where the first token's latency goes, and when the call arrived.
    first_token: Option<(Histogram, Instant)>,
    /// The prompt's tokens, where known.
    prompt: Option<usize>,
}

impl Stream {
    pub(super) fn new(
        rx: outlet::Inlet,
        tools: bool,
        first_token: Option<(Histogram, Instant)>,
        prompt: Option<usize>,
    ) -> Self {
        let calls = tools.then(CallFilter::default);
        Self {
            rx,
            calls,
            end: None,
            aborted: None,
            first_token,
            prompt,
        }
    }

    async fn event(&mut self) -> Result<StreamEvent, AiError> {
        if let Some(end) = self.end.take() {
            return Ok(StreamEvent::Done(end));
        }
        match self.rx.recv().await {
            Some(Out::Text(mut text, logprobs)) => {
                if let Some((h, arrived)) = self.first_token.take() {
                    h.observe(arrived.elapsed().as_secs_f64());
                }
                if let Some(f) = &mut self.calls {
                    text = f.push(&text);
                }
                Ok(StreamEvent::Delta(TextDelta { text, logprobs }))
            }
            Some(Out::Error(e)) => Err(e),
            Some(Out::Done {
                finish,
                prompt,
                completion,
                cached,
            }) => {
                let (held, tool_calls) = (self.calls.as_mut())
                    .map(CallFilter::finish)
                    .unwrap_or_default();
                let used = usage(prompt, completion, cached);
                let finish_reason = finish_reason(&finish, &tool_calls)
                    .inspect_err(|_| self.aborted = Some(used))?;
                let end = StreamEnd {
                    finish_reason,
                    usage: used,
                    tool_calls,
                };
                if held.is_empty() {
                    return Ok(StreamEvent::Done(end));
                }
                self.end = Some(end);
                Ok(StreamEvent::Delta(TextDelta {
                    text: held,
                    logprobs: Vec::new(),
                }))
            }
            None => Err(dropped()),
        }
    }
}

impl TokenStream for Stream {
    fn next(&mut self) -> kiln_runtime::BoxFuture<'_, Result<StreamEvent, AiError>> {
        Box::pin(self.event())
    }

    fn take_unread(&mut self) -> kiln_runtime::Unread {
        if let Some(used) = self.end.as_ref().map(|e| e.usage).or(self.aborted) {
            return kiln_runtime::Unread::Done(used);
        }
        let mut deltas = 0;
        while let Ok(out) = self.rx.try_recv() {
            match out {
                Out::Text(..) => deltas += 1,
                Out::Done {
                    prompt,
                    completion,
                    cached,
                    ..
                } => return kiln_runtime::Unread::Done(usage(prompt, completion, cached)),
                Out::Error(_) => break,
            }
        }
        kiln_runtime::Unread::Deltas(deltas)
    }

    fn prompt_tokens(&self) -> Option<u64> {
        self.prompt.map(|p| p as u64)
    }
}
