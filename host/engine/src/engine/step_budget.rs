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

    #[test]
    fn an_engine_step_is_observed_when_it_closes_and_only_if_it_ran_the_main_lane() {
        // A target none of these steps passes: the aim stays on it.
        let mut b = StepBudget::new(2.0, 2048);
        b.close(100.0, true);
        assert_eq!(b.lone_ms, None, "a step with nothing carried");
        b.carried(1, 0, None);
        assert_eq!(b.lone_ms, None, "observed before it closed");
        b.close(10.0, true);
        b.close(100.0, true);
        b.carried(64, 0, None);
        b.close(16.3, true);
        // As `measured`'s first two steps: caps from the closed times alone.
        let mut want = StepBudget::new(2.0, 2048);
        want.observe(1, 0, 10.0);
        want.observe(64, 0, 16.3);
        assert_eq!(b.caps_apart(busy(200)), want.caps_apart(busy(200)));
        assert_eq!(b.lone_ms, Some(10.0));
    }

    #[test]
    fn disaggregated_prefill_waits_until_the_decode_steps_beside_it_are_repaid() {
        // A lone step of 10 ms: the target allows 15, and the aim starts
        // there (the steps past it below bring it down by a few hundredths
        // of a millisecond each).
        let mut b = StepBudget::new(1.5, 2048);
        let mut step = |ms: f64, beside: bool, guarding: bool| {
            b.carried(1, 0, Some(beside));
            b.close(ms, guarding);
            b.prefill_due()
        };
        assert!(step(10.0, false, true));
        assert!(!step(19.0, true, true), "~4 ms over");
        assert!(!step(18.0, true, true), "~7 ms over");
        assert!(!step(12.0, false, true), "~3 ms repaid, ~4 owed");
        assert!(step(10.5, false, true), "repaid");
        // Steps alone past the aim still repay a tenth of a lone step.
        assert!(!step(19.0, true, true), "~4 ms over");
        let waits = (0..10).take_while(|_| !step(16.0, false, true)).count();
        assert_eq!(waits, 4, "a ms a step, ~4.1 owed");
        // What may be owed is bounded: eight lone steps.
        for _ in 0..50 {
            step(100.0, true, true);
        }
        let waits = (0..100).take_while(|_| !step(16.0, false, true)).count();
        assert_eq!(waits, 79);
        // Nothing is owed without a rival to guard, or with no stream
        // decoding, or without disaggregation.
        assert!(!step(40.0, true, true));
        assert!(step(40.0, true, false), "no rival");
        assert!(!step(40.0, true, true));
        b.close(1.0, true);
        assert!(b.prefill_due(), "no stream decoded");
        b.carried(1, 0, None);
        b.close(40.0, true);
        assert!(b.prefill_due(), "one lane");
    }

    /// One guarded engine step of `ms` on the main lane.
    fn closed(b: &mut StepBudget, ms: f64, beside: Option<bool>) -> f64 {
        b.carried(64, 0, beside);
        b.close(ms, true);
        b.aim
    }

    #[test]
    fn steps_past_the_target_bring_the_aim_under_it_and_back() {
        // A lone step of 10 ms; the target allows 15.
        let mut b = StepBudget::new(1.5, 2048);
        b.observe(1, 0, 10.0);
        assert_eq!(closed(&mut b, 14.0, Some(false)), 1.5);
        // Every step past the target, beside prefill or not: the aim comes
        // down to halfway, and no lower.
        let down: Vec<f64> = (0..200)
            .map(|i| closed(&mut b, 15.5, Some(i % 2 == 0)))
            .collect();
        assert!(down.windows(2).all(|w| w[1] <= w[0]), "{down:?}");
        assert!(down[0] < 1.5);
        assert_eq!(down[199], 1.25);
        // An unguarded step does not move it (a lone tenant has no caps).
        b.carried(64, 0, Some(false));
        b.close(30.0, false);
        assert_eq!(b.aim, 1.25);
        // Steps under the target bring it back up, less than half as fast.
        let up: Vec<f64> = (0..1000).map(|_| closed(&mut b, 12.0, None)).collect();
        assert!(up.windows(2).all(|w| w[1] >= w[0]), "{up:?}");
        assert!(up[99] < 1.5, "{}", up[99]);
        assert_eq!(up[999], 1.5);
    }

    #[test]
    fn a_target_of_one_lone_step_or_none_has_no_aim_to_steer() {
        for target in [0.0, 0.5, 1.0] {
            let mut b = StepBudget::new(target, 2048);
            b.observe(1, 0, 10.0);
            assert_eq!(closed(&mut b, 50.0, None), target, "target {target}");
        }
    }

    #[test]
    fn the_aim_settles_where_three_steps_in_ten_pass_the_target() {
        let run = |over: &[usize]| {
            let mut b = StepBudget::new(1.5, 2048);
            b.observe(1, 0, 10.0);
            for i in 0..2000 {
                closed(
                    &mut b,
                    if over.contains(&(i % 10)) { 16.0 } else { 14.0 },
                    None,
                );
            }
            b.aim
        };
        let half = run(&[0, 2, 4, 6, 8]);
        assert!(
            half < 1.26,
            "half the steps over: down to the floor, {half}"
        );
        assert_eq!(run(&[0]), 1.5, "one in ten over: at the target");
        let three = run(&[1, 4, 7]);
        assert!((1.48..=1.5).contains(&three), "three in ten: held, {three}");
        let four = run(&[1, 3, 5, 7]);
        assert!(four < 1.26, "four in ten: down, {four}");
    }

    #[test]
    fn steps_are_planned_to_the_aim() {
        let mut b = measured(2.0);
        b.aim = 1.5;
        // 15 ms a step: the floor of 64 prompt tokens takes 2.56 ms, 24
        // streams more the next 2.4, and 65 prompt tokens what is left.
        assert_eq!(
            b.caps(busy(64)),
            StepCaps {
                decodes: 25,
                prompt: 65
            }
        );
        // Disaggregated: 5 ms beside the lone step, 50 streams more.
        assert_eq!(b.caps_apart(busy(200)).decodes, 51);
    }
}
