//! The start of the next GEMM's weight asked of L2 by the small kernel
//! before it (`L2Ahead` in common.cu).
//!
//! A decode step of tens of rows is a chain of weight-bound GEMMs with
//! small kernels between them (norms, SiLU-and-multiply, the attention's
//! merge) that read a few MB and leave DRAM mostly idle for their few
//! microseconds. Each such kernel can ask L2 for the first bytes of every
//! row of the weight after it, where a GEMM's blocks start streaming, so
//! the GEMM opens on L2 hits while DRAM already works for it. Heads of
//! rows, not whole rows: the GEMM reads its own stream through L2 at once,
//! so only bytes it reads in its first microseconds are sure to be there.

use cudarc::driver::{DevicePtr, DeviceRepr};

use super::{DeviceWeight, Gpu};

/// Rows from which a product is the GEMM's math, not its weight bytes:
/// nothing is asked ahead of it.
pub const AHEAD_MAX_M: usize = 256;

/// Bytes of a row asked for at least (one L2 line).
const LINE: usize = 128;

/// Where a small kernel asks L2 for a weight's first bytes: the first
/// `head` bytes of `rows` rows `pitch` bytes apart from `base` (none where
/// `base` is 0). Laid out as `L2Ahead` in common.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct L2Ahead {
    base: u64,
    rows: i32,
    head: i32,
    pitch: i64,
}

// SAFETY: a plain `repr(C)` struct of integers, as the kernels declare it.
unsafe impl DeviceRepr for L2Ahead {}

impl L2Ahead {
    /// Whether anything is asked.
    pub fn is_some(&self) -> bool {
        self.base != 0
    }

    /// Bytes asked in all.
    pub fn bytes(&self) -> usize {
        self.rows.max(0) as usize * self.head.max(0) as usize
    }
}

/// The rows and bytes of each row to ask for: `budget` bytes spread over
/// `rows` rows of `pitch`, at least a line a row and never past a row (the
/// first rows only, where the budget holds less than a line a row); `None`
/// where the budget holds no line.
pub fn ahead_plan(budget: usize, rows: usize, pitch: usize) -> Option<(usize, usize)> {
    if rows == 0 || pitch < LINE || budget < LINE {
        return None;
    }
    let head = (budget / rows / LINE * LINE).clamp(LINE, pitch / 16 * 16);
    Some(((budget / head).min(rows), head))
}

impl Gpu {
    /// Bytes each step-time weight may be asked of L2 ahead of its GEMM (0:
    /// none, the default; the engine sets it).
    pub fn set_l2_ahead(&mut self, bytes: usize) {
        self.l2_ahead = bytes;
    }

    /// What a small kernel asks of L2 before the GEMM of `m` rows over the
    /// first `rows` rows of bf16 `w` (`k` columns): nothing with no
    /// budget, past [`AHEAD_MAX_M`] rows or for other formats.
    pub fn ahead_of(&self, w: &DeviceWeight, rows: usize, k: usize, m: usize) -> L2Ahead {
        let DeviceWeight::Bf16(wb) = w else {
            return L2Ahead::default();
        };
        let pitch = k * 2;
        let plan = ahead_plan(self.l2_ahead, rows, pitch);
        match plan {
            Some((rows, head)) if m <= AHEAD_MAX_M && wb.len() >= rows * k => {
                let (base, _guard) = wb.device_ptr(&self.stream);
                L2Ahead {
                    base,
                    rows: rows as i32,
                    head: head as i32,
                    pitch: pitch as i64,
                }
            }
            _ => L2Ahead::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_spreads_over_every_row_in_whole_lines() {
        // 16 MiB over the stacked gate/up rows of Llama-3-8B: 512 bytes
        // of each of 28672 rows of 8 KiB.
        let (rows, head) = ahead_plan(16 << 20, 28672, 8192).unwrap();
        assert_eq!((rows, head), (28672, 512));
        assert!(rows * head <= 16 << 20);
        // The down projection's 4096 rows of 28 KiB: 4 KiB of each.
        assert_eq!(ahead_plan(16 << 20, 4096, 28672), Some((4096, 4096)));
    }

    #[test]
    fn a_row_is_never_asked_past_its_end() {
        // 64 MiB over 1024 rows of 8 KiB would be 64 KiB a row.
        assert_eq!(ahead_plan(64 << 20, 1024, 8192), Some((1024, 8192)));
    }

    #[test]
    fn a_small_budget_asks_a_line_of_the_first_rows_only() {
        let (rows, head) = ahead_plan(64 << 10, 28672, 8192).unwrap();
        assert_eq!((rows, head), (512, 128));
    }

    #[test]
    fn no_budget_asks_nothing() {
        assert_eq!(ahead_plan(0, 4096, 8192), None);
        assert_eq!(ahead_plan(100, 4096, 8192), None);
        assert_eq!(ahead_plan(1 << 20, 0, 8192), None);
        assert!(!L2Ahead::default().is_some());
        assert_eq!(L2Ahead::default().bytes(), 0);
    }
}
