//! Rotary position embedding over a step's queries and keys (`rope.cu`):
//! alone, or with the keys and values then written into their pages.

use cudarc::driver::{CudaSlice, CudaView, DevicePtr, DevicePtrMut, DeviceRepr, PushKernelArg};

use super::kv::NULL_SCALES;
use super::kv::PagedKv;
use super::launch::cfg;
use super::{Gpu, cuda_err};
use crate::KernelError;
use crate::kv::KvFormat;

type R<T = ()> = Result<T, KernelError>;

/// Heads of [`Gpu::rope_kv_write`] a block (`ROPE_WARPS` in rope.cu).
const ROPE_WARPS: usize = 4;
/// The widest head it takes (`ROPE_HD_MAX`).
const ROPE_HD_MAX: usize = 256;

/// Where and how [`Gpu::rope_kv_write`] rotates and writes a step's tokens.
#[derive(Clone, Copy)]
pub struct RopeKv<'a> {
    /// Each token's KV slot (a negative one writes nothing).
    pub slots: &'a CudaView<'a, i32>,
    /// Each token's position.
    pub pos: &'a CudaView<'a, i32>,
    /// The rotary frequencies (`head_dim / 2`).
    pub inv_freq: &'a CudaSlice<f32>,
    /// Tokens in the step.
    pub tokens: usize,
    /// Query heads.
    pub heads: usize,
    /// Pairs (2i, 2i + 1) rather than (i, i + half).
    pub interleaved: bool,
}

impl RopeKv<'_> {
    /// Whether its slots and positions cover its tokens and its
    /// frequencies a head of `head_dim`.
    pub(super) fn covers(&self, head_dim: usize) -> bool {
        self.slots.len() >= self.tokens
            && self.pos.len() >= self.tokens
            && self.inv_freq.len() >= head_dim / 2
    }
}

/// Where and how [`Gpu::rope`] and [`Gpu::rope_qk`] rotate a step's tokens.
#[derive(Clone, Copy)]
pub struct RopeArgs<'a> {
    /// Each token's position.
    pub pos: &'a CudaView<'a, i32>,
    /// The rotary frequencies (`dim / 2`).
    pub inv_freq: &'a CudaSlice<f32>,
    /// Tokens in the step.
    pub tokens: usize,
    /// Heads of each token (its query heads, for [`Gpu::rope_qk`]).
    pub heads: usize,
    /// Elements per head.
    pub dim: usize,
    /// Pairs (2i, 2i + 1) rather than (i, i + half).
    pub interleaved: bool,
}

/// Device addresses of a step's queries, keys and values, each token's
/// row at its stride (in floats), and where the rotated queries go.
struct QkvRows {
    q: u64,
    k: u64,
    v: u64,
    q_ld: usize,
    kv_ld: usize,
    q_out: u64,
}

/// What a flash launch rotates and writes first (`RopeIn` in rope.cu):
/// token t's query heads at `q + t * q_ld`, its key and value heads at
/// `k` and `v` plus `t * kv_ld` (floats), each token's position and KV
/// slot, and the rotary frequencies; nothing where `q` is 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct RopeIn {
    pub(super) q: u64,
    pub(super) k: u64,
    pub(super) v: u64,
    pub(super) pos: u64,
    pub(super) inv_freq: u64,
    pub(super) slots: u64,
    pub(super) q_ld: i32,
    pub(super) kv_ld: i32,
    pub(super) interleaved: i32,
}

// SAFETY: a plain `repr(C)` struct of integers, as the kernels declare it.
unsafe impl DeviceRepr for RopeIn {}

// Six pointers and three ints, padded to 8 bytes: the CUDA struct's size.
const _: () = assert!(std::mem::size_of::<RopeIn>() == 64);

impl RopeIn {
    /// Whether the launch rotates and writes.
    pub(super) fn rotates(&self) -> bool {
        self.q != 0
    }
}

impl Gpu {
    /// Rotates `x` (`tokens x heads x dim`) at `pos` with `inv_freq`.
    ///
    /// Reference path: the engine's step uses [`Self::rope_kv_write`]; kept
    /// for the parity tests of RoPE against the CPU.
    pub fn rope(&self, x: &mut CudaSlice<f32>, at: &RopeArgs<'_>) -> R {
        self.rope_launch(x, None, at)
    }

    /// [`Self::rope`] over a step's queries `q` (`tokens x heads x dim`) and
    /// keys `k` (`tokens x kv_heads x dim`) in one launch.
    ///
    /// Reference path: the engine's step uses [`Self::rope_kv_write`]; kept
    /// for the test that the fused launch writes what this and
    /// [`Self::kv_write`] write.
    pub fn rope_qk(
        &self,
        q: &mut CudaSlice<f32>,
        k: &mut CudaSlice<f32>,
        kv_heads: usize,
        at: &RopeArgs<'_>,
    ) -> R {
        self.rope_launch(q, Some((k, kv_heads)), at)
    }

    /// [`Self::rope_qk`] then [`Self::kv_write`] in one launch: rotates the
    /// step's queries `q` (`tokens x heads x head_dim`) and keys `k`
    /// (`tokens x kv_heads x head_dim`) in place and writes the rotated
    /// keys and the values `v` into `kv` at `slots` (a negative slot writes
    /// nothing), bit for bit what the two launches write.
    pub fn rope_kv_write(
        &self,
        kv: &mut PagedKv,
        q: &mut CudaSlice<f32>,
        k: &mut CudaSlice<f32>,
        v: &CudaSlice<f32>,
        at: &RopeKv<'_>,
    ) -> R {
        let (kv_heads, head_dim, _) = kv.writable_layout()?;
        let (tokens, heads) = (at.tokens, at.heads);
        let (q_dim, kv_dim) = (heads * head_dim, kv_heads * head_dim);
        if q.len() < tokens * q_dim || k.len() < tokens * kv_dim || v.len() < tokens * kv_dim {
            return Err(KernelError::Shape(format!(
                "rope and KV write over {tokens} tokens of {heads} + {kv_heads} heads of \
                 {head_dim}: buffer too small"
            )));
        }
        let (qp, _rq) = q.device_ptr_mut(&self.stream);
        let (kp, _rk) = k.device_ptr_mut(&self.stream);
        let (vp, _rv) = v.device_ptr(&self.stream);
        let rows = QkvRows {
            q: qp,
            k: kp,
            v: vp,
            q_ld: q_dim,
            kv_ld: kv_dim,
            q_out: qp,
        };
        // SAFETY: q, k and v hold `tokens` rows of their widths (checked
        // above); the queries rotate in place.
        unsafe { self.rope_kv_launch(kv, rows, at) }
    }

    /// [`Self::rope_kv_write`] over one stacked projection: row t of `qkv`
    /// is token t's queries, keys and values side by side (`heads + 2 x
    /// kv_heads` heads of `head_dim`), as one GEMM over the stacked q, k and
    /// v weights writes them. The rotated queries go to `q_out` (`tokens x
    /// heads x head_dim`), the rotated keys back into `qkv`, the keys and
    /// values into `kv`: what [`Self::rope_kv_write`] writes from three
    /// separate buffers, bit for bit.
    pub fn rope_kv_write_stacked(
        &self,
        kv: &mut PagedKv,
        qkv: &mut CudaSlice<f32>,
        q_out: &mut CudaSlice<f32>,
        at: &RopeKv<'_>,
    ) -> R {
        let (kv_heads, head_dim, _) = kv.writable_layout()?;
        let (tokens, heads) = (at.tokens, at.heads);
        let (q_dim, kv_dim) = (heads * head_dim, kv_heads * head_dim);
        let ld = q_dim + 2 * kv_dim;
        if qkv.len() < tokens * ld || q_out.len() < tokens * q_dim {
            return Err(KernelError::Shape(format!(
                "rope and KV write over {tokens} stacked rows of {heads} + 2 x {kv_heads} heads \
                 of {head_dim}: buffer too small"
            )));
        }
        let (p, _r) = qkv.device_ptr_mut(&self.stream);
        let (qo, _ro) = q_out.device_ptr_mut(&self.stream);
        let f32s = std::mem::size_of::<f32>() as u64;
        let rows = QkvRows {
            q: p,
            k: p + q_dim as u64 * f32s,
            v: p + (q_dim + kv_dim) as u64 * f32s,
            q_ld: ld,
            kv_ld: ld,
            q_out: qo,
        };
        // SAFETY: `tokens` rows of `ld` in qkv and of q_dim in q_out
        // (checked above), separate allocations.
        unsafe { self.rope_kv_launch(kv, rows, at) }
    }

    /// # Safety
    /// `rows` must point at `at.tokens` rows of queries, keys and values at
    /// their strides, and `q_out` at `tokens x heads x head_dim` floats.
    unsafe fn rope_kv_launch(&self, kv: &mut PagedKv, rows: QkvRows, at: &RopeKv<'_>) -> R {
        let (kv_heads, head_dim, page_size) = kv.writable_layout()?;
        let RopeKv {
            slots,
            pos,
            inv_freq,
            tokens,
            heads,
            interleaved,
        } = *at;
        if !at.covers(head_dim) {
            return Err(KernelError::Shape(format!(
                "rope and KV write over {tokens} tokens: slots, positions or frequencies too short"
            )));
        }
        if !head_dim.is_multiple_of(32) || head_dim > ROPE_HD_MAX {
            return Err(KernelError::Shape(format!(
                "rope and KV write: heads of {head_dim}, not a multiple of 32 up to {ROPE_HD_MAX}"
            )));
        }
        let name = match kv.format {
            KvFormat::Bf16 => "rope_kv_write_bf16",
            KvFormat::Fp8 => "rope_kv_write_fp8",
            KvFormat::Fp8Static => {
                if !head_dim.is_power_of_two() {
                    return Err(KernelError::Shape(format!(
                        "head_dim {head_dim}: static fp8 pages rotate heads of a power of two"
                    )));
                }
                "rope_kv_write_fp8s"
            }
        };
        let f = self.function(name)?;
        let (h, kvh, d) = (heads as i32, kv_heads as i32, head_dim as i32);
        let (ps, il) = (page_size as i32, interleaved as i32);
        let (q_ld, kv_ld) = (rows.q_ld as i32, rows.kv_ld as i32);
        let mut b = self.stream.launch_builder(f);
        b.arg(&rows.q)
            .arg(&rows.k)
            .arg(&rows.v)
            .arg(&q_ld)
            .arg(&kv_ld);
        b.arg(&rows.q_out).arg(pos).arg(inv_freq).arg(slots);
        b.arg(&mut kv.k).arg(&mut kv.v);
        if kv.format == KvFormat::Fp8 {
            b.arg(&mut kv.k_scale).arg(&mut kv.v_scale);
        } else {
            b.arg(&NULL_SCALES).arg(&NULL_SCALES);
        }
        b.arg(&h).arg(&kvh).arg(&d).arg(&ps).arg(&il);
        let grid = (
            tokens as u32,
            (heads + kv_heads).div_ceil(ROPE_WARPS) as u32,
            1,
        );
        // SAFETY: the caller vouches for the rows; slots index vectors
        // inside the pages; a warp a head, past the last one idle.
        unsafe { b.launch(cfg(grid, 32 * ROPE_WARPS as u32, 0)) }.map_err(cuda_err)?;
        Ok(())
    }

    /// Rotates `x` (`tokens x at.heads x dim`) and, in the same launch,
    /// `keys`: a second buffer with its heads per token (`tokens x heads2 x
    /// dim`).
    fn rope_launch(
        &self,
        x: &mut CudaSlice<f32>,
        keys: Option<(&mut CudaSlice<f32>, usize)>,
        at: &RopeArgs<'_>,
    ) -> R {
        let RopeArgs {
            pos,
            inv_freq,
            tokens,
            heads,
            dim,
            interleaved,
        } = *at;
        let (x2, heads2) = match keys {
            Some((k, h)) => (Some(k), h),
            None => (None, 0),
        };
        if x.len() < tokens * heads * dim
            || x2.as_ref().is_some_and(|k| k.len() < tokens * heads2 * dim)
        {
            return Err(KernelError::Shape(format!(
                "rope over {tokens} tokens of {heads} + {heads2} heads of {dim}: buffer too small"
            )));
        }
        let f = self.function("rope")?;
        let (h, h2, d, il) = (heads as i32, heads2 as i32, dim as i32, interleaved as i32);
        let mut b = self.stream.launch_builder(f);
        let null = 0u64;
        b.arg(x);
        match x2 {
            Some(k) => b.arg(k),
            None => b.arg(&null),
        };
        b.arg(pos).arg(inv_freq).arg(&h).arg(&h2).arg(&d).arg(&il);
        let threads = (dim / 2).clamp(32, 256) as u32;
        let grid = (tokens as u32, (heads + heads2) as u32, 1);
        // SAFETY: grid covers tokens x (heads + heads2) rows of `dim`, each
        // buffer checked above.
        unsafe { b.launch(cfg(grid, threads, 0)) }.map_err(cuda_err)?;
        Ok(())
    }
}
