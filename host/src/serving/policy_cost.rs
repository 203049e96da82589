//! What a model call may cost against its tenant's quota, estimated
//! before it runs.

use kiln_runtime::{AiError, ModelCall, Prompt};

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

/// Bytes of text a call's prompt brings: its messages (tool calls' ids,
/// names and arguments, and the id a tool message answers, included) or
/// its text, and its tools' names, descriptions and schemas, which the
/// chat template writes out.
pub(in crate::serving) fn prompt_bytes(call: &ModelCall) -> usize {
    let bytes: usize = match &call.prompt {
        Prompt::Chat(messages) => (messages.iter())
            .map(|m| {
                m.content.len()
                    + m.tool_call_id.as_ref().map_or(0, String::len)
                    + (m.tool_calls.iter())
                        .map(|c| c.id.len() + c.name.len() + c.arguments.len())
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

/// Bytes of text templating a call writes, at least: [`prompt_bytes`] and
/// the template's own text around each message and tool, which may be
/// most of it (thousands of empty messages).
pub(in crate::serving) fn templated_bytes(call: &ModelCall) -> usize {
    const AROUND: usize = 32;
    let pieces = match &call.prompt {
        Prompt::Chat(messages) => {
            messages.len() + messages.iter().map(|m| m.tool_calls.len()).sum::<usize>()
        }
        Prompt::Text(_) => 0,
    };
    prompt_bytes(call) + AROUND * (pieces + call.params.tools.len())
}

/// The refusal of a call of `n` samples, each of `cost` (the prompt paid
/// once), that would use more than tenant `tenant`'s whole quota of `tpm`
/// tokens a minute; none if it fits.
pub(super) fn past_whole_quota(tenant: &str, tpm: u64, cost: Cost, n: usize) -> Option<AiError> {
    let n = n.max(1) as u64;
    let need = cost.prompt + n * cost.completion;
    if need <= tpm {
        return None;
    }
    let samples = if n > 1 {
        format!(" for each of n = {n} samples")
    } else {
        String::new()
    };
    Some(AiError::QuotaExceeded(format!(
        "this call may use {need} tokens (about {} of prompt and max-tokens {}{samples}), more \
         than tenant `{tenant}`'s whole quota of {tpm} tokens per minute; ask for fewer tokens \
         or samples, or ask the operator to raise `tokens_per_minute` \
         (PUT /v1/tenants/{tenant}/policy)",
        cost.prompt, cost.completion
    )))
}

#[cfg(test)]
mod tests {
    use kiln_runtime::{Message, Params, Role, ToolCall};

    use super::*;

    fn chat(messages: Vec<Message>) -> ModelCall {
        ModelCall {
            tenant: "a".into(),
            model: "m".into(),
            prompt: Prompt::Chat(messages),
            params: Params::defaults(),
        }
    }

    fn message(content: &str) -> Message {
        Message {
            role: Role::User,
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }

    #[test]
    fn tool_call_names_and_ids_count_as_prompt_text() {
        let big = "n".repeat(100_000);
        let mut m = message("");
        m.role = Role::Assistant;
        m.tool_calls.push(ToolCall {
            id: big.clone(),
            name: big.clone(),
            arguments: "{}".into(),
        });
        let mut answer = message("ok");
        answer.role = Role::Tool;
        answer.tool_call_id = Some(big);
        assert!(prompt_bytes(&chat(vec![m, answer])) >= 300_000);
    }

    #[test]
    fn many_empty_messages_weigh_what_their_template_writes() {
        let call = chat((0..10_000).map(|_| message("")).collect());
        assert_eq!(prompt_bytes(&call), 0);
        assert!(templated_bytes(&call) >= 320_000);
    }
}
