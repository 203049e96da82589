//! A sequence moved between two engines of the default model once its
//! prompt is computed (`Engine::export` / `Engine::adopt`, the engine's
//! half of prefill on one GPU and decode on another): it decodes on the
//! second engine the tokens it would have decoded on the first, on pages
//! that engine tagged for its tenant, and each pool gets its pages back.

use kiln_host::engine::{Engine, EngineConfig, Finish, TenantId};
use kiln_host::model::KvCache;
use kiln_kernels::kv::KvFormat;
use kiln_tests::{PROMPTS, chat_ids, default_model, greedy_to, tokens_of};

fn engine(format: KvFormat, pd: bool) -> Engine {
    let page = KvCache::page_bytes(&default_model().model.config, format, 16);
    let config = EngineConfig {
        kv_format: format,
        kv_memory: 64 * page,
        pd,
        ..Default::default()
    };
    Engine::new(default_model(), config).expect("engine")
}

#[test]
fn a_sequence_moved_after_its_prompt_decodes_the_tokens_it_would_have_at_home() {
    for (format, pd) in [
        (KvFormat::Fp8, false),
        (KvFormat::Bf16, false),
        (KvFormat::Fp8, true),
    ] {
        let mut home = engine(format, false);
        let prompt = chat_ids(&home, PROMPTS[2]);
        let at_home = home
            .add(TenantId(7), prompt.clone(), greedy_to(10))
            .unwrap();
        let (want, end) = tokens_of(&mut home, at_home, usize::MAX);
        assert_eq!((want.len(), end), (10, Some(Finish::Length)));

        let (mut prefill, mut decode) = (engine(format, false), engine(format, pd));
        let (free_p, free_d) = (prefill.free_pages(), decode.free_pages());
        let seq = prefill
            .add(TenantId(7), prompt.clone(), greedy_to(10))
            .unwrap();
        let (first, _) = tokens_of(&mut prefill, seq, 1);
        let moved = prefill.export(seq).unwrap();
        assert_eq!(moved.tenant(), TenantId(7));
        assert_eq!(moved.pages(), prompt.len().div_ceil(16), "{moved:?}");
        assert_eq!(
            prefill.free_pages(),
            free_p,
            "the prefill pool has its pages back"
        );
        assert!(!prefill.has_work());

        let there = decode.adopt(moved).unwrap();
        let (rest, end) = tokens_of(&mut decode, there, usize::MAX);
        assert_eq!(end, Some(Finish::Length), "{format:?} pd {pd}");
        assert_eq!([first, rest].concat(), want, "{format:?} pd {pd}");
        assert_eq!(decode.stats().integrity_aborts, 0);
        assert_eq!(
            decode.free_pages(),
            free_d,
            "the decode pool has its pages back"
        );
    }
}

#[test]
fn only_a_computed_sequence_moves_and_only_to_pages_of_its_format() {
    let mut a = engine(KvFormat::Fp8, false);
    let prompt = chat_ids(&a, PROMPTS[0]);
    let seq = a.add(TenantId(1), prompt, greedy_to(4)).unwrap();
    let early = a.export(seq).unwrap_err();
    assert!(
        early.why.contains("not running with its prompt computed") && early.later,
        "{early}"
    );
    tokens_of(&mut a, seq, 1);
    let moved = a.export(seq).unwrap();
    let mut bf16 = engine(KvFormat::Bf16, false);
    let wrong = bf16.adopt(moved).unwrap_err();
    assert!(wrong.contains("pages of"), "{wrong}");
    assert!(!bf16.has_work());
}

#[test]
fn the_next_sequence_adopted_is_of_the_tenant_running_fewest_there() {
    let (a, b) = (TenantId(1), TenantId(2));
    let mut prefill = engine(KvFormat::Fp8, false);
    let mut decode = engine(KvFormat::Fp8, false);
    let prompt = chat_ids(&prefill, PROMPTS[0]);
    for _ in 0..2 {
        let seq = prefill.add(a, prompt.clone(), greedy_to(8)).unwrap();
        tokens_of(&mut prefill, seq, 1);
        decode.adopt(prefill.export(seq).unwrap()).unwrap();
    }
    // a runs two there, b none: b's sequence goes first though it came last.
    assert_eq!(decode.next_to_adopt(&[(a, 1), (a, 1), (b, 1)]), Some(2));
    // Weighted 3, a's two running are under b's one in share.
    let seq = prefill.add(b, prompt, greedy_to(8)).unwrap();
    tokens_of(&mut prefill, seq, 1);
    decode.adopt(prefill.export(seq).unwrap()).unwrap();
    assert_eq!(decode.next_to_adopt(&[(b, 1), (a, 3)]), Some(1));
    assert_eq!(decode.next_to_adopt(&[(b, 1), (a, 1)]), Some(0));
}

#[test]
fn a_sequence_whose_pages_fail_their_tags_stays_home_and_is_aborted() {
    let mut prefill = engine(KvFormat::Fp8, false);
    let a = (prefill.add(TenantId(1), chat_ids(&prefill, PROMPTS[0]), greedy_to(10))).unwrap();
    let b = (prefill.add(TenantId(2), chat_ids(&prefill, PROMPTS[1]), greedy_to(10))).unwrap();
    let (first, _) = tokens_of(&mut prefill, a, 1);
    assert_eq!(first.len(), 1);
    // a's first page now maps b's: its KV is another tenant's.
    assert!(prefill.inject_page_fault(a, b));
    let e = prefill.export(a).unwrap_err();
    assert!(e.why.contains("tag check") && !e.later, "{e}");
    let (_, end) = tokens_of(&mut prefill, a, usize::MAX);
    assert!(
        matches!(end, Some(Finish::Aborted(_))),
        "the next step stops it: {end:?}"
    );
    assert_eq!(prefill.stats().integrity_aborts, 1);
}

#[test]
fn a_sequence_is_adopted_only_once_the_engines_own_waiting_ones_have_run() {
    let mut prefill = engine(KvFormat::Fp8, false);
    let page = KvCache::page_bytes(&default_model().model.config, KvFormat::Fp8, 16);
    let config = EngineConfig {
        kv_format: KvFormat::Fp8,
        kv_memory: 64 * page,
        scheduler: kiln_host::engine::SchedulerConfig {
            max_running: 1,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut decode = Engine::new(default_model(), config).expect("engine");
    let prompt = chat_ids(&prefill, PROMPTS[0]);
    let seq = prefill
        .add(TenantId(1), prompt.clone(), greedy_to(8))
        .unwrap();
    tokens_of(&mut prefill, seq, 1);
    let moved = prefill.export(seq).unwrap();
    assert!(
        decode.room_to_adopt(moved.pages(), 1),
        "an idle engine takes it"
    );
    // One of its own runs and one waits (in a decode pool, a stream it
    // preempted): the slot that frees is the waiting one's.
    let (a, _b) = (
        decode
            .add(TenantId(2), prompt.clone(), greedy_to(8))
            .unwrap(),
        decode.add(TenantId(2), prompt, greedy_to(8)).unwrap(),
    );
    decode.step().unwrap();
    assert!(decode.cancel(a));
    assert_eq!(decode.running(), 0);
    assert!(!decode.room_to_adopt(moved.pages(), 1));
    decode.step().unwrap();
    assert_eq!(decode.running(), 1, "the waiting one runs");
}

#[test]
fn a_sequence_other_samples_wait_on_moves_once_they_have_started() {
    let mut prefill = engine(KvFormat::Fp8, false);
    let prompt = chat_ids(&prefill, PROMPTS[0]);
    let salt = kiln_host::engine::Salt::derive(&[7; 32], "m", "t");
    let ids = (prefill.admit(TenantId(1), salt, prompt, greedy_to(8), 2, None)).unwrap();
    tokens_of(&mut prefill, ids[0], 1);
    let e = prefill.export(ids[0]).unwrap_err();
    assert!(e.why.contains("samples wait") && e.later, "{e}");
    // The next step starts the other sample from its prompt's pages.
    prefill.step().unwrap();
    let moved = prefill.export(ids[0]).expect("it moves now");
    let mut decode = engine(KvFormat::Fp8, false);
    decode.adopt(moved).unwrap();
}
