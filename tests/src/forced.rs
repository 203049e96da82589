//! Teacher-forced agreement of one engine with a reference: the weight,
//! page and rank formats are all held to it. The reference's side (its
//! greedy continuations and their logits) is computed once in [`Forced`],
//! so a test binary that holds several formats to one reference pays for
//! the reference once.

use kiln_host::engine::{Engine, GenerateParams, TenantId};

/// A reference engine's greedy continuation of each prompt, with its
/// logits at every continued position.
pub struct Forced {
    prompts: Vec<ForcedPrompt>,
}

/// One prompt's forced sequence and the reference's logits over it.
struct ForcedPrompt {
    /// Prompt tokens followed by the reference's greedy continuation.
    seq: Vec<u32>,
    /// Where the continuation starts in `seq`.
    from: usize,
    /// The reference's logits at each position from `from` on.
    logits: Vec<Vec<f32>>,
}

/// Tokens each prompt is continued by before it is forced.
const CONTINUATION: usize = 32;

impl Forced {
    /// Runs each prompt (a chat message, templated by the reference's
    /// tokenizer) through `reference`'s own greedy continuation and keeps
    /// its logits at every continued position.
    pub fn by(reference: &mut Engine, prompts: &[&str]) -> Self {
        let greedy = GenerateParams {
            max_tokens: CONTINUATION,
            temperature: 0.0,
            ..Default::default()
        };
        let prompts = prompts
            .iter()
            .map(|p| {
                let prompt = crate::chat_ids(reference, p);
                let cont = reference
                    .generate(TenantId(1), prompt.clone(), greedy.clone())
                    .unwrap()
                    .tokens;
                let from = prompt.len();
                let seq: Vec<u32> = prompt.into_iter().chain(cont).collect();
                let logits = reference
                    .teacher_forced_logits(TenantId(1), &seq, from)
                    .unwrap();
                ForcedPrompt { seq, from, logits }
            })
            .collect();
        Self { prompts }
    }

    /// `other`'s agreement with the reference over every prompt: (positions
    /// whose argmax agrees, positions, mean KL(reference || other) in nats).
    pub fn against(&self, other: &mut Engine) -> (usize, usize, f64) {
        self.against_first(self.prompts.len(), other)
    }

    /// [`Forced::against`] over the first `n` prompts only.
    pub fn against_first(&self, n: usize, other: &mut Engine) -> (usize, usize, f64) {
        let (mut agree, mut total, mut kl) = (0usize, 0usize, 0f64);
        for p in &self.prompts[..n] {
            let got = other
                .teacher_forced_logits(TenantId(1), &p.seq, p.from)
                .unwrap();
            for (want, got) in p.logits.iter().zip(&got) {
                total += 1;
                agree += usize::from(
                    kiln_kernels::sample::argmax(want) == kiln_kernels::sample::argmax(got),
                );
                kl += kl_nats(want, got);
            }
        }
        (agree, total, kl / total.max(1) as f64)
    }
}

/// Teacher-forced next-token agreement of `other` with `reference` over
/// `prompts`, each continued by the reference's own greedy 32 tokens:
/// (positions whose argmax agrees, positions, mean KL(reference || other)
/// in nats).
pub fn teacher_forced(
    reference: &mut Engine,
    other: &mut Engine,
    prompts: &[&str],
) -> (usize, usize, f64) {
    Forced::by(reference, prompts).against(other)
}

/// KL(softmax(a) || softmax(b)) in nats, for two rows of logits.
pub fn kl_nats(a: &[f32], b: &[f32]) -> f64 {
    let log_softmax = |l: &[f32]| -> Vec<f64> {
        let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = l.iter().map(|v| (*v as f64 - max).exp()).sum::<f64>().ln() + max;
        l.iter().map(|v| *v as f64 - lse).collect()
    };
    let (pa, pb) = (log_softmax(a), log_softmax(b));
    pa.iter().zip(&pb).map(|(x, y)| x.exp() * (x - y)).sum()
}
