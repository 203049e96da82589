//! `kiln bench`: prompt and decode throughput of the engine at several
//! concurrencies, measured side by side in one run.

use std::time::Instant;

use std::sync::Arc;

use rand::{Rng, SeedableRng};

use crate::engine::{
    Engine, EngineConfig, Event, Finish, GenerateParams, OutputFormat, PAGE_SIZE, TenantId,
};
use crate::model::Loaded;

/// One concurrency's figures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchRow {
    /// Sequences submitted at once.
    pub concurrency: usize,
    /// Most sequences the engine ran at once (what its KV memory and
    /// limits admitted).
    pub admitted: usize,
    /// Requests of the run's full length (the KV of the prompt and of every
    /// generated token but the last) the KV pool holds at once: its pages
    /// over the pages of one.
    /// Unlike `admitted`, it does not move with the order in which the
    /// sequences prefill and grow.
    pub holds: usize,
    /// Prompt tokens per second (all prompts, until every sequence has its
    /// first token).
    pub prompt_tok_s: f64,
    /// Tokens per second in steps that only decoded (no prefill chunk).
    pub decode_tok_s: f64,
    /// Decode tokens per second over the decode-only steps that ran at
    /// least 90% of the largest such batch: the engine at its fullest,
    /// without the ramp while prompts are admitted and the tail while
    /// sequences finish.
    pub full_tok_s: f64,
    /// Every generated token over the whole run's time, prefill included.
    pub output_tok_s: f64,
    /// Median time between a sequence's tokens, in ms: every step that
    /// decoded, including those that also ran someone's prefill chunk.
    pub itl_p50_ms: f64,
    /// 95th percentile of the same.
    pub itl_p95_ms: f64,
    /// Median step that only decoded, in ms.
    pub decode_step_ms: f64,
    /// Median host time of those steps, in ms: the step less the time it
    /// waited on the device (scheduling, KV bookkeeping, gathering the
    /// inputs), while the device idles.
    pub host_ms: f64,
    /// With `integrity_ab`: median decode-only step with the page-tag check
    /// on and off (alternate steps once every sequence has its first
    /// token), in ms.
    pub check_on_off_ms: Option<(f64, f64)>,
    /// Bytes a decode-only step must move at the mean decode context:
    /// weights once, plus every running sequence's KV.
    pub step_bytes: f64,
    /// Mean sequences per decode-only step.
    pub mean_batch: f64,
    /// Every step of the run, in order.
    pub steps: Vec<StepTrace>,
}

impl BenchRow {
    /// The header of [`BenchRow::table_line`]'s columns.
    pub const TABLE_HEADER: &'static str = "    kv  conc admitted holds prompt t/s decode t/s   full t/s \
        output t/s  ITL p50  ITL p95  step ms host ms  batch      check on/off ms ideal ms \
        roofline";

    /// The row as one line of the bench table, labelled `label` (format and
    /// mode); with the device's copy bandwidth (GB/s), the roofline: the
    /// bytes a decode-only step must move over it, against the measured
    /// decode-only step.
    pub fn table_line(&self, label: &str, copy_gb_s: Option<f64>) -> String {
        let check = self.check_on_off_ms.map_or("-".into(), |(on, off)| {
            format!("{on:.2}/{off:.2} {:+.1}%", (on / off - 1.0) * 100.0)
        });
        let ideal = copy_gb_s.map(|b| self.step_bytes / (b * 1e9) * 1e3);
        format!(
            "{:>6} {:>5} {:>8} {:>5} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>8.2} {:>8.2} {:>8.2} {:>7.2} {:>6.1} {:>20} {:>8} {:>8}",
            label,
            self.concurrency,
            self.admitted,
            self.holds,
            self.prompt_tok_s,
            self.decode_tok_s,
            self.full_tok_s,
            self.output_tok_s,
            self.itl_p50_ms,
            self.itl_p95_ms,
            self.decode_step_ms,
            self.host_ms,
            self.mean_batch,
            check,
            ideal.map_or("-".into(), |i| format!("{i:.2}")),
            ideal.map_or("-".into(), |i| format!(
                "{:.0}%",
                i / self.decode_step_ms * 100.0
            )),
        )
    }

    /// Writes [`BenchRow::steps`] to `path` as CSV.
    pub fn write_trace(&self, path: &std::path::Path) -> std::io::Result<()> {
        let mut csv = vec![StepTrace::CSV_HEADER.to_string()];
        csv.extend(self.steps.iter().enumerate().map(|(i, s)| s.csv(i)));
        std::fs::write(path, csv.join("\n") + "\n")
    }
}

/// One engine step of a bench run.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct StepTrace {
    /// Sequences in the step (0: the call ran no forward pass).
    pub seqs: usize,
    /// Tokens the step computed (more than `seqs` when it ran a prefill
    /// chunk).
    pub tokens: usize,
    /// Wall time of the step, in ms.
    pub ms: f64,
    /// Of which the host waited on the device, in ms.
    pub device_ms: f64,
    /// Sequences preempted during the step.
    pub preempted: u64,
}

impl StepTrace {
    /// The CSV header matching [`StepTrace::csv`].
    pub const CSV_HEADER: &'static str = "step,seqs,tokens,ms,device_ms,preempted";

    /// One CSV line for step `i`.
    pub fn csv(&self, i: usize) -> String {
        format!(
            "{i},{},{},{:.3},{:.3},{}",
            self.seqs, self.tokens, self.ms, self.device_ms, self.preempted
        )
    }
}

/// What to run.
#[derive(Debug, Clone, Copy)]
pub struct BenchSpec {
    /// Sequences submitted at once.
    pub concurrency: usize,
    /// Prompt tokens per sequence.
    pub prompt_tokens: usize,
    /// Tokens generated per sequence.
    pub gen_tokens: usize,
    /// Run the page-tag check on every other decode step only, timing
    /// both kinds of step side by side.
    pub integrity_ab: bool,
    /// Generate under an output format that never completes (a JSON array
    /// of records), so every token is drawn through its mask.
    pub constrained: bool,
}

/// The format of a constrained bench run: JSON that may go on for ever.
fn endless_json() -> OutputFormat {
    OutputFormat::JsonSchema(serde_json::json!({
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
        },
    }))
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Tokens per second over the steps (tokens, ms) whose batch is at least
/// 90% of the largest.
fn full_rate(steps: &[(usize, f64)]) -> f64 {
    let fullest = steps.iter().map(|s| s.0).max().unwrap_or(0);
    let (tokens, ms) = steps
        .iter()
        .filter(|s| s.0 * 10 >= fullest * 9)
        .fold((0usize, 0.0f64), |(t, m), s| (t + s.0, m + s.1));
    tokens as f64 / (ms / 1e3).max(1e-9)
}

/// Runs `concurrency` sequences of `prompt_tokens` random tokens, each
/// generating `gen_tokens` (EOS ignored), on a fresh engine.
pub fn run(
    loaded: Arc<Loaded>,
    config: EngineConfig,
    spec: BenchSpec,
) -> Result<(BenchRow, Arc<Loaded>), String> {
    let BenchSpec {
        concurrency,
        prompt_tokens,
        gen_tokens,
        integrity_ab,
        constrained,
    } = spec;
    let vocab = loaded.model.config.vocab as u32;
    let check = config.integrity;
    let mut engine = Engine::new(loaded, config)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let params = GenerateParams {
        max_tokens: gen_tokens,
        temperature: 0.0,
        ignore_eos: true,
        format: constrained.then(endless_json),
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
    let (mut itl, mut decode_steps, mut on, mut off, mut host) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // (tokens, ms) of each decode-only step.
    let mut rates: Vec<(usize, f64)> = Vec::new();
    let (mut generated, mut admitted, mut decode_tokens) = (0usize, 0, 0usize);
    let mut checked = true;
    let mut trace = Vec::new();
    while engine.has_work() {
        let alternating = integrity_ab && check && first_token_all.is_some();
        if alternating {
            checked = !checked;
            engine.set_integrity(checked);
        }
        let before = engine.stats();
        let t = Instant::now();
        let events = engine.step()?;
        let elapsed = t.elapsed().as_secs_f64() * 1e3;
        admitted = admitted.max(engine.running());
        let stats = engine.stats();
        // A call that ran no forward pass leaves the last step's figures.
        let ran = stats.steps > before.steps;
        let preempted = stats.preemptions - before.preemptions;
        trace.push(StepTrace {
            seqs: if ran { stats.last_step_seqs } else { 0 },
            tokens: if ran { stats.last_step_tokens } else { 0 },
            ms: elapsed,
            device_ms: if ran {
                stats.last_step_device_us as f64 / 1e3
            } else {
                0.0
            },
            preempted,
        });
        let mut decoded = 0;
        for e in events {
            match e {
                Event::Token {
                    seq,
                    token: Some(_),
                    ..
                } => {
                    let n = seen.entry(seq).or_insert(0usize);
                    if *n > 0 {
                        decoded += 1;
                    }
                    *n += 1;
                    generated += 1;
                }
                // A lost sequence would make the figures lie.
                Event::Finished {
                    finish: Finish::Aborted(why),
                    ..
                } => return Err(format!("a bench sequence was aborted: {why}")),
                _ => {}
            }
        }
        if first_token_all.is_none() && seen.len() == concurrency {
            first_token_all = Some(start.elapsed());
        }
        if decoded == 0 {
            continue;
        }
        itl.push(elapsed);
        if stats.last_step_tokens == stats.last_step_seqs {
            decode_steps.push(elapsed);
            host.push(elapsed - stats.last_step_device_us as f64 / 1e3);
            rates.push((decoded, elapsed));
            decode_tokens += decoded;
            if alternating {
                if checked { &mut on } else { &mut off }.push(elapsed);
            }
        }
    }
    let total = start.elapsed();
    let prefill = first_token_all.unwrap_or(total);
    let decode_time: f64 = decode_steps.iter().sum::<f64>() / 1e3;
    let mean_batch = decode_tokens as f64 / decode_steps.len().max(1) as f64;
    for v in [&mut itl, &mut decode_steps, &mut on, &mut off, &mut host] {
        v.sort_by(f64::total_cmp);
    }
    let context = (prompt_tokens + gen_tokens / 2) as f64;
    let full_tok_s = full_rate(&rates);
    let row = BenchRow {
        concurrency,
        admitted,
        // KV for every token but the last generated, which is never fed.
        holds: engine.total_pages()
            / (prompt_tokens + gen_tokens)
                .saturating_sub(1)
                .div_ceil(PAGE_SIZE)
                .max(1),
        prompt_tok_s: (concurrency * prompt_tokens) as f64 / prefill.as_secs_f64(),
        decode_tok_s: decode_tokens as f64 / decode_time.max(1e-9),
        full_tok_s,
        output_tok_s: generated as f64 / total.as_secs_f64(),
        itl_p50_ms: percentile(&itl, 0.5),
        itl_p95_ms: percentile(&itl, 0.95),
        decode_step_ms: percentile(&decode_steps, 0.5),
        host_ms: percentile(&host, 0.5),
        check_on_off_ms: (integrity_ab && check && !on.is_empty())
            .then(|| (percentile(&on, 0.5), percentile(&off, 0.5))),
        step_bytes: engine.weight_bytes() as f64
            + mean_batch * context * engine.kv_bytes_per_token() as f64,
        mean_batch,
        steps: trace,
    };
    Ok((row, engine.into_loaded()))
}

/// The device's copy bandwidth in GB/s (on a GPU), for rooflines.
pub fn copy_bandwidth(loaded: Arc<Loaded>, config: EngineConfig) -> (Option<f64>, Arc<Loaded>) {
    match Engine::new(loaded.clone(), config) {
        Ok(e) => {
            let bw = e.copy_bandwidth();
            (bw, e.into_loaded())
        }
        Err(_) => (None, loaded),
    }
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
    /// Every run in order, cold and cached alternating: its time to first
    /// token and the wall time of each engine step it took, in ms.
    pub runs: Vec<(f64, Vec<f64>)>,
}

/// One request's run to its first token.
struct FirstToken {
    /// Time to the first token, in ms.
    ms: f64,
    /// Prompt tokens found cached.
    cached: usize,
    /// Wall time of each engine step, in ms.
    steps: Vec<f64>,
}

/// Runs one request to its first token.
fn first_token(
    engine: &mut Engine,
    salt: crate::engine::Salt,
    prompt: &[u32],
) -> Result<FirstToken, String> {
    let params = GenerateParams {
        max_tokens: 1,
        temperature: 0.0,
        ignore_eos: true,
        ..Default::default()
    };
    let t = Instant::now();
    let seq = engine.add_salted(TenantId(0), salt, prompt.to_vec(), params)?;
    let (mut first, mut steps) = (None, Vec::new());
    while engine.has_work() {
        let s0 = Instant::now();
        let events = engine.step()?;
        steps.push(s0.elapsed().as_secs_f64() * 1e3);
        for e in events {
            match e {
                Event::Token { seq: s, .. } if s == seq && first.is_none() => {
                    first = Some(t.elapsed().as_secs_f64() * 1e3);
                }
                Event::Finished {
                    seq: s,
                    cached_tokens,
                    ..
                } if s == seq => {
                    return Ok(FirstToken {
                        ms: first.unwrap_or(0.0),
                        cached: cached_tokens,
                        steps,
                    });
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
    let (mut cold, mut cached, mut hit, mut runs) = (Vec::new(), Vec::new(), 0, Vec::new());
    for rep in 0..reps.max(1) {
        let prompt: Vec<u32> = (0..prompt_tokens)
            .map(|_| rng.random_range(vocab / 8..vocab / 2))
            .collect();
        let mut bytes = [0u8; 32];
        bytes[..8].copy_from_slice(&(rep as u64).to_le_bytes());
        let salt = crate::engine::Salt::from_bytes(bytes);
        let c = first_token(&mut engine, salt, &prompt)?;
        cold.push(c.ms);
        runs.push((c.ms, c.steps));
        let w = first_token(&mut engine, salt, &prompt)?;
        cached.push(w.ms);
        hit = w.cached;
        runs.push((w.ms, w.steps));
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
        runs,
    };
    Ok((row, engine.into_loaded()))
}

#[cfg(test)]
mod tests {
    use super::{BenchRow, full_rate};

    #[test]
    fn table_lines_line_up_with_the_header() {
        let row = BenchRow {
            concurrency: 256,
            admitted: 232,
            holds: 198,
            prompt_tok_s: 20225.0,
            decode_tok_s: 11297.0,
            full_tok_s: 15883.4,
            output_tok_s: 4339.6,
            itl_p50_ms: 13.21,
            itl_p95_ms: 74.69,
            decode_step_ms: 11.26,
            host_ms: 0.39,
            check_on_off_ms: Some((6.17, 6.15)),
            step_bytes: 24e9,
            mean_batch: 115.9,
            steps: Vec::new(),
        };
        let line = row.table_line("fp8+g", Some(4235.0));
        assert_eq!(line.len(), BenchRow::TABLE_HEADER.len(), "{line}");
        assert!(line.ends_with("5.67      50%"), "{line}");
        assert!(BenchRow::TABLE_HEADER.starts_with("    kv  conc admitted holds"));
    }

    #[test]
    fn full_rate_counts_only_steps_near_the_largest_batch() {
        // A ramp (10, 50), the full batch (100 and 95 in 10 ms each) and a
        // tail (40, 5): only the two full steps count.
        let steps = [
            (10, 5.0),
            (50, 7.0),
            (100, 10.0),
            (95, 10.0),
            (40, 6.0),
            (5, 5.0),
        ];
        assert_eq!(full_rate(&steps), 195.0 / 0.020);
        assert_eq!(full_rate(&[]), 0.0);
    }
}
