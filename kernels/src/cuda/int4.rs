//! Kiln's int4 weights on the device at 4.25 bits a weight (groups of 128):
//! repacked at upload into the tiles `int4.cu` reads as tensor-core
//! fragments, with the groups' scales and offsets after the nibbles. Products
//! of up to [`INT4_MMA_MAX_M`] rows run on them: one row in one launch
//! (`int4_one.cu`), 2 to [`super::GEMV_MAX_M`] through `int4_xfrag` and the
//! GEMV or (`int4_rows.rs`, the default) in one launch, more in blocks of 8 rows;
//! larger ones dequantize a bounded chunk of rows to bf16 for a cuBLAS GEMM.

use cudarc::driver::{CudaSlice, CudaView, PushKernelArg};
use half::bf16;

use super::shape::{StackShape, check_parts, row_blocks};
use super::{GemmScratch, Gpu, cuda_err, grid_1d as cfg};
use crate::KernelError;
use crate::quant::{DType, INT4_HEADER, QK};

type R<T = ()> = Result<T, KernelError>;

/// Most activation rows the int4 tensor-core kernels take; above, int4
/// dequantizes to bf16 for cuBLAS.
pub const INT4_MMA_MAX_M: usize = 64;

/// Rows a tile strip holds and columns a tile spans.
const STRIP: usize = 16;
const TILE: usize = 64;

/// Strips of 16 rows a block of the one-launch GEMV may take (built as
/// `gemv_int4_one_g{G}_r{R}`).
pub(super) const INT4_ONE_STRIPS: [usize; 2] = [1, 2];

/// Strips a block of the one-launch GEMV takes for a matrix of `strips`:
/// two wherever there are two (a warp's split of x and its B-fragment
/// reads then serve twice the weights, and its registers leave room to
/// load x with the weights; on the H200 two beat one at every Llama-3-8B
/// shape, down by 22%, perf.md 2026-12-04).
fn int4_one_strips(strips: usize) -> usize {
    strips.clamp(1, 2)
}

/// Warps per block of `gemv_int4` (`INT4_WARPS` in int4.cu).
const WARPS: u32 = 8;

/// Warps a block of the one-launch GEMV (`_w{W}` of its kernels) takes on
/// a grid of `blocks` blocks of `per_block` strips over `groups` groups of
/// x: sixteen at two strips where the grid is at most `wide` blocks (one
/// wave of sixteen-warp blocks: an SM's warps set the bytes it keeps in
/// flight, and a grid under two blocks of eight an SM leaves SMs at eight)
/// and each warp still gets two groups; eight otherwise.
pub(super) fn int4_one_warps(blocks: usize, per_block: usize, groups: usize, wide: usize) -> usize {
    if per_block == 2 && blocks <= wide && groups >= 32 {
        16
    } else {
        8
    }
}

/// Lets the few-row builds (`int4_rows.cu`) take shared memory past the
/// 48 KiB default, up to the device's limit (each launch asks for its
/// own); returns the dynamic shared memory every such build can take.
pub(super) fn let_int4_shared_grow(
    ctx: &cudarc::driver::CudaContext,
    functions: &std::collections::HashMap<String, cudarc::driver::CudaFunction>,
) -> Result<usize, KernelError> {
    use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN as OPTIN;
    use cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX_SHARED;
    use cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES as STATIC;
    let most = ctx.attribute(OPTIN).map_err(cuda_err)?;
    let mut room = most.max(0) as usize;
    for (name, f) in functions {
        if name.starts_with("gemv_int4_rows") {
            // The static shared memory (fragments, sums) comes off the top.
            let stat = f.get_attribute(STATIC).map_err(cuda_err)?;
            f.set_attribute(MAX_SHARED, most - stat).map_err(cuda_err)?;
            room = room.min((most - stat).max(0) as usize);
        }
    }
    Ok(room)
}

/// Bytes of an int4 matrix of `rows x cols` in groups of `group`, as laid
/// out on the device: the nibbles, then an (f16 scale, f16 offset) per
/// group.
pub fn int4_device_bytes(rows: usize, cols: usize, group: usize) -> usize {
    rows * cols / 2 + rows * (cols / group) * INT4_HEADER
}

/// Rows `bytes` of an int4 type (`rows x cols`, rows one after another in
/// the host layout of [`crate::quant`]) as the device's tiles, or `None`
/// where the shape does not tile (rows a multiple of 16 and columns of 64
/// are needed; the caller falls back to Q4_1 blocks).
///
/// Nibble `j + 4 h` of word `s` of lane `4 g + t`'s 16 bytes of a tile is
/// row `g + 8 (j & 1)`, column `16 s + 2 t + 8 (j >> 1) + h` of the tile:
/// the word's pairs are then the A fragments of an m16n8k16 MMA.
pub fn int4_tiles(dtype: DType, bytes: &[u8], rows: usize, cols: usize) -> Option<Vec<u8>> {
    let group = dtype.int4_group()?;
    let row_bytes = dtype.bytes_for(cols);
    if !rows.is_multiple_of(STRIP)
        || !cols.is_multiple_of(TILE)
        || !cols.is_multiple_of(group)
        || bytes.len() != rows * row_bytes
    {
        return None;
    }
    let quant = |row: usize, col: usize| {
        let grp = &bytes[row * row_bytes + col / group * dtype.bytes_for(group)..];
        let (run, j) = ((col % group) / QK, col % QK);
        let b = grp[INT4_HEADER + 16 * run + j % 16];
        if j < 16 { b & 0x0f } else { b >> 4 }
    };
    let mut out = vec![0u8; int4_device_bytes(rows, cols, group)];
    let tiles = cols / TILE;
    for strip in 0..rows / STRIP {
        for kt in 0..tiles {
            let tile = &mut out[(strip * tiles + kt) * 512..][..512];
            for (lane, piece) in tile.chunks_exact_mut(16).enumerate() {
                let (g, t) = (lane / 4, lane % 4);
                for s in 0..4 {
                    for nib in 0..8 {
                        let (j, h) = (nib % 4, nib / 4);
                        let row = strip * STRIP + g + 8 * (j & 1);
                        let col = kt * TILE + 16 * s + 2 * t + 8 * (j >> 1) + h;
                        piece[4 * s + nib / 2] |= quant(row, col) << (4 * (nib % 2));
                    }
                }
            }
        }
    }
    let params = &mut out[rows * cols / 2..];
    let groups = cols / group;
    for row in 0..rows {
        for grp in 0..groups {
            let src = row * row_bytes + grp * dtype.bytes_for(group);
            params[(row * groups + grp) * INT4_HEADER..][..INT4_HEADER]
                .copy_from_slice(&bytes[src..src + INT4_HEADER]);
        }
    }
    Some(out)
}

impl Gpu {
    /// The int4 product over a stack of `rows` (the whole stack's) in
    /// groups of `group` for `m <= INT4_MMA_MAX_M` rows of `x`: the rows go
    /// to `scratch` as bf16 fragments with their groups' sums, then one
    /// block per strip of 16 weight rows runs tensor-core MMAs on the
    /// nibbles. Up to [`super::GEMV_MAX_M`] rows the activations ride as
    /// bf16 hi + lo (f32 to ~2^-16); above, as bf16 (what cuBLAS would
    /// read), in blocks of 8 rows.
    pub(super) fn gemv_int4(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<u8>,
        group: usize,
        outs: &mut [&mut CudaSlice<f32>],
        shape: StackShape<'_>,
        scratch: &mut GemmScratch,
    ) -> R {
        let StackShape { m, parts, k } = shape;
        let n = check_parts(outs, parts, m)?;
        // Fragments (2 m k bf16) then the groups' sums (m k / group f32).
        let need = 2 * m * k + 2 * m * (k / group);
        if m > INT4_MMA_MAX_M || scratch.act.len() < need {
            return Err(KernelError::Shape(format!(
                "int4 product of {m} rows of {k}: at most {INT4_MMA_MAX_M} rows and {need} bf16 \
                 of scratch"
            )));
        }
        let (mi, ki, gi) = (m as i32, k as i32, group as i32);
        if m == 1 && self.int4_one {
            return self.gemv_int4_one(x, w, group, outs, parts, k);
        }
        if m > 1 && self.int4_rows && self.gemv_int4_rows(x, w, group, outs, parts, (m, k))? {
            return Ok(());
        }
        let hi_lo = m <= super::GEMV_MAX_M;
        let lo = hi_lo as i32;
        let mut b = self.stream.launch_builder(self.function("int4_xfrag")?);
        b.arg(x)
            .arg(&mut scratch.act)
            .arg(&mi)
            .arg(&ki)
            .arg(&gi)
            .arg(&lo);
        let grid = cudarc::driver::LaunchConfig {
            grid_dim: ((k / group) as u32, m as u32, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: one warp per (group, row), writes within `need` (checked).
        unsafe { b.launch(grid) }.map_err(cuda_err)?;
        // Above the GEMV, 2, 4 or 8 blocks of 8 activation rows (m > 8).
        let (name, strips_per_block) = if hi_lo {
            (format!("gemv_int4_g{group}"), 1)
        } else {
            let (blocks, per_block) = row_blocks(m);
            (format!("gemm_int4_g{group}_nb{blocks}"), per_block)
        };
        let o = self.out_ptrs(outs, parts);
        let mut b = self.stream.launch_builder(self.function(&name)?);
        b.arg(&scratch.act).arg(w);
        b.arg(&o.ptrs[0]).arg(&o.ptrs[1]).arg(&o.ptrs[2]);
        b.arg(&o.n0).arg(&o.n1).arg(&mi).arg(&o.n).arg(&ki);
        let grid = (n / STRIP).div_ceil(strips_per_block) as u32;
        // SAFETY: one block per `strips_per_block` strips of 16 of the n
        // rows (a multiple of 16 by construction of the tiles; the kernel
        // skips strips past them); outputs checked above.
        unsafe { b.launch(super::launch::cfg((grid, 1, 1), 32 * WARPS, 0)) }.map_err(cuda_err)?;
        Ok(())
    }

    /// One row of `x` times the stack, in one launch (`int4_one.cu`): each
    /// warp splits its own groups of `x` as `int4_xfrag` would.
    fn gemv_int4_one(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<u8>,
        group: usize,
        outs: &mut [&mut CudaSlice<f32>],
        parts: &[usize],
        k: usize,
    ) -> R {
        let n: usize = parts.iter().sum();
        let strips = n / STRIP;
        let per_block = self.int4_one_strips.unwrap_or(int4_one_strips(strips));
        let o = self.out_ptrs(outs, parts);
        let ki = k as i32;
        let grid = strips.div_ceil(per_block);
        let warps = self.int4_one_block_warps(grid, per_block, k / group);
        let name = format!("gemv_int4_one_g{group}_r{per_block}_w{warps}");
        let mut b = self.stream.launch_builder(self.function(&name)?);
        b.arg(x).arg(w);
        b.arg(&o.ptrs[0]).arg(&o.ptrs[1]).arg(&o.ptrs[2]);
        b.arg(&o.n0).arg(&o.n1).arg(&o.n).arg(&ki);
        // SAFETY: one block per `per_block` strips of 16 of the n rows (a
        // multiple of 16 by construction of the tiles; a block's strips past
        // the last are read again from the last and not written); x holds k
        // floats and the outputs their parts (checked by the caller).
        let block = 32 * warps as u32;
        unsafe { b.launch(super::launch::cfg((grid as u32, 1, 1), block, 0)) }.map_err(cuda_err)?;
        Ok(())
    }

    /// Rows `r0 .. r0 + rows` (whole strips of 16) of an int4 matrix of
    /// `n` rows of `k` as bf16 into `out`, a thread per 32 weights.
    pub(super) fn dequantize_int4_bf16(
        &self,
        w: &CudaView<'_, u8>,
        out: &mut CudaSlice<bf16>,
        (n, k, group): (usize, usize, usize),
        r0: usize,
        rows: usize,
    ) -> R {
        let strips = r0.is_multiple_of(STRIP) && rows.is_multiple_of(STRIP);
        let fits = out.len() >= rows * k && r0 + rows <= n;
        if !fits || !strips || w.len() < int4_device_bytes(n, k, group) {
            return Err(KernelError::Shape(format!(
                "dequantizing rows {r0}..{} of {n} x {k} int4: buffers too small or not whole strips",
                r0 + rows
            )));
        }
        let pieces = rows / STRIP * (k / TILE) * 32;
        let (row0, len) = (r0 as i64, pieces as i64);
        let (ni, ki, gi) = (n as i32, k as i32, group as i32);
        let mut b = self
            .stream
            .launch_builder(self.function("dequant_int4_bf16")?);
        b.arg(w).arg(out).arg(&row0).arg(&len);
        b.arg(&ni).arg(&ki).arg(&gi);
        // SAFETY: one thread per 16-byte piece of the strips, bounds-checked.
        unsafe { b.launch(cfg(pieces.div_ceil(256) as u32, 256)) }.map_err(cuda_err)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequantize_row, quantize_rows};

    /// Weight (row, col) read back from the tiles as `int4_elem` in
    /// int4.cu reads it.
    fn tile_elem(
        tiles: &[u8],
        rows: usize,
        cols: usize,
        group: usize,
        row: usize,
        col: usize,
    ) -> f32 {
        let (strip, rr) = (row / STRIP, row % STRIP);
        let (g, hi) = (rr % 8, rr / 8);
        let (kt, cc) = (col / TILE, col % TILE);
        let (s, r) = (cc / 16, cc % 16);
        let (h, t, j) = (r & 1, (r >> 1) & 3, hi | ((r >> 3) << 1));
        let nib = j + 4 * h;
        let byte = tiles[strip * STRIP * cols / 2 + kt * 512 + (4 * g + t) * 16 + 4 * s + nib / 2];
        let q = (byte >> (4 * (nib % 2))) & 0x0f;
        let p = &tiles[rows * cols / 2 + (row * (cols / group) + col / group) * INT4_HEADER..];
        let d = half::f16::from_le_bytes([p[0], p[1]]).to_f32();
        let m = half::f16::from_le_bytes([p[2], p[3]]).to_f32();
        q as f32 * d + m
    }

    #[test]
    fn int4_tiles_hold_every_weight_where_the_kernels_read_it() {
        for (dtype, group) in [(DType::Int4G128, 128), (DType::Int4G64, 64)] {
            let (rows, cols) = (32, 256);
            let values: Vec<f32> = (0..rows * cols)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
                .collect();
            let bytes = quantize_rows(dtype, cols, &values);
            let tiles = int4_tiles(dtype, &bytes, rows, cols).unwrap();
            assert_eq!(tiles.len(), int4_device_bytes(rows, cols, group));
            let mut want = vec![0.0f32; cols];
            for row in 0..rows {
                dequantize_row(
                    dtype,
                    &bytes[row * dtype.bytes_for(cols)..][..dtype.bytes_for(cols)],
                    &mut want,
                );
                for (col, w) in want.iter().enumerate() {
                    assert_eq!(
                        tile_elem(&tiles, rows, cols, group, row, col),
                        *w,
                        "{dtype:?} ({row}, {col})"
                    );
                }
            }
        }
    }

    #[test]
    fn one_row_grids_under_a_wave_of_long_rows_take_blocks_of_sixteen_warps() {
        // Llama-3-8B on the H200's 132 SMs: o and down (128 blocks) take
        // sixteen, q/k/v (192) and gate/up (896) eight.
        assert_eq!(int4_one_warps(128, 2, 112, 132), 16);
        assert_eq!(int4_one_warps(128, 2, 32, 132), 16);
        assert_eq!(int4_one_warps(192, 2, 32, 132), 8);
        assert_eq!(int4_one_warps(896, 2, 32, 132), 8);
        // Under two groups a warp, or one strip a block: eight.
        assert_eq!(int4_one_warps(16, 2, 9, 132), 8);
        assert_eq!(int4_one_warps(16, 1, 112, 132), 8);
    }

    #[test]
    fn shapes_that_do_not_tile_are_left_to_q4_1_blocks() {
        let bytes = quantize_rows(DType::Int4G64, 64, &vec![0.5; 8 * 64]);
        assert!(int4_tiles(DType::Int4G64, &bytes, 8, 64).is_none());
        let bytes = quantize_rows(DType::Int4G64, 192, &vec![0.5; 16 * 192]);
        assert!(int4_tiles(DType::Int4G64, &bytes, 16, 192).is_some());
        assert!(int4_tiles(DType::Q4_1, &bytes, 16, 192).is_none());
    }
}
