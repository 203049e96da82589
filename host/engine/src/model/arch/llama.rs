//! Llama 2/3, SmolLM2 and Mistral: pre-norm blocks of grouped-query
//! attention with RoPE and a SiLU-gated MLP, RMSNorm throughout.

use kiln_kernels::ops::RopeStyle;

use super::{Backend, Block, Decoder, Input, Ops, R};

/// Its `general.architecture` in GGUF files.
pub(super) const GGUF_NAME: &str = "llama";
/// Its `architectures` in Hugging Face `config.json` files.
pub(super) const HF_NAMES: &[&str] = &["LlamaForCausalLM", "MistralForCausalLM"];
/// ggml's converter permutes q and k rows so RoPE rotates interleaved
/// pairs.
pub(super) const GGUF_ROPE: RopeStyle = RopeStyle::Interleaved;

/// One step: embedding, the blocks, the head.
pub(super) fn forward<'w, O: Ops<'w>>(o: &mut O, w: &'w Decoder<O::W>) -> R {
    o.embed(&w.embed)?;
    if let Some(first) = w.blocks.first() {
        o.norm(&first.attn_norm)?;
    }
    for (i, b) in w.blocks.iter().enumerate() {
        // Each residual add hands the stream to the norm that reads it next.
        let next = w.blocks.get(i + 1).map_or(&w.norm, |n| &n.attn_norm);
        block(o, i, b, next)?;
    }
    if w.blocks.is_empty() {
        o.norm(&w.norm)?;
    }
    o.head(w.head())
}

/// Block `i`: attention and MLP, each added to the residual stream.
pub(super) fn block<'w, O: Ops<'w>>(
    o: &mut O,
    i: usize,
    b: &'w Block<O::W>,
    next: &'w <O::W as Backend>::Vector,
) -> R {
    o.attention(i, &b.qkv, b.qkv_bias.as_ref())?;
    o.add_projection(Input::Attention, &b.wo, &b.ffn_norm)?;
    o.gated_mlp(&b.gate_up)?;
    o.add_projection(Input::Mlp, &b.down, next)
}
