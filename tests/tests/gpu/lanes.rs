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
