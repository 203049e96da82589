//! Paged KV storage for one layer and attention over it.
//!
//! A page holds [`KvLayout::page_size`] tokens; element `(page, slot, head,
//! d)` of K (or V) lives at `((page * kv_heads + head) * page_size + slot) *
//! head_dim + d`: one KV head's vectors of a page lie together, so attention
//! (a block per KV head) reads whole runs of `page_size` vectors. In the fp8 format every `(page, slot, head)` vector has an
//! f32 scale (see [`crate::fp8`]).

use half::bf16;

use crate::fp8;
use crate::ops::softmax;
use crate::simd::{axpy, dot};

/// How KV vectors are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvFormat {
    /// bfloat16: 2 bytes an element.
    Bf16,
    /// FP8 e4m3 with a per-vector f32 scale: 1 byte an element + 4 per vector.
    Fp8,
    /// FP8 e4m3 with one static scale, 1 (vLLM's fp8 KV without checkpoint
    /// scales): 1 byte an element and nothing else, exactly half of bf16.
    /// Queries and keys are rotated by [`crate::hadamard`] after RoPE (the
    /// model does it, before it writes K: see [`KvFormat::rotates`]), which
    /// spreads the keys' outlier channels so one scale serves every token.
    Fp8Static,
}

impl KvFormat {
    /// Bytes one `(token, head)` vector of `head_dim` takes, scale included.
    pub fn vector_bytes(self, head_dim: usize) -> usize {
        match self {
            KvFormat::Bf16 => head_dim * 2,
            KvFormat::Fp8 => head_dim + 4,
            KvFormat::Fp8Static => head_dim,
        }
    }

    /// Bytes one element takes.
    pub fn elem_bytes(self) -> usize {
        match self {
            KvFormat::Bf16 => 2,
            KvFormat::Fp8 | KvFormat::Fp8Static => 1,
        }
    }

    /// Whether elements are e4m3 codes (either fp8 format).
    pub fn is_fp8(self) -> bool {
        self.elem_bytes() == 1
    }

    /// Whether queries and keys go through [`crate::hadamard::rotate_heads`]
    /// after RoPE, before K is written: the contract between a model and
    /// pages of this format.
    pub fn rotates(self) -> bool {
        self == KvFormat::Fp8Static
    }
}

mod transfer;

/// Shape of a layer's pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    /// Tokens per page.
    pub page_size: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
}

impl KvLayout {
    /// Bytes of K and V for one page of one layer.
    pub fn page_bytes(&self, format: KvFormat) -> usize {
        2 * self.page_size * self.kv_heads * format.vector_bytes(self.head_dim)
    }
}

/// K and V pages of one layer.
#[derive(Debug)]
pub struct KvPages {
    format: KvFormat,
    layout: KvLayout,
    k: Vec<u8>,
    v: Vec<u8>,
    k_scale: Vec<f32>,
    v_scale: Vec<f32>,
}

impl KvPages {
    /// `num_pages` zeroed pages.
    pub fn new(format: KvFormat, layout: KvLayout, num_pages: usize) -> Self {
        let vectors = num_pages * layout.page_size * layout.kv_heads;
        let elem = format.elem_bytes();
        let scales = if format == KvFormat::Fp8 { vectors } else { 0 };
        Self {
            format,
            layout,
            k: vec![0; vectors * layout.head_dim * elem],
            v: vec![0; vectors * layout.head_dim * elem],
            k_scale: vec![1.0; scales],
            v_scale: vec![1.0; scales],
        }
    }

    /// The storage format.
    pub fn format(&self) -> KvFormat {
        self.format
    }

    /// The layout.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    fn store(
        format: KvFormat,
        hd: usize,
        data: &mut [u8],
        scales: &mut [f32],
        vec: usize,
        x: &[f32],
    ) {
        match format {
            KvFormat::Bf16 => {
                for (i, v) in x.iter().enumerate() {
                    let b = bf16::from_f32(*v).to_le_bytes();
                    data[(vec * hd + i) * 2] = b[0];
                    data[(vec * hd + i) * 2 + 1] = b[1];
                }
            }
            KvFormat::Fp8 => {
                scales[vec] = fp8::encode(x, &mut data[vec * hd..(vec + 1) * hd]);
            }
            KvFormat::Fp8Static => fp8::encode_unit(x, &mut data[vec * hd..(vec + 1) * hd]),
        }
    }

    fn load(format: KvFormat, hd: usize, data: &[u8], scales: &[f32], vec: usize, out: &mut [f32]) {
        match format {
            KvFormat::Bf16 => {
                let bytes = &data[vec * hd * 2..(vec + 1) * hd * 2];
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
            KvFormat::Fp8 => fp8::decode(&data[vec * hd..(vec + 1) * hd], scales[vec], out),
            KvFormat::Fp8Static => fp8::decode(&data[vec * hd..(vec + 1) * hd], 1.0, out),
        }
    }

    fn vector(&self, page: usize, slot: usize, head: usize) -> usize {
        (page * self.layout.kv_heads + head) * self.layout.page_size + slot
    }

    /// Writes one token's K and V (`kv_heads × head_dim` each) at `slot` of
    /// `page`, quantizing to the page format.
    pub fn write(&mut self, page: usize, slot: usize, k: &[f32], v: &[f32]) {
        let hd = self.layout.head_dim;
        for h in 0..self.layout.kv_heads {
            let vec = self.vector(page, slot, h);
            Self::store(
                self.format,
                hd,
                &mut self.k,
                &mut self.k_scale,
                vec,
                &k[h * hd..(h + 1) * hd],
            );
            Self::store(
                self.format,
                hd,
                &mut self.v,
                &mut self.v_scale,
                vec,
                &v[h * hd..(h + 1) * hd],
            );
        }
    }

    /// Reads back the K or V vector of `(page, slot, head)`.
    pub fn read(&self, value: bool, page: usize, slot: usize, head: usize, out: &mut [f32]) {
        let vec = self.vector(page, slot, head);
        let (data, scales) = if value {
            (&self.v, &self.v_scale)
        } else {
            (&self.k, &self.k_scale)
        };
        Self::load(self.format, self.layout.head_dim, data, scales, vec, out);
    }

    /// Attention of one token's query heads (`n_heads × head_dim`) over the
    /// first `len` tokens of the sequence whose pages are `pages`, writing
    /// `n_heads × head_dim` into `out`. Query heads sharing a KV head
    /// (grouped-query attention) are handled together so each K and V
    /// vector is decoded once.
    pub fn attend(&self, q: &[f32], pages: &[u32], len: usize, scale: f32, out: &mut [f32]) {
        let KvLayout {
            page_size,
            kv_heads,
            head_dim: hd,
        } = self.layout;
        let n_heads = q.len() / hd;
        let group = n_heads / kv_heads;
        let mut kbuf = vec![0.0f32; hd];
        let mut scores = vec![0.0f32; group * len];
        out.iter_mut().for_each(|o| *o = 0.0);
        let read = |value: bool, t: usize, kvh: usize, buf: &mut [f32]| {
            self.read(
                value,
                pages[t / page_size] as usize,
                t % page_size,
                kvh,
                buf,
            )
        };
        for kvh in 0..kv_heads {
            for t in 0..len {
                read(false, t, kvh, &mut kbuf);
                for g in 0..group {
                    let h = kvh * group + g;
                    scores[g * len + t] = dot(&q[h * hd..(h + 1) * hd], &kbuf) * scale;
                }
            }
            for g in 0..group {
                softmax(&mut scores[g * len..(g + 1) * len]);
            }
            for t in 0..len {
                read(true, t, kvh, &mut kbuf);
                for g in 0..group {
                    let h = kvh * group + g;
                    axpy(scores[g * len + t], &kbuf, &mut out[h * hd..(h + 1) * hd]);
                }
            }
        }
    }
}

/// Reference attention over unpaged f32 K and V (`len × kv_heads × head_dim`).
pub fn attend_reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    kv_heads: usize,
    head_dim: usize,
    scale: f32,
) -> Vec<f32> {
    let n_heads = q.len() / head_dim;
    let group = n_heads / kv_heads;
    let len = k.len() / (kv_heads * head_dim);
    let mut out = vec![0.0; q.len()];
    for h in 0..n_heads {
        let kvh = h / group;
        let qh = &q[h * head_dim..(h + 1) * head_dim];
        let at = |t: usize| (t * kv_heads + kvh) * head_dim;
        let mut s: Vec<f32> = (0..len)
            .map(|t| {
                let o = at(t);
                qh.iter()
                    .zip(&k[o..o + head_dim])
                    .map(|(a, b)| a * b)
                    .sum::<f32>()
                    * scale
            })
            .collect();
        softmax(&mut s);
        for (t, w) in s.iter().enumerate() {
            let o = at(t);
            for d in 0..head_dim {
                out[h * head_dim + d] += w * v[o + d];
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn check(format: KvFormat, tol: f32) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let layout = KvLayout {
            page_size: 4,
            kv_heads: 2,
            head_dim: 16,
        };
        let mut pages = KvPages::new(format, layout, 8);
        let len = 11;
        // Scattered, out-of-order pages, as a block table would have them.
        let table = [5u32, 1, 6];
        let row = layout.kv_heads * layout.head_dim;
        let k: Vec<f32> = (0..len * row)
            .map(|_| rng.random_range(-2.0..2.0))
            .collect();
        let v: Vec<f32> = (0..len * row)
            .map(|_| rng.random_range(-2.0..2.0))
            .collect();
        for t in 0..len {
            pages.write(
                table[t / 4] as usize,
                t % 4,
                &k[t * row..(t + 1) * row],
                &v[t * row..(t + 1) * row],
            );
        }
        let q: Vec<f32> = (0..6 * 16).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut out = vec![f32::NAN; q.len()];
        pages.attend(&q, &table, len, 0.25, &mut out);
        let want = attend_reference(&q, &k, &v, 2, 16, 0.25);
        for (a, b) in out.iter().zip(&want) {
            assert!((a - b).abs() <= tol, "{format:?}: {a} vs {b}");
        }
    }

    #[test]
    fn paged_attention_matches_reference_in_bf16() {
        check(KvFormat::Bf16, 2e-2);
    }

    #[test]
    fn paged_attention_matches_reference_in_fp8() {
        check(KvFormat::Fp8, 0.15);
    }

    #[test]
    fn paged_attention_matches_reference_in_static_fp8() {
        check(KvFormat::Fp8Static, 0.15);
    }

    #[test]
    fn static_fp8_pages_take_exactly_half_the_bytes_of_bf16() {
        let layout = KvLayout {
            page_size: 16,
            kv_heads: 8,
            head_dim: 128,
        };
        let bf16 = layout.page_bytes(KvFormat::Bf16);
        assert_eq!(bf16, 2 * layout.page_bytes(KvFormat::Fp8Static));
        assert!(
            bf16 < 2 * layout.page_bytes(KvFormat::Fp8),
            "per-vector scales cost bytes"
        );
    }
}
