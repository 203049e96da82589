//! Paged KV of random values for the attention benchmarks.

use half::bf16;
use kiln_kernels::cuda::{Gpu, PagedKv};
use kiln_kernels::kv::{KvFormat, KvLayout};
use rand::Rng;

use super::E;

/// `pages` pages of `layout` in `format`, K and V random ordinary values
/// (fp8 scales 0.01), and a block table of every page in shuffled order.
pub fn random_pages(
    gpu: &Gpu,
    rng: &mut rand::rngs::StdRng,
    format: KvFormat,
    layout: KvLayout,
    pages: usize,
) -> Result<(PagedKv, Vec<i32>), E> {
    let s = gpu.stream().clone();
    let mut kv = gpu.paged_kv(format, layout, pages)?;
    let vectors = pages * layout.page_size * layout.kv_heads;
    let elems = vectors * layout.head_dim;
    let fill: Vec<u8> = match format {
        KvFormat::Bf16 => (0..elems)
            .flat_map(|_| bf16::from_f32(rng.random_range(-1.0..1.0)).to_le_bytes())
            .collect(),
        // e4m3 bytes with exponent bits kept small: ordinary values.
        KvFormat::Fp8 | KvFormat::Fp8Static => (0..elems)
            .map(|_| rng.random::<u8>() & 0b1011_0111)
            .collect(),
    };
    s.memcpy_htod(&fill, &mut kv.k)?;
    s.memcpy_htod(&fill, &mut kv.v)?;
    if format == KvFormat::Fp8 {
        let sc = vec![0.01f32; vectors];
        s.memcpy_htod(&sc, &mut kv.k_scale)?;
        s.memcpy_htod(&sc, &mut kv.v_scale)?;
    }
    let mut order: Vec<i32> = (0..pages as i32).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.random_range(0..=i));
    }
    Ok((kv, order))
}
