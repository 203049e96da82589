//! The scheduler's planning: chunks, prefix hits, preemption, fairness
//! (short of pages: scheduler_pages_tests.rs).

use std::collections::BTreeMap;

use super::*;

pub(crate) fn cfg(tokens: usize, running: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_tokens_per_step: tokens,
        max_running: running,
        step_target: 0.0,
    }
}

#[test]
fn long_prompts_are_prefilled_in_chunks_then_decoded() {
    let mut kv = KvCacheManager::new(16, 16);
    let mut s = Scheduler::new(cfg(32, 8));
    s.add(1, TenantId(0), 70, Vec::new());
    let plan: Vec<_> = (0..3)
        .map(|_| s.schedule(&mut kv, StepCaps::NONE).scheduled[0].clone())
        .collect();
    assert_eq!(
        plan.iter()
            .map(|p| (p.start, p.count, p.sample))
            .collect::<Vec<_>>(),
        vec![(0, 32, false), (32, 32, false), (64, 6, true)]
    );
    s.append_token(1);
    let next = s.schedule(&mut kv, StepCaps::NONE).scheduled[0].clone();
    assert_eq!((next.start, next.count, next.sample), (70, 1, true));
}

#[test]
fn flooding_tenant_cannot_starve_another_tenants_single_request() {
    let mut kv = KvCacheManager::new(64, 16);
    let mut s = Scheduler::new(cfg(64, 4));
    for i in 0..20 {
        s.add(i, TenantId(1), 16, Vec::new());
    }
    s.add(100, TenantId(2), 16, Vec::new());
    let first = s.schedule(&mut kv, StepCaps::NONE);
    let ids: Vec<_> = first.scheduled.iter().map(|x| x.seq).collect();
    assert!(
        ids.contains(&100),
        "tenant 2 admitted in the first step: {ids:?}"
    );
}

#[test]
fn cached_prompt_pages_are_skipped_and_a_full_hit_recomputes_only_the_last_token() {
    let mut kv = KvCacheManager::new(8, 16);
    let mut s = Scheduler::new(cfg(256, 8));
    let t = TenantId(1);
    s.add(1, t, 32, vec![5, 6]);
    let first = s.schedule(&mut kv, StepCaps::NONE);
    assert_eq!(first.prefix_hits, vec![(1, 0)]);
    kv.cache_pages(1, &[5, 6], 32);
    s.remove(1);
    kv.free(1);
    // Same 32-token prompt: both pages hit, only position 31 is run,
    // and its KV is not rewritten into the shared page.
    s.add(2, t, 32, vec![5, 6]);
    let full = s.schedule(&mut kv, StepCaps::NONE);
    assert_eq!(full.prefix_hits, vec![(2, 31)]);
    assert_eq!(
        full.scheduled,
        vec![Scheduled {
            seq: 2,
            start: 31,
            count: 1,
            sample: true,
            write_kv: false
        }]
    );
    // A longer prompt sharing the first page computes from token 16.
    s.add(3, t, 40, vec![5, 9]);
    let part = s.schedule(&mut kv, StepCaps::NONE);
    let p = &part.scheduled[0];
    assert_eq!((p.seq, p.start, p.count, p.write_kv), (3, 16, 24, true));
}

#[test]
fn pool_exhaustion_preempts_and_readmits_by_recompute() {
    let mut kv = KvCacheManager::new(2, 16);
    let mut s = Scheduler::new(cfg(64, 8));
    s.add(1, TenantId(1), 16, Vec::new());
    s.add(2, TenantId(2), 16, Vec::new());
    let out = s.schedule(&mut kv, StepCaps::NONE);
    assert_eq!(out.scheduled.len(), 2);
    assert_eq!(kv.num_free(), 0);
    // Both grow past their page: the newer one is preempted.
    s.append_token(1);
    s.append_token(2);
    let out = s.schedule(&mut kv, StepCaps::NONE);
    assert_eq!(out.preempted, vec![2]);
    assert_eq!(
        out.scheduled.iter().map(|x| x.seq).collect::<Vec<_>>(),
        vec![1]
    );
    s.remove(1);
    kv.free(1);
    let out = s.schedule(&mut kv, StepCaps::NONE);
    // Recompute from scratch: prompt and the generated token.
    assert_eq!(
        out.scheduled,
        vec![Scheduled {
            seq: 2,
            start: 0,
            count: 17,
            sample: true,
            write_kv: true,
        }]
    );
}

#[test]
fn fair_shares_give_small_claims_all_they_ask_and_split_the_rest_evenly() {
    let even = |budget, demands: &[usize]| fair_shares(budget, demands, &vec![1; demands.len()]);
    assert_eq!(even(64, &[1000]), [64]);
    assert_eq!(even(64, &[1000, 1000]), [32, 32]);
    assert_eq!(even(64, &[10, 1000]), [10, 54]);
    assert_eq!(even(64, &[10, 1000, 1000]), [10, 27, 27]);
    assert_eq!(
        even(65, &[1000, 1000]),
        [33, 32],
        "the odd token to the first"
    );
    assert_eq!(even(64, &[5, 6]), [5, 6], "less asked than there is");
    assert_eq!(even(64, &[]), Vec::<usize>::new());
}

#[test]
fn fair_shares_split_by_weight_and_give_what_a_light_claim_leaves_to_the_others() {
    assert_eq!(fair_shares(64, &[1000, 1000], &[3, 1]), [48, 16]);
    assert_eq!(
        fair_shares(60, &[1000, 1000, 1000], &[1, 2, 3]),
        [10, 20, 30]
    );
    // Weight 3's share would be 48; it asks 20, so the other takes the rest.
    assert_eq!(fair_shares(64, &[20, 1000], &[3, 1]), [20, 44]);
    // A heavy claim that asks little is filled before the light ones.
    assert_eq!(fair_shares(64, &[1000, 5, 1000], &[1, 4, 1]), [30, 5, 29]);
    assert_eq!(fair_shares(64, &[1000], &[7]), [64], "alone, everything");
}

/// The tokens each tenant gets in `out`.
fn tokens_by_tenant(s: &Scheduler, out: &SchedulerOutput) -> BTreeMap<u32, usize> {
    let mut by = BTreeMap::new();
    for sch in &out.scheduled {
        *by.entry(s.seqs[&sch.seq].tenant.0).or_insert(0) += sch.count;
    }
    by
}

#[test]
fn decodes_run_before_any_prompt_chunk() {
    let mut kv = KvCacheManager::new(64, 16);
    let mut s = Scheduler::new(cfg(16, 16));
    for id in 1..=3 {
        s.add(id, TenantId(1), 4, Vec::new());
    }
    s.schedule(&mut kv, StepCaps::NONE);
    for id in 1..=3 {
        s.append_token(id);
    }
    // A long prompt arrives from an older-numbered tenant with the same
    // budget: the three decodes still run, the prompt gets what is left.
    s.add(9, TenantId(0), 100, Vec::new());
    let out = s.schedule(&mut kv, StepCaps::NONE);
    let plan: Vec<_> = out.scheduled.iter().map(|x| (x.seq, x.count)).collect();
    assert_eq!(plan, [(1, 1), (2, 1), (3, 1), (9, 13)]);
}

#[test]
fn a_flood_of_prompts_gets_half_the_prompt_budget_when_another_tenant_has_one() {
    let mut kv = KvCacheManager::new(256, 16);
    let mut s = Scheduler::new(cfg(64, 64));
    for id in 0..50 {
        s.add(id, TenantId(1), 200, Vec::new());
    }
    s.add(100, TenantId(2), 200, Vec::new());
    let out = s.schedule(&mut kv, StepCaps::NONE);
    assert_eq!(
        tokens_by_tenant(&s, &out),
        BTreeMap::from([(1, 32), (2, 32)])
    );
    // Next step: each continues its running prompt with half the budget.
    let out = s.schedule(&mut kv, StepCaps::NONE);
    assert_eq!(
        tokens_by_tenant(&s, &out),
        BTreeMap::from([(1, 32), (2, 32)])
    );
}

#[test]
fn a_tenant_alone_gets_the_whole_budget_and_a_short_prompt_leaves_the_rest() {
    let mut kv = KvCacheManager::new(256, 16);
    let mut s = Scheduler::new(cfg(64, 64));
    s.add(1, TenantId(1), 500, Vec::new());
    let out = s.schedule(&mut kv, StepCaps::NONE);
    assert_eq!(tokens_by_tenant(&s, &out), BTreeMap::from([(1, 64)]));
    s.add(2, TenantId(2), 10, Vec::new());
    let out = s.schedule(&mut kv, StepCaps::NONE);
    assert_eq!(
        tokens_by_tenant(&s, &out),
        BTreeMap::from([(1, 54), (2, 10)])
    );
}

#[test]
fn a_tenant_over_its_share_of_running_slots_waits_while_another_tenant_waits() {
    let mut kv = KvCacheManager::new(256, 16);
    let mut s = Scheduler::new(cfg(1000, 4));
    for id in 0..10 {
        s.add(id, TenantId(1), 8, Vec::new());
    }
    s.schedule(&mut kv, StepCaps::NONE);
    assert_eq!(s.running(), 4, "alone, tenant 1 takes every slot");
    s.add(100, TenantId(2), 8, Vec::new());
    // A slot frees: tenant 2's request takes it, not tenant 1's next.
    s.remove(0);
    kv.free(0);
    let out = s.schedule(&mut kv, StepCaps::NONE);
    let admitted: Vec<_> = out.prefix_hits.iter().map(|(id, _)| *id).collect();
    assert_eq!(admitted, [100]);
    // With both waiting, tenant 1 is held to half the slots.
    s.add(101, TenantId(2), 8, Vec::new());
    for id in [1, 2] {
        s.remove(id);
        kv.free(id);
    }
    let out = s.schedule(&mut kv, StepCaps::NONE);
    let mut admitted: Vec<_> = out.prefix_hits.iter().map(|(id, _)| *id).collect();
    admitted.sort();
    assert_eq!(admitted, [4, 101]);
    assert_eq!(
        (s.running_of(TenantId(1)), s.running_of(TenantId(2))),
        (2, 2),
        "two slots each"
    );
}

#[test]
fn a_prompt_cap_limits_prompt_tokens_but_never_decodes() {
    let mut kv = KvCacheManager::new(64, 16);
    let mut s = Scheduler::new(cfg(64, 16));
    for id in 1..=3 {
        s.add(id, TenantId(1), 4, Vec::new());
    }
    s.schedule(&mut kv, StepCaps::NONE);
    for id in 1..=3 {
        s.append_token(id);
    }
    assert!(s.contention().streams > 0);
    s.add(9, TenantId(2), 100, Vec::new());
    let caps = StepCaps {
        prompt: 10,
        ..StepCaps::NONE
    };
    let out = s.schedule(&mut kv, caps);
    let plan: Vec<_> = out.scheduled.iter().map(|x| (x.seq, x.count)).collect();
    assert_eq!(plan, [(1, 1), (2, 1), (3, 1), (9, 10)]);
}

#[test]
fn a_heavier_tenant_gets_its_weights_share_of_prompt_tokens_and_slots() {
    let mut kv = KvCacheManager::new(1024, 16);
    let mut s = Scheduler::new(cfg(64, 8));
    s.set_weight(TenantId(1), 3);
    for id in 0..20 {
        s.add(id, TenantId(1), 200, Vec::new());
        s.add(100 + id, TenantId(2), 200, Vec::new());
    }
    let out = s.schedule(&mut kv, StepCaps::NONE);
    assert_eq!(
        tokens_by_tenant(&s, &out),
        BTreeMap::from([(1, 48), (2, 16)])
    );
    // Admissions go on until the slots are full: three for tenant 1 to
    // every one of tenant 2's.
    for _ in 0..40 {
        s.schedule(&mut kv, StepCaps::NONE);
    }
    assert_eq!(s.running(), 8);
    assert_eq!(
        (s.running_of(TenantId(1)), s.running_of(TenantId(2))),
        (6, 2)
    );
}

#[test]
fn preemption_takes_from_the_tenant_furthest_over_its_weighted_share() {
    let mut kv = KvCacheManager::new(64, 16);
    let mut s = Scheduler::new(cfg(1000, 16));
    s.set_weight(TenantId(1), 4);
    // Tenant 1 (weight 4) runs 4 sequences, tenant 2 (weight 1) runs 2:
    // per unit of weight, tenant 2 holds more.
    for id in 0..4 {
        s.add(id, TenantId(1), 16, Vec::new());
    }
    for id in 10..12 {
        s.add(id, TenantId(2), 16, Vec::new());
    }
    s.schedule(&mut kv, StepCaps::NONE);
    assert_eq!(s.running(), 6);
    let v = s.victim(|_| false).unwrap();
    assert_eq!(s.seqs[&v].tenant, TenantId(2), "victim {v}");
    assert_eq!(v, 11, "the newest of that tenant");
}

#[test]
fn a_stream_waiting_its_decode_turn_is_preempted_before_another_tenants_within_its_share() {
    let mut kv = KvCacheManager::new(4, 16);
    let mut s = Scheduler::new(cfg(256, 64));
    for id in 0..3 {
        s.add(id, TenantId(1), 8, Vec::new());
    }
    s.add(3, TenantId(2), 16, Vec::new());
    s.schedule(&mut kv, StepCaps::NONE);
    assert_eq!(kv.num_free(), 0);
    for id in 0..4 {
        s.append_token(id);
    }
    // Two decode turns: tenant 1's oldest and tenant 2's stream, which
    // needs a second page; tenant 1's other two wait their turn.
    let caps = StepCaps {
        decodes: 2,
        prompt: usize::MAX,
    };
    let out = s.schedule(&mut kv, caps);
    assert_eq!(out.preempted, vec![2], "tenant 1's newest, over its share");
    let ran: Vec<_> = out.scheduled.iter().map(|x| x.seq).collect();
    assert!(ran.contains(&3), "{ran:?}");
}
