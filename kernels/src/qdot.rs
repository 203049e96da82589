//! Fast paths for block-quantized rows on x86-64 with AVX2/FMA/F16C:
//! a fused dequantize-and-dot for single activation rows (decode), and a
//! vectorized dequantization for several rows (prefill). Both compute the
//! same f32 math as [`crate::quant::dequantize_row`] + a dot product, up to
//! summation order; elsewhere they fall back to that scalar reference.

use crate::quant::{DType, INT4_HEADER, QK, dequantize_row};
use crate::simd::dot;

/// Per-block sums of an activation row (`x.len() / 32` of them), used for
/// the Q4 offset terms.
pub fn block_sums(x: &[f32]) -> Vec<f32> {
    x.chunks_exact(QK).map(|b| b.iter().sum()).collect()
}

fn has_fast() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| crate::simd::has_avx2() && std::arch::is_x86_feature_detected!("f16c"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// A block-quantized row decoded once for several activation rows: the
/// unscaled quants as floats and each block's scale `d` and offset `m`
/// (so that `w = d · q + m`). An int4 group counts as blocks of 32 with
/// its scale and offset each.
#[derive(Debug, Default, Clone)]
pub struct DecodedRow {
    q: Vec<f32>,
    d: Vec<f32>,
    m: Vec<f32>,
}

/// `Σ w·x` for one row of a block-quantized `dtype`, `sums` from
/// [`block_sums`] of `x`: decodes and multiplies in one pass.
///
/// Bitwise equal to [`DecodedRow::decode`] followed by
/// [`DecodedRow::dot`]: the two differ only in where the quants come from,
/// so a sequence's result does not depend on its batch.
pub fn dot_row(dtype: DType, row: &[u8], x: &[f32], sums: &[f32], scratch: &mut DecodedRow) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_fast() {
        // SAFETY: AVX2, FMA and F16C are present (checked above); the row
        // holds x.len() / 32 blocks of `dtype` (checked by the caller).
        return unsafe { avx2::dot(dtype, row, x, sums) };
    }
    scratch.decode(dtype, row);
    scratch.dot(x, sums)
}

impl DecodedRow {
    /// Decodes `row` (whole blocks of `dtype`).
    pub fn decode(&mut self, dtype: DType, row: &[u8]) {
        let (len, qoff) = match dtype {
            DType::Q4_1 => (20, 4),
            DType::Q4_0 => (18, 2),
            DType::Int4G128 | DType::Int4G64 => (dtype.bytes_for(dtype.block_len()), INT4_HEADER),
            _ => (34, 2),
        };
        let blocks = row.len() / len * (dtype.block_len() / QK);
        self.q.resize(blocks * QK, 0.0);
        self.d.resize(blocks, 0.0);
        self.m.resize(blocks, 0.0);
        #[cfg(target_arch = "x86_64")]
        if has_fast() {
            // SAFETY: AVX2/FMA/F16C present; buffers sized for `blocks`.
            unsafe { avx2::decode(dtype, row, &mut self.q, &mut self.d, &mut self.m) };
            return;
        }
        if let Some(group) = dtype.int4_group() {
            let runs = group / QK;
            for (g, grp) in row.chunks_exact(len).enumerate() {
                let d = half::f16::from_le_bytes([grp[0], grp[1]]).to_f32();
                let m = half::f16::from_le_bytes([grp[2], grp[3]]).to_f32();
                for run in 0..runs {
                    let b = runs * g + run;
                    let q = &mut self.q[b * QK..(b + 1) * QK];
                    let nib = &grp[qoff + 16 * run..qoff + 16 * (run + 1)];
                    for (j, v) in nib.iter().enumerate() {
                        q[j] = (v & 0x0f) as f32;
                        q[j + 16] = (v >> 4) as f32;
                    }
                    self.d[b] = d;
                    self.m[b] = m;
                }
            }
            return;
        }
        for (b, blk) in row.chunks_exact(len).enumerate() {
            let d = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
            let q = &mut self.q[b * QK..(b + 1) * QK];
            match dtype {
                DType::Q8_0 => {
                    for (o, v) in q.iter_mut().zip(&blk[2..34]) {
                        *o = (*v as i8) as f32;
                    }
                    self.m[b] = 0.0;
                }
                _ => {
                    for j in 0..16 {
                        q[j] = (blk[qoff + j] & 0x0f) as f32;
                        q[j + 16] = (blk[qoff + j] >> 4) as f32;
                    }
                    self.m[b] = if dtype == DType::Q4_1 {
                        half::f16::from_le_bytes([blk[2], blk[3]]).to_f32()
                    } else {
                        -8.0 * d
                    };
                }
            }
            self.d[b] = d;
        }
    }

    /// `Σ w·x` with the decoded row.
    pub fn dot(&self, x: &[f32], sums: &[f32]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if has_fast() {
            // SAFETY: AVX2/FMA present; q and x hold d.len() * 32 floats.
            return unsafe { avx2::dot_decoded(&self.q, &self.d, &self.m, x, sums) };
        }
        let mut acc = 0.0f32;
        let mut offs = 0.0f32;
        for (b, (d, m)) in self.d.iter().zip(&self.m).enumerate() {
            acc += d * dot(&self.q[b * QK..(b + 1) * QK], &x[b * QK..(b + 1) * QK]);
            offs += m * sums[b];
        }
        acc + offs
    }
}

/// Dequantizes one row into `out`, vectorized where possible.
pub fn dequant_row(dtype: DType, row: &[u8], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_fast() && dtype.is_block() {
        // SAFETY: as in `dot_row`.
        unsafe { avx2::dequant(dtype, row, out) };
        return;
    }
    dequantize_row(dtype, row, out)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use crate::quant::DType;

    /// Expands to the block's 32 weights as `[__m256; 4]` (before scale and
    /// offset) and its `(d, m)`, inline in the calling target-feature fn.
    macro_rules! block {
        (Q4_1, $blk:expr) => {{
            let blk: &[u8] = $blk;
            (nibbles!(blk.as_ptr().add(4)), f16!(blk, 0), f16!(blk, 2))
        }};
        (Q4_0, $blk:expr) => {{
            let blk: &[u8] = $blk;
            let d = f16!(blk, 0);
            (nibbles!(blk.as_ptr().add(2)), d, -8.0 * d)
        }};
        (Q8_0, $blk:expr) => {{
            let blk: &[u8] = $blk;
            let p = blk.as_ptr().add(2);
            let (a, b) = (
                _mm_loadu_si128(p as *const __m128i),
                _mm_loadu_si128(p.add(16) as *const __m128i),
            );
            let q = [
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a)),
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8))),
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))),
            ];
            (q, f16!(blk, 0), 0.0f32)
        }};
    }

    macro_rules! f16 {
        ($b:expr, $i:expr) => {
            _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
                u16::from_le_bytes([$b[$i], $b[$i + 1]]) as i32,
            )))
        };
    }

    macro_rules! nibbles {
        ($p:expr) => {{
            let qs = _mm_loadu_si128($p as *const __m128i);
            let mask = _mm_set1_epi8(0x0f);
            let lo = _mm_and_si128(qs, mask);
            let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
            [
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))),
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))),
            ]
        }};
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// One block's contribution; shared by the fused and decoded paths so
    /// both round identically.
    macro_rules! block_step {
        ($q:expr, $d:expr, $m:expr, $xp:expr, $acc0:ident, $acc1:ident, $offs:ident, $sum:expr) => {{
            let q = $q;
            let xp = $xp;
            let s0 = _mm256_fmadd_ps(
                q[1],
                _mm256_loadu_ps(xp.add(8)),
                _mm256_mul_ps(q[0], _mm256_loadu_ps(xp)),
            );
            let s1 = _mm256_fmadd_ps(
                q[3],
                _mm256_loadu_ps(xp.add(24)),
                _mm256_mul_ps(q[2], _mm256_loadu_ps(xp.add(16))),
            );
            let dv = _mm256_set1_ps($d);
            $acc0 = _mm256_fmadd_ps(dv, s0, $acc0);
            $acc1 = _mm256_fmadd_ps(dv, s1, $acc1);
            $offs += $m * $sum;
        }};
    }

    /// Runs `$body` for each 32-weight run of a row of int4 `$dtype` with
    /// `$b` (the run's index in the row), `$q` (its quants as
    /// `[__m256; 4]`), `$d` and `$m` (its group's scale and offset).
    macro_rules! int4_runs {
        ($dtype:expr, $row:expr, $b:ident, $q:ident, $d:ident, $m:ident, $body:block) => {{
            let group = $dtype.block_len();
            let runs = group / 32;
            for (g, grp) in $row.chunks_exact($dtype.bytes_for(group)).enumerate() {
                // SAFETY: grp is a whole group: its header, then runs of 16.
                unsafe {
                    let ($d, $m) = (f16!(grp, 0), f16!(grp, 2));
                    for run in 0..runs {
                        let $b = runs * g + run;
                        let $q = nibbles!(grp.as_ptr().add(crate::quant::INT4_HEADER + 16 * run));
                        $body
                    }
                }
            }
        }};
    }

    macro_rules! dot_loop {
        ($kind:ident, $len:expr, $row:expr, $x:expr, $sums:expr) => {{
            // Two accumulators hide the FMA latency of the running sum.
            let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut offs = 0.0f32;
            for (b, blk) in $row.chunks_exact($len).enumerate() {
                // SAFETY: blk is a whole block; x holds 32 floats at b * 32.
                unsafe {
                    let (q, d, m) = block!($kind, blk);
                    block_step!(q, d, m, $x.as_ptr().add(b * 32), acc0, acc1, offs, $sums[b]);
                }
            }
            hsum(_mm256_add_ps(acc0, acc1)) + offs
        }};
    }

    macro_rules! decode_loop {
        ($kind:ident, $len:expr, $row:expr, $qf:expr, $d:expr, $m:expr) => {{
            for (b, blk) in $row.chunks_exact($len).enumerate() {
                // SAFETY: blk is a whole block; qf holds 32 floats at b * 32.
                unsafe {
                    let (q, d, m) = block!($kind, blk);
                    let op = $qf.as_mut_ptr().add(b * 32);
                    for (i, v) in q.iter().enumerate() {
                        _mm256_storeu_ps(op.add(i * 8), *v);
                    }
                    $d[b] = d;
                    $m[b] = m;
                }
            }
        }};
    }

    /// Unscaled quants, scales and offsets of a row (see `DecodedRow`).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn decode(
        dtype: DType,
        row: &[u8],
        qf: &mut [f32],
        d: &mut [f32],
        m: &mut [f32],
    ) {
        match dtype {
            DType::Int4G128 | DType::Int4G64 => int4_runs!(dtype, row, b, q, db, mb, {
                let op = qf.as_mut_ptr().add(b * 32);
                for (i, v) in q.iter().enumerate() {
                    _mm256_storeu_ps(op.add(i * 8), *v);
                }
                d[b] = db;
                m[b] = mb;
            }),
            DType::Q4_1 => decode_loop!(Q4_1, 20, row, qf, d, m),
            DType::Q4_0 => decode_loop!(Q4_0, 18, row, qf, d, m),
            _ => decode_loop!(Q8_0, 34, row, qf, d, m),
        }
    }

    /// The same sum over a row decoded by `DecodedRow::decode`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_decoded(
        qf: &[f32],
        d: &[f32],
        m: &[f32],
        x: &[f32],
        sums: &[f32],
    ) -> f32 {
        let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut offs = 0.0f32;
        for b in 0..d.len() {
            // SAFETY: qf and x hold 32 floats at b * 32.
            unsafe {
                let qp = qf.as_ptr().add(b * 32);
                let q = [
                    _mm256_loadu_ps(qp),
                    _mm256_loadu_ps(qp.add(8)),
                    _mm256_loadu_ps(qp.add(16)),
                    _mm256_loadu_ps(qp.add(24)),
                ];
                block_step!(
                    q,
                    d[b],
                    m[b],
                    x.as_ptr().add(b * 32),
                    acc0,
                    acc1,
                    offs,
                    sums[b]
                );
            }
        }
        hsum(_mm256_add_ps(acc0, acc1)) + offs
    }

    /// Fused dot: Σ_b d_b · Σ_j q_j x_j + m_b · Σ_j x_j.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot(dtype: DType, row: &[u8], x: &[f32], sums: &[f32]) -> f32 {
        match dtype {
            DType::Int4G128 | DType::Int4G64 => {
                let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                let mut offs = 0.0f32;
                int4_runs!(dtype, row, b, q, d, m, {
                    block_step!(q, d, m, x.as_ptr().add(b * 32), acc0, acc1, offs, sums[b]);
                });
                hsum(_mm256_add_ps(acc0, acc1)) + offs
            }
            DType::Q4_1 => dot_loop!(Q4_1, 20, row, x, sums),
            DType::Q4_0 => dot_loop!(Q4_0, 18, row, x, sums),
            _ => dot_loop!(Q8_0, 34, row, x, sums),
        }
    }

    macro_rules! dequant_loop {
        ($kind:ident, $len:expr, $row:expr, $out:expr) => {{
            for (b, blk) in $row.chunks_exact($len).enumerate() {
                // SAFETY: blk is a whole block; out holds 32 floats at b * 32.
                unsafe {
                    let (q, d, m) = block!($kind, blk);
                    let (dv, mv) = (_mm256_set1_ps(d), _mm256_set1_ps(m));
                    let op = $out.as_mut_ptr().add(b * 32);
                    for (i, v) in q.iter().enumerate() {
                        _mm256_storeu_ps(op.add(i * 8), _mm256_fmadd_ps(*v, dv, mv));
                    }
                }
            }
        }};
    }

    /// Vectorized dequantization: w = d · q + m.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dequant(dtype: DType, row: &[u8], out: &mut [f32]) {
        match dtype {
            DType::Int4G128 | DType::Int4G64 => int4_runs!(dtype, row, b, q, d, m, {
                let (dv, mv) = (_mm256_set1_ps(d), _mm256_set1_ps(m));
                let op = out.as_mut_ptr().add(b * 32);
                for (i, v) in q.iter().enumerate() {
                    _mm256_storeu_ps(op.add(i * 8), _mm256_fmadd_ps(*v, dv, mv));
                }
            }),
            DType::Q4_1 => dequant_loop!(Q4_1, 20, row, out),
            DType::Q4_0 => dequant_loop!(Q4_0, 18, row, out),
            _ => dequant_loop!(Q8_0, 34, row, out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantize;
    use rand::{Rng, SeedableRng};

    #[test]
    fn fast_paths_match_the_scalar_reference() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let cols = 256;
        for dtype in [
            DType::Q4_0,
            DType::Q4_1,
            DType::Q8_0,
            DType::Int4G128,
            DType::Int4G64,
        ] {
            let w: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0..1.0)).collect();
            let row = quantize(dtype, &w);
            let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-2.0..2.0)).collect();
            let mut want_w = vec![0.0; cols];
            dequantize_row(dtype, &row, &mut want_w);
            let want: f32 = x.iter().zip(&want_w).map(|(a, b)| a * b).sum();
            let mut scratch = DecodedRow::default();
            let sums = block_sums(&x);
            let got = dot_row(dtype, &row, &x, &sums, &mut scratch);
            assert!(
                (got - want).abs() <= 1e-3 * (1.0 + want.abs()),
                "{dtype:?}: {got} vs {want}"
            );
            let mut decoded = DecodedRow::default();
            decoded.decode(dtype, &row);
            let again = decoded.dot(&x, &sums);
            assert_eq!(
                again.to_bits(),
                got.to_bits(),
                "{dtype:?}: the paths must agree bitwise"
            );
            let mut got_w = vec![f32::NAN; cols];
            dequant_row(dtype, &row, &mut got_w);
            for (a, b) in got_w.iter().zip(&want_w) {
                assert!(
                    (a - b).abs() <= 1e-6 * (1.0 + b.abs()),
                    "{dtype:?}: {a} vs {b}"
                );
            }
        }
    }
}
