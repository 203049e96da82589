//! FP8 e4m3 ("e4m3fn": no infinities, max 448) with one f32 scale per
//! vector ([`crate::kv::KvFormat::Fp8`]), or with none
//! ([`crate::kv::KvFormat::Fp8Static`], [`encode_unit`]).
//!
//! Scaling scheme for KV pages: each (token, KV head) vector of `head_dim`
//! values gets its own scale `s = amax / 448`, stored as f32 beside the
//! page, and is stored as `e4m3(x / s)`. Why per (token, head):
//! - it is dynamic, so it needs no calibration data and no static scale
//!   shipped with each model (unlike vLLM's per-tensor scales);
//! - keys have a few outlier channels whose size changes from token to
//!   token; a per-page or per-tensor scale lets one token's outliers crush
//!   every other token's precision, a per-vector scale does not;
//! - it costs 4 bytes per `head_dim` bytes (6% at 64, 3% at 128), and the
//!   scale is known once the vector is written, so pages stay append-only.

use float8::F8E4M3;

/// Largest finite e4m3 magnitude.
pub const E4M3_MAX: f32 = 448.0;

fn table() -> &'static [f32; 256] {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = [0.0f32; 256];
        for (i, v) in t.iter_mut().enumerate() {
            *v = F8E4M3::from_bits(i as u8).to_f32();
        }
        t
    })
}

/// Encodes `x` into `out` (same length) and returns the scale to decode it.
pub fn encode(x: &[f32], out: &mut [u8]) -> f32 {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let scale = if amax > 0.0 && amax.is_finite() {
        amax / E4M3_MAX
    } else {
        1.0
    };
    let inv = 1.0 / scale;
    for (o, v) in out.iter_mut().zip(x) {
        *o = F8E4M3::from_f32((v * inv).clamp(-E4M3_MAX, E4M3_MAX)).to_bits();
    }
    scale
}

/// Encodes `x` into `out` with the unit scale of
/// [`crate::kv::KvFormat::Fp8Static`]: `e4m3(x)`, saturating at +-448.
pub fn encode_unit(x: &[f32], out: &mut [u8]) {
    for (o, v) in out.iter_mut().zip(x) {
        *o = F8E4M3::from_f32(v.clamp(-E4M3_MAX, E4M3_MAX)).to_bits();
    }
}

/// Decodes `bytes` with `scale` into `out`.
pub fn decode(bytes: &[u8], scale: f32, out: &mut [f32]) {
    let t = table();
    for (o, b) in out.iter_mut().zip(bytes) {
        *o = t[*b as usize] * scale;
    }
}

/// `x`'s rows of `k` as e4m3 with a scale per row gives them back: what
/// an FP8 tensor-core product reads of its activations.
pub fn round_rows(x: &[f32], k: usize) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    let mut q = vec![0u8; k];
    for (row, o) in x.chunks_exact(k).zip(out.chunks_exact_mut(k)) {
        let scale = encode(row, &mut q);
        decode(&q, scale, o);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_error_is_within_e4m3_precision() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 29 % 64) as f32 - 32.0) * 0.37)
            .collect();
        let mut enc = vec![0u8; 64];
        let s = encode(&x, &mut enc);
        let mut dec = vec![0.0; 64];
        decode(&enc, s, &mut dec);
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (a, b) in x.iter().zip(&dec) {
            // 3 mantissa bits: relative error <= 1/16, plus subnormal floor.
            assert!((a - b).abs() <= a.abs() / 16.0 + amax * 1e-3, "{a} vs {b}");
        }
    }

    #[test]
    fn zero_vector_encodes_to_zeros() {
        let mut enc = vec![1u8; 8];
        let s = encode(&[0.0; 8], &mut enc);
        let mut dec = vec![1.0; 8];
        decode(&enc, s, &mut dec);
        assert!(dec.iter().all(|v| *v == 0.0));
    }
}
