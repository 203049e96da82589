//! Driving an engine outside the serving loop: one prompt to its end (for
//! `kiln run` and tests) and teacher-forced logits (for parity checks).

use super::{Engine, Event, Finish, GenerateParams, Generation, TenantId};
use crate::model::step::{Draw, RunLane, SeqOut, Step, StepSeq, StepTags};

impl Engine {
    /// Runs `prompt` alone to the end (for `kiln run` and tests): the
    /// generated token ids, text and why it ended.
    pub fn generate(
        &mut self,
        tenant: TenantId,
        prompt: Vec<u32>,
        params: GenerateParams,
    ) -> Result<Generation, String> {
        let id = self.add(tenant, prompt, params)?;
        let mut out = Generation {
            tokens: Vec::new(),
            text: String::new(),
            finish: Finish::Length,
            prompt_tokens: 0,
        };
        loop {
            for e in self.step()? {
                match e {
                    Event::Token {
                        seq, token, text, ..
                    } if seq == id => {
                        out.tokens.extend(token);
                        out.text.push_str(&text);
                    }
                    Event::Finished {
                        seq,
                        finish,
                        prompt_tokens,
                        ..
                    } if seq == id => {
                        out.finish = finish;
                        out.prompt_tokens = prompt_tokens;
                        return Ok(out);
                    }
                    _ => {}
                }
            }
            if !self.has_work() {
                return Err("the request vanished without finishing".into());
            }
        }
    }

    /// Teacher forcing: the logits after each of `tokens[from - 1..]`,
    /// i.e. the distributions predicting `tokens[from..]` and the token
    /// after them. Runs through the same paged KV as decoding: a prefill of
    /// `tokens[..from]`, then one token per forward pass.
    pub fn teacher_forced_logits(
        &mut self,
        tenant: TenantId,
        tokens: &[u32],
        from: usize,
    ) -> Result<Vec<Vec<f32>>, String> {
        if from == 0 || from > tokens.len() {
            return Err(format!("`from` must be in 1..={}", tokens.len()));
        }
        let id = self.next_id;
        self.next_id += 1;
        if !self.kv.allocate(id, tenant, tokens.len()) {
            return Err("the KV pool is too small for this sequence".into());
        }
        let result = (|| {
            let pages = self
                .kv
                .table(id)
                .map(|t| t.pages.clone())
                .unwrap_or_default();
            // The prefill chunk, then one token per pass, as decoding runs.
            let chunks = std::iter::once((0, from)).chain((from..tokens.len()).map(|i| (i, i + 1)));
            let mut out = Vec::with_capacity(tokens.len() - from + 1);
            for (start, end) in chunks {
                let seq = StepSeq {
                    tokens: &tokens[start..end],
                    start,
                    pages: &pages,
                    logits: true,
                    write_kv: true,
                    draw: Draw::Logits,
                    mask: None,
                    scores: None,
                };
                let changes = self.retags_for(RunLane::Main);
                let step = Step {
                    seqs: vec![seq],
                    tags: StepTags {
                        expected: &[],
                        changes: &changes,
                    },
                };
                let rows = self.runner.forward(&self.loaded, &step)?.rows;
                out.extend(rows.into_iter().filter_map(|r| match r {
                    SeqOut::Logits(l) => Some(l),
                    SeqOut::Token(_) | SeqOut::Scored { .. } => None,
                }));
            }
            Ok(out)
        })();
        self.kv.free(id);
        result
    }
}
