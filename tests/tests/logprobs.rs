//! Log-probabilities of generated tokens, on the CPU engine and the
//! default model: the model's own distribution at each token, the most
//! likely tokens beside it, and sampling that does not change for asking.

use kiln_host::engine::{
    Engine, EngineConfig, Event, GenerateParams, MAX_TOP_LOGPROBS, TenantId, TokenLogprobs,
};
use kiln_tests::{PROMPTS, chat_ids, default_model};

fn engine() -> Engine {
    Engine::new(default_model(), EngineConfig::default()).expect("engine")
}

/// Runs `params` on `prompt` alone: each generated token with what came
/// with it.
fn run(
    e: &mut Engine,
    prompt: &[u32],
    params: GenerateParams,
) -> Vec<(u32, Option<TokenLogprobs>)> {
    let seq = e.add(TenantId(1), prompt.to_vec(), params).unwrap();
    let (mut tokens, mut lps) = (Vec::new(), Vec::new());
    while e.has_work() {
        for ev in e.step().unwrap() {
            if let Event::Token {
                seq: s,
                token,
                logprobs,
                ..
            } = ev
                && s == seq
            {
                tokens.extend(token);
                lps.extend(logprobs);
            }
        }
    }
    // A token's figures may come with a later token's text, never before
    // its own.
    assert!(
        lps.is_empty() || lps.len() == tokens.len(),
        "{} of {}",
        lps.len(),
        tokens.len()
    );
    let mut lps = lps.into_iter();
    tokens.into_iter().map(|t| (t, lps.next())).collect()
}

fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().cloned().fold(f32::MIN, f32::max) as f64;
    let z: f64 = logits.iter().map(|v| (*v as f64 - max).exp()).sum();
    logits.iter().map(|v| *v as f64 - max - z.ln()).collect()
}

#[test]
fn each_greedy_token_comes_with_the_models_log_probabilities() {
    let mut e = engine();
    let prompt = chat_ids(&e, PROMPTS[0]);
    let params = GenerateParams {
        max_tokens: 8,
        temperature: 0.0,
        ignore_eos: true,
        logprobs: Some(5),
        ..Default::default()
    };
    let out = run(&mut e, &prompt, params);
    assert_eq!(out.len(), 8);
    // Teacher forcing the same tokens gives the distributions they were
    // drawn from.
    let mut all = prompt.clone();
    all.extend(out.iter().map(|(t, _)| *t));
    let forced = e
        .teacher_forced_logits(TenantId(2), &all, prompt.len())
        .unwrap();
    for (i, (token, lp)) in out.iter().enumerate() {
        let lp = lp.as_ref().expect("log-probabilities on every token");
        assert_eq!(lp.chosen.id, *token);
        assert_eq!(lp.top.len(), 5);
        // Greedy: the token is the most likely one.
        assert_eq!(lp.top[0].id, *token);
        assert_eq!(lp.top[0].logprob, lp.chosen.logprob);
        assert!(lp.top.windows(2).all(|w| w[0].logprob >= w[1].logprob));
        let mass: f64 = lp.top.iter().map(|t| (t.logprob as f64).exp()).sum();
        assert!(mass <= 1.0 + 1e-5, "token {i}: top-5 mass {mass}");
        let want = log_softmax(&forced[i]);
        for t in &lp.top {
            let err = (t.logprob as f64 - want[t.id as usize]).abs();
            assert!(
                err < 1e-3,
                "token {i}, id {}: {} vs {}",
                t.id,
                t.logprob,
                want[t.id as usize]
            );
            assert_eq!(t.text, e.loaded().tokenizer.decode(&[t.id]));
        }
    }
}

#[test]
fn asking_for_log_probabilities_does_not_change_a_seeded_sample() {
    let mut e = engine();
    let prompt = chat_ids(&e, PROMPTS[1]);
    let params = |logprobs| GenerateParams {
        max_tokens: 12,
        temperature: 0.9,
        top_p: 0.95,
        seed: Some(42),
        logprobs,
        ..Default::default()
    };
    let plain = run(&mut e, &prompt, params(None));
    let asked = run(&mut e, &prompt, params(Some(0)));
    let tokens = |v: &[(u32, Option<TokenLogprobs>)]| v.iter().map(|(t, _)| *t).collect::<Vec<_>>();
    assert_eq!(tokens(&plain), tokens(&asked));
    assert!(plain.iter().all(|(_, lp)| lp.is_none()));
    for (t, lp) in &asked {
        let lp = lp.as_ref().unwrap();
        assert!(lp.top.is_empty());
        assert_eq!(lp.chosen.id, *t);
        assert!(lp.chosen.logprob <= 0.0 && lp.chosen.logprob.is_finite());
    }
}

#[test]
fn more_top_log_probabilities_than_the_limit_are_refused() {
    let mut e = engine();
    let prompt = chat_ids(&e, PROMPTS[0]);
    let params = GenerateParams {
        logprobs: Some(MAX_TOP_LOGPROBS + 1),
        ..Default::default()
    };
    let err = e.add(TenantId(1), prompt, params).unwrap_err();
    assert!(err.contains("at most 20"), "{err}");
}

#[test]
fn a_stop_strings_tokens_send_no_log_probabilities() {
    let mut e = engine();
    let prompt = chat_ids(&e, PROMPTS[0]);
    let greedy = |stop: Vec<String>| GenerateParams {
        max_tokens: 12,
        temperature: 0.0,
        logprobs: Some(0),
        stop,
        ..Default::default()
    };
    // The free text, then the same text stopped at its fourth token's.
    let free = e
        .generate(TenantId(1), prompt.clone(), greedy(Vec::new()))
        .unwrap();
    let tk = &e.loaded().tokenizer;
    let pieces: Vec<String> = (1..=free.tokens.len())
        .map(|n| tk.decode(&free.tokens[..n]))
        .collect();
    let cut = (3..pieces.len())
        .find(|i| {
            let added = pieces[*i].get(pieces[i - 1].len()..).unwrap_or("");
            !added.trim().is_empty() && !pieces[i - 1].contains(added)
        })
        .expect("a token that adds text");
    let stop = pieces[cut][pieces[cut - 1].len()..].to_owned();
    let stopped = e
        .generate(TenantId(1), prompt, greedy(vec![stop.clone()]))
        .unwrap();
    assert!(!stopped.text.contains(&stop), "{stopped:?}");
    let mut lps = Vec::new();
    let mut e2 = engine();
    let seq = e2
        .add(
            TenantId(1),
            chat_ids(&e2, PROMPTS[0]),
            greedy(vec![stop.clone()]),
        )
        .unwrap();
    while e2.has_work() {
        for ev in e2.step().unwrap() {
            if let Event::Token {
                seq: s, logprobs, ..
            } = ev
                && s == seq
            {
                lps.extend(logprobs);
            }
        }
    }
    // The tokens before the stop string's have theirs; its own does not.
    let sent: Vec<u32> = lps.iter().map(|l| l.chosen.id).collect();
    assert_eq!(sent, free.tokens[..cut], "stop {stop:?}");
}
