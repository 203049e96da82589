//! Architectures, each written once over [`Ops`]: the operations a decoder
//! step is made of. The CPU ([`super::cpu`]) and CUDA ([`super::gpu`])
//! backends implement them; a backend's fused paths (stacked GEMMs, norms
//! folded into GEMVs, captured graphs) are its way of running the same
//! operations, not a second forward pass.
//!
//! Adding an architecture is a file here (its weights' names and its
//! forward pass over [`Ops`]) and an [`Arch`] variant; an operation it
//! needs that [`Ops`] lacks comes with its CPU reference.

mod llama;
mod qwen2;

use kiln_kernels::KernelError;
use kiln_kernels::ops::RopeStyle;

use super::Arch;

/// The result of an operation.
pub(crate) type R<T = ()> = Result<T, KernelError>;

/// How a backend holds weights.
pub(crate) trait Backend {
    /// A vector: a norm's weights, a bias.
    type Vector;
    /// One weight matrix.
    type Matrix;
    /// Matrices that read the same input (q, k and v; gate and up), which a
    /// backend may stack into one.
    type Stack;
    /// Bytes of a matrix.
    fn matrix_bytes(m: &Self::Matrix) -> usize;
    /// Bytes of a stack.
    fn stack_bytes(s: &Self::Stack) -> usize;
}

/// One transformer block of the llama family.
pub(crate) struct Block<B: Backend> {
    /// The norm before attention.
    pub attn_norm: B::Vector,
    /// q, k and v.
    pub qkv: B::Stack,
    /// Biases of q, k and v (Qwen2).
    pub qkv_bias: Option<[B::Vector; 3]>,
    /// The attention's output projection.
    pub wo: B::Matrix,
    /// The norm before the MLP.
    pub ffn_norm: B::Vector,
    /// The MLP's gate and up projections.
    pub gate_up: B::Stack,
    /// The MLP's down projection.
    pub down: B::Matrix,
}

/// A decoder's weights on one backend.
pub(crate) struct Decoder<B: Backend> {
    /// The token embedding.
    pub embed: B::Matrix,
    /// The blocks.
    pub blocks: Vec<Block<B>>,
    /// The final norm.
    pub norm: B::Vector,
    /// The output head; `None` when it is tied to the embedding.
    pub output: Option<B::Matrix>,
}

/// Moves weights from one backend to another (an upload).
pub(crate) trait Convert<A: Backend, B: Backend> {
    /// A vector.
    fn vector(&mut self, v: &A::Vector) -> R<B::Vector>;
    /// A matrix.
    fn matrix(&mut self, m: &A::Matrix) -> R<B::Matrix>;
    /// A stack.
    fn stack(&mut self, s: &A::Stack) -> R<B::Stack>;
}

impl<A: Backend> Decoder<A> {
    /// The same weights on backend `B`.
    pub(crate) fn convert<B: Backend>(&self, f: &mut impl Convert<A, B>) -> R<Decoder<B>> {
        let blocks = self
            .blocks
            .iter()
            .map(|b| {
                Ok(Block {
                    attn_norm: f.vector(&b.attn_norm)?,
                    qkv: f.stack(&b.qkv)?,
                    qkv_bias: match &b.qkv_bias {
                        Some([q, k, v]) => Some([f.vector(q)?, f.vector(k)?, f.vector(v)?]),
                        None => None,
                    },
                    wo: f.matrix(&b.wo)?,
                    ffn_norm: f.vector(&b.ffn_norm)?,
                    gate_up: f.stack(&b.gate_up)?,
                    down: f.matrix(&b.down)?,
                })
            })
            .collect::<R<Vec<_>>>()?;
        Ok(Decoder {
            embed: f.matrix(&self.embed)?,
            blocks,
            norm: f.vector(&self.norm)?,
            output: self.output.as_ref().map(|m| f.matrix(m)).transpose()?,
        })
    }

    /// The output head's weights.
    pub(crate) fn head(&self) -> &A::Matrix {
        self.output.as_ref().unwrap_or(&self.embed)
    }

    /// Bytes of the matrices a decode step reads: every block's and the
    /// head.
    pub(crate) fn weight_bytes(&self) -> usize {
        let blocks: usize = self
            .blocks
            .iter()
            .map(|b| {
                A::stack_bytes(&b.qkv)
                    + A::stack_bytes(&b.gate_up)
                    + A::matrix_bytes(&b.wo)
                    + A::matrix_bytes(&b.down)
            })
            .sum();
        blocks + A::matrix_bytes(self.head())
    }
}

/// What a projection reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Input {
    /// The attention's output.
    Attention,
    /// The MLP's activation, `silu(gate) * up`.
    Mlp,
}

/// The operations of a decoder step, run by a backend on its own buffers
/// for the step's tokens: a hidden row per token (the residual stream), the
/// normed rows the next projection reads, q/k/v, the attention's output,
/// the MLP's activation and the results. A backend may run an operation
/// late or fused with the next one, as long as what it computes is this.
pub(crate) trait Ops<'w> {
    /// How this backend holds weights.
    type W: Backend + 'w;

    /// The hidden rows are the embedding rows of the step's tokens.
    fn embed(&mut self, table: &'w <Self::W as Backend>::Matrix) -> R;
    /// The next projection reads `rmsnorm(hidden) * w`.
    fn norm(&mut self, w: &'w <Self::W as Backend>::Vector) -> R;
    /// Block `layer`'s attention: q, k and v of the normed rows (plus
    /// `bias`), RoPE on q and k, the new K and V written to the layer's
    /// pages, and each token's attention over its sequence so far.
    fn attention(
        &mut self,
        layer: usize,
        qkv: &'w <Self::W as Backend>::Stack,
        bias: Option<&'w [<Self::W as Backend>::Vector; 3]>,
    ) -> R;
    /// The MLP's activation `silu(normed * gate) * (normed * up)`.
    fn gated_mlp(&mut self, gate_up: &'w <Self::W as Backend>::Stack) -> R;
    /// `hidden += input * w`; the next projection reads
    /// `rmsnorm(hidden) * next`.
    fn add_projection(
        &mut self,
        input: Input,
        w: &'w <Self::W as Backend>::Matrix,
        next: &'w <Self::W as Backend>::Vector,
    ) -> R;
    /// The logits of the normed rows of the sequences that want a result,
    /// and their tokens where the device chooses them.
    fn head(&mut self, w: &'w <Self::W as Backend>::Matrix) -> R;
}

impl Arch {
    /// Runs one step of this architecture on `ops`.
    pub(crate) fn forward<'w, O: Ops<'w>>(self, ops: &mut O, w: &'w Decoder<O::W>) -> R {
        match self {
            Arch::Llama => llama::forward(ops, w),
            Arch::Qwen2 => qwen2::forward(ops, w),
        }
    }

    /// Whether its blocks have q, k and v biases.
    pub(crate) fn qkv_bias(self) -> bool {
        match self {
            Arch::Llama => false,
            Arch::Qwen2 => qwen2::QKV_BIAS,
        }
    }

    /// How its GGUF files lay out q and k for RoPE.
    pub(crate) fn gguf_rope_style(self) -> RopeStyle {
        match self {
            Arch::Llama => llama::GGUF_ROPE,
            Arch::Qwen2 => qwen2::GGUF_ROPE,
        }
    }
}

/// The architecture a GGUF `general.architecture` names.
pub(crate) fn from_gguf(name: &str) -> Option<Arch> {
    [llama::GGUF_NAME, qwen2::GGUF_NAME]
        .iter()
        .position(|n| *n == name)
        .map(|i| [Arch::Llama, Arch::Qwen2][i])
}

/// The architecture a Hugging Face `config.json` names.
pub(crate) fn from_hf(name: &str) -> Option<Arch> {
    if llama::HF_NAMES.contains(&name) {
        Some(Arch::Llama)
    } else if qwen2::HF_NAMES.contains(&name) {
        Some(Arch::Qwen2)
    } else {
        None
    }
}
