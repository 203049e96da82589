//! The scheduler short of pages: chunks that wait or run what fits,
//! pages kept for another lane, blocked prompts and the victims
//! preemption takes.

use super::tests::cfg;
use super::*;

/// Each sequence `out` plans, with its first token and its count.
fn plan(out: &SchedulerOutput) -> Vec<(SeqId, usize, usize)> {
    (out.scheduled.iter())
        .map(|x| (x.seq, x.start, x.count))
        .collect()
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
    assert_eq!(plan(&out), vec![(1, 32, 16)]);
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
    assert_eq!(plan(&out), vec![(1, 32, 1), (2, 32, 16)]);
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

#[test]
fn a_prompt_refused_while_the_blocked_one_holds_nothing_back_keeps_its_pages_from_newcomers() {
    // Tenant 0 runs two sequences (five pages of eight) and waits with a
    // prompt of four pages, which the three free pages do not hold: it is
    // the one blocked.
    let mut kv = KvCacheManager::new(8, 16);
    let mut s = Scheduler::new(cfg(256, 4));
    s.add(1, TenantId(0), 60, Vec::new());
    s.add(2, TenantId(0), 10, Vec::new());
    s.schedule(&mut kv, StepCaps::NONE);
    s.add(3, TenantId(0), 60, Vec::new());
    let out = s.schedule(&mut kv, StepCaps::NONE);
    assert!(!out.scheduled.iter().any(|x| x.seq == 3), "{out:?}");
    assert_eq!(kv.num_free(), 3);
    // Tenant 1's sequence, preempted once, waits for all its 49 tokens'
    // four pages. Tenant 0 is now at its share (two of four slots), so
    // its blocked prompt holds no pages back, and tenant 1's, next in
    // line, holds them.
    s.add(4, TenantId(1), 49, Vec::new());
    s.seqs.get_mut(&4).unwrap().preempted = true;
    let out = s.schedule(&mut kv, StepCaps::NONE);
    assert!(!out.scheduled.iter().any(|x| x.seq == 4), "{out:?}");
    // A newcomer's one page would leave tenant 1's sequence short.
    s.add(5, TenantId(2), 10, Vec::new());
    let out = s.schedule(&mut kv, StepCaps::NONE);
    assert!(!out.scheduled.iter().any(|x| x.seq == 5), "{out:?}");
    assert_eq!(kv.num_free(), 3);
    // Once a page frees, tenant 0 is under its share again: its prompt,
    // refused first, takes the four free pages.
    s.remove(2);
    kv.free(2);
    let ran =
        |out: SchedulerOutput| -> Vec<SeqId> { out.scheduled.iter().map(|x| x.seq).collect() };
    assert_eq!(ran(s.schedule(&mut kv, StepCaps::NONE)), vec![3]);
    // When four pages free again, tenant 1's sequence is next, still
    // ahead of the newcomer.
    s.remove(1);
    kv.free(1);
    assert_eq!(ran(s.schedule(&mut kv, StepCaps::NONE)), vec![4]);
}

#[test]
fn prompts_that_never_gave_their_pages_up_give_them_to_the_streams_first() {
    // Prompts 1 (tenant 0) and 2 (tenant 1) in a pool of eight pages.
    let mut kv = KvCacheManager::new(8, 16);
    let mut s = Scheduler::new(cfg(32, 8));
    s.add(1, TenantId(0), 48, Vec::new());
    s.add(2, TenantId(1), 48, Vec::new());
    assert_eq!(
        plan(&s.schedule(&mut kv, StepCaps::NONE)),
        vec![(1, 0, 16), (2, 0, 16)]
    );
    // The other lane's streams are due a page more than is free: the newer
    // prompt gives its page up, then comes back once all of it fits.
    s.set_reserve(kv.num_free() + 1);
    let out = s.schedule(&mut kv, StepCaps::NONE);
    assert_eq!(out.preempted, vec![2]);
    s.set_reserve(0);
    let out = s.schedule(&mut kv, StepCaps::NONE);
    assert!(plan(&out).contains(&(2, 0, 16)), "{out:?}");
    // Short again: the prompt that never lost its pages gives them up,
    // though prompt 2 is newer.
    s.set_reserve(kv.num_free() + 1);
    let out = s.schedule(&mut kv, StepCaps::NONE);
    assert_eq!(out.preempted, vec![1], "{out:?}");
    assert_eq!(plan(&out), vec![(2, 16, 16)]);
}

#[test]
fn a_preempted_prompt_whose_tenant_was_at_its_share_gets_its_place_back_when_under_it() {
    // Tenant 0's share is two of sixteen slots, tenant 1's fourteen.
    let mut kv = KvCacheManager::new(6, 16);
    let mut s = Scheduler::new(cfg(256, 16));
    s.set_weight(TenantId(1), 7);
    s.add(1, TenantId(0), 8, Vec::new());
    s.add(2, TenantId(0), 8, Vec::new());
    s.schedule(&mut kv, StepCaps::NONE);
    s.append_token(1);
    s.append_token(2);
    // Tenant 0's sequence 3, preempted once, waits for all its five pages
    // (four are free): refused, it is the one blocked.
    s.add(3, TenantId(0), 80, Vec::new());
    s.seqs.get_mut(&3).unwrap().preempted = true;
    s.schedule(&mut kv, StepCaps::NONE);
    s.append_token(1);
    s.append_token(2);
    // Tenant 1 arrives: tenant 0 is at its share, so sequence 3 holds
    // nothing back, and tenant 1's short prompts take the free pages.
    for id in 10..30 {
        s.add(id, TenantId(1), 8, Vec::new());
    }
    let mut running: VecDeque<SeqId> = VecDeque::new();
    let out = s.schedule(&mut kv, StepCaps::NONE);
    for x in &out.scheduled {
        s.append_token(x.seq);
        running.push_back(x.seq);
    }
    assert!(!out.scheduled.iter().any(|x| x.seq == 3), "{out:?}");
    // Tenant 0's two finish: under its share again, its sequence must get
    // in while tenant 1's requests come and go one by one.
    for id in [1, 2] {
        s.remove(id);
        kv.free(id);
        running.retain(|r| *r != id);
    }
    let mut admitted = false;
    for next in 30..60 {
        if let Some(old) = running.pop_front() {
            s.remove(old);
            kv.free(old);
        }
        s.add(next, TenantId(1), 8, Vec::new());
        let out = s.schedule(&mut kv, StepCaps::NONE);
        if out.scheduled.iter().any(|x| x.seq == 3) {
            admitted = true;
            break;
        }
        for x in &out.scheduled {
            s.append_token(x.seq);
            if !running.contains(&x.seq) {
                running.push_back(x.seq);
            }
        }
    }
    assert!(admitted, "tenant 0's preempted prompt never got in");
}
