//! Parts of a weight matrix, in its own format and without rounding again:
//! a range of its output rows, or of its input columns (for tensor
//! parallelism, where each rank holds some heads and some of the MLP).

use std::ops::Range;

use super::{Store, Weight};
use crate::KernelError;
use crate::quant::{DType, FP8_ROW_HEADER};

impl Weight {
    /// Output rows `range`.
    pub fn slice_rows(&self, range: Range<usize>) -> Result<Weight, KernelError> {
        if range.start > range.end || range.end > self.rows {
            return Err(KernelError::Shape(format!(
                "rows {range:?} of a {}-row weight",
                self.rows
            )));
        }
        let store = match &self.store {
            Store::F32(v) => Store::F32(v[range.start * self.cols..range.end * self.cols].to_vec()),
            Store::Bytes(b) => {
                let stride = self.dtype.bytes_for(self.cols);
                Store::Bytes(b[range.start * stride..range.end * stride].to_vec())
            }
        };
        Ok(Weight {
            dtype: self.dtype,
            rows: range.len(),
            cols: self.cols,
            store,
        })
    }

    /// Input columns `range` of every row. Block formats split only at
    /// their blocks' edges; FP8 rows keep each row's scale.
    pub fn slice_cols(&self, range: Range<usize>) -> Result<Weight, KernelError> {
        let block = self.dtype.block_len();
        if range.start > range.end || range.end > self.cols {
            return Err(KernelError::Shape(format!(
                "columns {range:?} of a {}-column weight",
                self.cols
            )));
        }
        if !range.start.is_multiple_of(block) || !range.end.is_multiple_of(block) {
            return Err(KernelError::Shape(format!(
                "columns {range:?} of {:?} rows: they split only at multiples of {block}",
                self.dtype
            )));
        }
        let store = match &self.store {
            Store::F32(v) => Store::F32(
                v.chunks_exact(self.cols.max(1))
                    .flat_map(|row| &row[range.clone()])
                    .copied()
                    .collect(),
            ),
            Store::Bytes(b) => {
                let stride = self.dtype.bytes_for(self.cols);
                let mut out = Vec::with_capacity(self.rows * self.dtype.bytes_for(range.len()));
                for row in b.chunks_exact(stride.max(1)) {
                    if self.dtype == DType::Fp8Row {
                        let body = &row[FP8_ROW_HEADER..];
                        out.extend_from_slice(&row[..FP8_ROW_HEADER]);
                        out.extend_from_slice(&body[range.clone()]);
                    } else {
                        let bytes =
                            self.dtype.bytes_for(range.start)..self.dtype.bytes_for(range.end);
                        out.extend_from_slice(&row[bytes]);
                    }
                }
                Store::Bytes(out)
            }
        };
        Ok(Weight {
            dtype: self.dtype,
            rows: self.rows,
            cols: range.len(),
            store,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::every_weight;
    use super::*;
    use rand::SeedableRng;

    fn rows_of(w: &Weight) -> Vec<Vec<f32>> {
        (0..w.rows())
            .map(|r| {
                let mut row = vec![0.0; w.cols()];
                w.row(r, &mut row);
                row
            })
            .collect()
    }

    #[test]
    fn a_slice_holds_exactly_those_rows_and_columns_of_the_weight() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let (rows, cols) = (12, 512);
        for (dtype, w) in every_weight(&mut rng, rows, cols) {
            let whole = rows_of(&w);
            let part = w.slice_rows(4..10).unwrap();
            assert_eq!((part.rows(), part.cols()), (6, cols));
            assert_eq!(rows_of(&part), whole[4..10], "{dtype:?} rows");
            let part = w.slice_cols(128..384).unwrap();
            assert_eq!((part.rows(), part.cols()), (rows, 256));
            let want: Vec<Vec<f32>> = whole.iter().map(|r| r[128..384].to_vec()).collect();
            assert_eq!(rows_of(&part), want, "{dtype:?} columns");
            assert_eq!(part.size_bytes(), rows * dtype.bytes_for(256));
        }
    }

    #[test]
    fn a_slice_across_a_block_or_past_the_edge_is_an_error() {
        let w = Weight::from_bytes(DType::Q8_0, 2, 64, vec![0; 2 * 68]).unwrap();
        let e = w.slice_cols(16..64).unwrap_err().to_string();
        assert!(e.contains("multiples of 32"), "{e}");
        assert!(w.slice_cols(0..96).is_err());
        assert!(w.slice_rows(1..3).is_err());
        assert_eq!(w.slice_cols(32..64).unwrap().cols(), 32);
    }
}
