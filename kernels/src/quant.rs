//! Element types of weight tensors, including GGUF's block-quantized ones,
//! and their dequantization to f32.
//!
//! Block formats (32 weights a block, little-endian):
//! - `Q4_0`: f16 scale `d`, 16 bytes of nibbles; `w = (q - 8) * d`.
//! - `Q4_1`: f16 scale `d`, f16 minimum `m`, 16 bytes of nibbles; `w = q * d + m`.
//! - `Q8_0`: f16 scale `d`, 32 signed bytes; `w = q * d`.
//!
//! In a nibble block, byte `j` holds weight `j` in its low nibble and weight
//! `j + 16` in its high nibble.

use half::{bf16, f16};

use crate::KernelError;

/// Weights per quantization block.
pub const QK: usize = 32;

/// The element type of a weight tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// GGUF Q4_0.
    Q4_0,
    /// GGUF Q4_1.
    Q4_1,
    /// GGUF Q8_0.
    Q8_0,
}

impl DType {
    /// The GGUF (ggml) type id's dtype, or an error naming the type.
    pub fn from_ggml(id: u32) -> Result<Self, KernelError> {
        Ok(match id {
            0 => DType::F32,
            1 => DType::F16,
            2 => DType::Q4_0,
            3 => DType::Q4_1,
            8 => DType::Q8_0,
            30 => DType::BF16,
            other => {
                let name = match other {
                    6 => "Q5_0",
                    7 => "Q5_1",
                    9 => "Q8_1",
                    10 => "Q2_K",
                    11 => "Q3_K",
                    12 => "Q4_K",
                    13 => "Q5_K",
                    14 => "Q6_K",
                    15 => "Q8_K",
                    16..=23 => "IQ (importance-matrix) quant",
                    24 => "I8",
                    25 => "I16",
                    26 => "I32",
                    27 => "I64",
                    28 => "F64",
                    _ => "unknown",
                };
                return Err(KernelError::UnsupportedType(format!(
                    "ggml type {other} ({name}); supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1"
                )));
            }
        })
    }

    /// Bytes taken by `n` elements (`n` a multiple of [`QK`] for blocks).
    pub fn bytes_for(self, n: usize) -> usize {
        match self {
            DType::F32 => n * 4,
            DType::F16 | DType::BF16 => n * 2,
            DType::Q4_0 => n / QK * 18,
            DType::Q4_1 => n / QK * 20,
            DType::Q8_0 => n / QK * 34,
        }
    }

    /// Whether rows must be a multiple of [`QK`] long.
    pub fn is_block(self) -> bool {
        matches!(self, DType::Q4_0 | DType::Q4_1 | DType::Q8_0)
    }
}

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantizes one row of `out.len()` elements from its bytes.
pub fn dequantize_row(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(18)) {
                let d = f16_at(b, 0);
                for j in 0..16 {
                    let q = b[2 + j];
                    o[j] = ((q & 0x0f) as i32 - 8) as f32 * d;
                    o[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        DType::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(20)) {
                let d = f16_at(b, 0);
                let m = f16_at(b, 2);
                for j in 0..16 {
                    let q = b[4 + j];
                    o[j] = (q & 0x0f) as f32 * d + m;
                    o[j + 16] = (q >> 4) as f32 * d + m;
                }
            }
        }
        DType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(34)) {
                let d = f16_at(b, 0);
                for j in 0..QK {
                    o[j] = (b[2 + j] as i8) as f32 * d;
                }
            }
        }
    }
}

/// Quantizes `values` (a multiple of [`QK`] long) into `dtype`'s format.
/// Used to build test and synthetic weights; float types are stored as-is.
pub fn quantize(dtype: DType, values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(dtype.bytes_for(values.len()));
    match dtype {
        DType::F32 => values.iter().for_each(|v| out.extend(v.to_le_bytes())),
        DType::F16 => values
            .iter()
            .for_each(|v| out.extend(f16::from_f32(*v).to_le_bytes())),
        DType::BF16 => values
            .iter()
            .for_each(|v| out.extend(bf16::from_f32(*v).to_le_bytes())),
        DType::Q4_0 => {
            for blk in values.chunks_exact(QK) {
                let amax = blk
                    .iter()
                    .fold(0.0f32, |m, v| if v.abs() > m.abs() { *v } else { m });
                let d = amax / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                for j in 0..16 {
                    let q = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
                    out.push(q(blk[j]) | (q(blk[j + 16]) << 4));
                }
            }
        }
        DType::Q4_1 => {
            for blk in values.chunks_exact(QK) {
                let min = blk.iter().copied().fold(f32::INFINITY, f32::min);
                let max = blk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                out.extend(f16::from_f32(min).to_le_bytes());
                for j in 0..16 {
                    let q = |v: f32| (((v - min) * id + 0.5) as i32).clamp(0, 15) as u8;
                    out.push(q(blk[j]) | (q(blk[j + 16]) << 4));
                }
            }
        }
        DType::Q8_0 => {
            for blk in values.chunks_exact(QK) {
                let amax = blk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_le_bytes());
                for v in blk {
                    out.push(((v * id).round() as i32).clamp(-127, 127) as i8 as u8);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantize_then_dequantize_is_close_for_every_format() {
        let values: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect();
        for (dtype, tol) in [
            (DType::F32, 0.0),
            (DType::F16, 2e-3),
            (DType::BF16, 2e-2),
            (DType::Q8_0, 2e-2),
            (DType::Q4_0, 0.3),
            (DType::Q4_1, 0.3),
        ] {
            let bytes = quantize(dtype, &values);
            assert_eq!(bytes.len(), dtype.bytes_for(values.len()));
            let mut out = vec![0.0; values.len()];
            dequantize_row(dtype, &bytes, &mut out);
            for (a, b) in values.iter().zip(&out) {
                assert!((a - b).abs() <= tol, "{dtype:?}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn unsupported_ggml_types_are_named() {
        let e = DType::from_ggml(12).unwrap_err();
        assert!(e.to_string().contains("Q4_K"), "{e}");
    }
}
