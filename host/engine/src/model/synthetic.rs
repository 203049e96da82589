//! Models of real shapes with seeded random weights, for benchmarks and
//! device tests that need no download.

use kiln_kernels::matmul::Weight;
use kiln_kernels::ops::{Rope, RopeStyle};
use kiln_kernels::quant::{DType, quantize};
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

use super::arch::{Block, Decoder};
use super::cpu::{Host, Model};
use super::{Arch, ModelConfig, ModelError, Tokenizer};

/// The shapes, by name: architecture, (hidden, layers, heads, kv heads,
/// ffn, vocab) and the RoPE base.
type Shape = (&'static str, Arch, [usize; 6], f32);

const SHAPES: &[Shape] = &[
    (
        "llama-3-8b",
        Arch::Llama,
        [4096, 32, 32, 8, 14336, 128256],
        500000.0,
    ),
    (
        "llama-3-70b",
        Arch::Llama,
        [8192, 80, 64, 8, 28672, 128256],
        500000.0,
    ),
    (
        "llama-3.2-1b",
        Arch::Llama,
        [2048, 16, 32, 8, 8192, 128256],
        500000.0,
    ),
    (
        "smollm2-135m",
        Arch::Llama,
        [576, 30, 9, 3, 1536, 49152],
        100000.0,
    ),
    (
        "qwen2.5-0.5b",
        Arch::Qwen2,
        [896, 24, 14, 2, 4864, 151936],
        1000000.0,
    ),
];

/// `synthetic:NAME`: bf16 weights (biases f32) drawn from seeded
/// generators, unit norms, a byte tokenizer.
pub(super) fn synthetic(spec: &str) -> Result<(Model, Tokenizer), ModelError> {
    let Some(&(_, arch, [hidden, layers, heads, kv_heads, ffn, vocab], theta)) =
        SHAPES.iter().find(|s| s.0 == spec)
    else {
        let names: Vec<String> = SHAPES
            .iter()
            .map(|s| format!("synthetic:{}", s.0))
            .collect();
        return Err(ModelError::Unsupported(format!(
            "unknown synthetic model `{spec}`; try {}",
            names.join(", ")
        )));
    };
    let hd = hidden / heads;
    let config = ModelConfig {
        arch,
        vocab,
        hidden,
        layers,
        heads,
        kv_heads,
        head_dim: hd,
        ffn,
        eps: 1e-5,
        rope_theta: theta,
        rope_scaling: None,
        rope_style: RopeStyle::Half,
        context_length: 8192,
    };
    let mut seeds = Seeds(0x6b696c6e);
    let (q_dim, kv_dim) = (heads * hd, kv_heads * hd);
    let mut blocks = Vec::with_capacity(layers);
    let bar = super::progress::bar(layers, format!("making {spec}'s random layers"));
    for _ in 0..layers {
        bar.inc(1);
        let mut w = |rows, cols| seeds.weight(rows, cols).map_err(ModelError::from);
        let qkv = vec![w(q_dim, hidden)?, w(kv_dim, hidden)?, w(kv_dim, hidden)?];
        let wo = w(hidden, q_dim)?;
        let gate_up = vec![w(ffn, hidden)?, w(ffn, hidden)?];
        let down = w(hidden, ffn)?;
        let qkv_bias = arch
            .qkv_bias()
            .then(|| [q_dim, kv_dim, kv_dim].map(|n| seeds.vector(n)));
        blocks.push(Block::<Host> {
            attn_norm: vec![1.0; hidden],
            qkv,
            qkv_bias,
            wo,
            ffn_norm: vec![1.0; hidden],
            gate_up,
            down,
        });
    }
    bar.finish_and_clear();
    let embed = seeds.weight(vocab, hidden).map_err(ModelError::from)?;
    let model = Model {
        config,
        weights: Decoder {
            embed,
            blocks,
            norm: vec![1.0; hidden],
            output: None,
        },
        rope: Rope::new(hd, theta, None, RopeStyle::Half),
    };
    Ok((model, Tokenizer::bytes(vocab)))
}

/// Each matrix from its own seed, its rows in parallel (a generator per
/// 64-row band), so an 8B model builds in seconds on a many-core host and
/// is the same whatever the thread count.
struct Seeds(u64);

impl Seeds {
    fn next(&mut self) -> u64 {
        self.0 += 1;
        self.0
    }

    fn weight(&mut self, rows: usize, cols: usize) -> Result<Weight, kiln_kernels::KernelError> {
        let seed = self.next();
        // Uniform with the std of N(0, 0.02), the usual init scale.
        let a = 0.02 * 3f32.sqrt();
        let mut bytes = vec![0u8; rows * cols * 2];
        bytes
            .par_chunks_mut(64 * cols * 2)
            .enumerate()
            .for_each(|(band, out)| {
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed << 20 ^ band as u64);
                let values: Vec<f32> = (0..out.len() / 2)
                    .map(|_| rng.random_range(-a..a))
                    .collect();
                out.copy_from_slice(&quantize(DType::BF16, &values));
            });
        Weight::from_bytes(DType::BF16, rows, cols, bytes)
    }

    /// A bias: larger than the weights, as trained q/k biases are.
    fn vector(&mut self, n: usize) -> Vec<f32> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(self.next() << 20);
        (0..n).map(|_| rng.random_range(-0.5..0.5)).collect()
    }
}
