//! Causal prefill attention on the device, on tensor cores (see
//! `prefill.cu`): tiles of consecutive query tokens of one sequence, times
//! the query heads of one KV head, share each K and V read.

use cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};

use super::attention::{AttnOut, PagedQuery};
use super::kv::PagedKv;
use super::kv::push_pages;
use super::{Gpu, cuda_err};
use crate::KernelError;
use crate::kv::{KvFormat, KvLayout};

/// Warps a block may take (the source's instantiations), 16 query rows
/// (tokens x heads of one KV head) each.
pub(super) const WARPS: [usize; 2] = [4, 8];

/// Warps a block takes unless set.
pub(super) const DEFAULT_WARPS: usize = 4;

/// Query rows of the smallest block: a KV head's group must fit.
const MIN_ROWS: usize = 16 * WARPS[0];

/// Head sizes the source instantiates.
pub const PREFILL_HEAD_DIMS: [usize; 2] = [64, 128];

/// Whether [`Gpu::prefill_attention`] takes `heads` query heads over
/// `kv_heads` of `head_dim`.
pub fn prefill_supports(heads: usize, kv_heads: usize, head_dim: usize) -> bool {
    kv_heads > 0
        && heads.is_multiple_of(kv_heads)
        && heads / kv_heads <= MIN_ROWS
        && PREFILL_HEAD_DIMS.contains(&head_dim)
}

/// Splits query tokens into tiles of at most `rows / group` consecutive
/// tokens (`rows` from [`Gpu::prefill_rows`]) that share a block table
/// (`table_off`) and have consecutive lengths: `(first token, tokens)`
/// pairs, flattened.
pub fn prefill_tiles(table_off: &[i32], lens: &[i32], group: usize, rows: usize) -> Vec<i32> {
    let per = (rows / group.max(1)).max(1);
    let mut tiles = Vec::new();
    let mut t = 0;
    while t < lens.len() {
        let mut n = 1;
        while t + n < lens.len()
            && n < per
            && table_off[t + n] == table_off[t]
            && lens[t + n] == lens[t + n - 1] + 1
        {
            n += 1;
        }
        tiles.extend([t as i32, n as i32]);
        t += n;
    }
    tiles
}

impl Gpu {
    /// Attention of `tokens` query tokens (`query.q`: tokens x heads x
    /// head_dim) over their pages, token `t` over keys `0..lens[t]` of the
    /// table at `tables[table_off[t]..]`, in the tiles of
    /// [`prefill_tiles`].
    pub fn prefill_attention(
        &self,
        kv: &PagedKv,
        query: &PagedQuery<'_>,
        tiles: &CudaView<'_, i32>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        self.prefill_attention_to(kv, query, tiles, AttnOut::F32(out))
    }

    /// As [`Self::prefill_attention`], writing `out` (f32 or bf16 rows).
    pub fn prefill_attention_to(
        &self,
        kv: &PagedKv,
        query: &PagedQuery<'_>,
        tiles: &CudaView<'_, i32>,
        mut out: AttnOut<'_>,
    ) -> Result<(), KernelError> {
        let PagedQuery {
            q,
            tables,
            table_off,
            lens,
            heads,
            scale,
        } = *query;
        let KvLayout {
            kv_heads,
            head_dim,
            page_size,
        } = kv.layout;
        if !page_size.is_power_of_two() {
            return Err(KernelError::Shape(format!(
                "pages of {page_size} keys: prefill attention takes a power of two"
            )));
        }
        if !prefill_supports(heads, kv_heads, head_dim) {
            return Err(KernelError::Shape(format!(
                "{heads} query heads over {kv_heads} KV heads of {head_dim}: prefill attention \
                 takes groups of at most {MIN_ROWS} heads of {PREFILL_HEAD_DIMS:?}"
            )));
        }
        let group = heads / kv_heads;
        let n_tiles = tiles.len() / 2;
        if n_tiles == 0 {
            return Ok(());
        }
        if n_tiles > u16::MAX as usize {
            return Err(KernelError::Shape(format!(
                "{n_tiles} prefill tiles in one launch: at most {} (fewer tokens a step)",
                u16::MAX
            )));
        }
        let name = match kv.format {
            KvFormat::Bf16 => "bf16",
            KvFormat::Fp8 | KvFormat::Fp8Static => "fp8",
        };
        let name = format!("prefill_{name}_d{head_dim}_w{}", self.prefill_warps);
        let f = self.function(&name)?;
        let ints = [
            heads as i32,
            kv_heads as i32,
            group as i32,
            page_size as i32,
        ];
        let mut b = self.stream.launch_builder(f);
        b.arg(q);
        push_pages(&mut b, kv);
        b.arg(tables).arg(table_off).arg(lens).arg(tiles);
        let null = 0u64;
        out.push(&mut b, &null);
        for i in &ints {
            b.arg(i);
        }
        b.arg(&scale);
        let cfg = LaunchConfig {
            grid_dim: (kv_heads as u32, n_tiles as u32, 1),
            block_dim: (32 * self.prefill_warps as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: tiles index tokens of q, lens and table_off, at most
        // `rows` query rows each; tables hold every page those lengths
        // reach.
        unsafe { b.launch(cfg) }.map_err(cuda_err)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::prefill_tiles;

    #[test]
    fn tiles_break_at_sequences_at_gaps_and_at_the_row_limit() {
        // Two sequences (tables at 0 and 5): 10 tokens from position 4, then
        // 3 tokens; then a lone decode token of the first table.
        let off = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5, 5, 5, 0];
        let lens = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 1, 2, 3, 40];
        // Group 8: at most 8 tokens a tile.
        assert_eq!(
            prefill_tiles(&off, &lens, 8, 64),
            [0, 8, 8, 2, 10, 3, 13, 1]
        );
        assert_eq!(prefill_tiles(&off, &lens, 1, 64), [0, 10, 10, 3, 13, 1]);
        // Blocks of 128 rows: 16 tokens of a group of 8.
        assert_eq!(prefill_tiles(&off, &lens, 8, 128), [0, 10, 10, 3, 13, 1]);
        assert_eq!(
            prefill_tiles(&off, &lens, 4, 16),
            [0, 4, 4, 4, 8, 2, 10, 3, 13, 1]
        );
    }
}
