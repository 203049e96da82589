//! A page's contents as bytes, so that a sequence's KV can move to another
//! engine's pages (prefill on one device, decode on another): K, then V,
//! then (fp8 pages) the K and V scales, [`KvLayout::page_bytes`] in all.

use std::ops::Range;

use super::{KvFormat, KvLayout, KvPages};
use crate::KernelError;

impl KvLayout {
    /// Where page `page` of a layer in `format` lies: its range of K (and
    /// of V) bytes, and its range of K (and of V) scales (empty but for
    /// fp8 pages). The host's pages and the device's share it.
    pub fn page_ranges(&self, format: KvFormat, page: usize) -> (Range<usize>, Range<usize>) {
        let vectors = self.page_size * self.kv_heads;
        let elems = vectors * self.head_dim * format.elem_bytes();
        let scales = if format == KvFormat::Fp8 { vectors } else { 0 };
        (
            page * elems..(page + 1) * elems,
            page * scales..(page + 1) * scales,
        )
    }
}

impl KvPages {
    fn page_ranges(&self, page: usize) -> (Range<usize>, Range<usize>) {
        self.layout.page_ranges(self.format, page)
    }

    /// Appends page `page`'s contents to `out`.
    pub fn read_page(&self, page: usize, out: &mut Vec<u8>) {
        let (e, s) = self.page_ranges(page);
        out.extend_from_slice(&self.k[e.clone()]);
        out.extend_from_slice(&self.v[e]);
        for scale in self.k_scale[s.clone()].iter().chain(&self.v_scale[s]) {
            out.extend_from_slice(&scale.to_le_bytes());
        }
    }

    /// Overwrites page `page` with contents [`Self::read_page`] gave for
    /// pages of the same format and layout.
    pub fn write_page(&mut self, page: usize, bytes: &[u8]) -> Result<(), KernelError> {
        let want = self.layout.page_bytes(self.format);
        let pages = self.k.len() / self.page_ranges(0).0.len().max(1);
        if bytes.len() != want || page >= pages {
            return Err(KernelError::Shape(format!(
                "a page of {} bytes into page {page}: pages here take {want}",
                bytes.len()
            )));
        }
        let (e, s) = self.page_ranges(page);
        let (k, rest) = bytes.split_at(e.len());
        let (v, scales) = rest.split_at(e.len());
        self.k[e.clone()].copy_from_slice(k);
        self.v[e].copy_from_slice(v);
        let mut words = scales
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        let (ks, vs) = (s.clone(), s);
        for dst in self.k_scale[ks].iter_mut().chain(&mut self.v_scale[vs]) {
            *dst = words.next().unwrap_or(1.0);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::{KvFormat, KvLayout, KvPages};

    #[test]
    fn a_page_read_from_one_pool_writes_the_same_vectors_into_another() {
        let layout = KvLayout {
            page_size: 4,
            kv_heads: 2,
            head_dim: 8,
        };
        for format in [KvFormat::Bf16, KvFormat::Fp8, KvFormat::Fp8Static] {
            let mut a = KvPages::new(format, layout, 3);
            for t in 0..12 {
                let k: Vec<f32> = (0..16).map(|i| (t * 16 + i) as f32 * 0.01).collect();
                let v: Vec<f32> = k.iter().map(|x| 1.0 - x).collect();
                a.write(t / 4, t % 4, &k, &v);
            }
            let mut bytes = Vec::new();
            a.read_page(2, &mut bytes);
            assert_eq!(bytes.len(), layout.page_bytes(format), "{format:?}");
            let mut b = KvPages::new(format, layout, 2);
            b.write_page(0, &bytes).unwrap();
            let (mut x, mut y) = (vec![0.0; 8], vec![0.0; 8]);
            for slot in 0..4 {
                for h in 0..2 {
                    for value in [false, true] {
                        a.read(value, 2, slot, h, &mut x);
                        b.read(value, 0, slot, h, &mut y);
                        assert_eq!(x, y, "{format:?} slot {slot} head {h} (V: {value})");
                        assert!(x.iter().any(|e| *e != 0.0), "written");
                    }
                }
            }
            let short = b.write_page(1, &bytes[1..]).unwrap_err();
            assert!(short.to_string().contains("pages here take"), "{short}");
            assert!(b.write_page(2, &bytes).is_err(), "past the last page");
        }
    }
}
