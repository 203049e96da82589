//! A model call's stream under its deadline, holding its permit, which it
//! settles with what the call used however the stream ends.

use kiln_runtime::{AiError, BoxFuture, StreamEvent, TokenStream, Unread};

use super::{Permit, refused_up_front};

/// A stream under its call's deadline, holding the call's permit.
pub(super) struct Guarded {
    inner: Box<dyn TokenStream>,
    permit: Permit,
    until: tokio::time::Instant,
    expired: AiError,
    /// Deltas seen (each carries at least one token): what an unfinished
    /// stream is charged for besides its prompt.
    deltas: u64,
}

impl TokenStream for Guarded {
    fn next(&mut self) -> BoxFuture<'_, Result<StreamEvent, AiError>> {
        Box::pin(async move {
            let ev = tokio::time::timeout_at(self.until, self.inner.next())
                .await
                .map_err(|_| self.expired.clone())
                .and_then(|ev| ev);
            match &ev {
                Ok(StreamEvent::Delta(_)) => self.deltas += 1,
                Ok(StreamEvent::Done(end)) => self.permit.settle_usage(&end.usage),
                // Ended: what it used, if the engine said (an abort after
                // its prompt ran does, text or none); refused before any
                // token (a schema the engine cannot compile), as a call
                // refused up front; else its prompt and what waited to be
                // read.
                Err(e) => match self.inner.take_unread() {
                    Unread::Done(usage) => self.permit.settle_usage(&usage),
                    Unread::Deltas(0) if self.deltas == 0 && refused_up_front(e) => {
                        self.permit.settle(0, 0)
                    }
                    Unread::Deltas(n) => self.settle_cut(n),
                },
            }
            ev
        })
    }
}

impl Guarded {
    /// `inner` under the deadline `until` (past it, `expired`), holding
    /// `permit`.
    pub(super) fn new(
        inner: Box<dyn TokenStream>,
        permit: Permit,
        until: tokio::time::Instant,
        expired: AiError,
    ) -> Self {
        Self {
            inner,
            permit,
            until,
            expired,
            deltas: 0,
        }
    }

    /// Settles a stream cut part-way, `unread` deltas left waiting: its
    /// prompt (as the model counted it, where the stream knows) and every
    /// delta generated.
    fn settle_cut(&mut self, unread: u64) {
        let prompt = (self.inner.prompt_tokens()).unwrap_or(self.permit.cost.prompt);
        self.permit.settle(prompt, self.deltas + unread);
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        // Ended early: the prompt and every token generated, those that
        // went out and those the engine left waiting unread.
        match self.inner.take_unread() {
            Unread::Done(usage) => self.permit.settle_usage(&usage),
            Unread::Deltas(n) => self.settle_cut(n),
        }
    }
}
