//! The safetensors loader, `tokenizer.json` and rotate-half RoPE, checked
//! against the GGUF path: the default model is written out as a Hugging
//! Face directory (f32 weights, q/k rows un-permuted to HF's layout) and
//! both must compute the same logits.

use std::collections::HashMap;

use kiln_host::engine::{Engine, EngineConfig, TenantId};
use kiln_host::model::{self, gguf::Gguf};
use kiln_kernels::kv::KvFormat;
use kiln_kernels::matmul::Weight;

/// GGUF stores q and k rows permuted for interleaved RoPE: GGUF row
/// `h*hd + 2i + j` is HF row `h*hd + j*hd/2 + i`.
fn unpermute(rows: Vec<Vec<f32>>, heads: usize) -> Vec<Vec<f32>> {
    let hd = rows.len() / heads;
    let mut out = vec![Vec::new(); rows.len()];
    for (r, row) in rows.into_iter().enumerate() {
        let (h, k) = (r / hd, r % hd);
        let (i, j) = (k / 2, k % 2);
        out[h * hd + j * hd / 2 + i] = row;
    }
    out
}

fn write_hf_dir(dir: &std::path::Path) {
    let path = model::resolve_model(model::DEFAULT_MODEL, &model::default_cache_dir()).unwrap();
    let g = Gguf::open(std::path::Path::new(&path)).unwrap();
    let (hidden, heads, kv_heads, layers) = (576, 9, 3, 30);
    let mut tensors: HashMap<String, (Vec<usize>, Vec<u8>)> = HashMap::new();
    let mut put = |gguf_name: String, hf_name: String, permute_heads: Option<usize>| {
        let (t, bytes) = g.tensor_bytes(&gguf_name).unwrap();
        let cols = t.dims[0];
        let rows = t.dims.iter().skip(1).product::<usize>().max(1);
        let w = Weight::from_bytes(t.dtype, rows, cols, bytes.to_vec()).unwrap();
        let mut data: Vec<Vec<f32>> = (0..rows)
            .map(|r| {
                let mut v = vec![0.0; cols];
                w.row(r, &mut v);
                v
            })
            .collect();
        if let Some(h) = permute_heads {
            data = unpermute(data, h);
        }
        let bytes: Vec<u8> = data
            .iter()
            .flatten()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let shape = if t.dims.len() == 1 {
            vec![cols]
        } else {
            vec![rows, cols]
        };
        tensors.insert(hf_name, (shape, bytes));
    };
    put(
        "token_embd.weight".into(),
        "model.embed_tokens.weight".into(),
        None,
    );
    put(
        "output_norm.weight".into(),
        "model.norm.weight".into(),
        None,
    );
    for i in 0..layers {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        let b = |s: &str| format!("blk.{i}.{s}");
        put(b("attn_norm.weight"), p("input_layernorm.weight"), None);
        put(
            b("attn_q.weight"),
            p("self_attn.q_proj.weight"),
            Some(heads),
        );
        put(
            b("attn_k.weight"),
            p("self_attn.k_proj.weight"),
            Some(kv_heads),
        );
        put(b("attn_v.weight"), p("self_attn.v_proj.weight"), None);
        put(b("attn_output.weight"), p("self_attn.o_proj.weight"), None);
        put(
            b("ffn_norm.weight"),
            p("post_attention_layernorm.weight"),
            None,
        );
        put(b("ffn_gate.weight"), p("mlp.gate_proj.weight"), None);
        put(b("ffn_up.weight"), p("mlp.up_proj.weight"), None);
        put(b("ffn_down.weight"), p("mlp.down_proj.weight"), None);
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (shape, bytes))| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden, "intermediate_size": 1536, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "num_hidden_layers": layers, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "vocab_size": 49152, "max_position_embeddings": 8192,
        "tie_word_embeddings": true, "eos_token_id": 2,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let loaded = kiln_tests::default_model();
    loaded
        .tokenizer
        .save_json(&dir.join("tokenizer.json"))
        .unwrap();
    let tc = serde_json::json!({
        "chat_template": loaded.tokenizer.chat_template(),
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": false,
    });
    std::fs::write(dir.join("tokenizer_config.json"), tc.to_string()).unwrap();
}

#[test]
fn safetensors_directory_computes_what_the_gguf_computes() {
    let dir = tempfile::tempdir().unwrap();
    write_hf_dir(dir.path());
    let cfg = || EngineConfig {
        kv_format: KvFormat::Bf16,
        kv_memory: 32 << 20,
        ..Default::default()
    };
    let mut hf = Engine::new(
        model::load("hf", dir.path().to_str().unwrap()).unwrap(),
        cfg(),
    )
    .expect("engine");
    let mut gg = Engine::new(kiln_tests::default_model(), cfg()).expect("engine");
    let msgs = [model::ChatMessage::text("user", "Name three fruits.")];
    let prompt_hf = hf.loaded().tokenizer.chat_prompt(&msgs).unwrap();
    let prompt_gg = gg.loaded().tokenizer.chat_prompt(&msgs).unwrap();
    assert_eq!(prompt_hf, prompt_gg);
    let ids = hf.loaded().tokenizer.encode(&prompt_hf, true).unwrap();
    assert_eq!(ids, gg.loaded().tokenizer.encode(&prompt_gg, true).unwrap());
    let a = hf
        .teacher_forced_logits(TenantId(1), &ids, ids.len() - 4)
        .unwrap();
    let b = gg
        .teacher_forced_logits(TenantId(1), &ids, ids.len() - 4)
        .unwrap();
    // Same weights, different summation order (f32 rows vs fused Q4_1
    // blocks) over 30 layers: differences of a few hundredths (llama.cpp
    // itself differs from this engine by ~0.1 on average). A wrong
    // RoPE layout or q/k permutation moves logits by whole units.
    for (la, lb) in a.iter().zip(&b) {
        let max = la
            .iter()
            .zip(lb)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        let mean = la.iter().zip(lb).map(|(x, y)| (x - y).abs()).sum::<f32>() / la.len() as f32;
        assert!(
            max < 0.25 && mean < 0.1,
            "logits differ by up to {max} (mean {mean})"
        );
        assert_eq!(
            kiln_kernels::sample::argmax(la),
            kiln_kernels::sample::argmax(lb)
        );
    }
}

#[test]
fn synthetic_models_have_real_shapes_and_run() {
    let loaded = model::load("s", "synthetic:smollm2-135m").unwrap();
    let c = loaded.model.config.clone();
    assert_eq!(
        (c.hidden, c.layers, c.heads, c.kv_heads, c.vocab),
        (576, 30, 9, 3, 49152)
    );
    let mut e = Engine::new(
        loaded,
        EngineConfig {
            kv_memory: 16 << 20,
            ..Default::default()
        },
    )
    .expect("engine");
    let params = kiln_host::engine::GenerateParams {
        max_tokens: 2,
        temperature: 0.0,
        ignore_eos: true,
        ..Default::default()
    };
    let out = e
        .generate(
            TenantId(0),
            b"hello".iter().map(|b| *b as u32).collect(),
            params,
        )
        .unwrap();
    assert_eq!(out.tokens.len(), 2);
    assert!(model::load("s", "synthetic:gpt-9").is_err());
}

#[test]
fn unsupported_inputs_get_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let bogus = dir.path().join("x.gguf");
    std::fs::write(&bogus, b"not a gguf").unwrap();
    let e = model::load("x", bogus.to_str().unwrap())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("not a GGUF file"), "{e}");
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"architectures": ["GPT2LMHeadModel"]}"#,
    )
    .unwrap();
    let e = model::load("x", dir.path().to_str().unwrap())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("GPT2LMHeadModel"), "{e}");
    let e = model::resolve_model("no/such/path", dir.path())
        .unwrap_err()
        .to_string();
    assert!(e.contains("neither"), "{e}");
}
