//! Qwen2 and Qwen2.5: llama's blocks with biases on q, k and v, and RoPE
//! over the two halves of each head.

use kiln_kernels::ops::RopeStyle;

use super::{Decoder, Ops, R, llama};

/// Its `general.architecture` in GGUF files.
pub(super) const GGUF_NAME: &str = "qwen2";
/// Its `architectures` in Hugging Face `config.json` files.
pub(super) const HF_NAMES: &[&str] = &["Qwen2ForCausalLM"];
/// Its GGUF files keep q and k as trained: RoPE rotates halves.
pub(super) const GGUF_ROPE: RopeStyle = RopeStyle::Half;
/// Every block has q, k and v biases.
pub(super) const QKV_BIAS: bool = true;

/// One step: embedding, llama's blocks (their q, k and v biases loaded),
/// the head.
pub(super) fn forward<'w, O: Ops<'w>>(o: &mut O, w: &'w Decoder<O::W>) -> R {
    if w.blocks.iter().any(|b| b.qkv_bias.is_none()) {
        return Err(kiln_kernels::KernelError::Shape(
            "a Qwen2 block lacks its q, k and v biases".into(),
        ));
    }
    llama::forward(o, w)
}
