//! The step budget's caps, aim and pacing, on measured step times.

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
