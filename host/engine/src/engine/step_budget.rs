//! What a step may carry while tenants compete, so every tenant's streams
//! see a step at most `target` times a lone decode step (the weights' read:
//! the step a stream sees with the GPU to itself): decode tokens and prompt
//! tokens, from a linear model of a step's time fitted to what steps
//! measured. A step is timed whole, as its streams wait for it: the host's
//! planning and bookkeeping, and with disaggregation the prefill lane's
//! launches between decode steps, count as the device's time does.
//!
//! What a stream's inter-token latency reads is its steps' median, and a
//! model fitted to means lands half its steps above whatever it plans for.
//! So steps are planned to an aim under the target, steered so that few
//! steps pass the target; disaggregated, the prefill lane is paced so that
//! the decode steps beside it are repaid, against the aim, by steps alone.

use super::scheduler::{Contention, StepCaps};

/// Prompt tokens a step may carry: at least this many while streams decode
/// (so prompts always progress).
const MIN_PROMPT_TOKENS: usize = 64;

/// Weight of the newest measurement in the running means.
const NEW: f64 = 0.2;

/// Disaggregated: the least a decode step with no prefill beside it repays
/// of what steps beside prefill owe, in lone steps (so prompts always
/// progress, even when decode steps alone fill the target).
const REPAY: f64 = 0.1;

/// Disaggregated: the most decode steps may owe, in lone steps (a prefill
/// step waits at most about this many lone steps' worth of repayment).
const MAX_OWED: f64 = 8.0;

/// The share of guarded steps that may pass the target: well under half,
/// so the streams' median step stays under it.
const OVER_SHARE: f64 = 0.3;

/// How far one step moves the aim, in lone steps per unit of surprise.
const AIM_STEP: f64 = 0.005;

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
    /// What the engine step under way carried on the main lane: decodes,
    /// prompt tokens and, disaggregated, whether a prefill step was in
    /// flight beside it; observed when [`Self::close`] times it.
    carried: Option<(usize, usize, Option<bool>)>,
    /// Disaggregated, while the target guards streams: ms by which decode
    /// steps beside a prefill step passed the aim, less what steps alone
    /// since repaid. The prefill lane launches only with none owed.
    owed: f64,
    /// What steps are planned to, in lone steps: between halfway to the
    /// target and the target, steered by how often steps pass the target.
    /// It is kept between bursts: the pool's steps stay what they were.
    aim: f64,
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
            carried: None,
            owed: 0.0,
            aim: target,
        }
    }

    /// Notes that the engine step under way ran `decodes` one-token
    /// sequences and `prompt_tokens` prompt tokens on the main lane, and,
    /// disaggregated (`beside` is `Some`), whether a prefill step was in
    /// flight beside it.
    pub fn carried(&mut self, decodes: usize, prompt_tokens: usize, beside: Option<bool>) {
        self.carried = Some((decodes, prompt_tokens, beside));
    }

    /// Ends an engine step that took `ms` whole: observes what it carried,
    /// if it ran a step on the main lane, and, while the target is
    /// `guarding` streams, steers the aim by it and, disaggregated, counts
    /// what it owes or repays.
    pub fn close(&mut self, ms: f64, guarding: bool) {
        let Some((decodes, prompt_tokens, beside)) = self.carried.take() else {
            // No stream decoded: none to guard.
            self.owed = 0.0;
            return;
        };
        self.observe(decodes, prompt_tokens, ms);
        if let (Some(lone), true) = (self.lone_ms, guarding) {
            self.steer(ms, lone);
        }
        let (Some(beside), Some(lone), true) = (beside, self.lone_ms, guarding) else {
            self.owed = 0.0;
            return;
        };
        let over = ms - self.aim * lone;
        let change = if beside {
            over
        } else {
            over.min(-REPAY * lone)
        };
        self.owed = (self.owed + change).clamp(0.0, MAX_OWED * lone);
    }

    /// Moves the aim after a guarded step of `ms` (a lone step takes
    /// `lone`): down when it passed the target, up when it did not, in
    /// proportions that settle where `OVER_SHARE` of steps pass it.
    fn steer(&mut self, ms: f64, lone: f64) {
        if self.target <= 1.0 {
            return; // no target below which to aim
        }
        let over = if ms > self.target * lone { 1.0 } else { 0.0 };
        let floor = 1.0 + (self.target - 1.0) / 2.0;
        self.aim = (self.aim + AIM_STEP * (OVER_SHARE - over)).clamp(floor, self.target);
    }

    /// Disaggregated: whether the prefill lane may launch its next step. A
    /// prefill step beside decode steps slows them, by more than the
    /// target allows when decodes alone nearly fill it: while the target
    /// guards streams, prefill waits until the decode steps beside the last
    /// one are repaid by steps alone, so the streams' steps keep to the aim
    /// on average.
    pub fn prefill_due(&self) -> bool {
        self.owed <= 0.0
    }

    /// Records a step of `decodes` one-token sequences and `prompt_tokens`
    /// prompt tokens that took `ms` whole.
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
    /// streams to guard), a step of at most the aim's lone steps, room kept
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
        let limit = self.aim * lone;
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
    /// aim, known from decode steps alone; the prefill lane's step runs
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
        let decodes = streams_within((self.aim - 1.0) * lone, per);
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
#[path = "step_budget_tests.rs"]
mod tests;
