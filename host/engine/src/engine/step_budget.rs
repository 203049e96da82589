//! How many prompt tokens a step may carry while streams decode, so their
//! inter-token latency stays near `target` times a decode step's: the
//! decode step's time and a prompt token's cost, each a running mean of
//! what steps measured on the device.

/// Prompt tokens a step may carry: at least this many while streams decode
/// (so prompts always progress).
const MIN_PROMPT_TOKENS: usize = 64;

/// Weight of the newest measurement in the running means.
const NEW: f64 = 0.2;

/// The prompt-token budget of a step under a time target.
#[derive(Debug, Clone)]
pub struct StepBudget {
    /// A step's time at most this many decode steps' (0: no target).
    target: f64,
    /// The most tokens a step computes.
    max: usize,
    /// A decode-only step's time, ms.
    decode_ms: Option<f64>,
    /// One prompt token's time, ms.
    token_ms: Option<f64>,
}

fn mean(old: Option<f64>, new: f64) -> Option<f64> {
    Some(old.map_or(new, |o| o + NEW * (new - o)))
}

impl StepBudget {
    /// A budget for steps of at most `max` tokens that keeps a step within
    /// `target` decode steps (0 turns it off).
    pub fn new(target: f64, max: usize) -> Self {
        Self {
            target,
            max,
            decode_ms: None,
            token_ms: None,
        }
    }

    /// Records a step of `decodes` one-token sequences and `prompt_tokens`
    /// prompt tokens that took `ms` on the device.
    pub fn observe(&mut self, decodes: usize, prompt_tokens: usize, ms: f64) {
        if prompt_tokens == 0 {
            if decodes > 0 {
                self.decode_ms = mean(self.decode_ms, ms);
            }
            return;
        }
        let base = if decodes > 0 {
            self.decode_ms.unwrap_or(0.0)
        } else {
            0.0
        };
        self.token_ms = mean(self.token_ms, (ms - base).max(0.0) / prompt_tokens as f64);
    }

    /// Prompt tokens the next step may carry; `decoding` says whether some
    /// stream decodes in it (with none, a step may be as long as it likes).
    pub fn prompt_tokens(&self, decoding: bool) -> usize {
        if !decoding || self.target <= 1.0 {
            return self.max;
        }
        match (self.decode_ms, self.token_ms) {
            (Some(d), Some(t)) if t > 0.0 => {
                let fit = (self.target - 1.0) * d / t;
                (fit as usize).clamp(MIN_PROMPT_TOKENS.min(self.max), self.max)
            }
            _ => self.max,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_target_or_a_stream_a_step_takes_every_token() {
        let mut off = StepBudget::new(0.0, 2048);
        off.observe(10, 0, 10.0);
        off.observe(10, 1000, 50.0);
        assert_eq!(off.prompt_tokens(true), 2048);
        let on = StepBudget::new(2.0, 2048);
        assert_eq!(on.prompt_tokens(true), 2048, "nothing measured yet");
        assert_eq!(on.prompt_tokens(false), 2048);
    }

    #[test]
    fn prompt_tokens_fill_the_time_the_target_leaves_beside_the_decodes() {
        let mut b = StepBudget::new(2.0, 2048);
        // Decode steps of 10 ms; a mixed step of 1000 prompt tokens took
        // 50 ms, so a token costs 0.04 ms: 10 ms more fit 250 tokens.
        b.observe(64, 0, 10.0);
        b.observe(64, 1000, 50.0);
        assert_eq!(b.prompt_tokens(true), 250);
        assert_eq!(b.prompt_tokens(false), 2048, "no stream to protect");
        // A looser target fits more; the floor keeps prompts moving.
        let mut loose = b.clone();
        loose.target = 5.0;
        assert_eq!(loose.prompt_tokens(true), 1000);
        let mut tight = b;
        tight.target = 1.1;
        assert_eq!(tight.prompt_tokens(true), MIN_PROMPT_TOKENS);
    }

    #[test]
    fn the_means_follow_what_steps_measure() {
        let mut b = StepBudget::new(2.0, 4096);
        b.observe(8, 0, 10.0);
        b.observe(8, 1000, 50.0);
        assert_eq!(b.prompt_tokens(true), 250);
        for _ in 0..40 {
            // Prompt tokens got twice as dear: the budget halves.
            b.observe(0, 500, 40.0);
        }
        assert_eq!(b.prompt_tokens(true), 125);
    }
}
