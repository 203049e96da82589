//! Building a [`Model`] from GGUF, a safetensors directory, or a synthetic
//! spec.

use std::path::Path;

use kiln_kernels::matmul::Weight;
use kiln_kernels::ops::{Llama3Scaling, Rope, RopeStyle};
use kiln_kernels::quant::DType;

use super::arch::{self, Block, Decoder};
use super::convert::{WeightFormat, WeightPlan, convert, convert_head};
use super::cpu::{Host, Model};
use super::gguf::Gguf;
use super::int4::{self, Packed, QuantConfig};
use super::{Loaded, ModelConfig, ModelError, Tokenizer};

/// Loads `source` with its weights as stored: see [`load_as`].
pub fn load(name: &str, source: &str) -> Result<Loaded, ModelError> {
    load_as(name, source, WeightFormat::Native)
}

/// Loads `source` (a `.gguf` file, a Hugging Face directory with
/// config.json, *.safetensors (floats, or 4-bit GPTQ / AWQ) and
/// tokenizer.json, or `synthetic:NAME`), its projections in `weights`: one
/// format, or one for prefill and another for decode (two copies).
pub fn load_as(
    name: &str,
    source: &str,
    weights: impl Into<WeightPlan>,
) -> Result<Loaded, ModelError> {
    let plan = weights.into();
    let (mut model, tokenizer) = if let Some(spec) = source.strip_prefix("synthetic:") {
        super::synthetic::synthetic(spec)?
    } else {
        let path = Path::new(source);
        if path.is_dir() {
            safetensors_dir(path)?
        } else {
            gguf(path)?
        }
    };
    let decode = if plan.is_split() {
        let mut decode = model.duplicate()?;
        convert_logged(name, &mut decode, plan.decode, "decode");
        head_logged(name, &mut decode, plan.head);
        Some(decode)
    } else {
        None
    };
    convert_logged(name, &mut model, plan.prefill, "prefill");
    if !plan.is_split() {
        head_logged(name, &mut model, plan.head);
    }
    Ok(Loaded {
        name: name.to_owned(),
        model,
        decode,
        tokenizer,
        gpu_weights: Default::default(),
    })
}

impl Loaded {
    /// Gives decode its own copy of the weights, converted to `format`
    /// (`Native`: the same values, which measures what running the phases
    /// apart costs by itself).
    pub fn with_decode_weights(mut self, format: WeightFormat) -> Result<Self, ModelError> {
        let mut decode = self.model.duplicate()?;
        convert_logged(&self.name, &mut decode, format, "decode");
        self.decode = Some(decode);
        Ok(self)
    }
}

fn convert_logged(name: &str, model: &mut Model, format: WeightFormat, phase: &str) {
    if format != WeightFormat::Native {
        let (done, kept) = convert(model, format);
        tracing::info!(
            model = name,
            phase,
            "{done} projections as {format:?} ({kept} kept as stored)"
        );
    }
}

fn head_logged(name: &str, model: &mut Model, format: WeightFormat) {
    if format != WeightFormat::Native {
        if convert_head(model, format) {
            tracing::info!(model = name, "output head as {format:?}");
        } else {
            tracing::warn!(
                model = name,
                "output head kept as stored: its rows cannot be {format:?}"
            );
        }
    }
}

fn build(
    config: ModelConfig,
    mut get: impl FnMut(&str) -> Result<Option<Weight>, ModelError>,
    names: &Names,
) -> Result<Model, ModelError> {
    let mut need =
        |n: String| get(&n)?.ok_or_else(|| ModelError::Format(format!("tensor {n} is missing")));
    let vector = |w: Weight| {
        let mut v = vec![0.0; w.cols() * w.rows()];
        for r in 0..w.rows() {
            w.row(r, &mut v[r * w.cols()..(r + 1) * w.cols()]);
        }
        v
    };
    let embed = need(names.embed.into())?;
    let norm = vector(need(names.norm.into())?);
    let mut blocks = Vec::with_capacity(config.layers);
    let bar = super::progress::bar(config.layers, "loading layers".into());
    for i in 0..config.layers {
        bar.inc(1);
        let t = |suffix: &str| (names.layer)(i, suffix);
        let qkv_bias = if config.arch.qkv_bias() {
            Some([
                vector(need(t("q_bias"))?),
                vector(need(t("k_bias"))?),
                vector(need(t("v_bias"))?),
            ])
        } else {
            None
        };
        blocks.push(Block::<Host> {
            attn_norm: vector(need(t("attn_norm"))?),
            qkv: vec![need(t("q"))?, need(t("k"))?, need(t("v"))?],
            qkv_bias,
            wo: need(t("o"))?,
            ffn_norm: vector(need(t("ffn_norm"))?),
            gate_up: vec![need(t("gate"))?, need(t("up"))?],
            down: need(t("down"))?,
        });
    }
    bar.finish_and_clear();
    let output = get(names.output)?;
    let rope = Rope::new(
        config.head_dim,
        config.rope_theta,
        config.rope_scaling,
        config.rope_style,
    );
    Ok(Model {
        config,
        weights: Decoder {
            embed,
            blocks,
            norm,
            output,
        },
        rope,
    })
}

/// Tensor naming of a format.
struct Names {
    embed: &'static str,
    norm: &'static str,
    output: &'static str,
    layer: fn(usize, &str) -> String,
}

fn gguf_layer(i: usize, s: &str) -> String {
    let n = match s {
        "attn_norm" => "attn_norm.weight",
        "q" => "attn_q.weight",
        "k" => "attn_k.weight",
        "v" => "attn_v.weight",
        "o" => "attn_output.weight",
        "q_bias" => "attn_q.bias",
        "k_bias" => "attn_k.bias",
        "v_bias" => "attn_v.bias",
        "ffn_norm" => "ffn_norm.weight",
        "gate" => "ffn_gate.weight",
        "up" => "ffn_up.weight",
        _ => "ffn_down.weight",
    };
    format!("blk.{i}.{n}")
}

fn hf_layer(i: usize, s: &str) -> String {
    let n = match s {
        "attn_norm" => "input_layernorm.weight",
        "q" => "self_attn.q_proj.weight",
        "k" => "self_attn.k_proj.weight",
        "v" => "self_attn.v_proj.weight",
        "o" => "self_attn.o_proj.weight",
        "q_bias" => "self_attn.q_proj.bias",
        "k_bias" => "self_attn.k_proj.bias",
        "v_bias" => "self_attn.v_proj.bias",
        "ffn_norm" => "post_attention_layernorm.weight",
        "gate" => "mlp.gate_proj.weight",
        "up" => "mlp.up_proj.weight",
        _ => "mlp.down_proj.weight",
    };
    format!("model.layers.{i}.{n}")
}

const GGUF_NAMES: Names = Names {
    embed: "token_embd.weight",
    norm: "output_norm.weight",
    output: "output.weight",
    layer: gguf_layer,
};
const HF_NAMES: Names = Names {
    embed: "model.embed_tokens.weight",
    norm: "model.norm.weight",
    output: "lm_head.weight",
    layer: hf_layer,
};

fn gguf(path: &Path) -> Result<(Model, Tokenizer), ModelError> {
    let g = Gguf::open(path)?;
    let arch_name = g.str("general.architecture").unwrap_or("?").to_owned();
    let arch = arch::from_gguf(&arch_name).ok_or_else(|| {
        ModelError::Unsupported(format!(
            "architecture `{arch_name}`; Kiln runs llama-family models (llama, qwen2)"
        ))
    })?;
    let key = |k: &str| format!("{arch_name}.{k}");
    let int = |k: &str| {
        g.int(&key(k))
            .map(|v| v as usize)
            .ok_or_else(|| ModelError::Format(format!("metadata {} is missing", key(k))))
    };
    let hidden = int("embedding_length")?;
    let heads = int("attention.head_count")?;
    let embed_dims = g
        .tensors
        .get("token_embd.weight")
        .map(|t| t.dims.clone())
        .unwrap_or_default();
    let config = ModelConfig {
        arch,
        vocab: embed_dims.get(1).copied().unwrap_or(0),
        hidden,
        layers: int("block_count")?,
        heads,
        kv_heads: int("attention.head_count_kv").unwrap_or(heads),
        head_dim: g
            .int(&key("attention.key_length"))
            .map(|v| v as usize)
            .unwrap_or(hidden / heads),
        ffn: int("feed_forward_length")?,
        eps: g
            .float(&key("attention.layer_norm_rms_epsilon"))
            .unwrap_or(1e-5) as f32,
        rope_theta: g.float(&key("rope.freq_base")).unwrap_or(10000.0) as f32,
        rope_scaling: None,
        rope_style: arch.gguf_rope_style(),
        context_length: int("context_length").unwrap_or(4096),
    };
    let get = |name: &str| -> Result<Option<Weight>, ModelError> {
        if !g.tensors.contains_key(name) {
            return Ok(None);
        }
        let (t, bytes) = g.tensor_bytes(name)?;
        let cols = t.dims[0];
        let rows = t.dims.iter().skip(1).product::<usize>().max(1);
        Weight::from_bytes(t.dtype, rows, cols, bytes.to_vec())
            .map(Some)
            .map_err(ModelError::from)
    };
    let mut model = build(config, get, &GGUF_NAMES)?;
    // Llama 3.1+ GGUF files carry the llama3 RoPE scaling as per-frequency
    // divisors (llama.cpp's `rope_freqs`).
    if let Some(w) = get("rope_freqs.weight")? {
        let mut factors = vec![0.0; w.cols() * w.rows()];
        w.row(0, &mut factors[..w.cols()]);
        model.rope = model
            .rope
            .with_freq_factors(&factors)
            .map_err(ModelError::from)?;
    }
    let tokenizer = Tokenizer::from_gguf(&g)?;
    Ok((model, tokenizer))
}

fn safetensors_dir(dir: &Path) -> Result<(Model, Tokenizer), ModelError> {
    let read = |p: &Path| {
        std::fs::read(p).map_err(|e| ModelError::Io(format!("reading {}: {e}", p.display())))
    };
    let cfg: serde_json::Value = serde_json::from_slice(&read(&dir.join("config.json"))?)
        .map_err(|e| ModelError::Format(format!("config.json: {e}")))?;
    let arch_name = cfg["architectures"][0].as_str().unwrap_or("?");
    let arch = arch::from_hf(arch_name).ok_or_else(|| {
        ModelError::Unsupported(format!(
            "architecture `{arch_name}`; Kiln runs Llama, Mistral and Qwen2"
        ))
    })?;
    let u = |k: &str| {
        cfg[k]
            .as_u64()
            .map(|v| v as usize)
            .ok_or_else(|| ModelError::Format(format!("config.json lacks {k}")))
    };
    let hidden = u("hidden_size")?;
    let heads = u("num_attention_heads")?;
    let rs = &cfg["rope_scaling"];
    let rope_scaling = (rs["rope_type"].as_str() == Some("llama3")).then(|| Llama3Scaling {
        factor: rs["factor"].as_f64().unwrap_or(8.0) as f32,
        low_freq_factor: rs["low_freq_factor"].as_f64().unwrap_or(1.0) as f32,
        high_freq_factor: rs["high_freq_factor"].as_f64().unwrap_or(4.0) as f32,
        original_max_position: rs["original_max_position_embeddings"]
            .as_f64()
            .unwrap_or(8192.0) as f32,
    });
    let config = ModelConfig {
        arch,
        vocab: u("vocab_size")?,
        hidden,
        layers: u("num_hidden_layers")?,
        heads,
        kv_heads: u("num_key_value_heads").unwrap_or(heads),
        head_dim: u("head_dim").unwrap_or(hidden / heads),
        ffn: u("intermediate_size")?,
        eps: cfg["rms_norm_eps"].as_f64().unwrap_or(1e-5) as f32,
        rope_theta: cfg["rope_theta"].as_f64().unwrap_or(10000.0) as f32,
        rope_scaling,
        rope_style: RopeStyle::Half,
        context_length: u("max_position_embeddings").unwrap_or(4096),
    };
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| ModelError::Io(format!("listing {}: {e}", dir.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(ModelError::Format(format!(
            "no *.safetensors in {}",
            dir.display()
        )));
    }
    let blobs = files
        .iter()
        .map(|p| read(p))
        .collect::<Result<Vec<_>, _>>()?;
    let parsed = blobs
        .iter()
        .map(|b| {
            safetensors::SafeTensors::deserialize(b)
                .map_err(|e| ModelError::Format(format!("safetensors: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let quant = QuantConfig::from_hf(&cfg)?;
    let get = |name: &str| -> Result<Option<Weight>, ModelError> {
        for st in &parsed {
            if let Ok(t) = st.tensor(name) {
                return safetensors_weight(name, &t).map(Some);
            }
        }
        // A quantized checkpoint's projection: `.qweight`, `.qzeros`,
        // `.scales` (and GPTQ's `.g_idx`) in place of `.weight`.
        match (quant, name.strip_suffix(".weight")) {
            (Some(q), Some(stem)) => packed(&parsed, stem)?
                .map(|p| int4::unpack(stem, q, &p))
                .transpose(),
            _ => Ok(None),
        }
    };
    let model = build(config, get, &HF_NAMES)?;
    let tokenizer = Tokenizer::from_dir(dir)?;
    Ok((model, tokenizer))
}

/// The packed tensors of projection `stem`, if its `qweight` is stored.
fn packed<'a>(
    parsed: &'a [safetensors::SafeTensors<'a>],
    stem: &str,
) -> Result<Option<Packed<'a>>, ModelError> {
    let find = |suffix: &str| {
        parsed
            .iter()
            .find_map(|st| st.tensor(&format!("{stem}.{suffix}")).ok())
    };
    let Some(qweight) = find("qweight") else {
        return Ok(None);
    };
    let missing = |s: &str| ModelError::Format(format!("{stem}.qweight without {stem}.{s}"));
    Ok(Some(Packed {
        qweight,
        qzeros: find("qzeros").ok_or_else(|| missing("qzeros"))?,
        scales: find("scales").ok_or_else(|| missing("scales"))?,
        g_idx: find("g_idx"),
    }))
}

/// One safetensors tensor as a weight matrix (its last dimension the
/// row length).
fn safetensors_weight(
    name: &str,
    t: &safetensors::tensor::TensorView<'_>,
) -> Result<Weight, ModelError> {
    let dtype = match t.dtype() {
        safetensors::Dtype::F32 => DType::F32,
        safetensors::Dtype::F16 => DType::F16,
        safetensors::Dtype::BF16 => DType::BF16,
        other => {
            return Err(ModelError::Unsupported(format!(
                "tensor {name} has dtype {other:?}"
            )));
        }
    };
    let shape = t.shape();
    let cols = *shape.last().unwrap_or(&1);
    let rows = shape
        .iter()
        .rev()
        .skip(1)
        .try_fold(1usize, |n, d| n.checked_mul(*d))
        .ok_or_else(|| ModelError::Format(format!("tensor {name}'s shape overflows")))?
        .max(1);
    Weight::from_bytes(dtype, rows, cols, t.data().to_vec()).map_err(ModelError::from)
}

#[cfg(test)]
#[path = "safetensors_fuzz.rs"]
mod fuzz;
