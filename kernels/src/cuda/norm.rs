//! The per-token kernels around the projections: RMSNorm (with the
//! residual add), RoPE over queries and keys (alone, or with the keys and
//! values then written into their pages), SiLU-and-multiply.

use cudarc::driver::{CudaSlice, CudaView, PushKernelArg};
use half::bf16;

use super::launch::{PagedKv, blocks, cfg};
use super::{Gpu, cuda_err};
use crate::KernelError;
use crate::kv::KvFormat;

type R<T = ()> = Result<T, KernelError>;

/// Where the norm writes: f32 activations, or bf16 ones for a GEMM.
pub(super) enum NormOut<'a> {
    /// f32.
    F32(&'a mut CudaSlice<f32>),
    /// bf16.
    Bf16(&'a mut CudaSlice<bf16>),
}

impl Gpu {
    /// `x += residual` (if given), then `out = rmsnorm(x) * w`, per row.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_residual(
        &self,
        x: &mut CudaSlice<f32>,
        residual: Option<&CudaSlice<f32>>,
        w: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> R {
        self.rmsnorm_launch(x, residual, w, NormOut::F32(out), rows, dim, eps)
    }

    /// The norm's launch, into f32 or into bf16 (the caller checked that
    /// `out` holds `rows x dim`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rmsnorm_launch(
        &self,
        x: &mut CudaSlice<f32>,
        residual: Option<&CudaSlice<f32>>,
        w: &CudaSlice<f32>,
        out: NormOut<'_>,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> R {
        let f = self.function("rmsnorm_residual")?;
        let mut b = self.stream.launch_builder(f);
        let null = 0u64;
        b.arg(x);
        match residual {
            Some(r) => b.arg(r),
            None => b.arg(&null),
        };
        b.arg(w);
        match out {
            NormOut::F32(o) => b.arg(o).arg(&null),
            NormOut::Bf16(o) => b.arg(&null).arg(o),
        };
        let dim_i = dim as i32;
        b.arg(&dim_i).arg(&eps);
        // A thread per 16-byte piece of a row (up to 1024), so one row (a
        // decode step) is read in a single round.
        let threads = dim.div_ceil(4).next_multiple_of(32).clamp(32, 1024) as u32;
        // SAFETY: the kernel reads and writes `rows x dim` of each buffer.
        unsafe { b.launch(cfg((rows as u32, 1, 1), threads, 0)) }.map_err(cuda_err)?;
        Ok(())
    }

    /// Rotates `x` (`tokens x heads x dim`) at `pos` with `inv_freq`.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        pos: &CudaView<'_, i32>,
        inv_freq: &CudaSlice<f32>,
        tokens: usize,
        heads: usize,
        dim: usize,
        interleaved: bool,
    ) -> R {
        self.rope_launch(x, None, pos, inv_freq, tokens, [heads, 0], dim, interleaved)
    }

    /// [`Self::rope`] over a step's queries `q` (`tokens x heads x dim`) and
    /// keys `k` (`tokens x kv_heads x dim`) in one launch.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_qk(
        &self,
        q: &mut CudaSlice<f32>,
        k: &mut CudaSlice<f32>,
        pos: &CudaView<'_, i32>,
        inv_freq: &CudaSlice<f32>,
        tokens: usize,
        [heads, kv_heads]: [usize; 2],
        dim: usize,
        interleaved: bool,
    ) -> R {
        self.rope_launch(
            q,
            Some(k),
            pos,
            inv_freq,
            tokens,
            [heads, kv_heads],
            dim,
            interleaved,
        )
    }

    /// [`Self::rope_qk`] then [`Self::kv_write`] in one launch: rotates the
    /// step's queries `q` (`tokens x heads x head_dim`) and keys `k`
    /// (`tokens x kv_heads x head_dim`) in place and writes the rotated
    /// keys and the values `v` into `kv` at `slots` (a negative slot writes
    /// nothing), bit for bit what the two launches write.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_kv_write(
        &self,
        kv: &mut PagedKv,
        q: &mut CudaSlice<f32>,
        k: &mut CudaSlice<f32>,
        v: &CudaSlice<f32>,
        slots: &CudaView<'_, i32>,
        pos: &CudaView<'_, i32>,
        inv_freq: &CudaSlice<f32>,
        tokens: usize,
        heads: usize,
        interleaved: bool,
    ) -> R {
        let (kv_heads, head_dim, page_size) = kv.writable_layout()?;
        let kv_len = tokens * kv_heads * head_dim;
        if q.len() < tokens * heads * head_dim
            || k.len() < kv_len
            || v.len() < kv_len
            || slots.len() < tokens
            || pos.len() < tokens
            || inv_freq.len() < head_dim / 2
        {
            return Err(KernelError::Shape(format!(
                "rope and KV write over {tokens} tokens of {heads} + {kv_heads} heads of \
                 {head_dim}: buffer too small"
            )));
        }
        let name = match kv.format {
            KvFormat::Bf16 => "rope_kv_write_bf16",
            KvFormat::Fp8 => "rope_kv_write_fp8",
        };
        let f = self.function(name)?;
        let (h, kvh, d) = (heads as i32, kv_heads as i32, head_dim as i32);
        let (ps, il) = (page_size as i32, interleaved as i32);
        let mut b = self.stream.launch_builder(f);
        b.arg(q).arg(k).arg(v).arg(pos).arg(inv_freq).arg(slots);
        b.arg(&mut kv.k).arg(&mut kv.v);
        b.arg(&mut kv.k_scale).arg(&mut kv.v_scale);
        b.arg(&h).arg(&kvh).arg(&d).arg(&ps).arg(&il);
        let grid = (tokens as u32, (heads + kv_heads) as u32, 1);
        // SAFETY: every buffer checked above; slots index vectors inside
        // the pages.
        unsafe { b.launch(cfg(grid, head_dim as u32, 0)) }.map_err(cuda_err)?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn rope_launch(
        &self,
        x: &mut CudaSlice<f32>,
        x2: Option<&mut CudaSlice<f32>>,
        pos: &CudaView<'_, i32>,
        inv_freq: &CudaSlice<f32>,
        tokens: usize,
        [heads, heads2]: [usize; 2],
        dim: usize,
        interleaved: bool,
    ) -> R {
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

    /// `gate = silu(gate) * up` over `n` elements.
    pub fn silu_mul(&self, gate: &mut CudaSlice<f32>, up: &CudaSlice<f32>, n: usize) -> R {
        let f = self.function("silu_mul")?;
        let n_i = n as i32;
        let mut b = self.stream.launch_builder(f);
        let null = 0u64;
        b.arg(gate).arg(up).arg(&null).arg(&n_i);
        // SAFETY: one thread per element, bounds-checked.
        unsafe { b.launch(cfg((blocks(n, 256), 1, 1), 256, 0)) }.map_err(cuda_err)?;
        Ok(())
    }
}
