//! The scheduler's planning: chunks, prefix hits, preemption, fairness.

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

#[test]
fn a_chunk_short_of_pages_kept_for_another_lanes_streams_waits_and_the_newest_prompt_gives_its_up()
{
    let mut kv = KvCacheManager::new(3, 16);
    let mut s = Scheduler::new(cfg(32, 8));
    s.add(1, TenantId(1), 64, Vec::new());
    s.add(2, TenantId(2), 64, Vec::new());
    let first = s.schedule(&mut kv, StepCaps::NONE);
    assert_eq!(first.scheduled.len(), 2);
    // Another lane's stream takes the last page and is due one more: the
    // newer prompt (of tenants that tie) gives its page up for it.
    assert!(kv.allocate(99, TenantId(3), 16));
    s.set_reserve(1);
    let out = s.schedule(&mut kv, StepCaps::NONE);
    assert_eq!(out.preempted, vec![2]);
    assert!(out.scheduled.is_empty());
    assert_eq!(kv.num_free(), 1);
    // The stream's page frees: the older prompt goes on where it was.
    kv.free(99);
    s.set_reserve(0);
    let out = s.schedule(&mut kv, StepCaps::NONE);
    let starts: Vec<_> = out.scheduled.iter().map(|x| (x.seq, x.start)).collect();
    assert_eq!(
        starts[0],
        (1, 16),
        "the older prompt kept its work: {starts:?}"
    );
}

#[test]
fn a_chunk_beside_pages_kept_for_another_lanes_streams_runs_as_far_as_the_rest_take_it() {
    let mut kv = KvCacheManager::new(5, 16);
    let mut s = Scheduler::new(cfg(32, 8));
    s.add(1, TenantId(1), 96, Vec::new());
    s.schedule(&mut kv, StepCaps::NONE);
    // Another lane's stream holds a page and is due one more: of the two
    // free, one is the prompt's to take.
    assert!(kv.allocate(99, TenantId(3), 16));
    s.set_reserve(1);
    let out = s.schedule(&mut kv, StepCaps::NONE);
    let plan: Vec<_> = out
        .scheduled
        .iter()
        .map(|x| (x.seq, x.start, x.count))
        .collect();
    assert_eq!(plan, vec![(1, 32, 16)]);
    assert!(out.preempted.is_empty());
    assert_eq!(kv.num_free(), 1, "the kept page stays free");
}

#[test]
fn a_tenant_with_nothing_running_is_admitted_with_what_the_free_pages_hold() {
    let mut kv = KvCacheManager::new(4, 16);
    let mut s = Scheduler::new(cfg(64, 8));
    s.add(1, TenantId(1), 40, Vec::new());
    s.schedule(&mut kv, StepCaps::NONE);
    assert_eq!(kv.num_free(), 1);
    // Tenant 0's 48 tokens need 3 pages; tenant 1's next prompt needs the
    // one page free. Tenant 0 takes it for a first chunk, rather than
    // waiting while tenant 1 takes every page that frees.
    s.append_token(1);
    s.add(2, TenantId(0), 48, Vec::new());
    s.add(3, TenantId(1), 16, Vec::new());
    let out = s.schedule(&mut kv, StepCaps::NONE);
    let planned: Vec<_> = out.scheduled.iter().map(|x| (x.seq, x.count)).collect();
    assert!(planned.contains(&(2, 16)), "{planned:?}");
    assert!(out.preempted.is_empty(), "{:?}", out.preempted);
}

#[test]
fn a_chunk_short_of_pages_runs_what_fits_instead_of_giving_up_its_own() {
    let mut kv = KvCacheManager::new(6, 16);
    let mut s = Scheduler::new(cfg(64, 8));
    s.add(1, TenantId(1), 32, Vec::new());
    s.add(2, TenantId(0), 96, Vec::new());
    s.schedule(&mut kv, StepCaps::NONE);
    assert_eq!(kv.num_free(), 2);
    // Stream 1's next token takes a page; prompt 2's next 32 tokens need
    // two and one is left.
    s.append_token(1);
    let out = s.schedule(&mut kv, StepCaps::NONE);
    assert!(out.preempted.is_empty(), "{:?}", out.preempted);
    let planned: Vec<_> = out
        .scheduled
        .iter()
        .map(|x| (x.seq, x.start, x.count))
        .collect();
    assert_eq!(planned, vec![(1, 32, 1), (2, 32, 16)]);
}

#[test]
fn a_prompt_short_of_pages_beside_a_stream_waits_instead_of_recomputing_each_step() {
    let mut kv = KvCacheManager::new(4, 16);
    let mut s = Scheduler::new(cfg(64, 8));
    // Stream 1 (tenant 1) holds two pages; prompt 2 (tenant 0) gets the
    // other two for its first 32 tokens and needs more.
    s.add(1, TenantId(1), 31, Vec::new());
    s.schedule(&mut kv, StepCaps::NONE);
    s.append_token(1);
    s.add(2, TenantId(0), 60, Vec::new());
    let out = s.schedule(&mut kv, StepCaps::NONE);
    assert!(
        out.scheduled.iter().any(|x| (x.seq, x.start) == (2, 0)),
        "{out:?}"
    );
    assert_eq!(kv.num_free(), 0);
    // The stream's next page is the prompt's (it is the victim); the
    // prompt then waits for pages for all of it rather than start again
    // on the one page left and lose it at the stream's next page.
    let mut recomputed = 0;
    for _ in 0..20 {
        s.append_token(1);
        let out = s.schedule(&mut kv, StepCaps::NONE);
        recomputed += out.scheduled.iter().filter(|x| x.seq == 2).count();
    }
    assert_eq!(recomputed, 0);
    s.remove(1);
    kv.free(1);
    let out = s.schedule(&mut kv, StepCaps::NONE);
    assert!(
        out.scheduled.iter().any(|x| (x.seq, x.start) == (2, 0)),
        "{out:?}"
    );
}

#[test]
fn a_prompt_with_no_page_free_beside_a_stream_keeps_its_pages_and_waits() {
    let mut kv = KvCacheManager::new(4, 16);
    let mut s = Scheduler::new(cfg(64, 8));
    s.add(1, TenantId(1), 20, Vec::new());
    s.schedule(&mut kv, StepCaps::NONE);
    s.append_token(1);
    s.add(2, TenantId(0), 96, Vec::new());
    s.schedule(&mut kv, StepCaps::NONE);
    assert_eq!((s.seqs[&2].computed, kv.num_free()), (32, 0));
    // The stream's next tokens fit its pages; the prompt's next chunk
    // finds none free and no victim: it waits, its 32 tokens kept.
    s.append_token(1);
    let out = s.schedule(&mut kv, StepCaps::NONE);
    assert!(out.preempted.is_empty(), "{:?}", out.preempted);
    let planned: Vec<_> = out.scheduled.iter().map(|x| x.seq).collect();
    assert_eq!(planned, vec![1]);
    assert_eq!(s.seqs[&2].computed, 32);
}

#[test]
fn a_prompt_with_its_last_token_short_of_a_page_waits_rather_than_start_over() {
    // A stream holds one page of three; a 33-token prompt takes the other
    // two for 32 tokens, and its 33rd needs a third page. It is a prompt,
    // not a stream: it waits beside the stream, keeping its work.
    let mut kv = KvCacheManager::new(3, 16);
    let mut s = Scheduler::new(cfg(32, 8));
    s.add(1, TenantId(0), 4, Vec::new());
    s.schedule(&mut kv, StepCaps::NONE);
    s.append_token(1);
    s.add(2, TenantId(1), 33, Vec::new());
    let mut starts = 0;
    for _ in 0..10 {
        let out = s.schedule(&mut kv, StepCaps::NONE);
        for x in out.scheduled.iter().filter(|x| x.sample) {
            s.append_token(x.seq);
        }
        starts += (out.scheduled.iter())
            .filter(|x| x.seq == 2 && x.start == 0)
            .count();
        assert_eq!(out.preempted, Vec::<SeqId>::new());
    }
    assert_eq!(starts, 1, "the prompt started over");
}

#[test]
fn a_prompt_waiting_for_its_chunks_pages_is_not_passed_by_short_requests_taking_each_page() {
    // Tenant 0 streams on one page of four and waits with a 40-token
    // prompt (three pages); tenant 1 keeps two one-page requests in
    // flight, one ending and another arriving each step. A page comes
    // free each step, and the next request must not take it before the
    // prompt has its three.
    let mut kv = KvCacheManager::new(4, 16);
    let mut s = Scheduler::new(cfg(64, 8));
    s.add(1, TenantId(0), 8, Vec::new());
    s.schedule(&mut kv, StepCaps::NONE);
    s.append_token(1);
    s.add(10, TenantId(1), 8, Vec::new());
    s.schedule(&mut kv, StepCaps::NONE);
    s.append_token(1);
    s.append_token(10);
    s.add(2, TenantId(0), 40, Vec::new());
    s.add(11, TenantId(1), 8, Vec::new());
    let mut live = std::collections::VecDeque::from([10, 11]);
    for next in 12..30 {
        let out = s.schedule(&mut kv, StepCaps::NONE);
        if out.scheduled.iter().any(|x| x.seq == 2) {
            return;
        }
        for x in out.scheduled.iter().filter(|x| x.sample) {
            s.append_token(x.seq);
        }
        // The older request ends as the next arrives.
        if let Some(done) = live.pop_front() {
            s.remove(done);
            kv.free(done);
        }
        s.add(next, TenantId(1), 8, Vec::new());
        live.push_back(next);
    }
    panic!("the prompt never got its pages");
}

#[test]
fn a_blocked_prompt_of_a_tenant_over_its_share_holds_no_pages_back() {
    // Tenant 0 runs two streams of four slots and waits with a prompt
    // whose 128-token chunk (eight pages) the six free pages do not hold.
    // Tenant 1 arrives: tenant 0 is at its share (two), so its prompt is
    // not tried, and must not keep tenant 1 from the free pages.
    let mut kv = KvCacheManager::new(8, 16);
    let mut s = Scheduler::new(cfg(128, 4));
    s.add(1, TenantId(0), 8, Vec::new());
    s.add(2, TenantId(0), 8, Vec::new());
    s.schedule(&mut kv, StepCaps::NONE);
    s.append_token(1);
    s.append_token(2);
    s.add(3, TenantId(0), 400, Vec::new());
    let out = s.schedule(&mut kv, StepCaps::NONE);
    assert!(!out.scheduled.iter().any(|x| x.seq == 3), "{out:?}");
    s.append_token(1);
    s.append_token(2);
    s.add(4, TenantId(1), 16, Vec::new());
    let out = s.schedule(&mut kv, StepCaps::NONE);
    assert!(out.scheduled.iter().any(|x| x.seq == 4), "{out:?}");
}

#[test]
fn the_busiest_tenants_sequences_preempted_before_go_last_within_it() {
    let mut kv = KvCacheManager::new(64, 16);
    let mut s = Scheduler::new(cfg(256, 8));
    for (id, tenant) in [(1, 0), (2, 0), (3, 0), (4, 1)] {
        s.add(id, TenantId(tenant), 16, Vec::new());
    }
    s.schedule(&mut kv, StepCaps::NONE);
    assert_eq!(s.running(), 4);
    assert_eq!(s.victim(|_| false), Some(3), "the busiest tenant's newest");
    let mut lost = |id: SeqId| s.seqs.get_mut(&id).unwrap().preempted = true;
    lost(3);
    lost(2);
    // Tenant 0 is still the one over its share: its one sequence that
    // never lost its pages goes, not tenant 1's.
    assert_eq!(s.victim(|_| false), Some(1));
    s.seqs.get_mut(&1).unwrap().preempted = true;
    assert_eq!(s.victim(|_| false), Some(3), "all lost theirs: the newest");
    assert_eq!(s.victim(|id| *id != 4), Some(4));
}
