//! Pages' contents in and out of the device, for a sequence that moves to
//! another engine (`engine/transfer.rs`): each page's layers in turn, as
//! the CPU's pages hold them (`KvCache::read_pages`).

use super::{GpuKv, GpuModel, R};

impl GpuModel {
    /// `pages` of `kv`, each page's layers in turn.
    pub fn read_kv_pages(&self, kv: &GpuKv, pages: &[u32]) -> R<Vec<u8>> {
        let mut out = Vec::new();
        for &page in pages {
            for layer in &kv.layers {
                self.gpu.read_kv_page(layer, page as usize, &mut out)?;
            }
        }
        Ok(out)
    }

    /// Overwrites `pages` of `kv` with what [`Self::read_kv_pages`] (or
    /// the CPU's pages) gave for as many pages of the same format and
    /// layout.
    pub fn write_kv_pages(&self, kv: &mut GpuKv, pages: &[u32], bytes: &[u8]) -> R<()> {
        let per_layer = kv
            .layers
            .first()
            .map_or(0, |l| l.layout.page_bytes(l.format));
        if bytes.len() != per_layer * kv.layers.len() * pages.len() {
            return Err(kiln_kernels::KernelError::Shape(format!(
                "{} bytes for {} pages of {} here",
                bytes.len(),
                pages.len(),
                per_layer * kv.layers.len()
            )));
        }
        let mut chunks = bytes.chunks(per_layer.max(1));
        for &page in pages {
            for layer in &mut kv.layers {
                let chunk = chunks.next().unwrap_or_default();
                self.gpu.write_kv_page(layer, page as usize, chunk)?;
            }
        }
        self.gpu.synchronize()
    }
}
