//! Several samples of one prompt on the CPU engine and the default model:
//! they share the prompt's pages, and each draws as a lone request with
//! its own seed would.

use std::collections::HashMap;

use kiln_host::engine::{Engine, EngineConfig, Event, GenerateParams, MAX_SAMPLES, Salt, TenantId};
use kiln_tests::{chat_ids, default_model};

fn engine() -> Engine {
    Engine::new(default_model(), EngineConfig::default()).expect("engine")
}

fn sampled(seed: u64) -> GenerateParams {
    GenerateParams {
        max_tokens: 10,
        temperature: 1.0,
        top_p: 1.0,
        seed: Some(seed),
        ignore_eos: true,
        ..Default::default()
    }
}

/// A prompt of several full pages.
fn long_prompt(e: &Engine) -> Vec<u32> {
    let text =
        "Write a short story about a lighthouse keeper who finds a message in a bottle. ".repeat(4);
    chat_ids(e, &text)
}

/// Runs everything queued: each sequence's tokens and cached prompt
/// tokens.
fn drain(e: &mut Engine) -> HashMap<u64, (Vec<u32>, usize)> {
    let mut out: HashMap<u64, (Vec<u32>, usize)> = HashMap::new();
    while e.has_work() {
        for ev in e.step().unwrap() {
            match ev {
                Event::Token { seq, token, .. } => {
                    out.entry(seq).or_default().0.extend(token);
                }
                Event::Finished {
                    seq, cached_tokens, ..
                } => out.entry(seq).or_default().1 = cached_tokens,
            }
        }
    }
    out
}

#[test]
fn samples_share_the_prompts_full_pages_and_draw_with_their_own_seeds() {
    let mut e = engine();
    let prompt = long_prompt(&e);
    assert!(
        prompt.len() > 48,
        "{} tokens: want several pages",
        prompt.len()
    );
    let salt = Salt::derive(&[7; 32], "m", "t");
    let ids = e
        .admit(TenantId(1), salt, prompt.clone(), sampled(100), 3, None)
        .unwrap();
    let got = drain(&mut e);
    let full_pages = prompt.len() / 16 * 16;
    assert_eq!(got[&ids[0]].1, 0, "the first sample computes the prompt");
    for id in &ids[1..] {
        let cached = got[id].1;
        // Every full page hits; a prompt ending on a page boundary keeps
        // its last page to compute the first token from.
        assert!(
            cached + 16 >= full_pages && cached > 0,
            "{cached} of {full_pages}"
        );
    }
    // Each sample is the lone request with its seed, in a fresh engine.
    for (i, id) in ids.iter().enumerate() {
        let mut alone = engine();
        let seq = alone
            .add_salted(TenantId(1), salt, prompt.clone(), sampled(100 + i as u64))
            .unwrap();
        let want = &drain(&mut alone)[&seq].0;
        assert_eq!(&got[id].0, want, "sample {i}");
    }
    assert_ne!(got[&ids[0]].0, got[&ids[1]].0, "two seeds drew the same");
}

#[test]
fn a_waiting_sample_can_be_cancelled_and_bad_counts_are_refused() {
    let mut e = engine();
    let prompt = long_prompt(&e);
    let salt = Salt::derive(&[7; 32], "m", "t");
    let ids = e
        .admit(TenantId(1), salt, prompt.clone(), sampled(1), 3, None)
        .unwrap();
    assert!(e.cancel(ids[2]));
    let got = drain(&mut e);
    assert!(got.contains_key(&ids[0]) && got.contains_key(&ids[1]));
    assert!(!got.contains_key(&ids[2]), "a cancelled sample never ran");
    for n in [0, MAX_SAMPLES + 1] {
        let err = e
            .admit(TenantId(1), salt, prompt.clone(), sampled(1), n, None)
            .unwrap_err();
        assert!(err.contains("1 to 16"), "{err}");
    }
}

#[test]
fn when_the_first_sample_is_cancelled_the_next_computes_the_prompt_for_the_rest() {
    let mut e = engine();
    let prompt = long_prompt(&e);
    let salt = Salt::derive(&[7; 32], "m", "t");
    let ids = e
        .admit(TenantId(1), salt, prompt.clone(), sampled(100), 3, None)
        .unwrap();
    assert!(e.cancel(ids[0]));
    let got = drain(&mut e);
    assert!(!got.contains_key(&ids[0]));
    assert_eq!(got[&ids[1]].1, 0, "the second sample computes the prompt");
    assert_eq!(got[&ids[1]].0.len(), 10);
    assert!(
        got[&ids[2]].1 > 0,
        "the third waits for it and shares its pages"
    );
}

#[test]
fn samples_of_one_token_run_beside_each_other_once_the_first_has_its_prompt() {
    let mut e = engine();
    let prompt = long_prompt(&e);
    let salt = Salt::derive(&[7; 32], "m", "t");
    let one = GenerateParams {
        max_tokens: 1,
        ..sampled(3)
    };
    let ids = e.admit(TenantId(1), salt, prompt, one, 4, None).unwrap();
    let mut steps = 0;
    let mut tokens: HashMap<u64, usize> = HashMap::new();
    while e.has_work() {
        steps += 1;
        for ev in e.step().unwrap() {
            if let Event::Token { seq, token, .. } = ev {
                *tokens.entry(seq).or_default() += usize::from(token.is_some());
            }
        }
    }
    assert!(
        ids.iter().all(|id| tokens.get(id) == Some(&1)),
        "{tokens:?}"
    );
    assert_eq!(steps, 2, "the first sample's step, then the other three's");
}

#[test]
fn samples_whose_first_ends_at_once_on_eos_run_beside_each_other_next() {
    let mut e = engine();
    let prompt = long_prompt(&e);
    let salt = Salt::derive(&[7; 32], "m", "t");
    // A format of the empty text only: each sample's first token is EOS.
    let empty = GenerateParams {
        ignore_eos: false,
        format: Some(kiln_host::engine::OutputFormat::Grammar(
            "start: \"\"".into(),
        )),
        ..sampled(3)
    };
    let ids = e.admit(TenantId(1), salt, prompt, empty, 4, None).unwrap();
    let (mut steps, mut finished) = (0, Vec::new());
    while e.has_work() {
        steps += 1;
        for ev in e.step().unwrap() {
            if let Event::Finished { seq, .. } = ev {
                finished.push(seq);
            }
        }
    }
    finished.sort();
    assert_eq!(finished, ids);
    assert_eq!(steps, 2, "the first sample's step, then the other three's");
}
