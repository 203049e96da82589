//! Prefill/decode disaggregation on the GPU: the decode lane's steps (all
//! decodes, captured as graphs) and the prefill lane's (prompts only) over
//! one pool of pages give the tokens one scheduler's mixed steps give.

use kiln_host::engine::EngineConfig;
use kiln_tests::{Arrivals, staggered};

use super::{PROMPTS, device, engine_config};

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn disaggregated_lanes_on_the_test_device_give_the_tokens_of_one_scheduler() {
    let config = |pd| EngineConfig {
        device: device(),
        pd,
        ..Default::default()
    };
    let arrivals = Arrivals {
        every: 2,
        tenants: 3,
        max_tokens: 12,
    };
    let want = staggered(&mut engine_config(config(false)), PROMPTS, arrivals);
    assert!(want.iter().all(|(t, _)| t.len() == 12), "{want:?}");
    let mut e = engine_config(config(true));
    assert_eq!(staggered(&mut e, PROMPTS, arrivals), want);
    assert_eq!(e.stats().handoffs, PROMPTS.len() as u64);
    assert_eq!(e.free_pages(), e.total_pages());
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn pages_churning_between_the_lanes_on_the_test_device_never_fail_the_tag_check() {
    // A pool of 24 pages for 16 chats arriving one a step, some asking for
    // one token (their pages freed and retagged while the other lane's
    // step is in flight), every fourth cancelled a few steps in: pages
    // change owners and tags on both lanes, and each lane's copy of the
    // tags must follow.
    use kiln_host::engine::{Event, Finish, GenerateParams, TenantId};
    use kiln_host::model::KvCache;
    use kiln_tests::{chat_ids, default_model};
    let page = KvCache::page_bytes(
        &default_model().model.config,
        kiln_kernels::kv::KvFormat::Fp8,
        16,
    );
    let mut e = kiln_host::engine::Engine::new(
        default_model(),
        EngineConfig {
            device: device(),
            pd: true,
            kv_memory: 24 * page,
            ..Default::default()
        },
    )
    .expect("an engine on the test device");
    let all = kiln_tests::PROMPTS;
    let mut seqs = Vec::new();
    let mut finished = std::collections::HashMap::new();
    let mut step = 0;
    while seqs.len() < all.len() || e.has_work() {
        if let Some(p) = all.get(seqs.len()) {
            let params = GenerateParams {
                max_tokens: if seqs.len() % 3 == 0 { 1 } else { 10 },
                temperature: 0.0,
                ignore_eos: true,
                ..Default::default()
            };
            let tenant = TenantId(seqs.len() as u32 % 4);
            seqs.push(e.add(tenant, chat_ids(&e, p), params).unwrap());
        }
        if step % 4 == 3
            && let Some(victim) = seqs.get(step - 2)
        {
            e.cancel(*victim);
        }
        for ev in e.step().unwrap() {
            if let Event::Finished { seq, finish, .. } = ev {
                finished.insert(seq, finish);
            }
        }
        step += 1;
    }
    assert_eq!(e.stats().integrity_aborts, 0, "{finished:?}");
    assert!(
        finished.values().all(|f| !matches!(f, Finish::Aborted(_))),
        "{finished:?}"
    );
    assert!(e.stats().handoffs > 0);
    assert_eq!(e.free_pages(), e.total_pages());
}
