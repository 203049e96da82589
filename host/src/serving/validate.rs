//! What a call must be before it reaches an engine: its parameters, its
//! prompt and its output format, each refused with the reason while the
//! caller can still get a clean error (before a stream's 200), and the
//! format compiled here, not on the engine's thread.

use std::sync::atomic::Ordering;

use kiln_runtime::{AiError, OutputFormat as Format, Params};

use super::engine_thread::PoolHandle;
use super::{Served, TOTAL_PAGES};
use crate::engine::{self, CompiledFormat, Formats, GenerateParams, OutputFormat, PAGE_SIZE};
use crate::model::ModelConfig;

impl Served {
    /// `format` compiled for this model and `tenant` (whose compiled
    /// formats are its own): before the call reaches an engine's thread,
    /// where compiling would hold up the pool's steps, and so that a
    /// format that cannot compile is refused before a stream starts.
    pub(super) fn compile(
        &self,
        tenant: &str,
        format: &OutputFormat,
    ) -> Result<CompiledFormat, AiError> {
        let formats = self
            .formats
            .get_or_init(|| Formats::new(&self.loaded.tokenizer, self.loaded.model.config.vocab));
        (formats.as_ref())
            .map_err(Clone::clone)
            .and_then(|f| f.compile(tenant, format))
            .map_err(AiError::InvalidInput)
    }
}

/// Why the prompt `ids` cannot run on a model of `config` served by
/// `pools`, if it cannot: empty, a token past the model's embeddings, or
/// longer than the model's context or the smallest pool's KV pages (the
/// engine's own checks, made here too so that a streamed call gets its
/// error before the stream's 200). A pool that has not yet published
/// its pages is left to the engine's check.
pub(super) fn check_prompt(
    ids: &[u32],
    config: &ModelConfig,
    pools: &[PoolHandle],
) -> Result<(), AiError> {
    let pages = (pools.iter())
        .map(|p| p.figures[TOTAL_PAGES].load(Ordering::Relaxed))
        .filter(|&n| n > 0)
        .min();
    let limit = pages.map_or(config.context_length, |n| {
        config.context_length.min(n * PAGE_SIZE)
    });
    engine::check_prompt(ids, config.vocab, limit).map_err(AiError::InvalidInput)
}

/// The WIT params with the host's defaults, validated.
pub(super) fn generate_params(p: Params) -> Result<GenerateParams, AiError> {
    let bad = |m: String| Err(AiError::InvalidInput(m));
    let temperature = p.temperature.unwrap_or(GenerateParams::DEFAULT_TEMPERATURE);
    if !(0.0..=2.0).contains(&temperature) {
        return bad(format!(
            "temperature {temperature} is out of range: use 0 (greedy) to 2"
        ));
    }
    let top_p = p.top_p.unwrap_or(GenerateParams::DEFAULT_TOP_P);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return bad(format!(
            "top-p {top_p} is out of range: use a value in (0, 1]"
        ));
    }
    let max_tokens = p
        .max_tokens
        .map_or(GenerateParams::DEFAULT_MAX_TOKENS, |n| n as usize);
    if max_tokens == 0 {
        return bad("max-tokens must be at least 1".into());
    }
    GenerateParams::check_stop(&p.stop).map_err(AiError::InvalidInput)?;
    let most = crate::engine::MAX_TOP_LOGPROBS;
    if let Some(n) = p.logprobs.filter(|n| usize::from(*n) > most) {
        return bad(format!("logprobs {n} is out of range: use 0 to {most}"));
    }
    Ok(GenerateParams {
        max_tokens,
        temperature,
        top_k: p.top_k.unwrap_or(0) as usize,
        top_p,
        seed: p.seed,
        stop: p.stop,
        ignore_eos: false,
        logprobs: p.logprobs.map(usize::from),
        format: p.format.map(output_format).transpose()?,
    })
}

/// The engine's form of a call's output format.
fn output_format(f: Format) -> Result<OutputFormat, AiError> {
    match f {
        Format::JsonObject => Ok(OutputFormat::JsonObject),
        Format::JsonSchema(text) => serde_json::from_str(&text)
            .map(OutputFormat::JsonSchema)
            .map_err(|e| AiError::InvalidInput(format!("the JSON schema is not JSON: {e}"))),
        Format::Grammar(g) => Ok(OutputFormat::Grammar(g)),
    }
}
