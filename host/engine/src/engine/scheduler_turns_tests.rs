//! Who waits on a step: competing tenants and decode turns.

use super::tests::cfg;
use super::*;

#[test]
fn another_tenants_prompts_or_streams_call_for_the_step_target() {
    let mut kv = KvCacheManager::new(64, 16);
    let mut s = Scheduler::new(cfg(64, 16));
    for id in 1..=2 {
        s.add(id, TenantId(1), 4, Vec::new());
    }
    s.schedule(&mut kv, StepCaps::NONE);
    for id in 1..=2 {
        s.append_token(id);
    }
    assert!(!s.decoding_beside_others(), "tenant 1 streams alone");
    s.add(5, TenantId(1), 40, Vec::new());
    assert!(
        !s.decoding_beside_others(),
        "tenant 1's own prompt beside its own streams"
    );
    s.add(9, TenantId(2), 40, Vec::new());
    assert!(s.decoding_beside_others(), "tenant 2's prompt queued");
    // Tenant 2's prompt running (not queued) still counts; once every
    // prompt is done, only streams remain.
    s.schedule(&mut kv, StepCaps::NONE);
    for id in 1..=2 {
        s.append_token(id);
    }
    assert!(s.decoding_beside_others(), "tenant 2's prompt mid-prefill");
    s.remove(5);
    s.remove(9);
    assert!(!s.decoding_beside_others());
    // Two tenants' streams: each slows the other's, prompts or not.
    let (mut kv, mut two) = (KvCacheManager::new(64, 16), Scheduler::new(cfg(64, 16)));
    two.add(1, TenantId(1), 4, Vec::new());
    two.add(2, TenantId(2), 4, Vec::new());
    two.schedule(&mut kv, StepCaps::NONE);
    two.append_token(1);
    two.append_token(2);
    assert!(two.decoding_beside_others());
}

/// Streams of `per_tenant[t]` sequences of tenant `t + 1`, all decoding.
fn streams(per_tenant: &[usize]) -> (KvCacheManager, Scheduler) {
    let mut kv = KvCacheManager::new(256, 16);
    let mut s = Scheduler::new(cfg(256, 64));
    let mut id = 0;
    for (t, n) in per_tenant.iter().enumerate() {
        for _ in 0..*n {
            s.add(id, TenantId(t as u32 + 1), 4, Vec::new());
            id += 1;
        }
    }
    s.schedule(&mut kv, StepCaps::NONE);
    for i in 0..id {
        s.append_token(i);
    }
    (kv, s)
}

/// The sequences one step with at most `decodes` decode tokens runs.
fn decode_step(s: &mut Scheduler, kv: &mut KvCacheManager, decodes: usize) -> Vec<SeqId> {
    let caps = StepCaps {
        decodes,
        ..StepCaps::NONE
    };
    let ran: Vec<SeqId> = s
        .schedule(kv, caps)
        .scheduled
        .iter()
        .map(|x| x.seq)
        .collect();
    for id in &ran {
        s.append_token(*id);
    }
    ran
}

#[test]
fn capped_decodes_go_to_every_tenant_and_take_turns_within_one() {
    // Tenant 1 streams 6 sequences (0-5), tenant 2 one (6); 3 decodes a
    // step: tenant 2's stream runs every step, tenant 1's two at a time,
    // each once in three steps, longest unserved first.
    let (mut kv, mut s) = streams(&[6, 1]);
    assert_eq!(s.contention().streams, 7);
    let steps: Vec<Vec<SeqId>> = (0..3).map(|_| decode_step(&mut s, &mut kv, 3)).collect();
    assert_eq!(steps, [vec![0, 1, 6], vec![2, 3, 6], vec![4, 5, 6]]);
    assert_eq!(decode_step(&mut s, &mut kv, 3), [0, 1, 6], "round again");
    // Uncapped, every stream decodes.
    assert_eq!(decode_step(&mut s, &mut kv, usize::MAX).len(), 7);
}

#[test]
fn capped_decodes_follow_the_weights_and_never_skip_a_tenant() {
    // Weights 3 : 1 : 1, streams 8, 8 and 1 (ids 0-7, 8-15, 16), 9 decodes
    // a step: tenant 3's one, then 6 and 2.
    let (mut kv, mut s) = streams(&[8, 8, 1]);
    s.set_weight(TenantId(1), 3);
    let ran = decode_step(&mut s, &mut kv, 9);
    let count = |lo, hi| ran.iter().filter(|id| (lo..hi).contains(*id)).count();
    assert_eq!((count(0, 8), count(8, 16), count(16, 17)), (6, 2, 1));
    // A cap below the tenants' count still runs one stream of each.
    let (mut kv, mut s) = streams(&[3, 3, 1]);
    assert_eq!(decode_step(&mut s, &mut kv, 1).len(), 3);
}

#[test]
fn turns_that_would_spare_no_tenant_are_not_taken() {
    // Two tenants of 8 streams and a cap of 8: each over its share, so
    // turns would only slow every stream; all 16 decode.
    let (mut kv, mut s) = streams(&[8, 8]);
    assert_eq!(decode_step(&mut s, &mut kv, 8).len(), 16);
}

#[test]
fn an_uneven_splits_remainder_goes_round_the_tenants() {
    // Streams 4, 4 and 1 (ids 0-3, 4-7, 8), 6 decodes a step: tenant 3's
    // one, 5 left for two tenants; the odd one is not always tenant 1's.
    let (mut kv, mut s) = streams(&[4, 4, 1]);
    let (mut first, mut second) = (0, 0);
    for _ in 0..3 {
        let ran = decode_step(&mut s, &mut kv, 6);
        assert_eq!(ran.len(), 6);
        first += ran.iter().filter(|id| **id < 4).count();
        second += ran.iter().filter(|id| (4..8).contains(*id)).count();
    }
    assert!(first > 6 && second > 6, "{first} and {second} of 15");
}

#[test]
fn a_stream_just_out_of_its_prompt_waits_behind_the_others() {
    // Tenant 1: streams 0-3 decoding, then prompt 9 finishes and joins
    // them; tenant 2's lone stream (5) makes turns worth taking.
    let mut kv = KvCacheManager::new(256, 16);
    let mut s = Scheduler::new(cfg(256, 64));
    for id in 0..4 {
        s.add(id, TenantId(1), 4, Vec::new());
    }
    s.add(5, TenantId(2), 4, Vec::new());
    s.schedule(&mut kv, StepCaps::NONE);
    for id in [0, 1, 2, 3, 5] {
        s.append_token(id);
    }
    // Streams 0 and 1 decode; then 9's prompt samples its first token.
    assert_eq!(decode_step(&mut s, &mut kv, 3), [0, 1, 5]);
    s.add(9, TenantId(1), 4, Vec::new());
    assert_eq!(decode_step(&mut s, &mut kv, 3), [2, 3, 5, 9]);
    // 0 and 1 waited longest; 9 sampled last step, so it waits.
    assert_eq!(decode_step(&mut s, &mut kv, 3), [0, 1, 5]);
}
