//! Causal prefill attention over one Llama-3-8B layer's pages (32 query
//! heads over 8 KV heads of 128), as the engine's 2048-token steps run it:
//! the second half of a 4096-token prompt, and two 1024-token prompts
//! whole; and a mixed step's decode rows (128 sequences of 1151 cached
//! tokens and one new: what the decode kernel times at 128 x 1152), in
//! GB/s of pages read. Each build (4 and 8 warps a block) is checked against the first
//! before it is timed; TFLOP/s counts the keys each query attends to.

use cudarc::driver::CudaSlice;
use kiln_kernels::cuda::{Gpu, PagedQuery, prefill_tiles};
use kiln_kernels::kv::{KvFormat, KvLayout};
use rand::Rng;

use super::{E, rel_diff, time_graph};

const HEADS: usize = 32;
const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 128;
const PAGE: usize = 16;

/// A step's query tokens: sequences of `(cached, new)` tokens.
struct Chunk {
    name: &'static str,
    seqs: &'static [(usize, usize)],
}

const CHUNKS: [Chunk; 3] = [
    Chunk {
        name: "1x4096, second 2048",
        seqs: &[(2048, 2048)],
    },
    Chunk {
        name: "2x1024 whole",
        seqs: &[(0, 1024), (0, 1024)],
    },
    Chunk {
        name: "128 decode rows x 1152",
        seqs: &[(1151, 1); 128],
    },
];

/// Times every chunk in every KV format and block size.
pub fn run(gpu: &mut Gpu, rng: &mut rand::rngs::StdRng) -> Result<(), E> {
    for chunk in &CHUNKS {
        for format in [KvFormat::Bf16, KvFormat::Fp8Static] {
            one(gpu, rng, chunk, format)?;
        }
    }
    gpu.set_prefill_warps(4)?;
    Ok(())
}

fn one(
    gpu: &mut Gpu,
    rng: &mut rand::rngs::StdRng,
    chunk: &Chunk,
    format: KvFormat,
) -> Result<(), E> {
    let s = gpu.stream().clone();
    let layout = KvLayout {
        page_size: PAGE,
        kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
    };
    let per_seq: Vec<usize> = chunk
        .seqs
        .iter()
        .map(|(c, n)| (c + n).div_ceil(PAGE))
        .collect();
    let pages: usize = per_seq.iter().sum();
    // Pages shuffled across the pool; each sequence's table in turn.
    let (kv, order) = super::pages::random_pages(gpu, rng, format, layout, pages)?;
    let (mut off, mut lens, mut flops, mut bytes) = (Vec::new(), Vec::new(), 0.0f64, 0.0f64);
    let mut first_page = 0;
    for (&(cached, new), n) in chunk.seqs.iter().zip(&per_seq) {
        for pos in cached..cached + new {
            off.push(first_page as i32);
            lens.push(pos as i32 + 1);
            // Q K^T and P V: 2 flops a multiply-add, each over head_dim.
            flops += (4 * (pos + 1) * HEAD_DIM * HEADS) as f64;
        }
        // Each sequence's keys and values, read once.
        bytes += ((cached + new) * KV_HEADS * 2 * format.vector_bytes(HEAD_DIM)) as f64;
        first_page += n;
    }
    let tokens = lens.len();
    let q: Vec<f32> = (0..tokens * HEADS * HEAD_DIM)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let (tables, doff, dlens, q) = (
        s.clone_htod(&order)?,
        s.clone_htod(&off)?,
        s.clone_htod(&lens)?,
        s.clone_htod(&q)?,
    );
    let query = PagedQuery {
        q: &q,
        tables: &tables.slice(..),
        table_off: &doff.slice(..),
        lens: &dlens.slice(..),
        heads: HEADS,
        scale: 0.088,
    };
    let mut out: CudaSlice<f32> = s.alloc_zeros(tokens * HEADS * HEAD_DIM)?;
    let mut first: Option<Vec<f32>> = None;
    for warps in [4usize, 8] {
        gpu.set_prefill_warps(warps)?;
        let tiles = prefill_tiles(&off, &lens, HEADS / KV_HEADS, gpu.prefill_rows());
        let tiles = s.clone_htod(&tiles)?;
        let g: &Gpu = gpu;
        g.prefill_attention(&kv, &query, &tiles.slice(..), &mut out)?;
        let got = s.clone_dtoh(&out)?;
        let err = first.as_ref().map_or(0.0, |want| rel_diff(&got, want));
        first.get_or_insert(got);
        if err.is_nan() || err >= 1e-5 {
            return Err(format!("prefill in {warps} warps disagrees: rel err {err}").into());
        }
        let t = time_graph(g, 10, || {
            Ok(g.prefill_attention(&kv, &query, &tiles.slice(..), &mut out)?)
        })?;
        println!(
            "prefill attention {format:?} {}, {warps} warps: {:.3} ms, {:.0} TFLOP/s, \
             {:.0} GB/s of pages",
            chunk.name,
            t * 1e3,
            flops / t / 1e12,
            bytes / t / 1e9
        );
    }
    Ok(())
}
