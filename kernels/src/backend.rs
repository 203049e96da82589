//! One interface over host slices for every kernel, implemented by the CPU
//! (the reference) and by CUDA ([`crate::cuda::Gpu`], which uploads,
//! launches and downloads). The parity tests are written once against it:
//! CI runs them on the CPU, the GPU machine on CUDA.

use half::bf16;

use crate::KernelError;
use crate::kv::{KvFormat, KvLayout, KvPages};
use crate::matmul::Weight;
use crate::ops::Rope;
use crate::sample::SamplingParams;

/// A result of a backend call.
pub type R<T = ()> = Result<T, KernelError>;

/// One token's K and V to store at vector slot `page * page_size + slot`.
#[derive(Debug, Clone)]
pub struct KvRow {
    /// `page * page_size + slot`.
    pub slot: usize,
    /// `kv_heads x head_dim` keys.
    pub k: Vec<f32>,
    /// `kv_heads x head_dim` values.
    pub v: Vec<f32>,
}

/// Layer `layer`'s rows for [`Backend::kv_pages_moved`]: the case's,
/// scaled by `layer + 1`, K and V swapped on odd layers, so no two layers'
/// pages hold the same bytes.
pub fn layer_case(case: &AttentionCase, layer: usize) -> AttentionCase {
    let scale = (layer + 1) as f32;
    let mut c = case.clone();
    for r in &mut c.rows {
        if layer % 2 == 1 {
            std::mem::swap(&mut r.k, &mut r.v);
        }
        r.k.iter_mut()
            .chain(r.v.iter_mut())
            .for_each(|x| *x *= scale);
    }
    c
}

/// A paged-attention problem: pages to fill, then one query per sequence.
#[derive(Debug, Clone)]
pub struct AttentionCase {
    /// Page format.
    pub format: KvFormat,
    /// Page shape.
    pub layout: KvLayout,
    /// Pages in the pool.
    pub num_pages: usize,
    /// Rows to write first.
    pub rows: Vec<KvRow>,
    /// `seqs x heads x head_dim` queries.
    pub q: Vec<f32>,
    /// Query heads.
    pub heads: usize,
    /// Each sequence's block table.
    pub tables: Vec<Vec<u32>>,
    /// Each sequence's length.
    pub lens: Vec<usize>,
    /// Score scale.
    pub scale: f32,
    /// The decode attention kernel to run (devices with one ignore it).
    pub kernel: AttentionKernel,
}

/// Which decode attention kernel a device runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionKernel {
    /// The device's fastest for the shape.
    #[default]
    Best,
    /// CUDA: one pass per warp on tensor cores.
    Flash,
    /// CUDA: the same, its build held to four blocks an SM where it has
    /// one (fp8 pages, heads of 128).
    FlashFourAnSm,
    /// CUDA: the flash kernel, the partitions of each sequence merged by
    /// the block that finishes last instead of a merge launch.
    FlashFusedMerge,
    /// CUDA: the same, each sequence in one partition (the kernel
    /// normalizes its output; no merge).
    FlashUnsplit,
    /// CUDA: scores and values summed by warp shuffles on CUDA cores.
    Shuffle,
}

/// A decode row after a folded norm, as [`Backend::matmul_residual`] left
/// it: the row times the norm's weights, its sum of squares, and the
/// norm's epsilon.
#[derive(Debug, Clone, Copy)]
pub struct NormedRow<'a> {
    /// `g * h`.
    pub gh: &'a [f32],
    /// The sum of `h^2`.
    pub ss: f32,
    /// Added to the row's mean square.
    pub eps: f32,
}

/// A row's drawn token's log-probability and its most likely tokens with
/// theirs.
pub type RowLogprobs = (f32, Vec<(u32, f32)>);

/// Every kernel, over host memory.
pub trait Backend {
    /// The device's name.
    fn name(&self) -> String;
    /// `x += residual` (if given), then `out = rmsnorm(x) * w` per row.
    fn rmsnorm_residual(
        &self,
        x: &mut [f32],
        residual: Option<&[f32]>,
        w: &[f32],
        eps: f32,
        out: &mut [f32],
    ) -> R;
    /// RoPE over `x` (`tokens x heads x dim`), token `t` at `pos[t]`.
    fn rope(&self, x: &mut [f32], pos: &[usize], rope: &Rope) -> R;
    /// `gate = silu(gate) * up`.
    fn silu_mul(&self, gate: &mut [f32], up: &[f32]) -> R;
    /// Rows of a bf16 table.
    fn embed(&self, table: &[bf16], hidden: usize, ids: &[u32], out: &mut [f32]) -> R;
    /// Writes the case's rows into fresh pages, then attends.
    fn paged_attention(&self, case: &AttentionCase) -> R<Vec<f32>>;
    /// Fills `layers` layers of fresh pages with the case's rows (layer
    /// `l`'s as [`layer_case`] makes them), moves pages `from` to pages `to`
    /// of the same pool through one buffer of pages (read, then written;
    /// on a GPU gathered, peer-copied and scattered), and returns pages
    /// `to` as bytes, each page's layers in turn.
    fn kv_pages_moved(
        &self,
        case: &AttentionCase,
        layers: usize,
        from: &[u32],
        to: &[u32],
    ) -> R<Vec<u8>>;
    /// The same attention for prefill: the "sequences" of `case` are query
    /// tokens, consecutive ones of one sequence sharing its table with
    /// lengths one apart (a causal chunk), computed a tile of tokens at a
    /// time on devices that can.
    fn prefill_attention(&self, case: &AttentionCase) -> R<Vec<f32>>;
    /// The page-tag check: `expected[i]` for `pages[i]`, sequence `s` owning
    /// `offsets[s]..offsets[s + 1]`; tags are two opaque words.
    fn tag_check(
        &self,
        pages: &[u32],
        expected: &[[u64; 2]],
        offsets: &[usize],
        current: &[[u64; 2]],
    ) -> R<Vec<bool>>;
    /// The index of each row's largest value (lowest on ties).
    fn argmax_rows(&self, x: &[f32], n: usize) -> R<Vec<u32>>;
    /// Each row's log-probability of `picks[r]` and its `top` most likely
    /// tokens with theirs, as [`crate::sample::logprobs`] gives them.
    fn row_logprobs(&self, x: &[f32], n: usize, picks: &[u32], top: usize) -> R<Vec<RowLogprobs>>;
    /// Each row of `x` (`n` wide) with the tokens mask `slot[r]` (of
    /// `words` words in `masks`) does not allow set to -inf; a negative
    /// slot leaves its row alone.
    fn mask_rows(
        &self,
        x: &[f32],
        n: usize,
        masks: &[u32],
        words: usize,
        slot: &[i32],
    ) -> R<Vec<f32>>;
    /// `out (m x n) = x (m x k) * w^T`, bf16 weights `n x k`.
    fn matmul_bf16(
        &self,
        x: &[f32],
        m: usize,
        w: &[bf16],
        n: usize,
        k: usize,
        out: &mut [f32],
    ) -> R;
    /// A decode row's product before a norm with weights `g`, the norm's
    /// first half folded in: `h += x * w^T` (bf16 `w` of `h.len() x k`),
    /// `gh = g * h`; returns the sum of `h^2`.
    fn matmul_residual(
        &self,
        x: &[f32],
        w: &[bf16],
        k: usize,
        h: &mut [f32],
        g: &[f32],
        gh: &mut [f32],
    ) -> R<f32>;
    /// A decode row's product after that norm, from what
    /// [`Self::matmul_residual`] left: `out = gh * w^T / sqrt(ss / k + eps)`,
    /// which is `(rmsnorm(h) * g) * w^T` (bf16 `w` of `out.len() x k`).
    /// With `silu`, `w` stacks gate over up (`2 out.len() x k`) and
    /// `out = silu(gate) * up` of the two normed products.
    fn matmul_normed(
        &self,
        row: &NormedRow<'_>,
        w: &[bf16],
        k: usize,
        silu: bool,
        out: &mut [f32],
    ) -> R;
    /// GGUF blocks of `n` elements as values (bf16 on CUDA, f32 here).
    fn dequantize(&self, dtype: crate::quant::DType, bytes: &[u8], n: usize) -> R<Vec<f32>>;
    /// `out (m x rows) = x (m x cols) * w^T` for a weight of any type, as
    /// the engine runs it (block types stay quantized on the device).
    fn matmul_weight(&self, x: &[f32], m: usize, w: &Weight, out: &mut [f32]) -> R;
    /// `outs[i] = x (m x cols) * ws[i]^T` for weights of one width, as the
    /// engine runs projections that share an input (stacked into one
    /// weight on the device when their types allow).
    fn matmul_stacked(&self, x: &[f32], m: usize, ws: &[&Weight], outs: &mut [Vec<f32>]) -> R;
    /// `out[t] = w[ids[t]]` for a weight of any type (the embedding).
    fn embed_weight(&self, w: &Weight, ids: &[u32], out: &mut [f32]) -> R;
    /// One token per row of `logits` (rows of `n`), row `r` sampled with
    /// `params[r]` and the uniform draw `uniforms[r]`.
    fn sample_rows(
        &self,
        logits: &[f32],
        n: usize,
        params: &[SamplingParams],
        uniforms: &[f32],
    ) -> R<Vec<u32>>;
}

/// The CPU: the reference implementation of every kernel.
#[derive(Debug, Default, Clone, Copy)]
pub struct Cpu;

impl Backend for Cpu {
    fn name(&self) -> String {
        "cpu".into()
    }

    fn rmsnorm_residual(
        &self,
        x: &mut [f32],
        residual: Option<&[f32]>,
        w: &[f32],
        eps: f32,
        out: &mut [f32],
    ) -> R {
        if let Some(r) = residual {
            crate::ops::add_assign(x, r);
        }
        for (row, o) in x.chunks_exact(w.len()).zip(out.chunks_exact_mut(w.len())) {
            crate::ops::rmsnorm(row, w, eps, o);
        }
        Ok(())
    }

    fn rope(&self, x: &mut [f32], pos: &[usize], rope: &Rope) -> R {
        let per = x.len() / pos.len().max(1);
        for (row, p) in x.chunks_exact_mut(per).zip(pos) {
            rope.apply(row, *p);
        }
        Ok(())
    }

    fn silu_mul(&self, gate: &mut [f32], up: &[f32]) -> R {
        crate::ops::silu_mul(gate, up);
        Ok(())
    }

    fn embed(&self, table: &[bf16], hidden: usize, ids: &[u32], out: &mut [f32]) -> R {
        for (o, id) in out.chunks_exact_mut(hidden).zip(ids) {
            let row = &table[*id as usize * hidden..(*id as usize + 1) * hidden];
            o.iter_mut().zip(row).for_each(|(o, w)| *o = w.to_f32());
        }
        Ok(())
    }

    fn paged_attention(&self, c: &AttentionCase) -> R<Vec<f32>> {
        let mut pages = KvPages::new(c.format, c.layout, c.num_pages);
        let ps = c.layout.page_size;
        for r in &c.rows {
            pages.write(r.slot / ps, r.slot % ps, &r.k, &r.v);
        }
        let per = c.heads * c.layout.head_dim;
        let mut out = vec![0.0; c.q.len()];
        for (s, (table, len)) in c.tables.iter().zip(&c.lens).enumerate() {
            pages.attend(
                &c.q[s * per..(s + 1) * per],
                table,
                *len,
                c.scale,
                &mut out[s * per..(s + 1) * per],
            );
        }
        Ok(out)
    }

    fn kv_pages_moved(
        &self,
        case: &AttentionCase,
        layers: usize,
        from: &[u32],
        to: &[u32],
    ) -> R<Vec<u8>> {
        let ps = case.layout.page_size;
        let mut pools: Vec<KvPages> = (0..layers)
            .map(|l| {
                let c = layer_case(case, l);
                let mut pages = KvPages::new(c.format, c.layout, c.num_pages);
                for r in &c.rows {
                    pages.write(r.slot / ps, r.slot % ps, &r.k, &r.v);
                }
                pages
            })
            .collect();
        let read = |pools: &[KvPages], ids: &[u32]| {
            let mut out = Vec::new();
            for &p in ids {
                pools.iter().for_each(|l| l.read_page(p as usize, &mut out));
            }
            out
        };
        let buf = read(&pools, from);
        let mut parts = buf.chunks(case.layout.page_bytes(case.format).max(1));
        for &p in to {
            for layer in &mut pools {
                layer.write_page(p as usize, parts.next().unwrap_or_default())?;
            }
        }
        Ok(read(&pools, to))
    }

    fn tag_check(
        &self,
        pages: &[u32],
        expected: &[[u64; 2]],
        offsets: &[usize],
        current: &[[u64; 2]],
    ) -> R<Vec<bool>> {
        Ok(offsets
            .windows(2)
            .map(|w| (w[0]..w[1]).all(|i| current.get(pages[i] as usize) == Some(&expected[i])))
            .collect())
    }

    fn argmax_rows(&self, x: &[f32], n: usize) -> R<Vec<u32>> {
        Ok(x.chunks_exact(n).map(crate::sample::argmax).collect())
    }

    fn row_logprobs(&self, x: &[f32], n: usize, picks: &[u32], top: usize) -> R<Vec<RowLogprobs>> {
        Ok((x.chunks_exact(n).zip(picks))
            .map(|(row, p)| crate::sample::logprobs(row, *p, top))
            .collect())
    }

    fn mask_rows(
        &self,
        x: &[f32],
        n: usize,
        masks: &[u32],
        words: usize,
        slot: &[i32],
    ) -> R<Vec<f32>> {
        let mut out = x.to_vec();
        for (row, s) in out.chunks_exact_mut(n).zip(slot) {
            if let Ok(s) = usize::try_from(*s) {
                crate::sample::mask_logits(row, &masks[s * words..(s + 1) * words]);
            }
        }
        Ok(out)
    }

    fn matmul_bf16(
        &self,
        x: &[f32],
        m: usize,
        w: &[bf16],
        n: usize,
        k: usize,
        out: &mut [f32],
    ) -> R {
        use rayon::prelude::*;
        if x.len() < m * k || w.len() < n * k || out.len() < m * n {
            return Err(KernelError::Shape(format!("matmul {m}x{k} by {n}x{k}")));
        }
        out[..m * n]
            .par_chunks_mut(n)
            .enumerate()
            .for_each(|(i, row)| {
                let xi = &x[i * k..(i + 1) * k];
                for (j, o) in row.iter_mut().enumerate() {
                    *o = w[j * k..(j + 1) * k]
                        .iter()
                        .zip(xi)
                        .map(|(a, b)| a.to_f32() * b)
                        .sum();
                }
            });
        Ok(())
    }

    fn matmul_residual(
        &self,
        x: &[f32],
        w: &[bf16],
        k: usize,
        h: &mut [f32],
        g: &[f32],
        gh: &mut [f32],
    ) -> R<f32> {
        let n = h.len();
        if g.len() != n || gh.len() != n {
            return Err(KernelError::Shape(format!(
                "residual product of {n} rows: g and gh of {n}"
            )));
        }
        let mut y = vec![0.0; n];
        self.matmul_bf16(x, 1, w, n, k, &mut y)?;
        let mut ss = 0.0;
        for ((h, y), (g, gh)) in h.iter_mut().zip(&y).zip(g.iter().zip(gh.iter_mut())) {
            *h += y;
            *gh = g * *h;
            ss += *h * *h;
        }
        Ok(ss)
    }

    fn matmul_normed(
        &self,
        row: &NormedRow<'_>,
        w: &[bf16],
        k: usize,
        silu: bool,
        out: &mut [f32],
    ) -> R {
        let NormedRow { gh, ss, eps } = *row;
        let n = out.len();
        let rows = if silu { 2 * n } else { n };
        let mut y = vec![0.0; rows];
        self.matmul_bf16(gh, 1, w, rows, k, &mut y)?;
        let s = crate::ops::norm_factor(ss, k, eps);
        y.iter_mut().for_each(|v| *v *= s);
        if silu {
            let (gate, up) = y.split_at_mut(n);
            crate::ops::silu_mul(gate, up);
        }
        out.copy_from_slice(&y[..n]);
        Ok(())
    }

    fn dequantize(&self, dtype: crate::quant::DType, bytes: &[u8], n: usize) -> R<Vec<f32>> {
        let mut out = vec![0.0; n];
        crate::quant::dequantize_row(dtype, bytes, &mut out);
        Ok(out)
    }

    fn matmul_weight(&self, x: &[f32], m: usize, w: &Weight, out: &mut [f32]) -> R {
        crate::matmul::matmul(x, m, w, out)
    }

    fn matmul_stacked(&self, x: &[f32], m: usize, ws: &[&Weight], outs: &mut [Vec<f32>]) -> R {
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            crate::matmul::matmul(x, m, w, out)?;
        }
        Ok(())
    }

    fn embed_weight(&self, w: &Weight, ids: &[u32], out: &mut [f32]) -> R {
        let cols = w.cols();
        if out.len() < ids.len() * cols || ids.iter().any(|i| *i as usize >= w.rows()) {
            return Err(KernelError::Shape("embedding ids or output".into()));
        }
        for (row, id) in out.chunks_exact_mut(cols).zip(ids) {
            w.row(*id as usize, row);
        }
        Ok(())
    }

    fn sample_rows(
        &self,
        logits: &[f32],
        n: usize,
        params: &[SamplingParams],
        uniforms: &[f32],
    ) -> R<Vec<u32>> {
        Ok(logits
            .chunks_exact(n)
            .zip(params.iter().zip(uniforms))
            .map(|(row, (p, u))| crate::sample::sample_with_uniform(row, *p, *u))
            .collect())
    }

    fn prefill_attention(&self, case: &AttentionCase) -> R<Vec<f32>> {
        self.paged_attention(case)
    }
}
