//! The operations of a decoder step as CUDA launches. Launches only (no
//! copy, allocation or wait), so a step can be captured as a graph.
//!
//! A norm runs late, fused with the projection that reads it: from two
//! rows up with bf16 weights it writes cuBLAS's bf16 input directly, and a
//! stacked q/k/v runs as one GEMM whose rows the fused RoPE + KV write
//! reads in place. A step of one row with bf16 weights folds the norms
//! into the GEMVs instead (`fold.rs`). The MLP's SiLU-and-multiply runs
//! with the down projection's input conversion, or (the bf16 MLP, prefill
//! steps) right after one bf16 GEMM over the stacked gate/up weights.

use kiln_kernels::KernelError;
use kiln_kernels::cuda::{
    AttentionPlan, AttnOut, CudaSlice, CudaView, DecodeBatch, DeviceWeight, GemmScratch, GemmShape,
    Gpu, NextNorm, NormArgs, Normed, PagedKv, PagedQuery, RopeKv, SKINNY_MAX_M, SKINNY_WINS_M,
    StackShape, Unrotated,
};
use kiln_kernels::ops::RopeStyle;

use super::fold::{fold_stack, fold_weight};
use super::inputs::{Layout, ints};
use super::linear::{Linear, NormIn};
use super::{Buffers, Cuda, GpuModel, Work};
use crate::model::ModelConfig;
use crate::model::arch::{Block, Input, Ops, R};

/// A step's shape, as the launches see it.
pub(super) struct Shape<'a> {
    /// Where each input sits in the step's buffer.
    pub l: &'a Layout,
    /// Tokens.
    pub n: usize,
    /// Sequences.
    pub seqs: usize,
    /// Results wanted.
    pub m: usize,
    /// The longest attention span.
    pub max_len: usize,
    /// Whether page tags are checked.
    pub check: bool,
    /// Whether some result is sampled on the device (else argmax).
    pub sample: bool,
    /// Words of each output-format mask (0: no result is masked).
    pub mask_words: usize,
    /// Most likely tokens a scored result returns (0: none is scored).
    pub score_top: usize,
    /// Flash-style prefill tiles (none: decode attention per token).
    pub tiles: usize,
    /// With tiles: the step's leading one-token sequences (rows
    /// `0..decodes`), which the decode kernel attends instead.
    pub decodes: usize,
    /// The longest span among those.
    pub decode_len: usize,
}

/// What the next projection reads.
#[derive(Clone, Copy)]
enum Pending<'w> {
    /// Nothing yet.
    Nothing,
    /// `rmsnorm(h (+= proj first, if `residual`)) * w`, not yet run.
    Norm {
        w: &'w CudaSlice<f32>,
        residual: bool,
    },
    /// `xn` holds `h * w` of the last norm and `sum` its sums of squares:
    /// the projection scales by the norm's factor (a folded step).
    Folded,
}

/// The pending norm over the step's `n` rows, adding `proj` first when
/// `residual`.
fn norm_in<'a>(
    h: &'a mut CudaSlice<f32>,
    proj: &'a CudaSlice<f32>,
    w: &'a CudaSlice<f32>,
    residual: bool,
    c: &ModelConfig,
    n: usize,
) -> NormIn<'a> {
    NormIn {
        h,
        norm: NormArgs {
            residual: residual.then_some(proj),
            w,
            rows: n,
            cols: c.hidden,
            eps: c.eps,
        },
    }
}

/// Where the attention writes: `len` bf16 activations of the scratch, or
/// the f32 rows of `attn`.
fn attn_out<'b>(
    scratch: &'b mut GemmScratch,
    attn: &'b mut CudaSlice<f32>,
    len: Option<usize>,
) -> R<AttnOut<'b>> {
    Ok(match len {
        Some(len) => AttnOut::Bf16(scratch.activations_mut(len)?),
        None => AttnOut::F32(attn),
    })
}

/// An `m x n` product over `k`.
fn gemm(m: usize, n: usize, k: usize) -> GemmShape {
    GemmShape { m, n, k }
}

fn no_norm() -> KernelError {
    KernelError::Shape("a projection without its norm".into())
}

/// One step's launches on a GPU.
pub(super) struct CudaStep<'a, 'w> {
    g: &'a Gpu,
    c: &'a ModelConfig,
    s: &'a Shape<'a>,
    inv_freq: &'a CudaSlice<f32>,
    pages: &'a mut [PagedKv],
    inputs: CudaView<'a, u32>,
    b: &'a mut Buffers,
    /// One row with bf16 weights: norms folded into the GEMVs.
    fold: bool,
    /// The MLP in bf16 (`GpuModel::set_bf16_mlp`).
    bf16_mlp: bool,
    /// Decode steps past the skinny GEMM's rows run the bf16 MLP too.
    bf16_mlp_decode: bool,
    /// Decode steps' attention rotates the q/k/v rows and writes the keys
    /// and values itself (`GpuModel::set_rope_in_attention`).
    rope_in_attention: bool,
    /// How decode attention launches run (`GpuModel::set_attention`).
    attention: AttentionPlan,
    /// The bf16 MLP's gate/up product waits in `gu16` for the down
    /// projection, which makes its activation.
    mlp_ready: bool,
    /// The blocks: a block's output projection says what its attention
    /// writes, the bf16 input of a bf16 GEMM (cuBLAS or skinny) or f32
    /// rows.
    blocks: &'a [Block<Cuda>],
    /// The scratch holds the attention's output for the projection.
    attn_ready: bool,
    pending: Pending<'w>,
    /// As one tensor-parallel rank: how its projections are summed.
    sum: Option<&'a super::RankSum>,
}

impl<'a> CudaStep<'a, '_> {
    pub(super) fn new(
        model: &'a GpuModel,
        g: &'a Gpu,
        pages: &'a mut [PagedKv],
        w: &'a mut Work,
        s: &'a Shape<'a>,
    ) -> Self {
        Self {
            g,
            c: &model.config,
            s,
            inv_freq: &model.inv_freq,
            pages,
            inputs: w.inputs.slice(..),
            b: &mut w.b,
            fold: model.folds(s.n),
            bf16_mlp: model.bf16_mlp,
            bf16_mlp_decode: model.bf16_mlp_decode,
            rope_in_attention: model.rope_in_attention,
            attention: model.attention,
            mlp_ready: false,
            blocks: &model.weights.blocks,
            attn_ready: false,
            pending: Pending::Nothing,
            sum: model.sum.as_ref(),
        }
    }
}

impl<'w> Ops<'w> for CudaStep<'_, 'w> {
    type W = Cuda;

    fn embed(&mut self, table: &'w DeviceWeight) -> R {
        let (l, n) = (self.s.l, self.s.n);
        let ids = self.inputs.slice(l.range(l.ids, n));
        self.g
            .embed_rows(table, &ids, &mut self.b.h, n, self.c.hidden)
    }

    fn norm(&mut self, w: &'w CudaSlice<f32>) -> R {
        self.pending = Pending::Norm { w, residual: false };
        Ok(())
    }

    fn attention(
        &mut self,
        layer: usize,
        qkv: &'w Linear,
        bias: Option<&'w [CudaSlice<f32>; 3]>,
    ) -> R {
        let (g, c, s) = (self.g, self.c, self.s);
        let (l, n) = (s.l, s.n);
        let (q_dim, kv_dim) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let inputs = &self.inputs;
        let (slots, pos) = (
            ints(inputs, l.range(l.slots, n)),
            ints(inputs, l.range(l.pos, n)),
        );
        let at = RopeKv {
            slots: &slots,
            pos: &pos,
            inv_freq: self.inv_freq,
            tokens: n,
            heads: c.heads,
            interleaved: c.rope_style == RopeStyle::Interleaved,
        };
        let b = &mut self.b;
        let pages = &mut self.pages[layer];
        // Whether the attention rotates and writes the step's q/k/v: the
        // stacked rows, or the three buffers. Only a token a sequence: a
        // block writes its own token's key, which no other block reads.
        let mut roped = None;
        let rotates =
            self.rope_in_attention && s.tiles == 0 && n == s.seqs && g.rotates_in_attention(pages);
        match self.pending {
            Pending::Folded => {
                let (w, parts) = fold_stack(qkv, &[q_dim, kv_dim, kv_dim])?;
                let outs = &mut [&mut b.q, &mut b.k, &mut b.v];
                let input = Normed {
                    gh: &b.xn,
                    sum: &b.norm_sum,
                    eps: c.eps,
                };
                g.gemv_normed(&input, w, outs, parts, c.hidden)?;
                if rotates {
                    roped = Some(false);
                } else {
                    g.rope_kv_write(pages, &mut b.q, &mut b.k, &b.v, &at)?;
                }
            }
            Pending::Norm { w, residual } => {
                let norm = norm_in(&mut b.h, &b.proj, w, residual, c, n);
                let stack = qkv.cublas_stack(g, n, c.hidden).filter(|_| bias.is_none());
                if let Some(stack) = stack {
                    // One GEMM for q, k and v (cuBLAS fills the GPU far
                    // better with the stack's 6144 rows than with k's or
                    // v's 1024).
                    stack.apply_normed(g, norm, &mut b.qkv, &mut b.scratch)?;
                    // A decode step's attention can rotate and write them.
                    if rotates {
                        roped = Some(true);
                    } else {
                        g.rope_kv_write_stacked(pages, &mut b.qkv, &mut b.q, &at)?;
                    }
                } else {
                    let outs = &mut [&mut b.q, &mut b.k, &mut b.v];
                    qkv.apply_normed(g, norm, &mut b.xn, outs, &mut b.scratch)?;
                    if let Some([bq, bk, bv]) = bias {
                        g.add_bias(&mut b.q, bq, n, q_dim)?;
                        g.add_bias(&mut b.k, bk, n, kv_dim)?;
                        g.add_bias(&mut b.v, bv, n, kv_dim)?;
                    }
                    if rotates {
                        roped = Some(false);
                    } else {
                        g.rope_kv_write(pages, &mut b.q, &mut b.k, &b.v, &at)?;
                    }
                }
            }
            Pending::Nothing => return Err(no_norm()),
        }
        let (tables, offs, lens) = (
            ints(inputs, l.tables..l.words),
            ints(inputs, l.range(l.offs, n)),
            ints(inputs, l.range(l.lens, n)),
        );
        let query = PagedQuery {
            q: &b.q,
            tables: &tables,
            table_off: &offs,
            lens: &lens,
            heads: c.heads,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
        };
        // Rows the output projection reads as bf16 go straight into its
        // scratch (one conversion launch fewer a layer).
        let to_bf16 = !self.fold
            && self
                .blocks
                .get(layer)
                .is_some_and(|b| g.takes_bf16_input(&b.wo, n, q_dim));
        self.attn_ready = to_bf16;
        let len = to_bf16.then_some(n * q_dim);
        if s.tiles > 0 {
            if s.decodes > 0 {
                let batch = DecodeBatch {
                    seqs: s.decodes,
                    max_len: s.decode_len,
                };
                let out = attn_out(&mut b.scratch, &mut b.attn, len)?;
                g.paged_attention_to(pages, &query, batch, self.attention, &mut b.abuf, out)?;
            }
            let tiles = ints(inputs, l.range(l.tiles, 2 * s.tiles));
            let out = attn_out(&mut b.scratch, &mut b.attn, len)?;
            g.prefill_attention_to(pages, &query, &tiles, out)
        } else {
            let batch = DecodeBatch {
                seqs: n,
                max_len: s.max_len,
            };
            let out = attn_out(&mut b.scratch, &mut b.attn, len)?;
            if let Some(stacked) = roped {
                let rows = if stacked {
                    Unrotated::Stacked(&b.qkv)
                } else {
                    Unrotated::Apart {
                        q: &b.q,
                        k: &b.k,
                        v: &b.v,
                    }
                };
                let plan = self.attention;
                return g.paged_attention_roped(
                    pages,
                    rows,
                    &at,
                    &query,
                    batch,
                    plan,
                    &mut b.abuf,
                    out,
                );
            }
            g.paged_attention_to(pages, &query, batch, self.attention, &mut b.abuf, out)
        }
    }

    fn gated_mlp(&mut self, gate_up: &'w Linear) -> R {
        let (g, c, n) = (self.g, self.c, self.s.n);
        let b = &mut self.b;
        match self.pending {
            Pending::Folded => {
                let (w, _) = fold_stack(gate_up, &[c.ffn, c.ffn])?;
                let input = Normed {
                    gh: &b.xn,
                    sum: &b.norm_sum,
                    eps: c.eps,
                };
                g.gemv_normed_silu(&input, w, &mut b.gate, c.ffn, c.hidden)
            }
            Pending::Norm { w, residual } => {
                let norm = norm_in(&mut b.h, &b.proj, w, residual, c, n);
                // Steps with a prompt chunk past the decode batches' sizes,
                // and any step on FP8 rows (SiLU-and-multiply of the pairs
                // then writes the down projection's e4m3 input in one
                // pass): bf16 weights' decode steps (and their captured
                // graphs) keep the f32 MLP unless asked past the skinny
                // GEMM's rows (one cuBLAS GEMM over the stack there).
                let prefill = n > self.s.seqs && n > SKINNY_MAX_M;
                let rows = self.bf16_mlp_decode && n == self.s.seqs && n > SKINNY_WINS_M;
                if let (true, Some(gu), Some(stack)) = (
                    self.bf16_mlp && (prefill || rows || gate_up.fp8_rows()),
                    b.gu16.as_mut(),
                    gate_up.cublas_stack(g, n, c.hidden),
                ) {
                    // One GEMM into bf16; SiLU-and-multiply runs with the
                    // down projection, into its input.
                    stack.apply_normed_bf16(g, norm, gu, &mut b.scratch)?;
                    self.mlp_ready = true;
                    return Ok(());
                }
                // SiLU-and-multiply runs with the down projection.
                let outs = &mut [&mut b.gate, &mut b.up];
                gate_up.apply_normed(g, norm, &mut b.xn, outs, &mut b.scratch)
            }
            Pending::Nothing => Err(no_norm()),
        }
    }

    fn add_projection(&mut self, input: Input, w: &'w DeviceWeight, next: &'w CudaSlice<f32>) -> R {
        let (g, c, n) = (self.g, self.c, self.s.n);
        let q_dim = c.heads * c.head_dim;
        let b = &mut self.b;
        let (x, k) = match input {
            Input::Attention => (&b.attn, q_dim),
            Input::Mlp => (&b.gate, c.ffn),
        };
        if self.fold {
            // h += x * w, then xn = h * next with its sums of squares.
            let next = NextNorm {
                g: next,
                gh: &mut b.xn,
                sum: &mut b.norm_sum,
            };
            g.gemv_resid(x, fold_weight(w)?, &mut b.h, next, c.hidden, k)?;
            self.pending = Pending::Folded;
            return Ok(());
        }
        match input {
            Input::Attention if std::mem::take(&mut self.attn_ready) => {
                let shape = StackShape {
                    m: n,
                    parts: &[c.hidden],
                    k,
                };
                g.matmul_parts_bf16(w, &mut [&mut b.proj], shape, &mut b.scratch)?;
            }
            Input::Attention => g.matmul(
                &b.attn,
                w,
                &mut b.proj,
                gemm(n, c.hidden, k),
                &mut b.scratch,
            )?,
            Input::Mlp if std::mem::take(&mut self.mlp_ready) => {
                let gu = b.gu16.as_ref().ok_or_else(|| {
                    KernelError::Shape("a bf16 MLP without its gate/up buffer".into())
                })?;
                let shape = gemm(n, c.hidden, k);
                g.down_from_pairs(gu, w, &mut b.proj, shape, &mut b.scratch)?;
            }
            Input::Mlp if g.takes_bf16_input(w, n, k) => {
                g.silu_mul_bf16(&b.gate, &b.up, &mut b.scratch, n * k)?;
                let shape = StackShape {
                    m: n,
                    parts: &[c.hidden],
                    k,
                };
                g.matmul_parts_bf16(w, &mut [&mut b.proj], shape, &mut b.scratch)?;
            }
            Input::Mlp => {
                g.silu_mul(&mut b.gate, &b.up, n * k)?;
                g.matmul(
                    &b.gate,
                    w,
                    &mut b.proj,
                    gemm(n, c.hidden, k),
                    &mut b.scratch,
                )?;
            }
        }
        // As a rank: every rank's part summed before the norm adds it.
        if let Some(sum) = self.sum {
            sum.all_reduce(g, &mut b.proj, n * c.hidden)?;
        }
        // The residual add runs with the next norm.
        self.pending = Pending::Norm {
            w: next,
            residual: true,
        };
        Ok(())
    }

    fn head(&mut self, w: &'w DeviceWeight) -> R {
        let (g, c, s) = (self.g, self.c, self.s);
        let (l, n, m) = (s.l, s.n, s.m);
        if m == 0 {
            return Ok(());
        }
        let b = &mut self.b;
        match self.pending {
            Pending::Folded => {
                // One token, so its row is the one wanted.
                let outs = &mut [&mut b.logits];
                let input = Normed {
                    gh: &b.xn,
                    sum: &b.norm_sum,
                    eps: c.eps,
                };
                g.gemv_normed(&input, fold_weight(w)?, outs, &[c.vocab], c.hidden)?;
            }
            Pending::Norm {
                w: norm_w,
                residual,
            } => {
                let norm = NormArgs {
                    residual: residual.then_some(&b.proj),
                    w: norm_w,
                    rows: n,
                    cols: c.hidden,
                    eps: c.eps,
                };
                g.rmsnorm_residual(&mut b.h, &mut b.xn, &norm)?;
                // Decode wants every token's row, already in place.
                let rows = if m == n {
                    &b.xn
                } else {
                    let wanted = self.inputs.slice(l.range(l.wanted, m));
                    g.gather_rows(&b.xn, &wanted, &mut b.last, m, c.hidden)?;
                    &b.last
                };
                g.matmul(
                    rows,
                    w,
                    &mut b.logits,
                    gemm(m, c.vocab, c.hidden),
                    &mut b.scratch,
                )?;
            }
            Pending::Nothing => return Err(no_norm()),
        }
        // Log-probabilities are the model's: taken before any mask.
        let scored = ints(&self.inputs, l.range(l.score_slot, m));
        if s.score_top > 0
            && let Some(out) = &mut b.scores
        {
            g.top_logprobs_rows(&b.logits, (m, c.vocab), &scored, s.score_top, out)?;
        }
        if s.mask_words > 0 {
            let masks = self.inputs.slice(l.range(l.masks, m * s.mask_words));
            let slots = ints(&self.inputs, l.range(l.mask_slot, m));
            g.mask_rows(&mut b.logits, (m, c.vocab), &masks, s.mask_words, &slots)?;
        }
        let mut picks = b.small.slice_mut(s.seqs..s.seqs + m);
        if s.sample {
            let params = self.inputs.slice(l.range(l.params, 3 * m));
            // SAFETY: the words hold f32 bit patterns (`f32::to_bits`).
            let params = unsafe { params.transmute::<f32>(3 * m) }.expect("same size");
            let top_k = ints(&self.inputs, l.range(l.top_k, m));
            g.sample_rows(&b.logits, m, c.vocab, &params, &top_k, &mut picks)?;
        } else {
            g.argmax_rows(&b.logits, m, c.vocab, &mut picks)?;
        }
        if s.score_top > 0
            && let Some(out) = &mut b.scores
        {
            let picks = b.small.slice(s.seqs..s.seqs + m);
            g.chosen_logprobs_rows(&b.logits, (m, c.vocab), &picks, &scored, s.score_top, out)?;
        }
        Ok(())
    }
}
