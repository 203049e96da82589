//! Pages' contents in and out of the device, for a sequence that moves to
//! another engine (`engine/transfer.rs`): each page's layers in turn, as
//! the CPU's pages hold them (`KvCache::read_pages`), in one device buffer
//! that the other engine's GPU copies (one peer copy) and scatters.

use kiln_kernels::cuda::{CudaSlice, Gpu};

use super::{GpuKv, GpuModel, R};

/// Pages' contents in a buffer on the GPU that gathered them, complete.
pub struct DevicePages {
    buf: CudaSlice<u8>,
    /// Bytes of pages in it (an empty one still holds a byte).
    len: usize,
}

impl DevicePages {
    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no page.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes, on the host.
    pub fn to_host(&self) -> R<Vec<u8>> {
        let mut bytes = Gpu::download_from(&self.buf)?;
        bytes.truncate(self.len);
        Ok(bytes)
    }
}

impl GpuModel {
    /// `pages` of `kv`, each page's layers in turn, on this GPU (one wait).
    pub fn export_kv_pages(&self, kv: &GpuKv, pages: &[u32]) -> R<DevicePages> {
        let buf = self.gpu.gather_kv_pages(&kv.layers, pages)?;
        self.gpu.synchronize()?;
        let len = Gpu::kv_pages_bytes(&kv.layers, pages.len());
        Ok(DevicePages { buf, len })
    }

    /// Overwrites `pages` of `kv` with what [`Self::export_kv_pages`] gave
    /// another engine's pages of the same format and layout, on this GPU or
    /// another (one peer copy).
    pub fn import_kv_pages(&self, kv: &mut GpuKv, pages: &[u32], from: &DevicePages) -> R<()> {
        if from.buf.ordinal() == self.ordinal {
            self.gpu
                .scatter_kv_pages(&mut kv.layers, pages, &from.buf)?;
        } else {
            let here = self.gpu.copy_from_peer(&from.buf)?;
            self.gpu.scatter_kv_pages(&mut kv.layers, pages, &here)?;
        }
        self.gpu.synchronize()
    }

    /// Overwrites `pages` of `kv` with what [`DevicePages::to_host`] (or
    /// the CPU's pages) gave for as many pages of the same format and
    /// layout.
    pub fn write_kv_pages(&self, kv: &mut GpuKv, pages: &[u32], bytes: &[u8]) -> R<()> {
        let want = Gpu::kv_pages_bytes(&kv.layers, pages.len());
        if pages.is_empty() && bytes.is_empty() {
            return Ok(());
        }
        if bytes.len() != want {
            return Err(kiln_kernels::KernelError::Shape(format!(
                "{} bytes for {} pages of {} here",
                bytes.len(),
                pages.len(),
                want / pages.len().max(1)
            )));
        }
        let buf = self.gpu.upload(bytes)?;
        self.gpu.scatter_kv_pages(&mut kv.layers, pages, &buf)?;
        self.gpu.synchronize()
    }
}
