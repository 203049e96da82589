//! What a step may carry while tenants compete, so every tenant's streams
//! see a step at most `target` times a lone decode step (the weights' read:
//! the step a stream sees with the GPU to itself): decode tokens and prompt
//! tokens, from a linear model of a step's device time fitted to what steps
//! measured.

use super::scheduler::{Contention, StepCaps};

/// Prompt tokens a step may carry: at least this many while streams decode
/// (so prompts always progress).
const MIN_PROMPT_TOKENS: usize = 64;

/// Weight of the newest measurement in the running means.
const NEW: f64 = 0.2;

/// A step's time as `lone + per_stream * (decodes - 1) + token * prompt
/// tokens`, each term measured.
#[derive(Debug, Clone)]
pub struct StepBudget {
    /// A step's time at most this many lone decode steps' (0: no target).
    target: f64,
    /// The most tokens a step computes.
    max: usize,
    /// Decode-only steps: mean time (ms) and mean streams.
    decode: Option<(f64, f64)>,
    /// The fastest decode-only step, ms: the lone step.
    lone_ms: Option<f64>,
    /// One prompt token's time, ms.
    token_ms: Option<f64>,
}

fn mean(old: Option<f64>, new: f64) -> Option<f64> {
    Some(old.map_or(new, |o| o + NEW * (new - o)))
}

impl StepBudget {
    /// A budget for steps of at most `max` tokens that keeps a step within
    /// `target` lone decode steps (0 turns it off).
    pub fn new(target: f64, max: usize) -> Self {
        Self {
            target,
            max,
            decode: None,
            lone_ms: None,
            token_ms: None,
        }
    }

    /// Records a step of `decodes` one-token sequences and `prompt_tokens`
    /// prompt tokens that took `ms` on the device.
    pub fn observe(&mut self, decodes: usize, prompt_tokens: usize, ms: f64) {
        if prompt_tokens == 0 {
            if decodes > 0 {
                let (m, n) = self.decode.unzip();
                self.decode = mean(m, ms).zip(mean(n, decodes as f64));
                self.lone_ms = Some(self.lone_ms.map_or(ms, |l| l.min(ms)));
            }
            return;
        }
        let base = match (decodes, self.decode_ms(decodes)) {
            (0, _) => 0.0,
            (_, Some(ms)) => ms,
            // Decodes of unknown cost would all count as prompt tokens'.
            (_, None) => return,
        };
        self.token_ms = mean(self.token_ms, (ms - base).max(0.0) / prompt_tokens as f64);
    }

    /// A decode-only step of `streams`, ms, from the model.
    fn decode_ms(&self, streams: usize) -> Option<f64> {
        Some(self.lone_ms? + self.per_stream()? * (streams.max(1) - 1) as f64)
    }

    /// One more stream's share of a decode step, ms: the mean decode step
    /// past the lone one, over its streams past one.
    fn per_stream(&self) -> Option<f64> {
        let ((mean_ms, mean_n), lone) = (self.decode?, self.lone_ms?);
        Some(if mean_n > 1.0 {
            ((mean_ms - lone) / (mean_n - 1.0)).max(0.0)
        } else {
            0.0
        })
    }

    /// Whether the target guards streams now: it is set, and tenants
    /// compete.
    pub fn guards(&self, now: Contention) -> bool {
        now.competing && self.target > 1.0
    }

    /// What the next step may carry: with competing tenants (another's
    /// streams to guard), a step of at most `target` lone steps, room kept
    /// for the floor of prompt tokens if some are waiting; otherwise every
    /// token.
    pub fn caps(&self, now: Contention) -> StepCaps {
        let Contention {
            streams, prompting, ..
        } = now;
        let whole = StepCaps {
            decodes: usize::MAX,
            prompt: self.max,
        };
        if !self.guards(now) {
            return whole;
        }
        let (Some(lone), Some(per), Some(token)) = (self.lone_ms, self.per_stream(), self.token_ms)
        else {
            return whole;
        };
        let limit = self.target * lone;
        let floor = MIN_PROMPT_TOKENS.min(self.max);
        let kept = if prompting { floor as f64 * token } else { 0.0 };
        let decodes = streams_within(limit - lone - kept, per);
        let spent = self.decode_ms(streams.min(decodes)).unwrap_or(lone);
        let prompt = if token > 0.0 {
            (((limit - spent) / token).max(0.0) as usize).clamp(floor, self.max)
        } else {
            self.max
        };
        StepCaps { decodes, prompt }
    }

    /// What the two lanes of a disaggregated step may carry: the decode
    /// lane's step holds no prompt tokens, so its decodes fill the whole
    /// target, known from decode steps alone; the prefill lane's step runs
    /// beside it on a stream of its own, within the token budget.
    pub fn caps_apart(&self, now: Contention) -> StepCaps {
        let whole = StepCaps {
            decodes: usize::MAX,
            prompt: self.max,
        };
        if !self.guards(now) {
            return whole;
        }
        let (Some(lone), Some(per)) = (self.lone_ms, self.per_stream()) else {
            return whole;
        };
        let decodes = streams_within((self.target - 1.0) * lone, per);
        StepCaps { decodes, ..whole }
    }
}

/// Streams a decode step holds within `room` ms beside its lone stream,
/// each costing `per` ms more (every stream if they cost nothing).
fn streams_within(room: f64, per: f64) -> usize {
    if per > 0.0 {
        ((room.max(0.0) / per) as usize).saturating_add(1)
    } else {
        usize::MAX
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tenants competing, `streams` decoding, prompts waiting.
    fn busy(streams: usize) -> Contention {
        Contention {
            competing: true,
            streams,
            prompting: true,
        }
    }

    /// A lone decode step of 10 ms, 0.1 ms more a stream, 0.04 ms a
    /// prompt token.
    fn measured(target: f64) -> StepBudget {
        let mut b = StepBudget::new(target, 2048);
        b.observe(1, 0, 10.0);
        b.observe(64, 0, 16.3);
        b.observe(64, 1000, 56.3);
        b
    }

    #[test]
    fn without_a_target_or_a_rival_a_step_takes_every_token() {
        let whole = StepCaps {
            decodes: usize::MAX,
            prompt: 2048,
        };
        assert_eq!(measured(0.0).caps(busy(200)), whole);
        assert_eq!(
            measured(2.0).caps(Contention {
                competing: false,
                ..busy(200)
            }),
            whole,
            "no rival"
        );
        let fresh = StepBudget::new(2.0, 2048);
        assert_eq!(fresh.caps(busy(200)), whole, "nothing measured yet");
    }

    #[test]
    fn a_step_keeps_within_the_target_of_a_lone_decode_step() {
        let b = measured(2.0);
        // 20 ms a step: 64 streams take 16.3, 3.7 ms is left for 92
        // prompt tokens; room for 75 streams beside the floor of 64.
        assert_eq!(
            b.caps(busy(64)),
            StepCaps {
                decodes: 75,
                prompt: 92
            }
        );
        // 200 streams: 75 of them a step, and the floor's worth of prompt.
        assert_eq!(
            b.caps(busy(200)),
            StepCaps {
                decodes: 75,
                prompt: 65
            }
        );
        // A looser target carries everything of a light step.
        assert_eq!(measured(10.0).caps(busy(8)).prompt, 2048);
    }

    #[test]
    fn streams_alone_keep_no_room_for_prompts_nobody_sent() {
        let idle = Contention {
            prompting: false,
            ..busy(200)
        };
        // 10 ms beside the lone step: 101 streams (100 at 0.1 ms more).
        assert_eq!(measured(2.0).caps(idle).decodes, 101);
    }

    #[test]
    fn disaggregated_decodes_fill_the_target_without_prompt_measurements() {
        // Decode steps only, as a disaggregated decode lane measures them.
        let mut b = StepBudget::new(1.325, 2048);
        b.observe(1, 0, 10.0);
        b.observe(64, 0, 16.3);
        assert_eq!(
            b.caps(busy(200)).decodes,
            usize::MAX,
            "mixed steps wait for prompts' cost"
        );
        // 3.25 ms beside the lone step: 32 streams more at 0.1 ms each.
        assert_eq!(
            b.caps_apart(busy(200)),
            StepCaps {
                decodes: 33,
                prompt: 2048
            }
        );
        let alone = Contention {
            competing: false,
            ..busy(200)
        };
        assert_eq!(b.caps_apart(alone).decodes, usize::MAX, "no rival");
        assert_eq!(
            StepBudget::new(1.325, 2048).caps_apart(busy(200)).decodes,
            usize::MAX,
            "nothing measured yet"
        );
    }

    #[test]
    fn a_mixed_step_before_any_decode_step_teaches_nothing() {
        let mut b = StepBudget::new(2.0, 2048);
        b.observe(64, 1000, 56.3);
        assert_eq!(b.token_ms, None, "its decodes' cost is unknown");
        b.observe(0, 1000, 40.0);
        assert_eq!(b.token_ms, Some(0.04));
    }

    #[test]
    fn the_model_follows_what_steps_measure() {
        let mut b = measured(2.0);
        for _ in 0..40 {
            // Prompt tokens got twice as dear: fewer fit.
            b.observe(0, 500, 40.0);
        }
        // The floor's 64 tokens now take 5.1 ms: 49 streams a step leave it.
        assert_eq!(
            b.caps(busy(64)),
            StepCaps {
                decodes: 49,
                prompt: 65
            }
        );
        // A faster lone step is the new reference; slower ones are not.
        b.observe(1, 0, 12.0);
        assert_eq!(b.lone_ms, Some(10.0));
        b.observe(1, 0, 8.0);
        assert_eq!(b.lone_ms, Some(8.0));
    }
}
