//! 4-bit weights (W4A16) from GPTQ and AWQ checkpoints, read into Kiln's
//! int4 groups (`kiln_kernels::quant`).
//!
//! Both checkpoint kinds store `w = (q - z) * s` for each group of `g`
//! inputs of an output, with 4-bit `q` and `z` packed eight to an `i32`
//! (bit `4i` up holds the `i`-th) and f16 scales `s [K/g, N]`:
//! - GPTQ: `qweight [K/8, N]` packed along the inputs K, `qzeros [K/g, N/8]`
//!   along the outputs N; format v1 (the default) stores `z - 1`.
//! - AWQ (GEMM): `qweight [K, N/8]` and `qzeros [K/g, N/8]`, both packed
//!   along N, the `i`-th nibble holding output `[0, 2, 4, 6, 1, 3, 5,
//!   7][i]` of its eight.

use half::f16;
use kiln_kernels::matmul::Weight;
use kiln_kernels::quant::{DType, push_int4_group};
use rayon::prelude::*;
use safetensors::tensor::TensorView;

use super::ModelError;

/// AWQ's packing order inverted: output `j` of eight is in nibble
/// `AWQ_NIBBLE[j]` (AWQ packs output `[0, 2, 4, 6, 1, 3, 5, 7][i]` into
/// nibble `i`).
const AWQ_NIBBLE: [usize; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

/// How a checkpoint packs its 4-bit weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Packing {
    /// GPTQ; `zero_offset` is added to each stored zero (1 in format v1).
    Gptq {
        /// Added to the stored zeros.
        zero_offset: u32,
    },
    /// AWQ, GEMM layout.
    Awq,
}

/// A checkpoint's `quantization_config`, as far as Kiln reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantConfig {
    /// How the weights are packed.
    pub packing: Packing,
    /// Inputs per group.
    pub group: usize,
}

impl QuantConfig {
    /// The quantization of a Hugging Face `config.json`: `None` for a
    /// model in floats, an error naming what Kiln cannot run.
    pub fn from_hf(cfg: &serde_json::Value) -> Result<Option<Self>, ModelError> {
        let q = &cfg["quantization_config"];
        if q.is_null() {
            return Ok(None);
        }
        let method = q["quant_method"].as_str().unwrap_or("?");
        let bits = q["bits"].as_u64().or(q["w_bit"].as_u64()).unwrap_or(0);
        let group = q["group_size"]
            .as_i64()
            .or(q["q_group_size"].as_i64())
            .unwrap_or(0);
        let unsupported = |what: String| Err(ModelError::Unsupported(what));
        if bits != 4 {
            return unsupported(format!(
                "{method} with {bits}-bit weights; Kiln reads 4-bit GPTQ and AWQ"
            ));
        }
        let group = match group {
            128 | 64 => group as usize,
            other => {
                return unsupported(format!(
                    "{method} groups of {other}; Kiln reads groups of 128 or 64"
                ));
            }
        };
        let packing = match method {
            "gptq" => {
                let v2 = q["checkpoint_format"].as_str() == Some("gptq_v2");
                Packing::Gptq {
                    zero_offset: if v2 { 0 } else { 1 },
                }
            }
            "awq" => {
                let version = q["version"].as_str().unwrap_or("gemm").to_lowercase();
                if version != "gemm" {
                    return unsupported(format!(
                        "AWQ's `{version}` layout; Kiln reads the GEMM layout"
                    ));
                }
                if q["zero_point"].as_bool() == Some(false) {
                    return unsupported("AWQ without zero points".into());
                }
                Packing::Awq
            }
            other => {
                return unsupported(format!(
                    "quantization `{other}`; Kiln reads GPTQ and AWQ (4-bit), or rounds a \
                     float model itself with `--weights int4`"
                ));
            }
        };
        Ok(Some(Self { packing, group }))
    }
}

/// A tensor's little-endian 32-bit words and its 2-D shape.
fn words(name: &str, t: &TensorView<'_>) -> Result<(Vec<u32>, [usize; 2]), ModelError> {
    let shape = two_d(name, t)?;
    if !matches!(t.dtype(), safetensors::Dtype::I32 | safetensors::Dtype::U32) {
        return Err(ModelError::Format(format!(
            "{name} is {:?}; packed 4-bit weights are int32",
            t.dtype()
        )));
    }
    Ok((le_words(t.data()), shape))
}

/// Little-endian 32-bit words.
fn le_words(data: &[u8]) -> Vec<u32> {
    data.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn two_d(name: &str, t: &TensorView<'_>) -> Result<[usize; 2], ModelError> {
    match t.shape() {
        [a, b] => Ok([*a, *b]),
        s => Err(ModelError::Format(format!(
            "{name} has shape {s:?}, not 2-D"
        ))),
    }
}

/// The packed tensors of one quantized projection.
pub struct Packed<'a> {
    /// `qweight`.
    pub qweight: TensorView<'a>,
    /// `qzeros`.
    pub qzeros: TensorView<'a>,
    /// `scales`.
    pub scales: TensorView<'a>,
    /// GPTQ's `g_idx`, if stored.
    pub g_idx: Option<TensorView<'a>>,
}

/// `p` (the projection `name`) as an int4 weight of `N` rows (outputs) of
/// `K` inputs.
pub fn unpack(name: &str, q: QuantConfig, p: &Packed<'_>) -> Result<Weight, ModelError> {
    let bad = |m: String| Err(ModelError::Format(format!("{name}: {m}")));
    let (qw, [a, b]) = words(name, &p.qweight)?;
    let (qz, [zg, zn8]) = words(name, &p.qzeros)?;
    let [sg, n] = two_d(name, &p.scales)?;
    let (k, n_from_w) = match q.packing {
        Packing::Gptq { .. } => (a * 8, b),
        Packing::Awq => (a, b * 8),
    };
    let g = q.group;
    if n_from_w != n || !k.is_multiple_of(g) || sg != k / g || zg != sg || zn8 * 8 != n {
        return bad(format!(
            "qweight {:?}, qzeros {:?} and scales {:?} do not fit together in groups of {g}",
            p.qweight.shape(),
            p.qzeros.shape(),
            p.scales.shape()
        ));
    }
    if p.scales.dtype() != safetensors::Dtype::F16 {
        return bad(format!("scales are {:?}, not f16", p.scales.dtype()));
    }
    if let Some(gi) = &p.g_idx {
        let in_order = |idx: &[u32]| {
            idx.len() == k && idx.iter().enumerate().all(|(i, v)| *v as usize == i / g)
        };
        if gi.dtype() != safetensors::Dtype::I32 || !in_order(&le_words(gi.data())) {
            return Err(ModelError::Unsupported(format!(
                "{name}: GPTQ with act-order (desc_act) groups; Kiln reads checkpoints whose \
                 g_idx is in order"
            )));
        }
    }
    let scales: Vec<f16> = p
        .scales
        .data()
        .chunks_exact(2)
        .map(|c| f16::from_le_bytes([c[0], c[1]]))
        .collect();
    let nib = |word: u32, i: usize| (word >> (4 * i)) & 0xf;
    let quant = |kk: usize, nn: usize| -> u8 {
        match q.packing {
            Packing::Gptq { .. } => nib(qw[(kk / 8) * n + nn], kk % 8) as u8,
            Packing::Awq => nib(qw[kk * (n / 8) + nn / 8], AWQ_NIBBLE[nn % 8]) as u8,
        }
    };
    let zero = |gi: usize, nn: usize| -> u32 {
        match q.packing {
            Packing::Gptq { zero_offset } => nib(qz[gi * (n / 8) + nn / 8], nn % 8) + zero_offset,
            Packing::Awq => nib(qz[gi * (n / 8) + nn / 8], AWQ_NIBBLE[nn % 8]),
        }
    };
    let dtype = int4_type(g);
    let rows: Vec<Vec<u8>> = (0..n)
        .into_par_iter()
        .map(|nn| {
            let mut row = Vec::with_capacity(dtype.bytes_for(k));
            let mut qs = vec![0u8; g];
            for gi in 0..k / g {
                let s = scales[gi * n + nn];
                let m = f16::from_f32(-(zero(gi, nn) as f32) * s.to_f32());
                for (j, q) in qs.iter_mut().enumerate() {
                    *q = quant(gi * g + j, nn);
                }
                push_int4_group(s, m, &qs, &mut row);
            }
            row
        })
        .collect();
    Weight::from_bytes(dtype, n, k, rows.concat()).map_err(ModelError::from)
}

fn int4_type(group: usize) -> DType {
    if group == 64 {
        DType::Int4G64
    } else {
        DType::Int4G128
    }
}

#[cfg(test)]
#[path = "int4_tests.rs"]
mod tests;
