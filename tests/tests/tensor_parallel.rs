//! The default model split over three tensor-parallel ranks on the CPU
//! (`EngineConfig::tensor_parallel`; its 9 query heads, 3 KV heads and
//! 1536-wide MLP split three ways): each rank holds its heads and its part
//! of the MLP, with KV pages of its own KV heads at the same page numbers
//! and tags, and the step sums the ranks' projections. It must compute
//! what the whole model computes, and everything that reads pages (the
//! prefix cache, the tag check, moving a sequence) must work unchanged.

use kiln_host::engine::{Engine, EngineConfig, Finish, TenantId};
use kiln_host::model::{KvCache, Loaded, WeightPlan};
use kiln_kernels::kv::KvFormat;
use kiln_tests::{
    Arrivals, Forced, PROMPTS, chat_ids, default_model, default_model_as, greedy_to, run_salted,
    teacher_forced, tokens_of,
};

fn engine(format: KvFormat, ranks: usize) -> Result<Engine, String> {
    engine_of(default_model(), format, ranks)
}

fn engine_of(loaded: Loaded, format: KvFormat, ranks: usize) -> Result<Engine, String> {
    let page = KvCache::page_bytes(&loaded.model.config, format, 16);
    let config = EngineConfig {
        kv_format: format,
        kv_memory: 96 * page,
        tensor_parallel: ranks,
        ..Default::default()
    };
    Engine::new(loaded, config).map_err(|e| e.to_string())
}

#[test]
fn three_ranks_compute_what_the_whole_model_computes() {
    // On bf16 pages the ranks' sums in another order change no argmax.
    let mut whole = engine(KvFormat::Bf16, 1).unwrap();
    let mut ranks = engine(KvFormat::Bf16, 3).unwrap();
    let bf16 = Forced::by(&mut whole, &PROMPTS[..6]);
    let (agree, total, kl) = bf16.against(&mut ranks);
    eprintln!("bf16 pages: {agree}/{total} argmax agree, mean KL {kl:e} nats");
    assert!(total >= 64, "{total} positions");
    assert_eq!(agree, total, "bf16 pages: {agree}/{total} argmax agree");
    assert!(kl < 1e-4, "bf16 pages: mean KL {kl} nats");
    // On fp8 pages a key or value that the other order of sums puts on the
    // other side of an e4m3 step changes the layers after it, so the two
    // differ as two fp8 runs do; still by well under what fp8 pages cost.
    let mut fp8 = engine(KvFormat::Fp8, 1).unwrap();
    let (_, _, fp8_kl) = bf16.against(&mut fp8);
    let mut ranks = engine(KvFormat::Fp8, 3).unwrap();
    let (agree, total, kl) = teacher_forced(&mut fp8, &mut ranks, &PROMPTS[..6]);
    eprintln!(
        "fp8 pages: {agree}/{total} argmax agree, mean KL {kl:e} nats (fp8 against bf16 pages: {fp8_kl:e})"
    );
    assert!(
        agree * 100 >= total * 95,
        "fp8 pages: {agree}/{total} argmax agree"
    );
    assert!(
        kl * 2.0 < fp8_kl,
        "fp8 pages: mean KL {kl} nats, fp8's own {fp8_kl}"
    );
}

/// `ids`' 16 greedy tokens on `e` and how many prompt tokens it found
/// cached.
fn run(e: &mut Engine, ids: &[u32]) -> (Vec<u32>, usize) {
    run_salted(e, (1, 1), ids, greedy_to(16))
}

#[test]
fn three_ranks_generate_the_whole_models_greedy_tokens_and_reuse_its_prefix_cache() {
    let mut whole = engine(KvFormat::Bf16, 1).unwrap();
    let mut ranks = engine(KvFormat::Bf16, 3).unwrap();
    for prompt in &PROMPTS[..3] {
        let ids = chat_ids(&whole, prompt);
        let (want, _) = run(&mut whole, &ids);
        let (got, _) = run(&mut ranks, &ids);
        assert_eq!(got, want, "{prompt}");
        // The same prompt again reads its cached pages on every rank.
        let (again, cached) = run(&mut ranks, &ids);
        assert!(cached >= 16, "{prompt}: {cached} tokens cached");
        assert_eq!(again, want, "{prompt}, cached");
    }
    assert_eq!(ranks.stats().integrity_aborts, 0);
}

#[test]
fn three_ranks_with_weights_for_each_phase_give_the_whole_models_tokens() {
    // Prompts arrive a few steps apart, so steps hold one prompt's chunk
    // (on prefill's weights) beside the others' tokens (on decode's).
    let phased = || default_model_as("prefill=bf16,decode=int4".parse::<WeightPlan>().unwrap());
    let arrivals = Arrivals {
        every: 3,
        tenants: 1,
        max_tokens: 10,
    };
    let tokens = |ranks| {
        let mut e = engine_of(phased(), KvFormat::Bf16, ranks).unwrap();
        let runs = kiln_tests::staggered(&mut e, &PROMPTS[..4], arrivals);
        assert_eq!(e.stats().integrity_aborts, 0);
        runs.into_iter().map(|(t, _)| t).collect::<Vec<_>>()
    };
    let whole = tokens(1);
    assert!(whole.iter().all(|t| t.len() == 10), "{whole:?}");
    assert_eq!(tokens(3), whole);
}

#[test]
fn a_rank_count_that_does_not_split_the_heads_is_a_clear_error() {
    let e = engine(KvFormat::Fp8, 2)
        .err()
        .expect("two ranks of 3 KV heads");
    assert!(
        e.contains("2 tensor-parallel ranks") && e.contains("9 query heads"),
        "{e}"
    );
    let e = engine(KvFormat::Fp8, 0).err().expect("no ranks");
    assert!(e.contains("at least one rank"), "{e}");
}

#[test]
fn a_sequence_moves_between_split_engines_but_not_to_a_whole_one() {
    let mut home = engine(KvFormat::Fp8, 3).unwrap();
    let prompt = chat_ids(&home, PROMPTS[1]);
    let seq = home.add(TenantId(4), prompt.clone(), greedy_to(8)).unwrap();
    let (want, _) = tokens_of(&mut home, seq, usize::MAX);

    let (mut prefill, mut decode) = (
        engine(KvFormat::Fp8, 3).unwrap(),
        engine(KvFormat::Fp8, 3).unwrap(),
    );
    let seq = prefill
        .add(TenantId(4), prompt.clone(), greedy_to(8))
        .unwrap();
    let (first, _) = tokens_of(&mut prefill, seq, 1);
    let there = decode.adopt(prefill.export(seq).unwrap()).unwrap();
    let (rest, end) = tokens_of(&mut decode, there, usize::MAX);
    assert_eq!(end, Some(Finish::Length));
    assert_eq!([first, rest].concat(), want);

    let seq = prefill.add(TenantId(4), prompt, greedy_to(8)).unwrap();
    tokens_of(&mut prefill, seq, 1);
    let mut whole = engine(KvFormat::Fp8, 1).unwrap();
    let e = whole.adopt(prefill.export(seq).unwrap()).unwrap_err();
    assert!(e.contains("over 3 ranks"), "{e}");
}
