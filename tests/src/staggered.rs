//! Prompts the engine tests share, and a run of them arriving while
//! others decode.

use std::collections::HashMap;

use kiln_host::engine::{Engine, Event, Finish, GenerateParams, Salt, TenantId};

/// Short chat questions, each answered in a few tokens.
pub const PROMPTS: [&str; 16] = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Who wrote Hamlet?",
    "Explain gravity in one sentence.",
    "What is 12 times 12?",
    "Name a color of the rainbow.",
    "Translate 'hello' into Spanish.",
    "What do bees make?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "What is the boiling point of water?",
    "Say something kind.",
    "What is Rust (the language)?",
    "Which planet is closest to the sun?",
    "Describe a cat in five words.",
];

/// How [`staggered`] feeds the engine.
#[derive(Debug, Clone, Copy)]
pub struct Arrivals {
    /// A new prompt every this many steps.
    pub every: usize,
    /// Prompts go to tenants `0..tenants` in turn.
    pub tenants: u32,
    /// Greedy tokens each generates (EOS ignored).
    pub max_tokens: usize,
}

/// Runs `prompts` (chat messages) through `e` to the end, arriving as
/// `arrivals` says, so prompts are prefilled while others decode: each
/// one's generated tokens and finish, in prompt order.
pub fn staggered(e: &mut Engine, prompts: &[&str], arrivals: Arrivals) -> Vec<(Vec<u32>, Finish)> {
    let params = greedy_to(arrivals.max_tokens);
    let (mut seqs, mut out) = (Vec::new(), HashMap::new());
    let mut step = 0;
    while seqs.len() < prompts.len() || e.has_work() {
        if step % arrivals.every.max(1) == 0 && seqs.len() < prompts.len() {
            let ids = crate::chat_ids(e, prompts[seqs.len()]);
            let tenant = TenantId(seqs.len() as u32 % arrivals.tenants.max(1));
            seqs.push(e.add(tenant, ids, params.clone()).unwrap());
        }
        for ev in e.step().unwrap() {
            let (seq, token, finish) = match ev {
                Event::Token { seq, token, .. } => (seq, token, None),
                Event::Finished { seq, finish, .. } => (seq, None, Some(finish)),
            };
            let entry = out.entry(seq).or_insert((Vec::new(), Finish::Length));
            entry.0.extend(token);
            entry.1 = finish.unwrap_or(entry.1.clone());
        }
        step += 1;
    }
    (seqs.iter())
        .map(|s| out.remove(s).unwrap_or((Vec::new(), Finish::Length)))
        .collect()
}

/// Steps `e` until `seq` has `n` more tokens or ends: those tokens, and
/// how it ended if it did.
pub fn tokens_of(
    e: &mut Engine,
    seq: kiln_host::engine::SeqId,
    n: usize,
) -> (Vec<u32>, Option<Finish>) {
    let (tokens, end) = follow(e, seq, n);
    (tokens, end.map(|(finish, _)| finish))
}

/// Steps `e` until `seq` has `n` more tokens or ends: those tokens, and
/// if it ended, how and with how many prompt tokens found cached.
fn follow(
    e: &mut Engine,
    seq: kiln_host::engine::SeqId,
    n: usize,
) -> (Vec<u32>, Option<(Finish, usize)>) {
    let (mut tokens, mut end) = (Vec::new(), None);
    while end.is_none() && tokens.len() < n && e.has_work() {
        for ev in e.step().unwrap() {
            match ev {
                Event::Token {
                    seq: s,
                    token: Some(t),
                    ..
                } if s == seq => tokens.push(t),
                Event::Finished {
                    seq: s,
                    finish,
                    cached_tokens,
                    ..
                } if s == seq => end = Some((finish, cached_tokens)),
                _ => {}
            }
        }
    }
    (tokens, end)
}

/// Greedy decoding of exactly `max_tokens` tokens (EOS ignored).
pub fn greedy_to(max_tokens: usize) -> GenerateParams {
    GenerateParams {
        max_tokens,
        temperature: 0.0,
        ignore_eos: true,
        ..Default::default()
    }
}

/// Runs one request of `tenant` with prefix-cache salt `[salt; 32]` alone
/// to its end: its tokens and the prompt tokens it found cached.
pub fn run_salted(
    e: &mut Engine,
    (tenant, salt): (u32, u8),
    ids: &[u32],
    params: GenerateParams,
) -> (Vec<u32>, usize) {
    let salt = Salt::from_bytes([salt; 32]);
    let seq = (e.add_salted(TenantId(tenant), salt, ids.to_vec(), params)).unwrap();
    match follow(e, seq, usize::MAX) {
        (tokens, Some((_, cached))) => (tokens, cached),
        _ => panic!("request {seq} never finished"),
    }
}
