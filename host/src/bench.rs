//! `kiln bench`: prompt and decode throughput of the engine at several
//! concurrencies, measured side by side in one run.

use std::time::Instant;

use std::sync::Arc;

use rand::{Rng, SeedableRng};

use crate::engine::{Engine, EngineConfig, Event, GenerateParams, TenantId};
use crate::model::Loaded;

/// One concurrency's figures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchRow {
    /// Sequences run at once.
    pub concurrency: usize,
    /// Prompt tokens per second (all prompts, until every sequence has its
    /// first token).
    pub prompt_tok_s: f64,
    /// Generated tokens per second after the first token.
    pub decode_tok_s: f64,
    /// Median time between a sequence's tokens, in milliseconds.
    pub itl_p50_ms: f64,
}

/// Runs `concurrency` sequences of `prompt_tokens` random tokens, each
/// generating `gen_tokens` (EOS ignored), on a fresh engine.
pub fn run(
    loaded: Arc<Loaded>,
    config: EngineConfig,
    concurrency: usize,
    prompt_tokens: usize,
    gen_tokens: usize,
) -> Result<(BenchRow, Arc<Loaded>), String> {
    let vocab = loaded.model.config.vocab as u32;
    let mut engine = Engine::new(loaded, config)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let params = GenerateParams {
        max_tokens: gen_tokens,
        temperature: 0.0,
        ignore_eos: true,
        ..Default::default()
    };
    let start = Instant::now();
    for _ in 0..concurrency {
        // Token ids from the middle of the vocabulary: ordinary text pieces.
        let prompt: Vec<u32> = (0..prompt_tokens)
            .map(|_| rng.random_range(vocab / 8..vocab / 2))
            .collect();
        engine.add(TenantId(0), prompt, params.clone())?;
    }
    let mut first_token_all = None;
    let mut seen = std::collections::HashMap::new();
    let mut step_times = Vec::new();
    let mut generated_after_first = 0usize;
    while engine.has_work() {
        let t = Instant::now();
        let events = engine.step()?;
        let mut decoded = false;
        for e in events {
            if let Event::Token {
                seq,
                token: Some(_),
                ..
            } = e
            {
                let n = seen.entry(seq).or_insert(0usize);
                if *n > 0 {
                    generated_after_first += 1;
                    decoded = true;
                }
                *n += 1;
            }
        }
        if first_token_all.is_none() && seen.len() == concurrency {
            first_token_all = Some(start.elapsed());
        } else if decoded {
            step_times.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    let total = start.elapsed();
    let prefill = first_token_all.unwrap_or(total);
    step_times.sort_by(f64::total_cmp);
    let row = BenchRow {
        concurrency,
        prompt_tok_s: (concurrency * prompt_tokens) as f64 / prefill.as_secs_f64(),
        decode_tok_s: generated_after_first as f64 / (total - prefill).as_secs_f64().max(1e-9),
        itl_p50_ms: step_times.get(step_times.len() / 2).copied().unwrap_or(0.0),
    };
    Ok((row, engine.into_loaded()))
}

/// Time to first token of one prompt, cold and with its prefix cached.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TtftRow {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Median time to first token with nothing cached, in milliseconds.
    pub cold_ms: f64,
    /// Median time to first token when the same tenant sent the same
    /// prompt before, in milliseconds.
    pub cached_ms: f64,
    /// Prompt tokens the cached runs found in the cache.
    pub cached_tokens: usize,
}

/// Runs one request to its first token; the time it took and the prompt
/// tokens it found cached.
fn first_token(
    engine: &mut Engine,
    salt: crate::engine::Salt,
    prompt: &[u32],
) -> Result<(f64, usize), String> {
    let params = GenerateParams {
        max_tokens: 1,
        temperature: 0.0,
        ignore_eos: true,
        ..Default::default()
    };
    let t = Instant::now();
    let seq = engine.add_salted(TenantId(0), salt, prompt.to_vec(), params)?;
    let mut first = None;
    while engine.has_work() {
        for e in engine.step()? {
            match e {
                Event::Token { seq: s, .. } if s == seq && first.is_none() => {
                    first = Some(t.elapsed().as_secs_f64() * 1e3);
                }
                Event::Finished {
                    seq: s,
                    cached_tokens,
                    ..
                } if s == seq => {
                    return Ok((first.unwrap_or(0.0), cached_tokens));
                }
                _ => {}
            }
        }
    }
    Err("the request vanished".into())
}

/// Time to first token for a `prompt_tokens` prompt, cold (a fresh salt
/// each time, so nothing is cached) and cached (the same salt again),
/// alternating `reps` times on one engine.
pub fn ttft(
    loaded: Arc<Loaded>,
    config: EngineConfig,
    prompt_tokens: usize,
    reps: usize,
) -> Result<(TtftRow, Arc<Loaded>), String> {
    let vocab = loaded.model.config.vocab as u32;
    let mut engine = Engine::new(loaded, config)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(2);
    let (mut cold, mut cached, mut hit) = (Vec::new(), Vec::new(), 0);
    for rep in 0..reps.max(1) {
        let prompt: Vec<u32> = (0..prompt_tokens)
            .map(|_| rng.random_range(vocab / 8..vocab / 2))
            .collect();
        let mut bytes = [0u8; 32];
        bytes[..8].copy_from_slice(&(rep as u64).to_le_bytes());
        let salt = crate::engine::Salt::from_bytes(bytes);
        cold.push(first_token(&mut engine, salt, &prompt)?.0);
        let (ms, n) = first_token(&mut engine, salt, &prompt)?;
        cached.push(ms);
        hit = n;
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let row = TtftRow {
        prompt_tokens,
        cold_ms: median(&mut cold),
        cached_ms: median(&mut cached),
        cached_tokens: hit,
    };
    Ok((row, engine.into_loaded()))
}
