//! A decode step's RoPE and KV write inside its attention: the flash
//! kernel's blocks rotate their query heads from the step's q/k/v rows,
//! and the block that ends each sequence rotates its new key and
//! writes it and the value into their page slot, before reading the pages
//! (`flash_rope` in attention_flash.cu). One launch a layer fewer than
//! [`Gpu::rope_kv_write_stacked`] then [`Gpu::paged_attention_to`], with
//! the same bits in the pages and the output.

use cudarc::driver::{CudaSlice, DevicePtr};

use super::attention::{AttentionKind, AttentionPlan, AttnOut, DecodeBatch, PagedQuery};
use super::rope::{RopeIn, RopeKv};
use super::{AttentionBuffers, Gpu, PagedKv};
use crate::KernelError;
use crate::kv::KvFormat;

type R<T = ()> = Result<T, KernelError>;

/// A decode step's queries, keys and values before RoPE, for attention
/// that rotates and writes them ([`Gpu::paged_attention_roped`]).
#[derive(Clone, Copy)]
pub enum Unrotated<'a> {
    /// One stacked projection's rows: each token's query heads, then its
    /// key heads, then its value heads.
    Stacked(&'a CudaSlice<f32>),
    /// Separate rows: `tokens x heads`, `tokens x kv_heads` and `tokens x
    /// kv_heads` heads.
    Apart {
        /// The queries.
        q: &'a CudaSlice<f32>,
        /// The keys.
        k: &'a CudaSlice<f32>,
        /// The values.
        v: &'a CudaSlice<f32>,
    },
}

impl Gpu {
    /// Whether [`Self::paged_attention_roped`] takes a step's attention
    /// over `kv`: the flash kernel's shapes (heads of 64 or 128, pages of
    /// a power of two of at least 16 tokens).
    pub fn rotates_in_attention(&self, kv: &PagedKv) -> bool {
        let l = kv.layout;
        matches!(l.head_dim, 64 | 128) && l.page_size.is_power_of_two() && l.page_size >= 16
    }

    /// Decode attention of one token a sequence from the step's unrotated
    /// queries, keys and values (`rows`): rotates the queries and keys at
    /// `at`'s positions, writes each key and value into its slot in `kv`
    /// (none for a negative slot), then attends, as
    /// [`Self::rope_kv_write_stacked`] (or [`Self::rope_kv_write`]) then
    /// [`Self::paged_attention_to`] would, with one launch fewer.
    /// `query.q` is not read. Each row must be a different sequence's (a
    /// prompt's rows would read keys that other blocks write), and a key
    /// is written only for a row of at least one token within
    /// `batch.max_len` (the tag check clears a row's length with its
    /// slot). `plan`'s kind is the flash kernel's whatever it says. Fails
    /// where [`Self::rotates_in_attention`] does not hold.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_roped(
        &self,
        kv: &mut PagedKv,
        rows: Unrotated<'_>,
        at: &RopeKv<'_>,
        query: &PagedQuery<'_>,
        batch: DecodeBatch,
        plan: AttentionPlan,
        scratch: &mut AttentionBuffers,
        out: AttnOut<'_>,
    ) -> R {
        let (kv_heads, head_dim, _) = kv.writable_layout()?;
        let RopeKv {
            slots,
            pos,
            inv_freq,
            tokens,
            heads,
            interleaved,
        } = *at;
        if !self.rotates_in_attention(kv) {
            return Err(KernelError::Shape(format!(
                "attention rotates a step's keys only in the flash kernel's shapes, not heads of \
                 {head_dim} in pages of {}",
                kv.layout.page_size
            )));
        }
        let (q_dim, kv_dim) = (heads * head_dim, kv_heads * head_dim);
        let (q_ld, kv_ld, fits) = match rows {
            Unrotated::Stacked(r) => {
                let ld = q_dim + 2 * kv_dim;
                (ld, ld, r.len() >= tokens * ld)
            }
            Unrotated::Apart { q, k, v } => (
                q_dim,
                kv_dim,
                q.len() >= tokens * q_dim
                    && k.len() >= tokens * kv_dim
                    && v.len() >= tokens * kv_dim,
            ),
        };
        if tokens != batch.seqs || heads != query.heads || !fits || !at.covers(head_dim) {
            return Err(KernelError::Shape(format!(
                "attention that rotates {tokens} tokens of {heads} + 2 x {kv_heads} heads of \
                 {head_dim} for {} sequences: rows, slots, positions or frequencies too short",
                batch.seqs
            )));
        }
        if kv.format == KvFormat::Fp8Static && !head_dim.is_power_of_two() {
            return Err(KernelError::Shape(format!(
                "static fp8 pages rotate heads of a power of two, not {head_dim}"
            )));
        }
        let s = &self.stream;
        let f32s = std::mem::size_of::<f32>() as u64;
        let ((q, _rq), (k, _rk), (v, _rv)) = match rows {
            Unrotated::Stacked(r) => {
                let (p, g) = r.device_ptr(s);
                let k = p + q_dim as u64 * f32s;
                ((p, g), (k, None), (k + kv_dim as u64 * f32s, None))
            }
            Unrotated::Apart { q, k, v } => {
                let ((q, gq), (k, gk), (v, gv)) =
                    (q.device_ptr(s), k.device_ptr(s), v.device_ptr(s));
                ((q, gq), (k, Some(gk)), (v, Some(gv)))
            }
        };
        let (pos, _rp) = pos.device_ptr(s);
        let (freq, _rf) = inv_freq.device_ptr(s);
        let (slots, _rs) = slots.device_ptr(s);
        let rope = RopeIn {
            q,
            k,
            v,
            pos,
            inv_freq: freq,
            slots,
            q_ld: q_ld as i32,
            kv_ld: kv_ld as i32,
            interleaved: interleaved as i32,
        };
        let plan = AttentionPlan {
            kind: Some(AttentionKind::Flash),
            ..plan
        };
        // SAFETY: the rows, positions, frequencies and slots of the
        // batch's tokens (checked above), the slots naming `kv`'s pages,
        // whose layout the writes take (checked above); the guards held.
        unsafe { self.attention_launch(kv, query, batch, plan, scratch, out, rope) }
    }
}
