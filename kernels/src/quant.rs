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
//!
//! And Kiln's own W4A16 formats, [`DType::Int4G128`] and
//! [`DType::Int4G64`]: groups of 128 (or 64) weights, each an f16 scale
//! `d`, an f16 offset `m` and the group's nibbles in runs of 16 bytes, each
//! run laid out as a Q4_1 block's (so `w = q * d + m`, the group's `d` and
//! `m` shared by its runs). GPTQ and AWQ checkpoints (`w = (q - z) * s`)
//! load into them with `d = s`, `m = -z * s`; `--weights int4` makes them
//! from any model by rounding each group to nearest between its minimum
//! and maximum (groups of 64 where rows are not a multiple of 128 long).

use half::{bf16, f16};

use crate::KernelError;

/// Weights per quantization block (GGUF's, and each run of a group).
pub const QK: usize = 32;

/// Bytes of an int4 group's header (f16 scale and offset).
pub const INT4_HEADER: usize = 4;

/// Bytes of a [`DType::Fp8Row`] row's header (f32 scale, 12 zeros).
pub const FP8_ROW_HEADER: usize = 16;

/// [`DType::Fp8Row`] rows of `k` split as FP8 tensor cores read them: each
/// row's e4m3 codes, packed, and each row's scale. `None` if `bytes` is not
/// whole rows.
pub fn fp8_rows_packed(bytes: &[u8], k: usize) -> Option<(Vec<u8>, Vec<f32>)> {
    let stride = FP8_ROW_HEADER + k;
    if !bytes.len().is_multiple_of(stride) {
        return None;
    }
    let rows = bytes.len() / stride;
    let (mut codes, mut scales) = (Vec::with_capacity(rows * k), Vec::with_capacity(rows));
    for row in bytes.chunks_exact(stride) {
        scales.push(f32::from_le_bytes([row[0], row[1], row[2], row[3]]));
        codes.extend_from_slice(&row[FP8_ROW_HEADER..]);
    }
    Some((codes, scales))
}

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
    /// W4A16: 4-bit weights in groups of 128 with an f16 scale and offset
    /// each.
    Int4G128,
    /// W4A16 in groups of 64.
    Int4G64,
    /// FP8 e4m3 weights with one f32 scale per row (per output channel):
    /// each row is a 16-byte header (its f32 scale, then zeros, so the
    /// bytes after it stay 16-byte aligned on the device) then its bytes,
    /// `w = e4m3 * s`.
    Fp8Row,
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
            DType::Int4G128 | DType::Int4G64 => {
                let g = self.block_len();
                n / g * (INT4_HEADER + g / 2)
            }
            DType::Fp8Row => FP8_ROW_HEADER + n,
        }
    }

    /// Weights per group of an int4 type.
    pub fn int4_group(self) -> Option<usize> {
        match self {
            DType::Int4G128 => Some(128),
            DType::Int4G64 => Some(64),
            _ => None,
        }
    }

    /// Whether rows are made of blocks (a multiple of [`Self::block_len`]
    /// long).
    pub fn is_block(self) -> bool {
        self.block_len() > 1
    }

    /// Weights per block: the group for int4 types, [`QK`] for GGUF's
    /// blocks, 1 for float types.
    pub fn block_len(self) -> usize {
        match self {
            DType::Int4G128 => 128,
            DType::Int4G64 => 64,
            DType::Q4_0 | DType::Q4_1 | DType::Q8_0 => QK,
            DType::F32 | DType::F16 | DType::BF16 | DType::Fp8Row => 1,
        }
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
        DType::Fp8Row => {
            let scale = f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
            crate::fp8::decode(&bytes[FP8_ROW_HEADER..], scale, out);
        }
        DType::Int4G128 | DType::Int4G64 => {
            let g = dtype.block_len();
            for (o, grp) in out
                .chunks_exact_mut(g)
                .zip(bytes.chunks_exact(dtype.bytes_for(g)))
            {
                let (d, m) = (f16_at(grp, 0), f16_at(grp, 2));
                for (run, o) in o.chunks_exact_mut(QK).enumerate() {
                    for j in 0..16 {
                        let q = grp[INT4_HEADER + 16 * run + j];
                        o[j] = (q & 0x0f) as f32 * d + m;
                        o[j + 16] = (q >> 4) as f32 * d + m;
                    }
                }
            }
        }
    }
}

/// An int4 row (or rows) as GGUF Q4_1 blocks of the same values: each
/// 32-weight run of a group becomes a block with the group's scale and
/// offset (the runs are laid out as Q4_1's nibbles already). Costs 5 bits
/// a weight instead of 4.25 (groups of 128), and runs every Q4_1 kernel.
pub fn int4_as_q4_1(dtype: DType, bytes: &[u8]) -> Option<Vec<u8>> {
    let group = dtype.int4_group()?;
    let runs = group / QK;
    let mut out = Vec::with_capacity(bytes.len() / dtype.bytes_for(group) * runs * 20);
    for g in bytes.chunks_exact(dtype.bytes_for(group)) {
        for run in 0..runs {
            out.extend_from_slice(&g[..INT4_HEADER]);
            out.extend_from_slice(&g[INT4_HEADER + 16 * run..INT4_HEADER + 16 * (run + 1)]);
        }
    }
    Some(out)
}

/// Appends one int4 group from its scale, offset and quants (each 0..=15,
/// 64 or 128 of them): `w = q * d + m`.
pub fn push_int4_group(d: f16, m: f16, q: &[u8], out: &mut Vec<u8>) {
    out.extend(d.to_le_bytes());
    out.extend(m.to_le_bytes());
    for q in q.chunks_exact(QK) {
        for j in 0..16 {
            out.push((q[j] & 0x0f) | (q[j + 16] << 4));
        }
    }
}

/// `values` (a multiple of `group` long) as int4 groups: each weight
/// rounded to the nearest of its group's 16 levels `q * d + m`, with the
/// `(d, m)` among a few candidates (the group's range, stretched or
/// shrunk a little, each refitted by least squares to its own rounding)
/// that leaves the least squared error.
fn quantize_int4(values: &[f32], group: usize, out: &mut Vec<u8>) {
    let mut q = vec![0u8; group];
    for grp in values.chunks_exact(group) {
        let (d, m) = int4_fit(grp, &mut q);
        let (d, m) = (f16::from_f32(d), f16::from_f32(m));
        // Round again with the scale and offset as stored.
        int4_round(grp, d.to_f32(), m.to_f32(), &mut q);
        push_int4_group(d, m, &q, out);
    }
}

/// Rounds `w` to the nearest levels `q * d + m` (q in 0..=15) into `q`;
/// returns the squared error.
fn int4_round(w: &[f32], d: f32, m: f32, q: &mut [u8]) -> f32 {
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut err = 0.0;
    for (q, v) in q.iter_mut().zip(w) {
        *q = ((v - m) * id).round().clamp(0.0, 15.0) as u8;
        let e = *q as f32 * d + m - v;
        err += e * e;
    }
    err
}

/// The group's best `(d, m)` (see [`quantize_int4`]), `q` as scratch.
fn int4_fit(w: &[f32], q: &mut [u8]) -> (f32, f32) {
    let min = w.iter().copied().fold(f32::INFINITY, f32::min);
    let max = w.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max <= min {
        return (0.0, min);
    }
    let mut best = ((max - min) / 15.0, min);
    let mut best_err = int4_round(w, best.0, best.1, q);
    let n = w.len() as f32;
    for step in -4..=8 {
        // Levels spread over 15 + step / 4 steps of the range: a little
        // wider or narrower than the range itself.
        let d0 = (max - min) / (15.0 + step as f32 * 0.25);
        int4_round(w, d0, min, q);
        // Least squares for d and m given these levels.
        let (mut sq, mut sq2, mut sw, mut sqw) = (0.0f32, 0.0f32, 0.0f32, 0.0f32);
        for (qi, wi) in q.iter().zip(w) {
            let qf = *qi as f32;
            sq += qf;
            sq2 += qf * qf;
            sw += wi;
            sqw += qf * wi;
        }
        let det = n * sq2 - sq * sq;
        if det <= 0.0 {
            continue;
        }
        let d = (n * sqw - sq * sw) / det;
        let m = (sq2 * sw - sq * sqw) / det;
        if d <= 0.0 {
            continue;
        }
        let err = int4_round(w, d, m, q);
        if err < best_err {
            (best, best_err) = ((d, m), err);
        }
    }
    best
}

/// [`quantize`] row by row: `values` as rows of `cols` (for types with a
/// scale per row, [`DType::Fp8Row`]; the same bytes as one call for the
/// others).
pub fn quantize_rows(dtype: DType, cols: usize, values: &[f32]) -> Vec<u8> {
    values
        .chunks(cols.max(1))
        .flat_map(|row| quantize(dtype, row))
        .collect()
}

/// Quantizes `values` (a multiple of `dtype`'s [`DType::block_len`] long;
/// one row for [`DType::Fp8Row`]) into `dtype`'s format. Used to build test and synthetic weights and for
/// `--weights int4`; float types are stored as-is.
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
        DType::Int4G128 | DType::Int4G64 => quantize_int4(values, dtype.block_len(), &mut out),
        DType::Fp8Row => {
            // One row: its header, then its e4m3 bytes.
            let mut q = vec![0u8; values.len()];
            out.extend(crate::fp8::encode(values, &mut q).to_le_bytes());
            out.extend([0u8; FP8_ROW_HEADER - 4]);
            out.extend(q);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_fp8_rows_hold_each_rows_codes_and_scale() {
        let (k, rows) = (64, 3);
        let values: Vec<f32> = (0..rows * k).map(|i| (i as f32 - 90.0) * 0.01).collect();
        let bytes: Vec<u8> = values
            .chunks(k)
            .flat_map(|r| quantize(DType::Fp8Row, r))
            .collect();
        let (codes, scales) = fp8_rows_packed(&bytes, k).unwrap();
        assert_eq!((codes.len(), scales.len()), (rows * k, rows));
        for r in 0..rows {
            let mut want = vec![0.0f32; k];
            dequantize_row(
                DType::Fp8Row,
                &bytes[r * (k + 16)..(r + 1) * (k + 16)],
                &mut want,
            );
            let mut got = vec![0.0f32; k];
            crate::fp8::decode(&codes[r * k..(r + 1) * k], scales[r], &mut got);
            assert_eq!(got, want, "row {r}");
        }
        assert!(fp8_rows_packed(&bytes[1..], k).is_none(), "a partial row");
    }

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
            // (max - min) / 30 of these groups' range of 4, plus f16.
            (DType::Int4G128, 0.14),
            (DType::Int4G64, 0.14),
            // e4m3: 3 mantissa bits, values up to 2.
            (DType::Fp8Row, 0.07),
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
    fn int4_groups_put_each_run_in_q4_1_order_and_share_their_scale() {
        let q: Vec<u8> = (0..128).map(|i| (i * 7 % 16) as u8).collect();
        let mut g = Vec::new();
        push_int4_group(f16::from_f32(0.5), f16::from_f32(-2.0), &q, &mut g);
        // Run 1, byte 0: weight 32 (low nibble) and weight 48 (high).
        assert_eq!(g[4 + 16], q[32] | (q[48] << 4));
        let mut out = vec![0.0; 128];
        dequantize_row(DType::Int4G128, &g, &mut out);
        for (i, w) in out.iter().enumerate() {
            assert_eq!(*w, q[i] as f32 * 0.5 - 2.0, "weight {i}");
        }
        assert_eq!(DType::Int4G128.bytes_for(256), 2 * 68);
        assert_eq!(DType::Int4G64.bytes_for(256), 4 * 36);
    }

    #[test]
    fn fitted_int4_groups_leave_less_error_than_min_max_rounding() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        // Roughly normal weights (a sum of uniforms), 64 groups of 128.
        let w: Vec<f32> = (0..128 * 64)
            .map(|_| (0..4).map(|_| rng.random_range(-1.0f32..1.0)).sum())
            .collect();
        let mut q = vec![0u8; 128];
        let (mut fitted, mut minmax) = (0.0, 0.0);
        for g in w.chunks_exact(128) {
            let (d, m) = int4_fit(g, &mut q);
            fitted += int4_round(g, d, m, &mut q);
            let min = g.iter().copied().fold(f32::INFINITY, f32::min);
            let max = g.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            minmax += int4_round(g, (max - min) / 15.0, min, &mut q);
        }
        // Measured: 0.89 of min-max's squared error here.
        assert!(
            fitted < 0.92 * minmax,
            "fitted {fitted} vs min-max {minmax}"
        );
    }

    #[test]
    fn int4_rows_repacked_as_q4_1_blocks_hold_the_same_values() {
        let values: Vec<f32> = (0..512)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 9.0)
            .collect();
        for dtype in [DType::Int4G128, DType::Int4G64] {
            let bytes = quantize(dtype, &values);
            let q41 = int4_as_q4_1(dtype, &bytes).unwrap();
            assert_eq!(q41.len(), DType::Q4_1.bytes_for(values.len()));
            let (mut a, mut b) = (vec![0.0; 512], vec![0.0; 512]);
            dequantize_row(dtype, &bytes, &mut a);
            dequantize_row(DType::Q4_1, &q41, &mut b);
            assert_eq!(a, b, "{dtype:?}");
        }
        assert!(int4_as_q4_1(DType::Q4_1, &[]).is_none());
    }

    #[test]
    fn unsupported_ggml_types_are_named() {
        let e = DType::from_ggml(12).unwrap_err();
        assert!(e.to_string().contains("Q4_K"), "{e}");
    }
}
