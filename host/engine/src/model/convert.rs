//! Weight formats chosen at load (`--weights`): every projection (q, k,
//! v, o, gate, up, down; not the embedding or the output head) converted
//! to bf16, FP8 rows or int4 groups.

use kiln_kernels::matmul::Weight;
use kiln_kernels::quant::{DType, quantize_rows};
use rayon::prelude::*;

use super::cpu::Model;

/// The weights a model runs with.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WeightFormat {
    /// As the file stores them.
    #[default]
    Native,
    /// Projections as bf16 (the reference the other formats are held to).
    Bf16,
    /// Projections as FP8 e4m3 with a scale per output channel.
    Fp8,
    /// Projections rounded to int4 groups at load (W4A16).
    Int4,
}

/// Converts `model`'s projections to `format`; returns how many it
/// converted and how many it left as they were (int4 needs rows a multiple
/// of 64 long).
pub fn convert(model: &mut Model, format: WeightFormat) -> (usize, usize) {
    let weights = projections(model);
    let total = weights.len();
    let done = weights
        .into_iter()
        .filter_map(|w| {
            let new = match format {
                WeightFormat::Native => None,
                WeightFormat::Bf16 => rows_as(w, DType::BF16),
                WeightFormat::Fp8 => rows_as(w, DType::Fp8Row),
                WeightFormat::Int4 => to_int4(w),
            };
            new.map(|n| *w = n)
        })
        .count();
    (done, total - done)
}

/// Every projection of `model`.
fn projections(model: &mut Model) -> Vec<&mut Weight> {
    let mut weights: Vec<&mut Weight> = Vec::new();
    for b in &mut model.weights.blocks {
        weights.extend(b.qkv.iter_mut());
        weights.push(&mut b.wo);
        weights.extend(b.gate_up.iter_mut());
        weights.push(&mut b.down);
    }
    weights
}

/// `w`'s values as f32, row-major.
fn values(w: &Weight) -> Vec<f32> {
    let mut values = vec![0.0f32; w.rows() * w.cols()];
    values
        .par_chunks_mut(w.cols())
        .enumerate()
        .for_each(|(r, row)| w.row(r, row));
    values
}

/// `w` stored as `dtype`, row by row.
fn rows_as(w: &Weight, dtype: DType) -> Option<Weight> {
    let cols = w.cols();
    let bytes: Vec<u8> = values(w)
        .par_chunks(cols)
        .flat_map_iter(|row| quantize_rows(dtype, cols, row))
        .collect();
    Weight::from_bytes(dtype, w.rows(), cols, bytes).ok()
}

/// Rounds `w` to int4 groups of 128 inputs (64 where its rows are not a
/// multiple of 128 long); `None` when neither divides its rows or it is
/// int4 already.
fn to_int4(w: &Weight) -> Option<Weight> {
    let cols = w.cols();
    let dtype = [DType::Int4G128, DType::Int4G64]
        .into_iter()
        .find(|d| cols.is_multiple_of(d.block_len()))?;
    if w.dtype().int4_group().is_some() {
        return None;
    }
    rows_as(w, dtype)
}
