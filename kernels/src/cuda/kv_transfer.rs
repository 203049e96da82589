//! Pages' contents on the device as one buffer, laid out as
//! [`crate::kv::KvPages`] reads and writes them on the host
//! (`kv/transfer.rs`): each page's layers in turn, each layer's K, V, then
//! (fp8 pages) its K and V scales. A sequence that moves to another engine
//! takes its pages in one such buffer: gathered by a launch a layer,
//! copied to another GPU by one peer copy, scattered by a launch a layer.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, PushKernelArg};

use super::kv::PagedKv;
use super::{Gpu, cuda_err};
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

/// Bytes a page of `layers` takes in a buffer of pages, and where each
/// layer's part starts in it.
fn page_parts(layers: &[PagedKv]) -> (usize, Vec<usize>) {
    let mut at = 0;
    let offsets = (layers.iter())
        .map(|l| {
            let start = at;
            at += l.layout.page_bytes(l.format);
            start
        })
        .collect();
    (at, offsets)
}

impl Gpu {
    /// Bytes `pages` of `layers` take in a buffer of pages.
    pub fn kv_pages_bytes(layers: &[PagedKv], pages: usize) -> usize {
        page_parts(layers).0 * pages
    }

    /// `pages` of every layer of `layers` in one new buffer (gathered on
    /// this GPU's stream; no wait). The buffer belongs to a stream of its
    /// own, never captured, so another thread may read it or drop it while
    /// this GPU's stream captures a graph.
    pub fn gather_kv_pages(&self, layers: &[PagedKv], pages: &[u32]) -> R<CudaSlice<u8>> {
        check_pages(layers, pages)?;
        let own = self.ctx.new_stream().map_err(cuda_err)?;
        let len = Self::kv_pages_bytes(layers, pages.len());
        // SAFETY: the gather below writes every byte before anything reads
        // it (each page's every layer, K, V and scales, back to back).
        let mut buf = unsafe { own.alloc::<u8>(len.max(1)) }.map_err(cuda_err)?;
        // The allocation is ready before this GPU's stream writes it.
        own.synchronize().map_err(cuda_err)?;
        if pages.is_empty() {
            return Ok(buf);
        }
        let ids = self.upload(pages)?;
        let (per_page, offsets) = page_parts(layers);
        for (layer, at) in layers.iter().zip(offsets) {
            let mut b = self.stream.launch_builder(self.function("kv_pages_copy")?);
            b.arg(&layer.k)
                .arg(&layer.v)
                .arg(&layer.k_scale)
                .arg(&layer.v_scale);
            let args = CopyArgs::new(layer, per_page, at, true);
            args.push(&mut b, &ids);
            b.arg(&mut buf).arg(&args.to_buf);
            // SAFETY: every page id is under the pool's (checked) and `buf`
            // holds `ids.len()` pages of `per_page` bytes.
            unsafe { b.launch(args.grid(ids.len())) }.map_err(cuda_err)?;
        }
        Ok(buf)
    }

    /// Overwrites `pages` of every layer of `layers` with what
    /// [`Self::gather_kv_pages`] (or the host's pages) gave for as many
    /// pages of the same format and layout (queued on the stream).
    pub fn scatter_kv_pages(
        &self,
        layers: &mut [PagedKv],
        pages: &[u32],
        buf: &CudaSlice<u8>,
    ) -> R {
        let want = Self::kv_pages_bytes(layers, pages.len());
        if pages.is_empty() {
            return Ok(());
        }
        if buf.len() != want {
            return Err(KernelError::Shape(format!(
                "{} bytes for {} pages of {} here",
                buf.len(),
                pages.len(),
                want / pages.len().max(1)
            )));
        }
        check_pages(layers, pages)?;
        let ids = self.upload(pages)?;
        let (per_page, offsets) = page_parts(layers);
        for (layer, at) in layers.iter_mut().zip(offsets) {
            let args = CopyArgs::new(layer, per_page, at, false);
            let mut b = self.stream.launch_builder(self.function("kv_pages_copy")?);
            b.arg(&mut layer.k).arg(&mut layer.v);
            b.arg(&mut layer.k_scale).arg(&mut layer.v_scale);
            args.push(&mut b, &ids);
            b.arg(buf).arg(&args.to_buf);
            // SAFETY: as in `gather_kv_pages`, the other way.
            unsafe { b.launch(args.grid(ids.len())) }.map_err(cuda_err)?;
        }
        Ok(())
    }

    /// `buf`'s bytes on the host, waiting for the stream it was made on.
    pub fn download_from(buf: &CudaSlice<u8>) -> R<Vec<u8>> {
        let stream = buf.stream();
        let bytes = stream.clone_dtoh(buf).map_err(cuda_err)?;
        stream.synchronize().map_err(cuda_err)?;
        Ok(bytes)
    }

    /// A copy on this GPU of `src`, which another GPU (or this one) holds:
    /// one peer copy on this stream, over NVLink where the GPUs have it.
    /// `src` must be complete (its writers synchronized) and must live
    /// until this stream has synchronized after the copy.
    pub fn copy_from_peer(&self, src: &CudaSlice<u8>) -> R<CudaSlice<u8>> {
        let mut dst = self.zeros::<u8>(src.len())?;
        if src.is_empty() {
            return Ok(dst);
        }
        let src_stream = src.stream().clone();
        let (from, _read) = src.device_ptr(&src_stream);
        let (to, _write) = dst.device_ptr_mut(&self.stream);
        let (src_ctx, dst_ctx) = (src.context().cu_ctx(), self.stream.context().cu_ctx());
        self.stream.context().bind_to_thread().map_err(cuda_err)?;
        // SAFETY: both pointers are live allocations of `src.len()` bytes in
        // their contexts, and the copy is ordered on this stream.
        let r = unsafe {
            cudarc::driver::sys::cuMemcpyPeerAsync(
                to,
                dst_ctx,
                from,
                src_ctx,
                src.len(),
                self.stream.cu_stream(),
            )
        };
        r.result().map_err(cuda_err)?;
        drop((_read, _write));
        Ok(dst)
    }
}

/// Fails unless every page of `pages` is one of `layers`' pool.
fn check_pages(layers: &[PagedKv], pages: &[u32]) -> R {
    let Some(l) = layers.first() else {
        return Ok(());
    };
    let page_k = l.layout.page_ranges(l.format, 0).0.len().max(1);
    let room = l.k.len() / page_k;
    match pages.iter().find(|p| **p as usize >= room) {
        Some(p) => Err(KernelError::Shape(format!(
            "page {p} of a pool of {room} pages"
        ))),
        None => Ok(()),
    }
}

/// The scalar arguments of `kv_pages_copy` for one layer.
struct CopyArgs {
    ints: [i64; 4],
    to_buf: i32,
}

impl CopyArgs {
    fn new(layer: &PagedKv, per_page: usize, layer_off: usize, to_buf: bool) -> Self {
        let (e, s) = layer.layout.page_ranges(layer.format, 0);
        Self {
            ints: [
                e.len() as i64,
                s.len() as i64,
                per_page as i64,
                layer_off as i64,
            ],
            to_buf: i32::from(to_buf),
        }
    }

    /// The page ids and the sizes, after the four page buffers.
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>, ids: &'a CudaSlice<u32>) {
        b.arg(ids);
        for i in &self.ints {
            b.arg(i);
        }
    }

    /// A block a page and part (K, V and their scales).
    fn grid(&self, pages: usize) -> cudarc::driver::LaunchConfig {
        cudarc::driver::LaunchConfig {
            grid_dim: (pages as u32, 4, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}
