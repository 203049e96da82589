//! The llama forward pass on a CUDA GPU: bf16 weights resident on the
//! device, paged KV (bf16 or fp8) on the device, the same [`BatchSeq`]
//! contract as the CPU path. Logits come back to the host for sampling.
//!
//! First version: prefill tokens attend through the decode attention
//! kernel, one query per token (correct, not yet flash-style), and the
//! page-tag check stays on the host.

use half::bf16;
use kiln_kernels::KernelError;
use kiln_kernels::cuda::{AttentionBuffers, CudaSlice, Gpu, PagedKv};
use kiln_kernels::kv::{KvFormat, KvLayout};
use kiln_kernels::matmul::Weight;
use kiln_kernels::ops::RopeStyle;
use rayon::prelude::*;

use super::llama::{BatchSeq, Model};
use super::{ModelConfig, ModelError};

type R<T> = Result<T, KernelError>;

/// One block's weights on the device.
struct GpuLayer {
    attn_norm: CudaSlice<f32>,
    wq: CudaSlice<bf16>,
    wk: CudaSlice<bf16>,
    wv: CudaSlice<bf16>,
    wo: CudaSlice<bf16>,
    bias: Option<[CudaSlice<f32>; 3]>,
    ffn_norm: CudaSlice<f32>,
    w_gate: CudaSlice<bf16>,
    w_up: CudaSlice<bf16>,
    w_down: CudaSlice<bf16>,
}

/// A step's inputs, uploaded.
struct StepInputs {
    ids: CudaSlice<u32>,
    pos: CudaSlice<i32>,
    tables: CudaSlice<i32>,
    offs: CudaSlice<i32>,
    lens: CudaSlice<i32>,
    slots: CudaSlice<i64>,
    writes: CudaSlice<u32>,
}

/// A model's weights on a GPU.
pub struct GpuModel {
    gpu: Gpu,
    config: ModelConfig,
    embed: CudaSlice<bf16>,
    layers: Vec<GpuLayer>,
    norm: CudaSlice<f32>,
    output: Option<CudaSlice<bf16>>,
    inv_freq: CudaSlice<f32>,
}

/// Every layer's KV pages on the GPU, and the step's working buffers,
/// kept across steps and grown when a step needs more.
pub struct GpuKv {
    layers: Vec<PagedKv>,
    page_size: usize,
    work: Option<Work>,
}

/// Activation buffers for up to `tokens` tokens attending over at most
/// `max_len` positions.
struct Work {
    tokens: usize,
    max_len: usize,
    h: CudaSlice<f32>,
    xn: CudaSlice<f32>,
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    proj: CudaSlice<f32>,
    gate: CudaSlice<f32>,
    up: CudaSlice<f32>,
    kw: CudaSlice<f32>,
    vw: CudaSlice<f32>,
    scratch: CudaSlice<bf16>,
    abuf: AttentionBuffers,
}

fn bf16_weight(gpu: &Gpu, w: &Weight) -> R<CudaSlice<bf16>> {
    let cols = w.cols();
    let mut host = vec![bf16::ZERO; w.rows() * cols];
    host.par_chunks_mut(cols).enumerate().for_each(|(r, out)| {
        let mut row = vec![0.0f32; cols];
        w.row(r, &mut row);
        out.iter_mut()
            .zip(&row)
            .for_each(|(o, v)| *o = bf16::from_f32(*v));
    });
    gpu.upload(&host)
}

impl GpuModel {
    /// Opens GPU `ordinal` and uploads `model`'s weights as bf16.
    pub fn upload(model: &Model, ordinal: usize) -> Result<Self, ModelError> {
        let e = |e: KernelError| ModelError::Unsupported(e.to_string());
        let gpu = Gpu::new(ordinal).map_err(e)?;
        let layers = model
            .layers
            .iter()
            .map(|l| -> R<GpuLayer> {
                Ok(GpuLayer {
                    attn_norm: gpu.upload(&l.attn_norm)?,
                    wq: bf16_weight(&gpu, &l.wq)?,
                    wk: bf16_weight(&gpu, &l.wk)?,
                    wv: bf16_weight(&gpu, &l.wv)?,
                    wo: bf16_weight(&gpu, &l.wo)?,
                    bias: match &l.bias {
                        Some([q, k, v]) => Some([gpu.upload(q)?, gpu.upload(k)?, gpu.upload(v)?]),
                        None => None,
                    },
                    ffn_norm: gpu.upload(&l.ffn_norm)?,
                    w_gate: bf16_weight(&gpu, &l.w_gate)?,
                    w_up: bf16_weight(&gpu, &l.w_up)?,
                    w_down: bf16_weight(&gpu, &l.w_down)?,
                })
            })
            .collect::<R<Vec<_>>>()
            .map_err(e)?;
        Ok(Self {
            embed: bf16_weight(&gpu, &model.embed).map_err(e)?,
            output: model
                .output
                .as_ref()
                .map(|w| bf16_weight(&gpu, w))
                .transpose()
                .map_err(e)?,
            norm: gpu.upload(&model.norm).map_err(e)?,
            inv_freq: gpu.upload(model.rope.inv_freq()).map_err(e)?,
            layers,
            config: model.config.clone(),
            gpu,
        })
    }

    /// The device's name.
    pub fn device_name(&self) -> &str {
        self.gpu.name()
    }

    /// Zeroed KV pages for every layer.
    pub fn kv(&self, format: KvFormat, page_size: usize, num_pages: usize) -> R<GpuKv> {
        let layout = KvLayout {
            page_size,
            kv_heads: self.config.kv_heads,
            head_dim: self.config.head_dim,
        };
        let layers = (0..self.config.layers)
            .map(|_| self.gpu.paged_kv(format, layout, num_pages))
            .collect::<R<Vec<_>>>()?;
        Ok(GpuKv {
            layers,
            page_size,
            work: None,
        })
    }

    /// Working buffers for `n` tokens and contexts up to `max_len`, reused
    /// when big enough (sizes round up to powers of two, so a growing
    /// batch reallocates only a few times).
    fn work(&self, slot: &mut Option<Work>, n: usize, max_len: usize) -> R<Work> {
        if let Some(w) = slot.take()
            && w.tokens >= n
            && w.max_len >= max_len
        {
            return Ok(w);
        }
        let c = &self.config;
        let g = &self.gpu;
        let n = n.next_power_of_two();
        let max_len = max_len.next_power_of_two();
        let (q_dim, kv_dim) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let widest = c.hidden.max(c.ffn).max(q_dim);
        Ok(Work {
            tokens: n,
            max_len,
            h: g.zeros(n * c.hidden)?,
            xn: g.zeros(n * c.hidden)?,
            q: g.zeros(n * q_dim)?,
            k: g.zeros(n * kv_dim)?,
            v: g.zeros(n * kv_dim)?,
            attn: g.zeros(n * q_dim)?,
            proj: g.zeros(n * c.hidden)?,
            gate: g.zeros(n * c.ffn)?,
            up: g.zeros(n * c.ffn)?,
            kw: g.zeros(n * kv_dim)?,
            vw: g.zeros(n * kv_dim)?,
            scratch: g.zeros(n * widest)?,
            abuf: g.attention_buffers(n, c.heads, c.head_dim, max_len)?,
        })
    }

    /// One step: writes the new tokens' K and V into their pages and returns
    /// the logits of each sequence that asked, in batch order.
    pub fn forward(&self, kv: &mut GpuKv, batch: &[BatchSeq<'_>]) -> R<Vec<Vec<f32>>> {
        let c = &self.config;
        let g = &self.gpu;
        let ps = kv.page_size;
        // Per token: id, position, KV slot, the query's table and length.
        let (mut ids, mut pos, mut slots, mut lens, mut offs) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut tables, mut wanted) = (Vec::new(), Vec::new());
        for b in batch {
            let off = tables.len() as i32;
            tables.extend(b.pages.iter().map(|p| *p as i32));
            for (i, t) in b.tokens.iter().enumerate() {
                if *t as usize >= c.vocab {
                    return Err(KernelError::Shape(format!(
                        "token id {t} is outside the vocabulary"
                    )));
                }
                let p = b.start + i;
                ids.push(*t);
                pos.push(p as i32);
                slots.push(if b.write_kv {
                    (b.pages[p / ps] as usize * ps + p % ps) as i64
                } else {
                    -1
                });
                lens.push(p as i32 + 1);
                offs.push(off);
            }
            if b.logits && !b.tokens.is_empty() {
                wanted.push(ids.len() as u32 - 1);
            }
        }
        let n = ids.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        tables.push(0);
        let max_len = lens.iter().copied().max().unwrap_or(1) as usize;
        // Tokens whose KV is written (a full prefix hit writes none).
        let writes: Vec<usize> = (0..n).filter(|i| slots[*i] >= 0).collect();
        let write_slots: Vec<i64> = writes.iter().map(|i| slots[*i]).collect();
        let d = StepInputs {
            ids: g.upload(&ids)?,
            pos: g.upload(&pos)?,
            tables: g.upload(&tables)?,
            offs: g.upload(&offs)?,
            lens: g.upload(&lens)?,
            slots: g.upload(&write_slots)?,
            writes: g.upload(&writes.iter().map(|i| *i as u32).collect::<Vec<_>>())?,
        };
        let mut work = self.work(&mut kv.work, n, max_len)?;
        let result = self.layers_and_logits(kv, &mut work, &d, n, max_len, &writes, &wanted);
        kv.work = Some(work);
        result
    }

    /// The layers and the logits of one step, in `w`'s buffers.
    #[allow(clippy::too_many_arguments)]
    fn layers_and_logits(
        &self,
        kv: &mut GpuKv,
        w: &mut Work,
        d: &StepInputs,
        n: usize,
        max_len: usize,
        writes: &[usize],
        wanted: &[u32],
    ) -> R<Vec<Vec<f32>>> {
        let c = &self.config;
        let g = &self.gpu;
        let (hd, q_dim, kv_dim) = (c.head_dim, c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let Work {
            h,
            xn,
            q,
            k,
            v,
            attn,
            proj,
            gate,
            up,
            kw,
            vw,
            scratch,
            abuf,
            ..
        } = w;
        let (d_ids, d_pos, d_tables, d_offs, d_lens, d_slots) =
            (&d.ids, &d.pos, &d.tables, &d.offs, &d.lens, &d.slots);
        let d_writes = &d.writes;
        g.embed(&self.embed, d_ids, &mut *h, n, c.hidden)?;
        let interleaved = c.rope_style == RopeStyle::Interleaved;
        let scale = 1.0 / (hd as f32).sqrt();
        for (li, (layer, pages)) in self.layers.iter().zip(kv.layers.iter_mut()).enumerate() {
            // h += the previous block's output, then the attention norm.
            let residual = (li > 0).then_some(&*proj);
            g.rmsnorm_residual(
                &mut *h,
                residual,
                &layer.attn_norm,
                &mut *xn,
                n,
                c.hidden,
                c.eps,
            )?;
            g.matmul_bf16(xn, &layer.wq, &mut *q, n, q_dim, c.hidden, &mut *scratch)?;
            g.matmul_bf16(xn, &layer.wk, &mut *k, n, kv_dim, c.hidden, &mut *scratch)?;
            g.matmul_bf16(xn, &layer.wv, &mut *v, n, kv_dim, c.hidden, &mut *scratch)?;
            if let Some([bq, bk, bv]) = &layer.bias {
                g.add_bias(&mut *q, bq, n, q_dim)?;
                g.add_bias(&mut *k, bk, n, kv_dim)?;
                g.add_bias(&mut *v, bv, n, kv_dim)?;
            }
            g.rope(&mut *q, d_pos, &self.inv_freq, n, c.heads, hd, interleaved)?;
            g.rope(
                &mut *k,
                d_pos,
                &self.inv_freq,
                n,
                c.kv_heads,
                hd,
                interleaved,
            )?;
            if !writes.is_empty() {
                if writes.len() == n {
                    g.kv_write(pages, k, v, d_slots, n)?;
                } else {
                    g.gather_rows(k, d_writes, &mut *kw, writes.len(), kv_dim)?;
                    g.gather_rows(v, d_writes, &mut *vw, writes.len(), kv_dim)?;
                    g.kv_write(pages, kw, vw, d_slots, writes.len())?;
                }
            }
            g.paged_attention(
                pages, q, d_tables, d_offs, d_lens, &mut *abuf, &mut *attn, n, c.heads, max_len,
                scale,
            )?;
            g.matmul_bf16(
                attn,
                &layer.wo,
                &mut *proj,
                n,
                c.hidden,
                q_dim,
                &mut *scratch,
            )?;
            g.rmsnorm_residual(
                &mut *h,
                Some(&*proj),
                &layer.ffn_norm,
                &mut *xn,
                n,
                c.hidden,
                c.eps,
            )?;
            g.matmul_bf16(
                xn,
                &layer.w_gate,
                &mut *gate,
                n,
                c.ffn,
                c.hidden,
                &mut *scratch,
            )?;
            g.matmul_bf16(xn, &layer.w_up, &mut *up, n, c.ffn, c.hidden, &mut *scratch)?;
            g.silu_mul(&mut *gate, up, n * c.ffn)?;
            g.matmul_bf16(
                gate,
                &layer.w_down,
                &mut *proj,
                n,
                c.hidden,
                c.ffn,
                &mut *scratch,
            )?;
        }
        let m = wanted.len();
        if m == 0 {
            return Ok(Vec::new());
        }
        g.rmsnorm_residual(
            &mut *h,
            Some(&*proj),
            &self.norm,
            &mut *xn,
            n,
            c.hidden,
            c.eps,
        )?;
        let mut last = g.zeros::<f32>(m * c.hidden)?;
        g.gather_rows(xn, &g.upload(wanted)?, &mut last, m, c.hidden)?;
        let mut logits = g.zeros::<f32>(m * c.vocab)?;
        let out_w = self.output.as_ref().unwrap_or(&self.embed);
        g.matmul_bf16(
            &last,
            out_w,
            &mut logits,
            m,
            c.vocab,
            c.hidden,
            &mut *scratch,
        )?;
        let host = g.download(&logits)?;
        Ok(host[..m * c.vocab]
            .chunks_exact(c.vocab)
            .map(<[f32]>::to_vec)
            .collect())
    }
}
