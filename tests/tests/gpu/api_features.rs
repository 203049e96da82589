//! Log-probabilities and samples of one prompt on the test device: the
//! host reads the device's logits for them, so they must give the tokens
//! the device's own argmax and sampling give.

use std::collections::HashMap;

use kiln_host::engine::{Engine, EngineConfig, Event, GenerateParams, Salt, TenantId};
use kiln_tests::{chat_ids, default_model};

use super::{device, engine_with};

/// Runs everything queued: each sequence's tokens and log-probabilities
/// (which may come with a later token's text, never before their own).
fn drain(e: &mut kiln_host::engine::Engine) -> HashMap<u64, Vec<(u32, Option<f32>)>> {
    let mut tokens: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut lps: HashMap<u64, Vec<(u32, f32)>> = HashMap::new();
    while e.has_work() {
        for ev in e.step().unwrap() {
            if let Event::Token {
                seq,
                token,
                logprobs,
                ..
            } = ev
            {
                tokens.entry(seq).or_default().extend(token);
                let l = logprobs.iter().map(|l| (l.chosen.id, l.chosen.logprob));
                lps.entry(seq).or_default().extend(l);
            }
        }
    }
    let mut out = HashMap::new();
    for (seq, ts) in tokens {
        let l = lps.remove(&seq).unwrap_or_default();
        let mut l = l.into_iter();
        let with: Vec<(u32, Option<f32>)> = (ts.into_iter())
            .map(|t| {
                let lp = l.next().map(|(id, lp)| {
                    assert_eq!(id, t);
                    lp
                });
                (t, lp)
            })
            .collect();
        out.insert(seq, with);
    }
    out
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn log_probabilities_on_the_test_device_keep_its_greedy_tokens() {
    // Graphs on: without log-probabilities the device picks the argmax.
    let mut e = engine_with(device(), true);
    let ids = chat_ids(&e, super::PROMPTS[0]);
    let params = |logprobs| GenerateParams {
        max_tokens: 12,
        temperature: 0.0,
        ignore_eos: true,
        logprobs,
        ..Default::default()
    };
    let plain = e.add(TenantId(0), ids.clone(), params(None)).unwrap();
    let asked = e.add(TenantId(1), ids.clone(), params(Some(3))).unwrap();
    let mut tops: Vec<Vec<(u32, f32)>> = Vec::new();
    let mut got: HashMap<u64, Vec<(u32, f32)>> = HashMap::new();
    while e.has_work() {
        for ev in e.step().unwrap() {
            if let Event::Token { seq, logprobs, .. } = ev {
                for l in logprobs {
                    got.entry(seq)
                        .or_default()
                        .push((l.chosen.id, l.chosen.logprob));
                    tops.push(l.top.iter().map(|t| (t.id, t.logprob)).collect());
                }
            }
        }
    }
    assert!(!got.contains_key(&plain), "no figures unasked");
    let asked = &got[&asked];
    assert_eq!(asked.len(), 12);
    // The device's figures are the log-softmax of its own logits, which
    // teacher forcing reads back to the host.
    let mut all = ids.clone();
    all.extend(asked.iter().map(|(t, _)| *t));
    let forced = e
        .teacher_forced_logits(TenantId(2), &all, ids.len())
        .unwrap();
    for (i, ((token, lp), top)) in asked.iter().zip(&tops).enumerate() {
        let row = &forced[i];
        let max = row.iter().cloned().fold(f32::MIN, f32::max) as f64;
        let z = max
            + row
                .iter()
                .map(|v| (*v as f64 - max).exp())
                .sum::<f64>()
                .ln();
        let want = |id: u32| row[id as usize] as f64 - z;
        assert!(
            (*lp as f64 - want(*token)).abs() < 0.05,
            "token {i}: {lp} vs {}",
            want(*token)
        );
        // Greedy: the token is the most likely, with its own figure; the
        // rest follow, a part of one distribution. (The kernels' figures
        // match the CPU's on the same logits: the parity tests.)
        assert_eq!(top.len(), 3);
        assert_eq!(top[0], (*token, *lp), "token {i}");
        assert!(top.windows(2).all(|w| w[0].1 >= w[1].1), "{top:?}");
        let mass: f64 = top.iter().map(|t| (t.1 as f64).exp()).sum();
        assert!(mass <= 1.0 + 1e-4, "{top:?}");
        // Teacher forcing takes the prefill kernels, whose logits differ a
        // little from decode's: the tokens agree, the figures nearly.
        for (id, l) in top {
            let d = (*l as f64 - want(*id)).abs();
            assert!(d < 0.3, "token {i} id {id}: {l} vs {}", want(*id));
        }
    }
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn samples_on_the_test_device_draw_as_lone_requests() {
    let ids = {
        let e = engine_with(device(), true);
        chat_ids(&e, &super::PROMPTS[1].repeat(3))
    };
    let salt = Salt::derive(&[3; 32], "m", "t");
    let params = |seed| GenerateParams {
        max_tokens: 10,
        temperature: 0.8,
        seed: Some(seed),
        ignore_eos: true,
        ..Default::default()
    };
    let mut e = engine_with(device(), true);
    let group = e
        .admit(TenantId(0), salt, ids.clone(), params(9), 3, None)
        .unwrap();
    let got = drain(&mut e);
    // A lone request after them hits the same cached pages, so it computes
    // what a later sample did: the same tokens from the same seed.
    for (i, seq) in group.iter().enumerate().skip(1) {
        let s = e
            .add_salted(TenantId(0), salt, ids.clone(), params(9 + i as u64))
            .unwrap();
        assert_eq!(got[seq], drain(&mut e)[&s], "sample {i}");
    }
    assert_ne!(got[&group[1]], got[&group[2]], "two seeds drew the same");
}

#[test]
#[ignore = "needs a GPU: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn output_formats_on_the_test_device_draw_within_the_mask_it_uploads() {
    use kiln_host::engine::OutputFormat;
    // Graphs on: masked greedy decodes are captured too.
    let mut e = engine_with(device(), true);
    let ids = chat_ids(&e, "Name one large city and its population, as JSON.");
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20},
                       "population": {"type": "integer"}},
        "required": ["city", "population"], "additionalProperties": false
    });
    let params = |logprobs, seed: Option<u64>| GenerateParams {
        max_tokens: 60,
        temperature: if seed.is_some() { 0.9 } else { 0.0 },
        seed,
        logprobs,
        format: Some(OutputFormat::JsonSchema(schema.clone())),
        ..Default::default()
    };
    // Alone, the greedy request's decodes are captured, with masks of
    // changing widths; the CPU engine, masking on the host, must agree.
    let device_drawn = e.add(TenantId(0), ids.clone(), params(None, None)).unwrap();
    let mut got = drain(&mut e);
    let mut cpu = Engine::new(
        default_model(),
        EngineConfig {
            kv_memory: 64 << 20,
            kv_format: kiln_kernels::kv::KvFormat::Bf16,
            ..Default::default()
        },
    )
    .unwrap();
    let on_cpu = cpu
        .add(TenantId(0), ids.clone(), params(None, None))
        .unwrap();
    let cpu_got = drain(&mut cpu);
    // Sampled: each seed drawn within its mask on the device, and by an
    // engine that samples on the host (its logits masked there).
    let mut host = super::engine_config(EngineConfig {
        device: device(),
        device_sampling: false,
        ..Default::default()
    });
    let sampled: Vec<(u64, u64)> = (1..4)
        .map(|s| {
            let d = e.add(TenantId(2), ids.clone(), params(None, Some(s)));
            let h = host.add(TenantId(2), ids.clone(), params(None, Some(s)));
            (d.unwrap(), h.unwrap())
        })
        .collect();
    got.extend(drain(&mut e));
    let host_got = drain(&mut host);
    let tokens = |m: &HashMap<u64, Vec<(u32, Option<f32>)>>, s: u64| {
        m[&s].iter().map(|(t, _)| *t).collect::<Vec<_>>()
    };
    assert_eq!(tokens(&got, device_drawn), tokens(&cpu_got, on_cpu));
    for (d, h) in &sampled {
        assert_eq!(tokens(&got, *d), tokens(&host_got, *h), "seeded draws");
    }
    let tokens = |s: u64| tokens(&got, s);
    for seq in std::iter::once(device_drawn).chain(sampled.iter().map(|p| p.0)) {
        let text = e.loaded().tokenizer.decode(&tokens(seq));
        let v: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|err| panic!("not JSON ({err}): {text:?}"));
        assert!(v["city"].is_string() && v["population"].is_i64(), "{v}");
    }
}
