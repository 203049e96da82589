//! The shape of a llama-family model.

use kiln_kernels::ops::{Llama3Scaling, RopeStyle};

/// Supported architectures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama 2/3, SmolLM2, Mistral.
    Llama,
    /// Qwen2 (biases on q, k, v).
    Qwen2,
}

/// Hyper-parameters of a model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Architecture.
    pub arch: Arch,
    /// Vocabulary size.
    pub vocab: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Feed-forward size.
    pub ffn: usize,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// RoPE base.
    pub rope_theta: f32,
    /// Llama 3 RoPE scaling, if any.
    pub rope_scaling: Option<Llama3Scaling>,
    /// Which elements RoPE pairs (depends on the weight layout).
    pub rope_style: RopeStyle,
    /// Longest context.
    pub context_length: usize,
}

impl ModelConfig {
    /// Parameters, roughly (for reporting).
    pub fn parameters(&self) -> usize {
        let attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads);
        let mlp = 3 * self.hidden * self.ffn;
        self.layers * (attn + mlp) + 2 * self.vocab * self.hidden
    }
}
