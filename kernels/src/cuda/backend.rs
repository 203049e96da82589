//! [`Backend`] for [`Gpu`]: upload, launch the device kernel, download.
//! Outputs are poisoned (NaN) on the device first, so an element a kernel
//! fails to write shows up in the parity tests.

use cudarc::driver::CudaSlice;
use half::bf16;

use super::{
    AttentionKind, DecodeBatch, FLASH_MAX_PARTITION, FlashBuild, GemmShape, Gpu, NextNorm,
    NormArgs, Normed, PagedQuery, RopeArgs, StackShape,
};
use crate::KernelError;
use crate::backend::{AttentionCase, AttentionKernel, Backend, NormedRow, R};
use crate::matmul::Weight;
use crate::ops::{Rope, RopeStyle};
use crate::sample::SamplingParams;

impl Gpu {
    fn poisoned(&self, n: usize) -> R<CudaSlice<f32>> {
        self.upload(&vec![f32::NAN; n.max(1)])
    }
}

fn ints(v: impl IntoIterator<Item = usize>) -> Vec<i32> {
    v.into_iter().map(|x| x as i32).collect()
}

impl Backend for Gpu {
    fn name(&self) -> String {
        format!("cuda: {}", self.name())
    }

    fn rmsnorm_residual(
        &self,
        x: &mut [f32],
        residual: Option<&[f32]>,
        w: &[f32],
        eps: f32,
        out: &mut [f32],
    ) -> R {
        let mut dx = self.upload(x)?;
        let dr = residual.map(|r| self.upload(r)).transpose()?;
        let dw = self.upload(w)?;
        let mut dout = self.poisoned(out.len())?;
        let norm = NormArgs {
            residual: dr.as_ref(),
            w: &dw,
            rows: x.len() / w.len(),
            cols: w.len(),
            eps,
        };
        self.rmsnorm_residual(&mut dx, &mut dout, &norm)?;
        x.copy_from_slice(&self.download(&dx)?);
        out.copy_from_slice(&self.download(&dout)?[..out.len()]);
        Ok(())
    }

    fn rope(&self, x: &mut [f32], pos: &[usize], rope: &Rope) -> R {
        let dim = rope.inv_freq().len() * 2;
        let heads = x.len() / pos.len().max(1) / dim;
        let mut dx = self.upload(x)?;
        let dp = self.upload(&ints(pos.iter().copied()))?;
        let df = self.upload(rope.inv_freq())?;
        let at = RopeArgs {
            pos: &dp.slice(..),
            inv_freq: &df,
            tokens: pos.len(),
            heads,
            dim,
            interleaved: rope.style() == RopeStyle::Interleaved,
        };
        self.rope(&mut dx, &at)?;
        x.copy_from_slice(&self.download(&dx)?);
        Ok(())
    }

    fn silu_mul(&self, gate: &mut [f32], up: &[f32]) -> R {
        let mut dg = self.upload(gate)?;
        let du = self.upload(up)?;
        self.silu_mul(&mut dg, &du, gate.len())?;
        gate.copy_from_slice(&self.download(&dg)?);
        Ok(())
    }

    fn embed(&self, table: &[bf16], hidden: usize, ids: &[u32], out: &mut [f32]) -> R {
        let dt = self.upload(table)?;
        let di = self.upload(ids)?;
        let mut dout = self.poisoned(out.len())?;
        self.embed(&dt, &di.slice(..), &mut dout, ids.len(), hidden)?;
        out.copy_from_slice(&self.download(&dout)?[..out.len()]);
        Ok(())
    }

    fn kv_pages_moved(
        &self,
        case: &AttentionCase,
        layers: usize,
        from: &[u32],
        to: &[u32],
    ) -> R<Vec<u8>> {
        let mut pools = (0..layers)
            .map(|l| {
                let mut kv = self.paged_kv(case.format, case.layout, case.num_pages)?;
                self.write_rows(&mut kv, &crate::backend::layer_case(case, l))?;
                Ok(kv)
            })
            .collect::<R<Vec<_>>>()?;
        let buf = self.gather_kv_pages(&pools, from)?;
        self.synchronize()?;
        // The peer copy, from this GPU to itself.
        let here = self.copy_from_peer(&buf)?;
        self.scatter_kv_pages(&mut pools, to, &here)?;
        let out = self.gather_kv_pages(&pools, to)?;
        self.synchronize()?;
        Self::download_from(&out)
    }

    fn paged_attention(&self, c: &AttentionCase) -> R<Vec<f32>> {
        let mut kv = self.paged_kv(c.format, c.layout, c.num_pages)?;
        self.write_rows(&mut kv, c)?;
        let mut offsets = vec![0i32];
        let mut flat = Vec::new();
        for t in &c.tables {
            flat.extend(t.iter().map(|p| *p as i32));
            offsets.push(flat.len() as i32);
        }
        flat.push(0);
        let max_len = c.lens.iter().copied().max().unwrap_or(1);
        let seqs = c.lens.len();
        let hd = c.layout.head_dim;
        let mut scratch =
            self.attention_buffers((seqs, max_len), (c.heads, c.layout.kv_heads, hd), 0)?;
        let mut out = self.poisoned(c.q.len())?;
        let (dq, dt) = (self.upload(&c.q)?, self.upload(&flat)?);
        let (doff, dl) = (
            self.upload(&offsets)?,
            self.upload(&ints(c.lens.iter().copied()))?,
        );
        let query = PagedQuery {
            q: &dq,
            tables: &dt.slice(..),
            table_off: &doff.slice(..),
            lens: &dl.slice(..),
            heads: c.heads,
            scale: c.scale,
        };
        let plan = super::AttentionPlan {
            part_len: (c.kernel == AttentionKernel::FlashUnsplit)
                .then(|| max_len.next_multiple_of(16).clamp(16, FLASH_MAX_PARTITION)),
            kind: match c.kernel {
                AttentionKernel::Best => None,
                AttentionKernel::Flash
                | AttentionKernel::FlashFourAnSm
                | AttentionKernel::FlashFusedMerge
                | AttentionKernel::FlashUnsplit => Some(AttentionKind::Flash),
                AttentionKernel::Shuffle => Some(AttentionKind::Shuffle),
            },
            build: match c.kernel {
                AttentionKernel::Flash => Some(FlashBuild::Plain),
                AttentionKernel::FlashFourAnSm => Some(FlashBuild::FourAnSm),
                _ => None,
            },
            fused_merge: c.kernel == AttentionKernel::FlashFusedMerge,
        };
        let batch = DecodeBatch { seqs, max_len };
        self.paged_attention(&kv, &query, batch, plan, &mut scratch, &mut out)?;
        Ok(self.download(&out)?[..c.q.len()].to_vec())
    }

    fn tag_check(
        &self,
        pages: &[u32],
        expected: &[[u64; 2]],
        offsets: &[usize],
        current: &[[u64; 2]],
    ) -> R<Vec<bool>> {
        let seqs = offsets.len().saturating_sub(1);
        // The step's layout: expected tags, then table entries, then each
        // sequence's first entry.
        let mut words: Vec<u32> = expected
            .iter()
            .flat_map(|t| t.iter().flat_map(|w| [*w as u32, (*w >> 32) as u32]))
            .collect();
        let layout = super::TagLayout {
            expected: 0,
            tables: words.len(),
            seq_tab: words.len() + pages.len(),
            ..Default::default()
        };
        words.extend(pages);
        words.extend(offsets.iter().map(|o| *o as u32));
        let current: Vec<u64> = current.iter().flat_map(|w| *w).collect();
        let mut flags = self.upload(&vec![u32::MAX; seqs.max(1)])?;
        self.tag_check(
            &mut self.upload(&words)?,
            &layout,
            &self.upload(&current)?,
            &mut flags.slice_mut(..),
            seqs,
        )?;
        Ok(self.download(&flags)?[..seqs]
            .iter()
            .map(|f| *f == 1)
            .collect())
    }

    fn argmax_rows(&self, x: &[f32], n: usize) -> R<Vec<u32>> {
        let rows = x.len() / n;
        let mut out = self.upload(&vec![u32::MAX; rows.max(1)])?;
        self.argmax_rows(&self.upload(x)?, rows, n, &mut out.slice_mut(..))?;
        Ok(self.download(&out)?[..rows].to_vec())
    }

    fn row_logprobs(
        &self,
        x: &[f32],
        n: usize,
        picks: &[u32],
        top: usize,
    ) -> R<Vec<crate::backend::RowLogprobs>> {
        let rows = picks.len();
        let stride = 2 + 2 * top;
        let slots: Vec<i32> = (0..rows as i32).collect();
        let (dx, dp, ds) = (self.upload(x)?, self.upload(picks)?, self.upload(&slots)?);
        let mut out = self.upload(&vec![f32::NAN; rows * stride])?;
        self.top_logprobs_rows(&dx, (rows, n), &ds.slice(..), top, &mut out)?;
        self.chosen_logprobs_rows(&dx, (rows, n), &dp.slice(..), &ds.slice(..), top, &mut out)?;
        let got = self.download(&out)?;
        Ok((got.chunks_exact(stride).take(rows))
            .map(|o| {
                let best = (0..top)
                    .map(|k| (o[2 + 2 * k].to_bits(), o[3 + 2 * k]))
                    .collect();
                (o[1], best)
            })
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
        let rows = x.len() / n;
        let mut dx = self.upload(x)?;
        let (dm, ds) = (self.upload(masks)?, self.upload(slot)?);
        self.mask_rows(&mut dx, (rows, n), &dm.slice(..), words, &ds.slice(..))?;
        Ok(self.download(&dx)?[..rows * n].to_vec())
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
        let mut dout = self.poisoned(m * n)?;
        let mut scratch = self.upload(&vec![bf16::ZERO; (m * k).max(1)])?;
        self.matmul_bf16(
            &self.upload(x)?,
            &self.upload(w)?,
            &mut dout,
            GemmShape { m, n, k },
            &mut scratch,
        )?;
        out[..m * n].copy_from_slice(&self.download(&dout)?[..m * n]);
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
        let (dx, dw, dg) = (self.upload(x)?, self.upload(w)?, self.upload(g)?);
        let mut dh = self.upload(h)?;
        let mut dgh = self.poisoned(n)?;
        let mut sum = self.norm_sum(n)?;
        let next = NextNorm {
            g: &dg,
            gh: &mut dgh,
            sum: &mut sum,
        };
        self.gemv_bf16_resid(&dx, &dw, &mut dh, next, n, k)?;
        h.copy_from_slice(&self.download(&dh)?);
        gh.copy_from_slice(&self.download(&dgh)?[..n]);
        self.norm_sum_total(&sum)
    }

    fn matmul_normed(
        &self,
        row: &NormedRow<'_>,
        w: &[bf16],
        k: usize,
        silu: bool,
        out: &mut [f32],
    ) -> R {
        let n = out.len();
        let (dgh, dw) = (self.upload(row.gh)?, self.upload(w)?);
        let sum = self.norm_sum_of(row.ss, k)?;
        let mut dout = self.poisoned(n)?;
        let input = Normed {
            gh: &dgh,
            sum: &sum,
            eps: row.eps,
        };
        if silu {
            self.gemv_bf16_normed_silu(&input, &dw, &mut dout, n, k)?;
        } else {
            self.gemv_bf16_normed(&input, &dw, &mut [&mut dout], &[n], k)?;
        }
        out.copy_from_slice(&self.download(&dout)?[..n]);
        Ok(())
    }

    fn dequantize(&self, dtype: crate::quant::DType, bytes: &[u8], n: usize) -> R<Vec<f32>> {
        let mut out = self.poisoned(n)?;
        self.dequantize(dtype, &self.upload(bytes)?, &mut out, n)?;
        Ok(self.download(&out)?[..n].to_vec())
    }

    fn matmul_weight(&self, x: &[f32], m: usize, w: &Weight, out: &mut [f32]) -> R {
        let (n, k) = (w.rows(), w.cols());
        let dw = self.weight(w)?;
        let dx = self.upload(x)?;
        let mut dout = self.poisoned(m * n)?;
        let blocks = dw.dequantizes();
        let mut scratch = self.gemm_scratch(m, k, blocks)?;
        self.matmul(&dx, &dw, &mut dout, GemmShape { m, n, k }, &mut scratch)?;
        out[..m * n].copy_from_slice(&self.download(&dout)?[..m * n]);
        Ok(())
    }

    fn matmul_stacked(&self, x: &[f32], m: usize, ws: &[&Weight], outs: &mut [Vec<f32>]) -> R {
        let k = ws.first().map_or(0, |w| w.cols());
        let dw = self.weight_stack(ws)?.ok_or_else(|| {
            KernelError::Shape("weights of mixed types or widths do not stack".into())
        })?;
        let blocks = dw.dequantizes();
        let parts: Vec<usize> = ws.iter().map(|w| w.rows()).collect();
        let mut douts = parts
            .iter()
            .map(|rows| self.poisoned(m * rows))
            .collect::<R<Vec<_>>>()?;
        let mut refs: Vec<&mut CudaSlice<f32>> = douts.iter_mut().collect();
        let mut scratch = self.gemm_scratch(m, k, blocks)?;
        let shape = StackShape {
            m,
            parts: &parts,
            k,
        };
        self.matmul_parts(&self.upload(x)?, &dw, &mut refs, shape, &mut scratch)?;
        for ((out, d), rows) in outs.iter_mut().zip(&douts).zip(&parts) {
            out[..m * rows].copy_from_slice(&self.download(d)?[..m * rows]);
        }
        Ok(())
    }

    fn embed_weight(&self, w: &Weight, ids: &[u32], out: &mut [f32]) -> R {
        let dw = self.weight(w)?;
        let mut dout = self.poisoned(ids.len() * w.cols())?;
        self.embed_rows(
            &dw,
            &self.upload(ids)?.slice(..),
            &mut dout,
            ids.len(),
            w.cols(),
        )?;
        out.copy_from_slice(&self.download(&dout)?[..out.len()]);
        Ok(())
    }

    fn sample_rows(
        &self,
        logits: &[f32],
        n: usize,
        params: &[SamplingParams],
        uniforms: &[f32],
    ) -> R<Vec<u32>> {
        let rows = params.len();
        let p: Vec<f32> = params
            .iter()
            .zip(uniforms)
            .flat_map(|(p, u)| [p.temperature, p.top_p, *u])
            .collect();
        let k: Vec<i32> = params.iter().map(|p| p.top_k as i32).collect();
        let (dp, dk) = (self.upload(&p)?, self.upload(&k)?);
        let mut out = self.upload(&vec![u32::MAX; rows.max(1)])?;
        self.sample_rows(
            &self.upload(logits)?,
            rows,
            n,
            &dp.slice(..),
            &dk.slice(..),
            &mut out.slice_mut(..),
        )?;
        Ok(self.download(&out)?[..rows].to_vec())
    }

    fn prefill_attention(&self, c: &AttentionCase) -> R<Vec<f32>> {
        let mut kv = self.paged_kv(c.format, c.layout, c.num_pages)?;
        self.write_rows(&mut kv, c)?;
        // Tokens with the same table as the one before share its copy.
        let (mut flat, mut off) = (Vec::new(), Vec::new());
        for (i, t) in c.tables.iter().enumerate() {
            if i == 0 || c.tables[i - 1] != *t {
                off.push(flat.len() as i32);
                flat.extend(t.iter().map(|p| *p as i32));
            } else {
                off.push(off[i - 1]);
            }
        }
        flat.push(0);
        let lens = ints(c.lens.iter().copied());
        let group = c.heads / c.layout.kv_heads.max(1);
        let tiles = crate::cuda::prefill_tiles(&off, &lens, group, self.prefill_rows());
        let mut out = self.poisoned(c.q.len())?;
        let (dq, dt) = (self.upload(&c.q)?, self.upload(&flat)?);
        let (doff, dl) = (self.upload(&off)?, self.upload(&lens)?);
        let query = PagedQuery {
            q: &dq,
            tables: &dt.slice(..),
            table_off: &doff.slice(..),
            lens: &dl.slice(..),
            heads: c.heads,
            scale: c.scale,
        };
        let dtiles = self.upload(&tiles)?;
        self.prefill_attention(&kv, &query, &dtiles.slice(..), &mut out)?;
        Ok(self.download(&out)?[..c.q.len()].to_vec())
    }
}

impl Gpu {
    /// Writes `c`'s KV rows into `kv`.
    fn write_rows(&self, kv: &mut super::PagedKv, c: &AttentionCase) -> R {
        if c.rows.is_empty() {
            return Ok(());
        }
        let k: Vec<f32> = c.rows.iter().flat_map(|r| r.k.iter().copied()).collect();
        let v: Vec<f32> = c.rows.iter().flat_map(|r| r.v.iter().copied()).collect();
        let slots: Vec<i32> = c.rows.iter().map(|r| r.slot as i32).collect();
        let (dk, dv, ds) = (self.upload(&k)?, self.upload(&v)?, self.upload(&slots)?);
        self.kv_write(kv, &dk, &dv, &ds.slice(..), c.rows.len())
    }
}
