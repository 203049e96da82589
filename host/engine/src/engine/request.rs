//! A generation request's state: sampling settings, generated tokens, the
//! text produced so far and stop conditions.

use kiln_kernels::sample::SamplingParams;

use super::prefix::{PageHash, Salt};
use super::text::TextStream;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// What a caller asks for.
#[derive(Debug, Clone)]
pub struct GenerateParams {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Temperature (0 = greedy).
    pub temperature: f32,
    /// Top-k (0 = off).
    pub top_k: usize,
    /// Top-p (1 = off).
    pub top_p: f32,
    /// Sampling seed; random when absent.
    pub seed: Option<u64>,
    /// Generation stops before any of these strings.
    pub stop: Vec<String>,
    /// Keep generating past EOS (benchmarks).
    pub ignore_eos: bool,
    /// With `Some(n)`, each token comes with its log-probability and the
    /// `n` (at most [`super::MAX_TOP_LOGPROBS`]) most likely tokens' ([`Event`]'s
    /// `logprobs`).
    ///
    /// [`Event`]: super::Event
    pub logprobs: Option<usize>,
    /// What the output must be (any JSON object, or JSON a schema
    /// accepts); free text when `None`.
    pub format: Option<super::OutputFormat>,
}

/// Why `prompt` cannot run on a model of `vocab` embeddings whose engine
/// holds `max_len` tokens a sequence, if it cannot: empty, a token past the
/// embeddings (a tokenizer naming more tokens than the model has), or no
/// room left for a generated token.
pub fn check_prompt(prompt: &[u32], vocab: usize, max_len: usize) -> Result<(), String> {
    if prompt.is_empty() {
        return Err("the prompt is empty".into());
    }
    if let Some(id) = prompt.iter().find(|&&id| id as usize >= vocab) {
        return Err(format!(
            "the prompt holds token {id}, past the model's {vocab} embeddings"
        ));
    }
    if prompt.len() + 1 > max_len {
        return Err(format!(
            "the prompt has {} tokens; this model and KV pool hold at most {}",
            prompt.len(),
            max_len.saturating_sub(1)
        ));
    }
    Ok(())
}

/// A generated token's log-probability under the model (before
/// temperature, top-k or top-p) and the most likely tokens at its place.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The token generated.
    pub chosen: Logprob,
    /// The most likely tokens, most likely first (equal ones by id).
    pub top: Vec<Logprob>,
}

/// One token's natural-log probability.
#[derive(Debug, Clone, PartialEq)]
pub struct Logprob {
    /// The token id.
    pub id: u32,
    /// Its text alone (a piece of a character reads as U+FFFD).
    pub text: String,
    /// Its bytes (what a piece of a character really is).
    pub bytes: Vec<u8>,
    /// ln p.
    pub logprob: f32,
}

/// The server's defaults, defined here and nowhere else: `kiln run`'s flags,
/// guests' `kiln:ai` calls and the OpenAI-compatible API all fill in what a
/// caller leaves out with these.
impl GenerateParams {
    /// Tokens a call may generate when it does not say.
    pub const DEFAULT_MAX_TOKENS: usize = 256;
    /// Sampling temperature when a call does not say.
    pub const DEFAULT_TEMPERATURE: f32 = 0.7;
    /// Nucleus-sampling threshold when a call does not say.
    pub const DEFAULT_TOP_P: f32 = 0.9;
    /// Most stop strings a call may give (OpenAI's limit).
    pub const MAX_STOPS: usize = 4;
    /// Most bytes of one stop string: every token of the sequence
    /// searches its text for each, on the engine's thread, which every
    /// request of the pool shares.
    pub const MAX_STOP_BYTES: usize = 1024;

    /// Why `stop` is not a list of stop strings a call may give, if it
    /// is not: too many, or one too long (an empty one is ignored).
    pub fn check_stop(stop: &[String]) -> Result<(), String> {
        if stop.len() > Self::MAX_STOPS {
            return Err(format!(
                "{} stop strings given; at most {} are allowed",
                stop.len(),
                Self::MAX_STOPS
            ));
        }
        if let Some(s) = stop.iter().find(|s| s.len() > Self::MAX_STOP_BYTES) {
            return Err(format!(
                "a stop string has {} bytes; at most {} are allowed",
                s.len(),
                Self::MAX_STOP_BYTES
            ));
        }
        Ok(())
    }
}

impl Default for GenerateParams {
    fn default() -> Self {
        Self {
            max_tokens: Self::DEFAULT_MAX_TOKENS,
            temperature: Self::DEFAULT_TEMPERATURE,
            top_k: 0,
            top_p: Self::DEFAULT_TOP_P,
            seed: None,
            stop: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            format: None,
        }
    }
}

/// Why a generation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finish {
    /// EOS or a stop string.
    Stop,
    /// `max_tokens` reached (or the context is full).
    Length,
    /// Stopped by the engine, with the reason.
    Aborted(String),
}

/// A request inside the engine.
pub(super) struct Request {
    pub(super) prompt_len: usize,
    pub(super) tokens: Vec<u32>,
    pub(super) params: GenerateParams,
    pub(super) rng: ChaCha8Rng,
    /// The generated text and what of it has gone out.
    pub(super) text: TextStream,
    /// Prefix-cache salt; `None` bypasses the cache.
    pub(super) salt: Option<Salt>,
    /// Hashes of the full pages of `tokens` named so far.
    pub(super) hashes: Vec<PageHash>,
    /// Prompt tokens found in the prefix cache at first admission.
    pub(super) cached_tokens: Option<usize>,
    /// The output format's matcher, at the tokens generated so far.
    pub(super) matcher: Option<llguidance::Matcher>,
    /// Log-probabilities of tokens whose text has not gone out yet, each
    /// with where that text ends ([`TextStream::decoded`]).
    pub(super) held_logprobs: Vec<(usize, TokenLogprobs)>,
}

impl Request {
    pub(super) fn new(prompt: Vec<u32>, params: GenerateParams) -> Self {
        let rng = match params.seed {
            Some(s) => ChaCha8Rng::seed_from_u64(s),
            None => ChaCha8Rng::from_rng(&mut rand::rng()),
        };
        Self {
            prompt_len: prompt.len(),
            tokens: prompt,
            text: TextStream::new(&params.stop),
            params,
            rng,
            salt: None,
            hashes: Vec::new(),
            cached_tokens: None,
            matcher: None,
            held_logprobs: Vec::new(),
        }
    }

    pub(super) fn sampling(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.params.temperature,
            top_k: self.params.top_k,
            top_p: self.params.top_p,
        }
    }

    pub(super) fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }
}

#[cfg(test)]
mod tests {
    use super::GenerateParams;

    #[test]
    fn stop_lists_past_the_limits_are_refused_with_the_reason() {
        let ok = vec!["END".to_string(); GenerateParams::MAX_STOPS];
        assert_eq!(GenerateParams::check_stop(&ok), Ok(()));
        let longest = "x".repeat(GenerateParams::MAX_STOP_BYTES);
        assert_eq!(
            GenerateParams::check_stop(std::slice::from_ref(&longest)),
            Ok(())
        );
        let five = vec!["END".to_string(); GenerateParams::MAX_STOPS + 1];
        assert!(
            GenerateParams::check_stop(&five)
                .unwrap_err()
                .contains("at most 4")
        );
        let long = longest + "x";
        assert!(
            GenerateParams::check_stop(&[long])
                .unwrap_err()
                .contains("1025 bytes")
        );
        assert_eq!(GenerateParams::check_stop(&["".into()]), Ok(()));
    }
}
