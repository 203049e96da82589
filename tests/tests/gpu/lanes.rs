//! Prefill/decode disaggregation on the GPU: the decode lane's steps (all
//! decodes, captured as graphs) and the prefill lane's (prompts only) over
//! one pool of pages give the tokens one scheduler's mixed steps give.

use std::collections::HashMap;

use kiln_host::engine::{Engine, EngineConfig, Event, GenerateParams, TenantId};
use kiln_tests::chat_ids;

use super::{PROMPTS, device, engine_config};

/// Every prompt's greedy tokens, one arriving every other step (tenants
/// 0-2), so prompts run while others decode.
fn staggered(e: &mut Engine) -> Vec<Vec<u32>> {
    let params = GenerateParams {
        max_tokens: 12,
        temperature: 0.0,
        ignore_eos: true,
        ..Default::default()
    };
    let (mut seqs, mut tokens) = (Vec::new(), HashMap::<u64, Vec<u32>>::new());
    let mut step = 0;
    while seqs.len() < PROMPTS.len() || e.has_work() {
        if step % 2 == 0 && seqs.len() < PROMPTS.len() {
            let ids = chat_ids(e, PROMPTS[seqs.len()]);
            let tenant = TenantId(seqs.len() as u32 % 3);
            seqs.push(e.add(tenant, ids, params.clone()).unwrap());
        }
        for ev in e.step().unwrap() {
            if let Event::Token {
                seq,
                token: Some(t),
                ..
            } = ev
            {
                tokens.entry(seq).or_default().push(t);
            }
        }
        step += 1;
    }
    seqs.iter()
        .map(|s| tokens.remove(s).unwrap_or_default())
        .collect()
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn disaggregated_lanes_on_the_test_device_give_the_tokens_of_one_scheduler() {
    let config = |pd| EngineConfig {
        device: device(),
        pd,
        ..Default::default()
    };
    let want = staggered(&mut engine_config(config(false)));
    assert!(want.iter().all(|t| t.len() == 12), "{want:?}");
    let mut e = engine_config(config(true));
    assert_eq!(staggered(&mut e), want);
    assert_eq!(e.stats().handoffs, PROMPTS.len() as u64);
    assert_eq!(e.free_pages(), e.total_pages());
}
