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
//! - [`backend`]: one interface over every kernel, for the CPU and CUDA.
//! - [`cuda`]: the CUDA backend (NVRTC-compiled kernels, cuBLAS).

pub mod backend;
pub mod cuda;
pub mod fp8;
pub mod hadamard;
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
    /// CUDA GPU number `n`.
    Cuda(usize),
}

impl Device {
    /// The device's name as the command line spells it.
    pub fn name(self) -> String {
        match self {
            Device::Cpu => "cpu".into(),
            Device::Cuda(n) => format!("cuda:{n}"),
        }
    }
}

impl std::str::FromStr for Device {
    type Err = String;

    /// `cpu`, `cuda` (GPU 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("unknown device `{s}`: use cpu, cuda or cuda:N")),
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
    /// The device asked for cannot be used here.
    #[error("device unavailable: {0}")]
    DeviceUnavailable(String),
    /// A CUDA call failed.
    #[error("CUDA error: {0}")]
    Cuda(String),
    /// A tensor-parallel rank stopped because another one failed (the
    /// other's error says why).
    #[error("tensor-parallel ranks: {0}")]
    OtherRank(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_is_the_default_device() {
        assert_eq!(Device::default().name(), "cpu");
    }

    #[test]
    fn devices_parse_as_the_command_line_spells_them() {
        assert_eq!("cuda".parse(), Ok(Device::Cuda(0)));
        assert_eq!("cuda:3".parse(), Ok(Device::Cuda(3)));
        assert!("gpu".parse::<Device>().is_err());
    }
}
