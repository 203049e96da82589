//! What a model call may cost against its tenant's quota, estimated
//! before it runs.

use kiln_runtime::{ModelCall, Prompt};

use crate::engine::GenerateParams;

/// What one call may cost, reserved against the quota when it starts.
#[derive(Debug, Clone, Copy)]
pub(super) struct Cost {
    /// An estimate of the prompt's tokens (a little over for most text).
    pub(super) prompt: u64,
    /// The most tokens it may generate.
    pub(super) completion: u64,
}

impl Cost {
    pub(super) fn of(prompt_bytes: usize, messages: usize, max_tokens: Option<u32>) -> Self {
        // Byte-level BPE tokens average three to four bytes of text; the
        // chat template adds a few tokens around each message.
        Self {
            prompt: prompt_bytes.div_ceil(3) as u64 + 8 * messages as u64,
            completion: max_tokens.map_or(GenerateParams::DEFAULT_MAX_TOKENS as u64, u64::from),
        }
    }

    pub(super) fn total(self) -> u64 {
        self.prompt + self.completion
    }

    pub(super) fn of_call(call: &ModelCall) -> Self {
        let pieces = match &call.prompt {
            Prompt::Chat(messages) => messages.len(),
            Prompt::Text(_) => 1,
        };
        Self::of(
            prompt_bytes(call),
            pieces + call.params.tools.len(),
            call.params.max_tokens,
        )
    }
}

/// Bytes of text a call's prompt brings: its messages (tool calls'
/// arguments included) or its text, and its tools' names, descriptions
/// and schemas, which the chat template writes out.
pub(in crate::serving) fn prompt_bytes(call: &ModelCall) -> usize {
    let bytes: usize = match &call.prompt {
        Prompt::Chat(messages) => (messages.iter())
            .map(|m| {
                m.content.len()
                    + m.tool_calls
                        .iter()
                        .map(|c| c.arguments.len())
                        .sum::<usize>()
            })
            .sum(),
        Prompt::Text(text) => text.len(),
    };
    let tools: usize = (call.params.tools.iter())
        .map(|t| {
            t.name.len()
                + t.description.as_ref().map_or(0, String::len)
                + t.parameters.as_ref().map_or(0, String::len)
        })
        .sum();
    bytes + tools
}
