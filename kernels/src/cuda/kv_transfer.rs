//! A page's contents on the device as bytes, as [`crate::kv::KvPages`]
//! reads and writes them on the host (`kv/transfer.rs`): K, V, then (fp8
//! pages) the K and V scales. Through the host for now; a copy between
//! two GPUs' pages by peer copy is the next step (docs/architecture.md).

use super::Gpu;
use super::kv::PagedKv;
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

impl Gpu {
    /// Appends page `page` of `kv` to `out` (waits for the stream).
    pub fn read_kv_page(&self, kv: &PagedKv, page: usize, out: &mut Vec<u8>) -> R {
        let (e, s) = kv.layout.page_ranges(kv.format, page);
        out.extend(self.download_range(&kv.k, e.clone())?);
        out.extend(self.download_range(&kv.v, e)?);
        for scales in [&kv.k_scale, &kv.v_scale]
            .into_iter()
            .filter(|_| !s.is_empty())
        {
            let words = self.download_range(scales, s.clone())?;
            out.extend(words.iter().flat_map(|w| w.to_le_bytes()));
        }
        Ok(())
    }

    /// Overwrites page `page` of `kv` with what [`Self::read_kv_page`] (or
    /// `KvPages::read_page`) gave for pages of the same format and layout.
    pub fn write_kv_page(&self, kv: &mut PagedKv, page: usize, bytes: &[u8]) -> R {
        let want = kv.layout.page_bytes(kv.format);
        let (e, s) = kv.layout.page_ranges(kv.format, page);
        if bytes.len() != want || e.end > kv.k.len() {
            return Err(KernelError::Shape(format!(
                "a page of {} bytes into page {page}: pages here take {want}",
                bytes.len()
            )));
        }
        let (k, rest) = bytes.split_at(e.len());
        let (v, scales) = rest.split_at(e.len());
        self.upload_at(k, &mut kv.k, e.start)?;
        self.upload_at(v, &mut kv.v, e.start)?;
        let words: Vec<f32> = (scales.chunks_exact(4))
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        if !s.is_empty() {
            let (ks, vs) = words.split_at(s.len());
            self.upload_at(ks, &mut kv.k_scale, s.start)?;
            self.upload_at(vs, &mut kv.v_scale, s.start)?;
        }
        Ok(())
    }
}
