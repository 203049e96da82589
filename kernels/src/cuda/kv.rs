//! A layer's KV pages on the device, and the plain write of K and V rows
//! into them (the kernels of `kv.cu`).

use cudarc::driver::{CudaSlice, CudaView, LaunchArgs, PushKernelArg};

use super::launch::cfg;
use super::{Gpu, cuda_err};
use crate::KernelError;
use crate::kv::{KvFormat, KvLayout};

type R<T = ()> = Result<T, KernelError>;

/// One layer's KV pages on the GPU (same layout as [`crate::kv::KvPages`]).
pub struct PagedKv {
    /// The format.
    pub format: KvFormat,
    /// The layout.
    pub layout: KvLayout,
    /// K bytes (bf16 or e4m3).
    pub k: CudaSlice<u8>,
    /// V bytes.
    pub v: CudaSlice<u8>,
    /// K scales (fp8 only; one per vector).
    pub k_scale: CudaSlice<f32>,
    /// V scales.
    pub v_scale: CudaSlice<f32>,
}

impl PagedKv {
    /// KV heads, head size and page size, when the KV-writing kernels (a
    /// thread per element of a head's vector) can take the layout.
    pub(super) fn writable_layout(&self) -> R<(usize, usize, usize)> {
        let head_dim = self.layout.head_dim;
        if !head_dim.is_multiple_of(32) || head_dim > 1024 {
            return Err(KernelError::Shape(format!(
                "head_dim {head_dim}: a multiple of 32 up to 1024"
            )));
        }
        let l = self.layout;
        Ok((l.kv_heads, head_dim, l.page_size))
    }
}

impl Gpu {
    /// Zeroed pages.
    pub fn paged_kv(&self, format: KvFormat, layout: KvLayout, pages: usize) -> R<PagedKv> {
        let vectors = pages * layout.page_size * layout.kv_heads;
        let elem = format.elem_bytes();
        let bytes = vectors * layout.head_dim * elem;
        let scales = if format == KvFormat::Fp8 { vectors } else { 1 };
        let s = &self.stream;
        Ok(PagedKv {
            format,
            layout,
            k: s.alloc_zeros(bytes).map_err(cuda_err)?,
            v: s.alloc_zeros(bytes).map_err(cuda_err)?,
            k_scale: s.alloc_zeros(scales).map_err(cuda_err)?,
            v_scale: s.alloc_zeros(scales).map_err(cuda_err)?,
        })
    }

    /// Writes `tokens` K and V rows (`kv_heads x head_dim` each) at slots
    /// `page * page_size + slot` (each head's vector where
    /// [`crate::kv`]'s layout puts it); a negative slot writes nothing.
    ///
    /// Reference path: the engine's step writes K and V in
    /// [`Self::rope_kv_write`]; kept for the parity tests, which fill pages
    /// with it, and for the test of the fused launch.
    pub fn kv_write(
        &self,
        kv: &mut PagedKv,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        slots: &CudaView<'_, i32>,
        tokens: usize,
    ) -> R {
        let (kv_heads, head_dim, page_size) = kv.writable_layout()?;
        let (h, d, ps) = (kv_heads as i32, head_dim as i32, page_size as i32);
        let grid = (tokens as u32, kv_heads as u32, 1);
        match kv.format {
            KvFormat::Bf16 => {
                let f = self.function("kv_write_bf16")?;
                let mut b = self.stream.launch_builder(f);
                b.arg(k)
                    .arg(v)
                    .arg(slots)
                    .arg(&mut kv.k)
                    .arg(&mut kv.v)
                    .arg(&h)
                    .arg(&d)
                    .arg(&ps);
                // SAFETY: slots index vectors inside the pages.
                unsafe { b.launch(cfg(grid, head_dim as u32, 0)) }.map_err(cuda_err)?;
            }
            KvFormat::Fp8 | KvFormat::Fp8Static => {
                let f = self.function("kv_write_fp8")?;
                let mut b = self.stream.launch_builder(f);
                b.arg(k).arg(v).arg(slots).arg(&mut kv.k).arg(&mut kv.v);
                if kv.format == KvFormat::Fp8 {
                    b.arg(&mut kv.k_scale).arg(&mut kv.v_scale);
                } else {
                    b.arg(&NULL_SCALES).arg(&NULL_SCALES);
                }
                b.arg(&h).arg(&d).arg(&ps);
                // SAFETY: as above.
                unsafe { b.launch(cfg(grid, head_dim as u32, 0)) }.map_err(cuda_err)?;
            }
        }
        Ok(())
    }
}

/// Pushes a layer's pages as kernel arguments: K, V, K scales, V scales.
pub(super) fn push_pages<'a>(b: &mut LaunchArgs<'a>, kv: &'a PagedKv) {
    b.arg(&kv.k).arg(&kv.v);
    push_scales(b, kv);
}

/// Pushes the K and V scale buffers of pages with a scale per vector, and
/// two null pointers for the other formats: the fp8 kernels read a null
/// scale buffer as the static format's scale of 1.
fn push_scales<'a>(b: &mut LaunchArgs<'a>, kv: &'a PagedKv) {
    if kv.format == KvFormat::Fp8 {
        b.arg(&kv.k_scale).arg(&kv.v_scale);
    } else {
        b.arg(&NULL_SCALES).arg(&NULL_SCALES);
    }
}

/// A null device pointer, passed for the scale buffers of formats without
/// them.
pub(super) static NULL_SCALES: u64 = 0;
