//! Kiln's compute kernels.
//!
//! Every kernel has a CPU implementation here, which is also the reference
//! that faster backends are checked against. This crate knows nothing of
//! tenants, requests or HTTP: it works on slices, weights and KV pages.
//!
//! - [`quant`]: GGUF block formats and dequantization.
//! - [`matmul`]: activations times (possibly quantized) weight matrices.
//! - [`qdot`]: vectorized dequantization and fused dot products for block formats.
//! - [`ops`]: RMSNorm, RoPE, SiLU-and-multiply, embedding, softmax.
//! - [`fp8`]: FP8 e4m3 encoding with a per-vector scale.
//! - [`kv`]: paged KV storage (bf16 or fp8) and paged attention.
//! - [`sample`]: argmax and seeded top-k / top-p sampling.

pub mod fp8;
pub mod kv;
pub mod matmul;
pub mod ops;
pub mod qdot;
pub mod quant;
pub mod sample;
mod simd;

/// A device kernels can run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    /// The CPU: the default, and the reference for every other device.
    #[default]
    Cpu,
}

impl Device {
    /// The device's name as the command line spells it.
    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
        }
    }
}

/// Errors of kernel setup (shape or format mismatches).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KernelError {
    /// A tensor's element type is not supported.
    #[error("unsupported tensor type {0}")]
    UnsupportedType(String),
    /// Sizes disagree.
    #[error("shape mismatch: {0}")]
    Shape(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_is_the_default_device() {
        assert_eq!(Device::default().name(), "cpu");
    }
}
