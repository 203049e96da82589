//! Each architecture through the shared forward pass, checked against a
//! dense textbook implementation written here from the Hugging Face
//! definition: a tiny Qwen2 (q/k/v biases, RoPE over halves, an untied
//! head) saved as a safetensors directory, run by the engine over paged KV
//! (a prefill chunk, then one token a step).

use std::collections::HashMap;

use kiln_host::engine::{Engine, EngineConfig, TenantId};
use kiln_host::model;
use kiln_kernels::kv::KvFormat;

const HIDDEN: usize = 64;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HD: usize = HIDDEN / HEADS;
const FFN: usize = 128;
const LAYERS: usize = 2;
const VOCAB: usize = 512;
const THETA: f64 = 1_000_000.0;
const EPS: f64 = 1e-6;

/// Seeded uniform values in `[-a, a)` (a small xorshift, so the test needs
/// no generator crate).
struct Draw(u64);

impl Draw {
    fn values(&mut self, n: usize, a: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                self.0 ^= self.0 << 13;
                self.0 ^= self.0 >> 7;
                self.0 ^= self.0 << 17;
                ((self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a
            })
            .collect()
    }
}

/// The tensors of a tiny Qwen2, by Hugging Face name: (shape, values).
fn qwen2_tensors() -> HashMap<String, (Vec<usize>, Vec<f32>)> {
    let mut d = Draw(0x9e37_79b9_7f4a_7c15);
    let mut t = HashMap::new();
    let mut put = |name: String, shape: Vec<usize>, a: f32, d: &mut Draw| {
        let n = shape.iter().product();
        t.insert(name, (shape, d.values(n, a)));
    };
    put(
        "model.embed_tokens.weight".into(),
        vec![VOCAB, HIDDEN],
        1.0,
        &mut d,
    );
    put("lm_head.weight".into(), vec![VOCAB, HIDDEN], 0.2, &mut d);
    put("model.norm.weight".into(), vec![HIDDEN], 1.0, &mut d);
    for i in 0..LAYERS {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        let (q, kv) = (HEADS * HD, KV_HEADS * HD);
        put(p("input_layernorm.weight"), vec![HIDDEN], 1.0, &mut d);
        put(
            p("post_attention_layernorm.weight"),
            vec![HIDDEN],
            1.0,
            &mut d,
        );
        put(p("self_attn.q_proj.weight"), vec![q, HIDDEN], 0.2, &mut d);
        put(p("self_attn.k_proj.weight"), vec![kv, HIDDEN], 0.2, &mut d);
        put(p("self_attn.v_proj.weight"), vec![kv, HIDDEN], 0.2, &mut d);
        put(p("self_attn.q_proj.bias"), vec![q], 1.0, &mut d);
        put(p("self_attn.k_proj.bias"), vec![kv], 1.0, &mut d);
        put(p("self_attn.v_proj.bias"), vec![kv], 1.0, &mut d);
        put(p("self_attn.o_proj.weight"), vec![HIDDEN, q], 0.2, &mut d);
        put(p("mlp.gate_proj.weight"), vec![FFN, HIDDEN], 0.2, &mut d);
        put(p("mlp.up_proj.weight"), vec![FFN, HIDDEN], 0.2, &mut d);
        put(p("mlp.down_proj.weight"), vec![HIDDEN, FFN], 0.2, &mut d);
    }
    t
}

fn write_qwen2_dir(dir: &std::path::Path, t: &HashMap<String, (Vec<usize>, Vec<f32>)>) {
    let bytes: HashMap<&String, Vec<u8>> = t
        .iter()
        .map(|(n, (_, v))| (n, v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = t
        .iter()
        .map(|(n, (shape, _))| {
            let view = safetensors::tensor::TensorView::new(
                safetensors::Dtype::F32,
                shape.clone(),
                &bytes[n],
            );
            (n.clone(), view.unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    let config = serde_json::json!({
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": HIDDEN, "intermediate_size": FFN, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "num_hidden_layers": LAYERS, "rms_norm_eps": EPS,
        "rope_theta": THETA, "vocab_size": VOCAB, "max_position_embeddings": 4096,
        "tie_word_embeddings": false,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let tokenizer = kiln_tests::default_model();
    tokenizer
        .tokenizer
        .save_json(&dir.join("tokenizer.json"))
        .unwrap();
}

/// `x W^T (+ b)` for `x` of `W`'s width.
fn linear(x: &[f64], w: &[f32], b: Option<&[f32]>) -> Vec<f64> {
    let k = x.len();
    (0..w.len() / k)
        .map(|r| {
            let dot: f64 = (0..k).map(|c| x[c] * w[r * k + c] as f64).sum();
            dot + b.map_or(0.0, |b| b[r] as f64)
        })
        .collect()
}

fn rmsnorm(x: &[f64], w: &[f32]) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let f = 1.0 / (ms + EPS).sqrt();
    x.iter().zip(w).map(|(v, w)| v * f * *w as f64).collect()
}

/// Rotary embedding over the two halves of each head (`rotate_half`).
fn rope(x: &mut [f64], pos: usize) {
    for head in x.chunks_exact_mut(HD) {
        for i in 0..HD / 2 {
            let angle = pos as f64 * THETA.powf(-((2 * i) as f64) / HD as f64);
            let (a, b) = (head[i], head[i + HD / 2]);
            head[i] = a * angle.cos() - b * angle.sin();
            head[i + HD / 2] = b * angle.cos() + a * angle.sin();
        }
    }
}

/// The logits after each token of `ids`, computed densely in f64; with
/// `biases` false the q/k/v biases are left out.
fn reference(
    t: &HashMap<String, (Vec<usize>, Vec<f32>)>,
    ids: &[u32],
    biases: bool,
) -> Vec<Vec<f64>> {
    let w = |n: String| t[&n].1.as_slice();
    let embed = w("model.embed_tokens.weight".into());
    let mut xs: Vec<Vec<f64>> = ids
        .iter()
        .map(|id| {
            embed[*id as usize * HIDDEN..][..HIDDEN]
                .iter()
                .map(|v| *v as f64)
                .collect()
        })
        .collect();
    for i in 0..LAYERS {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        let bias = |s: &str| biases.then(|| w(p(s)));
        let (mut qs, mut ks, mut vs) = (Vec::new(), Vec::new(), Vec::new());
        for (pos, x) in xs.iter().enumerate() {
            let h = rmsnorm(x, w(p("input_layernorm.weight")));
            let mut q = linear(
                &h,
                w(p("self_attn.q_proj.weight")),
                bias("self_attn.q_proj.bias"),
            );
            let mut k = linear(
                &h,
                w(p("self_attn.k_proj.weight")),
                bias("self_attn.k_proj.bias"),
            );
            let v = linear(
                &h,
                w(p("self_attn.v_proj.weight")),
                bias("self_attn.v_proj.bias"),
            );
            rope(&mut q, pos);
            rope(&mut k, pos);
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        for (pos, x) in xs.iter_mut().enumerate() {
            let mut attn = vec![0.0; HEADS * HD];
            for head in 0..HEADS {
                let kvh = head / (HEADS / KV_HEADS);
                let q = &qs[pos][head * HD..][..HD];
                let scores: Vec<f64> = (0..=pos)
                    .map(|j| {
                        let k = &ks[j][kvh * HD..][..HD];
                        q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (HD as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for (j, e) in e.iter().enumerate() {
                    for d in 0..HD {
                        attn[head * HD + d] += e / sum * vs[j][kvh * HD + d];
                    }
                }
            }
            let o = linear(&attn, w(p("self_attn.o_proj.weight")), None);
            x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);
            let h = rmsnorm(x, w(p("post_attention_layernorm.weight")));
            let gate = linear(&h, w(p("mlp.gate_proj.weight")), None);
            let up = linear(&h, w(p("mlp.up_proj.weight")), None);
            let act: Vec<f64> = gate
                .iter()
                .zip(&up)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let down = linear(&act, w(p("mlp.down_proj.weight")), None);
            x.iter_mut().zip(&down).for_each(|(x, d)| *x += d);
        }
    }
    xs.iter()
        .map(|x| {
            linear(
                &rmsnorm(x, w("model.norm.weight".into())),
                w("lm_head.weight".into()),
                None,
            )
        })
        .collect()
}

/// ‖x − y‖ / ‖x‖.
fn rel_diff(x: &[f64], y: &[f32]) -> f64 {
    let num: f64 = x.iter().zip(y).map(|(u, v)| (u - *v as f64).powi(2)).sum();
    let den: f64 = x.iter().map(|u| u * u).sum();
    (num / den).sqrt()
}

#[test]
fn qwen2_with_biases_computes_the_dense_reference_logits_over_paged_kv() {
    let dir = tempfile::tempdir().unwrap();
    let tensors = qwen2_tensors();
    write_qwen2_dir(dir.path(), &tensors);
    let loaded = model::load("qwen2", dir.path().to_str().unwrap()).unwrap();
    assert_eq!(loaded.model.config.arch, model::Arch::Qwen2);
    let mut engine = Engine::new(
        loaded,
        EngineConfig {
            kv_format: KvFormat::Bf16,
            kv_memory: 8 << 20,
            ..Default::default()
        },
    )
    .unwrap();
    // 40 tokens over three pages: a prefill of 30, then ten decode steps.
    let ids: Vec<u32> = (0..40u32).map(|i| (i * 37 + 11) % VOCAB as u32).collect();
    let got = engine.teacher_forced_logits(TenantId(0), &ids, 30).unwrap();
    let want = reference(&tensors, &ids, true);
    let unbiased = reference(&tensors, &ids, false);
    assert_eq!(got.len(), 11);
    for (i, row) in got.iter().enumerate() {
        let at = 29 + i;
        let rel = rel_diff(&want[at], row);
        // K and V are stored as bf16 (2^-9 relative per element).
        assert!(rel < 3e-3, "position {at}: logits differ by {rel:.2e}");
        let without = rel_diff(&unbiased[at], row);
        eprintln!("position {at}: {rel:.2e} from the reference, {without:.2e} without biases");
        assert!(
            without > 10.0 * rel.max(1e-3),
            "position {at}: the biases changed nothing ({without:.2e})"
        );
    }
}
