//! A generation request's state: sampling settings, generated tokens, the
//! text produced so far and stop conditions.

use kiln_kernels::sample::SamplingParams;

use super::prefix::{PageHash, Salt};
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
}

impl Default for GenerateParams {
    fn default() -> Self {
        Self {
            max_tokens: 256,
            temperature: 0.7,
            top_k: 0,
            top_p: 0.9,
            seed: None,
            stop: Vec::new(),
            ignore_eos: false,
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
    /// Text of the generated tokens decoded so far.
    pub(super) text: String,
    /// Bytes of `text` already handed out.
    pub(super) emitted: usize,
    /// Prefix-cache salt; `None` bypasses the cache.
    pub(super) salt: Option<Salt>,
    /// Hashes of the full pages of `tokens` named so far.
    pub(super) hashes: Vec<PageHash>,
    /// Prompt tokens found in the prefix cache at first admission.
    pub(super) cached_tokens: Option<usize>,
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
            params,
            rng,
            text: String::new(),
            emitted: 0,
            salt: None,
            hashes: Vec::new(),
            cached_tokens: None,
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

    /// Updates the text with the newest decode; returns whether a stop
    /// string was hit (the text is then cut before it).
    pub(super) fn update_text(&mut self, decoded: String) -> bool {
        self.text = decoded;
        let hit = self
            .params
            .stop
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| self.text.find(s.as_str()))
            .min();
        if let Some(at) = hit {
            self.text.truncate(at);
            return true;
        }
        false
    }

    /// Text that can be handed out now: everything new, except an
    /// incomplete UTF-8 tail and a tail that might start a stop string.
    pub(super) fn take_delta(&mut self, finished: bool) -> String {
        let mut end = self.text.len();
        if !finished {
            if self.text.ends_with('\u{FFFD}') {
                end -= '\u{FFFD}'.len_utf8();
            }
            for s in &self.params.stop {
                for k in (1..s.len()).rev() {
                    if s.is_char_boundary(k) && self.text[..end].ends_with(&s[..k]) {
                        end = end.min(self.text.len() - k);
                        break;
                    }
                }
            }
        }
        if end <= self.emitted {
            return String::new();
        }
        let d = self.text[self.emitted..end].to_owned();
        self.emitted = end;
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_cut_the_text_and_hold_back_partial_matches() {
        let params = GenerateParams {
            stop: vec!["END".into()],
            ..Default::default()
        };
        let mut r = Request::new(vec![1], params);
        assert!(!r.update_text("hello E".into()));
        assert_eq!(r.take_delta(false), "hello ");
        assert!(!r.update_text("hello EN".into()));
        assert_eq!(r.take_delta(false), "");
        assert!(r.update_text("hello ENDING".into()));
        assert_eq!(r.take_delta(true), "");
        assert_eq!(r.text, "hello ");
    }
}
