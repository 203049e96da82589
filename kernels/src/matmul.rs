//! `out = x · Wᵀ`: activations (`n × cols`, f32) times a weight matrix
//! (`rows × cols`, any [`DType`]), parallel over row chunks.
//!
//! Quantized and half-precision rows are dequantized a row at a time into a
//! thread-local buffer and dotted with every activation row, so each weight
//! byte is read once per call whatever `n` is. f32 weights with several
//! activation rows go through the `gemm` crate.

use rayon::prelude::*;

use crate::KernelError;
use crate::qdot::{DecodedRow, block_sums, dequant_row, dot_row};
use crate::quant::DType;
use crate::simd::dot;

/// A weight matrix: `rows` outputs of `cols` inputs each, row-major.
#[derive(Debug, Clone)]
pub struct Weight {
    dtype: DType,
    rows: usize,
    cols: usize,
    store: Store,
}

#[derive(Debug, Clone)]
enum Store {
    Bytes(Vec<u8>),
    F32(Vec<f32>),
}

#[path = "matmul_slice.rs"]
mod slice;

/// Rows each parallel task handles.
const ROW_CHUNK: usize = 16;

impl Weight {
    /// A weight from raw bytes in `dtype`'s layout.
    pub fn from_bytes(
        dtype: DType,
        rows: usize,
        cols: usize,
        bytes: Vec<u8>,
    ) -> Result<Self, KernelError> {
        let block = dtype.block_len();
        if !cols.is_multiple_of(block) {
            return Err(KernelError::Shape(format!(
                "{dtype:?} rows must be a multiple of {block} long, got {cols}"
            )));
        }
        let want = dtype.bytes_for(cols).checked_mul(rows);
        if want != Some(bytes.len()) {
            return Err(KernelError::Shape(format!(
                "{dtype:?} {rows}x{cols} needs {} bytes, got {}",
                want.map_or("more than usize".to_owned(), |w| w.to_string()),
                bytes.len()
            )));
        }
        let store = if dtype == DType::F32 {
            Store::F32(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            )
        } else {
            Store::Bytes(bytes)
        };
        Ok(Self {
            dtype,
            rows,
            cols,
            store,
        })
    }

    /// An f32 weight.
    pub fn from_f32(rows: usize, cols: usize, values: Vec<f32>) -> Result<Self, KernelError> {
        if values.len() != rows * cols {
            return Err(KernelError::Shape(format!(
                "{rows}x{cols} needs {} values, got {}",
                rows * cols,
                values.len()
            )));
        }
        Ok(Self {
            dtype: DType::F32,
            rows,
            cols,
            store: Store::F32(values),
        })
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The raw bytes, for every type but f32 (kept as floats).
    pub fn bytes(&self) -> Option<&[u8]> {
        match &self.store {
            Store::Bytes(b) => Some(b),
            Store::F32(_) => None,
        }
    }

    /// Bytes of storage.
    pub fn size_bytes(&self) -> usize {
        match &self.store {
            Store::Bytes(b) => b.len(),
            Store::F32(v) => v.len() * 4,
        }
    }

    /// Dequantizes row `r` into `out` (`cols` long).
    pub fn row(&self, r: usize, out: &mut [f32]) {
        match &self.store {
            Store::F32(v) => out.copy_from_slice(&v[r * self.cols..(r + 1) * self.cols]),
            Store::Bytes(b) => {
                let stride = self.dtype.bytes_for(self.cols);
                dequant_row(self.dtype, &b[r * stride..(r + 1) * stride], out);
            }
        }
    }
}

/// FP8 rows multiply more activation rows than this as W8A8: each row
/// quantized to e4m3 with a scale of its own, as FP8 tensor cores take them
/// (per row, so a sequence's numbers do not depend on its batch's other
/// rows). None keeps f32 activations: decode at one sequence is W8A8 too,
/// so a sequence's numbers do not depend on its batch's size either, and
/// its product streams e4m3 codes into tensor cores unconverted.
pub const FP8_GEMV_ROWS: usize = 0;

/// `out[b][r] = Σ_c x[b][c] · W[r][c]` for `n` activation rows.
pub fn matmul(x: &[f32], n: usize, w: &Weight, out: &mut [f32]) -> Result<(), KernelError> {
    if x.len() != n * w.cols || out.len() != n * w.rows {
        return Err(KernelError::Shape(format!(
            "matmul: x {} (want {n}x{}), out {} (want {n}x{})",
            x.len(),
            w.cols,
            out.len(),
            w.rows
        )));
    }
    if n == 0 {
        return Ok(());
    }
    let rounded;
    let x = if w.dtype == DType::Fp8Row && n > FP8_GEMV_ROWS {
        rounded = crate::fp8::round_rows(x, w.cols);
        &rounded[..]
    } else {
        x
    };
    if let (Store::F32(wv), true) = (&w.store, n >= 4) {
        gemm_f32(x, n, wv, w.rows, w.cols, out);
        return Ok(());
    }
    if let (Store::Bytes(bytes), true) = (&w.store, w.dtype.is_block()) {
        matmul_block(x, n, w, bytes, out);
        return Ok(());
    }
    let chunks: Vec<Vec<f32>> = (0..w.rows.div_ceil(ROW_CHUNK))
        .into_par_iter()
        .map_init(
            || vec![0.0f32; w.cols],
            |row, c| {
                let r0 = c * ROW_CHUNK;
                let r1 = (r0 + ROW_CHUNK).min(w.rows);
                let mut local = vec![0.0f32; n * (r1 - r0)];
                for r in r0..r1 {
                    w.row(r, row);
                    for b in 0..n {
                        local[b * (r1 - r0) + (r - r0)] =
                            dot(&x[b * w.cols..(b + 1) * w.cols], row);
                    }
                }
                local
            },
        )
        .collect();
    scatter(&chunks, n, w.rows, out);
    Ok(())
}

/// Block-quantized weights. One activation row (decode): a fused
/// dequantize-and-dot per weight row. Several (prefill, batches): each
/// weight row is decoded once and dotted with every activation row. Both
/// give bitwise the same numbers, so a sequence's output does not depend on
/// what it is batched with.
fn matmul_block(x: &[f32], n: usize, w: &Weight, bytes: &[u8], out: &mut [f32]) {
    let sums: Vec<Vec<f32>> = x.chunks_exact(w.cols).map(block_sums).collect();
    let stride = w.dtype.bytes_for(w.cols);
    if n == 1 {
        // Decode: write straight into `out`, no per-chunk buffers.
        out.par_chunks_mut(ROW_CHUNK).enumerate().for_each_init(
            DecodedRow::default,
            |scratch, (c, o)| {
                for (i, v) in o.iter_mut().enumerate() {
                    let r = c * ROW_CHUNK + i;
                    *v = dot_row(
                        w.dtype,
                        &bytes[r * stride..(r + 1) * stride],
                        x,
                        &sums[0],
                        scratch,
                    );
                }
            },
        );
        return;
    }
    let chunks: Vec<Vec<f32>> = (0..w.rows.div_ceil(ROW_CHUNK))
        .into_par_iter()
        .map_init(DecodedRow::default, |scratch, c| {
            let r0 = c * ROW_CHUNK;
            let r1 = (r0 + ROW_CHUNK).min(w.rows);
            let mut local = vec![0.0f32; n * (r1 - r0)];
            for r in r0..r1 {
                let row = &bytes[r * stride..(r + 1) * stride];
                scratch.decode(w.dtype, row);
                for b in 0..n {
                    let xb = &x[b * w.cols..(b + 1) * w.cols];
                    local[b * (r1 - r0) + (r - r0)] = scratch.dot(xb, &sums[b]);
                }
            }
            local
        })
        .collect();
    scatter(&chunks, n, w.rows, out);
}

fn scatter(chunks: &[Vec<f32>], n: usize, rows: usize, out: &mut [f32]) {
    for (c, local) in chunks.iter().enumerate() {
        let r0 = c * ROW_CHUNK;
        let len = local.len() / n;
        for b in 0..n {
            out[b * rows + r0..b * rows + r0 + len].copy_from_slice(&local[b * len..(b + 1) * len]);
        }
    }
}

fn gemm_f32(x: &[f32], n: usize, w: &[f32], rows: usize, cols: usize, out: &mut [f32]) {
    // SAFETY: the pointers cover n*cols (x), rows*cols (w) and n*rows (out)
    // elements, checked by `matmul`; strides describe row-major layouts.
    unsafe {
        gemm::gemm(
            n,
            rows,
            cols,
            out.as_mut_ptr(),
            1,
            rows as isize,
            false,
            x.as_ptr(),
            1,
            cols as isize,
            w.as_ptr(),
            cols as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(0),
        );
    }
}

/// The naive reference: dequantize everything, then triple loop.
pub fn matmul_reference(x: &[f32], n: usize, w: &Weight) -> Vec<f32> {
    let mut out = vec![0.0; n * w.rows];
    let mut row = vec![0.0; w.cols];
    for r in 0..w.rows {
        w.row(r, &mut row);
        for b in 0..n {
            let xb = &x[b * w.cols..(b + 1) * w.cols];
            out[b * w.rows + r] = xb
                .iter()
                .zip(&row)
                .map(|(a, b)| (*a as f64) * (*b as f64))
                .sum::<f64>() as f32;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantize_rows;
    use rand::{Rng, SeedableRng};

    /// Every weight format.
    pub(super) const EVERY: [DType; 9] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Int4G128,
        DType::Int4G64,
        DType::Fp8Row,
    ];

    /// The same random `rows x cols` matrix in every format.
    pub(super) fn every_weight(
        rng: &mut impl Rng,
        rows: usize,
        cols: usize,
    ) -> impl Iterator<Item = (DType, Weight)> {
        let values: Vec<f32> = (0..rows * cols)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        EVERY.into_iter().map(move |dtype| {
            let bytes = quantize_rows(dtype, cols, &values);
            (dtype, Weight::from_bytes(dtype, rows, cols, bytes).unwrap())
        })
    }

    #[test]
    fn matmul_matches_reference_for_every_dtype_and_batch() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let (rows, cols) = (70, 384);
        for (dtype, w) in every_weight(&mut rng, rows, cols).collect::<Vec<_>>() {
            for n in [1, 3, 5] {
                let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
                let mut out = vec![f32::NAN; n * rows];
                matmul(&x, n, &w, &mut out).unwrap();
                let read = if dtype == DType::Fp8Row && n > FP8_GEMV_ROWS {
                    crate::fp8::round_rows(&x, cols)
                } else {
                    x
                };
                let want = matmul_reference(&read, n, &w);
                for (a, b) in out.iter().zip(&want) {
                    assert!(
                        (a - b).abs() <= 1e-3 * (1.0 + b.abs()),
                        "{dtype:?} n={n}: {a} vs {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn wrong_shapes_are_errors() {
        let w = Weight::from_f32(2, 3, vec![0.0; 6]).unwrap();
        let mut out = vec![0.0; 2];
        assert!(matmul(&[0.0; 4], 1, &w, &mut out).is_err());
        assert!(Weight::from_bytes(DType::Q4_1, 1, 31, vec![0; 20]).is_err());
        assert!(Weight::from_bytes(DType::Int4G128, 1, 96, vec![0; 51]).is_err());
    }
}
