//! Disaggregated lanes: handoff at the first token, the decode lane's
//! preemptions back to the prefill queue, and the prefill lane's respect
//! for the decode lane's slots and pages.

use super::*;
use crate::engine::scheduler::Scheduled;
use crate::engine::scheduler::tests::cfg;

/// Each lane's plan for one engine step (decode lane first), with every
/// sampled sequence's token appended and the ready ones handed off.
fn step(l: &mut Lanes, kv: &mut KvCacheManager) -> Vec<(Lane, Vec<Scheduled>)> {
    let mut plans = Vec::new();
    let order: &[Lane] = if l.disaggregated() {
        &[Lane::Decode, Lane::Prefill]
    } else {
        &[Lane::Prefill]
    };
    for lane in order {
        let out = l.schedule(*lane, kv, StepCaps::NONE);
        for s in out.scheduled.iter().filter(|s| s.sample) {
            l.append_token(s.seq);
        }
        plans.push((*lane, out.scheduled));
    }
    l.hand_off();
    plans
}

fn seqs(plan: &[Scheduled]) -> Vec<(SeqId, usize, usize)> {
    plan.iter().map(|s| (s.seq, s.start, s.count)).collect()
}

#[test]
fn a_prompt_runs_on_the_prefill_lane_then_decodes_on_the_decode_lane() {
    let mut kv = KvCacheManager::new(16, 16);
    let mut l = Lanes::new(cfg(32, 8), true);
    l.add(1, TenantId(0), 40, Vec::new());
    let first = step(&mut l, &mut kv);
    assert_eq!(first[0], (Lane::Decode, vec![]));
    assert_eq!(seqs(&first[1].1), vec![(1, 0, 32)]);
    assert_eq!(l.handoffs(), 0, "the prompt is not done");
    let second = step(&mut l, &mut kv);
    assert_eq!(seqs(&second[1].1), vec![(1, 32, 8)]);
    assert_eq!(l.handoffs(), 1);
    // Its first decode runs on the decode lane; the prefill lane is idle.
    let third = step(&mut l, &mut kv);
    assert_eq!(seqs(&third[0].1), vec![(1, 40, 1)]);
    assert_eq!(third[1], (Lane::Prefill, vec![]));
    assert_eq!(l.running(), 1);
    l.remove(1);
    assert!(l.is_empty());
}

#[test]
fn without_disaggregation_one_scheduler_prefills_and_decodes() {
    let mut kv = KvCacheManager::new(16, 16);
    let mut l = Lanes::new(cfg(32, 8), false);
    l.add(1, TenantId(0), 20, Vec::new());
    assert_eq!(seqs(&step(&mut l, &mut kv)[0].1), vec![(1, 0, 20)]);
    let next = step(&mut l, &mut kv);
    assert_eq!(next, vec![(Lane::Prefill, next[0].1.clone())]);
    assert_eq!(seqs(&next[0].1), vec![(1, 20, 1)]);
    assert_eq!(l.handoffs(), 0);
}

/// Two streams (tenants 0 and 1) handed to the decode lane of a four-page
/// pool, one page each, and two pages free.
fn two_streams() -> (Lanes, KvCacheManager) {
    let mut kv = KvCacheManager::new(4, 16);
    let mut l = Lanes::new(cfg(64, 8), true);
    l.add(1, TenantId(0), 15, Vec::new());
    l.add(2, TenantId(1), 15, Vec::new());
    step(&mut l, &mut kv);
    assert_eq!((l.handoffs(), kv.num_free()), (2, 2));
    (l, kv)
}

#[test]
fn the_prefill_lane_leaves_a_page_free_for_each_stream() {
    let (mut l, mut kv) = two_streams();
    // Two pages free, and the streams need one each within 16 tokens.
    l.add(3, TenantId(2), 17, Vec::new());
    let plans = step(&mut l, &mut kv);
    assert_eq!(plans[0].1.len(), 2);
    assert_eq!(
        plans[1],
        (Lane::Prefill, vec![]),
        "the prompt took the streams' pages"
    );
    step(&mut l, &mut kv);
    assert_eq!(kv.num_free(), 0, "both streams took their second page");
}

#[test]
fn the_decode_lane_sends_what_it_preempts_to_the_front_of_the_prefill_queue() {
    let (mut l, mut kv) = two_streams();
    l.add(3, TenantId(1), 17, Vec::new());
    // The streams fill the pool; at their third page one is preempted (the
    // newest of equal tenants).
    let mut decoding = 2;
    let mut prefill = Vec::new();
    for _ in 0..40 {
        let plans = step(&mut l, &mut kv);
        (decoding, prefill) = (plans[0].1.len(), plans[1].1.clone());
        if decoding < 2 {
            break;
        }
    }
    assert_eq!(decoding, 1, "the pool was meant to force a preemption");
    l.remove(1);
    kv.free(1);
    // Stream 2 is recomputed on the prefill lane, its prompt and generated
    // tokens whole, ahead of its tenant's prompt that was already waiting
    // (from the step that preempted it, if that step left a page free).
    prefill.extend(step(&mut l, &mut kv)[1].1.clone());
    let chunks = seqs(&prefill);
    assert_eq!(chunks[0].0, 2, "{chunks:?}");
    assert_eq!(chunks[0].1, 0, "{chunks:?}");
    let recomputed: usize = (chunks.iter()).filter(|c| c.0 == 2).map(|c| c.2).sum();
    assert!(recomputed > 15, "{chunks:?}");
}

#[test]
fn the_prefill_lane_counts_the_decode_lanes_streams_against_the_running_slots() {
    let mut kv = KvCacheManager::new(64, 16);
    let mut l = Lanes::new(cfg(64, 2), true);
    l.add(1, TenantId(0), 8, Vec::new());
    l.add(2, TenantId(1), 8, Vec::new());
    step(&mut l, &mut kv);
    assert_eq!(l.handoffs(), 2);
    l.add(3, TenantId(2), 8, Vec::new());
    let plans = step(&mut l, &mut kv);
    assert_eq!(plans[0].1.len(), 2, "both streams decode");
    assert_eq!(plans[1], (Lane::Prefill, vec![]), "no slot is free");
    l.remove(1);
    let plans = step(&mut l, &mut kv);
    assert_eq!(seqs(&plans[1].1), vec![(3, 0, 8)]);
}

#[test]
fn a_chunk_waits_for_pages_kept_for_the_other_lane_rather_than_preempt() {
    // Two prompts of 40 tokens, 8 a step each, in a pool of 4 pages with
    // one kept free for another lane.
    let mut kv = KvCacheManager::new(4, 16);
    let mut s = Scheduler::new(cfg(16, 8));
    s.add(1, TenantId(0), 40, Vec::new());
    s.add(2, TenantId(1), 40, Vec::new());
    s.schedule(&mut kv, StepCaps::NONE);
    s.set_reserve(1);
    s.schedule(&mut kv, StepCaps::NONE);
    assert_eq!(kv.num_free(), 2);
    // Each now needs its second page: one fits beside the kept page, the
    // other waits, and nothing is preempted.
    let out = s.schedule(&mut kv, StepCaps::NONE);
    assert!(out.preempted.is_empty(), "{:?}", out.preempted);
    assert_eq!(seqs(&out.scheduled), vec![(1, 16, 8)]);
    assert_eq!(kv.num_free(), 1);
}

#[test]
fn a_stream_handed_to_the_decode_lane_takes_its_turn_after_the_streams_waiting_there() {
    let mut kv = KvCacheManager::new(16, 16);
    let mut l = Lanes::new(cfg(64, 8), true);
    l.add(1, TenantId(1), 8, Vec::new());
    l.add(3, TenantId(2), 8, Vec::new());
    step(&mut l, &mut kv);
    // The decode lane steps alone for a while (its clock runs ahead of
    // the prefill lane's).
    for _ in 0..5 {
        let out = l.schedule(Lane::Decode, &mut kv, StepCaps::NONE);
        for s in out.scheduled.iter().filter(|s| s.sample) {
            l.append_token(s.seq);
        }
    }
    l.add(2, TenantId(1), 8, Vec::new());
    let out = l.schedule(Lane::Prefill, &mut kv, StepCaps::NONE);
    assert_eq!(seqs(&out.scheduled), vec![(2, 0, 8)]);
    l.append_token(2);
    l.hand_off();
    // Two turns: one of tenant 1's two streams, and tenant 2's. Stream 1
    // and the newcomer both just decoded; the older goes first.
    let caps = StepCaps {
        decodes: 2,
        prompt: 0,
    };
    let out = l.schedule(Lane::Decode, &mut kv, caps);
    let ran: Vec<SeqId> = out.scheduled.iter().map(|s| s.seq).collect();
    assert_eq!(ran, vec![1, 3]);
}

#[test]
fn the_prefill_lane_keeps_pages_for_streams_whose_decode_step_still_runs() {
    // A pool of four 16-token pages; a stream of 12 prompt tokens on the
    // decode lane, its step planned (and on a device, still running).
    let mut kv = KvCacheManager::new(4, 16);
    let mut l = Lanes::new(cfg(64, 8), true);
    l.add(1, TenantId(0), 12, Vec::new());
    while l.handoffs() < 1 {
        step(&mut l, &mut kv);
    }
    let out = l.schedule(Lane::Decode, &mut kv, StepCaps::NONE);
    assert_eq!(seqs(&out.scheduled), vec![(1, 12, 1)]);
    // A prompt that would take every free page: one stays for the
    // stream's next page, three tokens on.
    l.add(2, TenantId(1), 64, Vec::new());
    let out = l.schedule(Lane::Prefill, &mut kv, StepCaps::NONE);
    assert_eq!(seqs(&out.scheduled), vec![(2, 0, 32)]);
    assert_eq!(kv.num_free(), 1);
}

/// Streams of tenants 0 and 1 (two pages each) on the decode lane of a
/// sixteen-page pool, sixteen prompt tokens a step.
fn two_tenants_streaming() -> (Lanes, KvCacheManager) {
    let mut kv = KvCacheManager::new(16, 16);
    let mut l = Lanes::new(cfg(16, 8), true);
    l.add(1, TenantId(0), 17, Vec::new());
    l.add(2, TenantId(1), 17, Vec::new());
    while l.handoffs() < 2 {
        step(&mut l, &mut kv);
    }
    (l, kv)
}

#[test]
fn the_decode_lane_preempts_the_tenant_running_most_on_both_lanes() {
    // Tenant 0 streams one sequence and prefills another; tenant 1
    // streams one. Counted over both lanes tenant 0 runs more, so when a
    // stream outgrows the full pool the decode lane preempts tenant 0's
    // (on that lane alone the two tie, and the newer would go).
    let (mut l, mut kv) = two_tenants_streaming();
    l.add(3, TenantId(0), 400, Vec::new());
    let out = l.schedule(Lane::Prefill, &mut kv, StepCaps::NONE);
    assert_eq!(seqs(&out.scheduled), vec![(3, 0, 16)]);
    // Whatever else is free is held outside the lanes.
    assert!(kv.allocate(99, TenantId(2), kv.num_free() * 16));
    for _ in 0..40 {
        let out = l.schedule(Lane::Decode, &mut kv, StepCaps::NONE);
        let decoded: Vec<SeqId> = out.scheduled.iter().map(|s| s.seq).collect();
        decoded.iter().for_each(|s| l.append_token(*s));
        if decoded.len() < 2 {
            assert_eq!((decoded, out.preempted), (vec![2], vec![1]));
            return;
        }
    }
    panic!("the pool was meant to force a preemption");
}

#[test]
fn a_prompt_short_of_pages_keeps_them_until_the_streams_are_due_pages_it_holds() {
    // Two streams hold four pages of sixteen; a 200-token prompt needs
    // thirteen. It computes what the streams leave free, then keeps its
    // pages while they have room (never starting over), and gives them up
    // when the streams are due pages that only it holds: no stream is
    // preempted.
    let (mut l, mut kv) = two_tenants_streaming();
    l.add(3, TenantId(2), 200, Vec::new());
    let mut starts = 0;
    for _ in 0..40 {
        let plans = step(&mut l, &mut kv);
        assert_eq!(plans[0].1.len(), 2, "a stream was preempted");
        starts += (plans[1].1.iter())
            .filter(|s| s.seq == 3 && s.start == 0)
            .count();
        assert_eq!(starts, 1, "the prompt started over: {plans:?}");
        if kv.table(3).is_none() {
            // Kept while the pages left free for the streams took them
            // past token 32; given up as they come within eight of token 48.
            assert!(plans[0].1[0].start >= 40, "{plans:?}");
            return;
        }
    }
    panic!("the prompt kept the streams' pages");
}

#[test]
fn a_prompt_that_gave_its_pages_up_starts_over_once_and_finishes() {
    // As above, the 200-token prompt gives its pages up to the streams.
    // Then it waits until the free pages hold all of it rather than start
    // over on the one page its next chunk needs, which the streams would
    // take back (again and again while they run). Once they end it runs
    // whole.
    let (mut l, mut kv) = two_tenants_streaming();
    l.add(3, TenantId(2), 200, Vec::new());
    let (mut starts, mut computed) = (0, 0);
    for i in 0..120 {
        if i == 80 {
            for s in [1, 2] {
                l.remove(s);
                kv.free(s);
            }
        }
        let plans = step(&mut l, &mut kv);
        for s in plans[1].1.iter().filter(|s| s.seq == 3) {
            starts += usize::from(s.start == 0);
            computed += s.count;
        }
        if l.handoffs() == 3 {
            assert_eq!(starts, 2, "started over more than once");
            assert!(computed < 2 * 200, "{computed} tokens computed for 200");
            return;
        }
    }
    panic!("the prompt never finished: {starts} starts, {computed} tokens computed");
}

#[test]
fn the_decode_lane_takes_a_landed_prompts_pages_before_a_stream_of_a_tenant_no_busier() {
    // As above, but the prompt's step has landed: when the streams outgrow
    // the full pool, tenant 0's prompt gives its page up (its tenant runs
    // two to tenant 1's one), and no stream loses its pages.
    let (mut l, mut kv) = two_tenants_streaming();
    l.add(3, TenantId(0), 400, Vec::new());
    let out = l.schedule(Lane::Prefill, &mut kv, StepCaps::NONE);
    assert_eq!(seqs(&out.scheduled), vec![(3, 0, 16)]);
    l.hand_off();
    assert!(kv.allocate(99, TenantId(2), kv.num_free() * 16));
    for _ in 0..40 {
        let out = l.schedule(Lane::Decode, &mut kv, StepCaps::NONE);
        let decoded: Vec<SeqId> = out.scheduled.iter().map(|s| s.seq).collect();
        decoded.iter().for_each(|s| l.append_token(*s));
        if !out.preempted.is_empty() {
            assert_eq!(out.preempted, vec![3], "{decoded:?}");
            assert!(!decoded.is_empty());
            assert!(kv.table(1).is_some() && kv.table(2).is_some());
            return;
        }
    }
    panic!("the pool was meant to force a preemption");
}

#[test]
fn a_landed_prompt_gives_its_pages_up_before_a_stream_even_of_a_busier_tenant() {
    // Tenant 1 streams three older sequences; tenant 0 one newer stream
    // and a prompt whose step has landed. When a stream outgrows the full
    // pool the prompt gives its pages up, not tenant 0's stream (the
    // older streams, planned first, are out of the decode lane's reach).
    let mut kv = KvCacheManager::new(32, 16);
    let mut l = Lanes::new(cfg(16, 8), true);
    for id in 1..=3 {
        l.add(id, TenantId(1), 17, Vec::new());
    }
    while l.handoffs() < 3 {
        step(&mut l, &mut kv);
    }
    l.add(4, TenantId(0), 17, Vec::new());
    while l.handoffs() < 4 {
        step(&mut l, &mut kv);
    }
    l.add(5, TenantId(0), 400, Vec::new());
    let out = l.schedule(Lane::Prefill, &mut kv, StepCaps::NONE);
    assert!(seqs(&out.scheduled).contains(&(5, 0, 16)), "{out:?}");
    l.hand_off();
    assert!(kv.allocate(99, TenantId(2), kv.num_free() * 16));
    for _ in 0..40 {
        let out = l.schedule(Lane::Decode, &mut kv, StepCaps::NONE);
        out.scheduled.iter().for_each(|s| l.append_token(s.seq));
        if !out.preempted.is_empty() {
            assert_eq!(out.preempted, vec![5], "{out:?}");
            assert!((1..=4).all(|s| kv.table(s).is_some()));
            return;
        }
    }
    panic!("the pool was meant to force a preemption");
}
