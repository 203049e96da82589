//! Attention that writes the output projection's bf16 input: exactly its
//! f32 rows rounded, from every launch that writes them (the flash
//! kernel's own output, the partitions' merge, the flash kernel's own
//! merge of them, the prefill kernel); and the flash kernel's own merge
//! replayed in a graph.

use half::bf16;
use kiln_kernels::cuda::{
    AttentionBuffers, AttentionKind, AttentionPlan, AttnOut, CudaSlice, DecodeBatch, Gpu, PagedKv,
    PagedQuery, prefill_tiles,
};
use kiln_kernels::kv::{KvFormat, KvLayout};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const HEADS: usize = 8;
const LAYOUT: KvLayout = KvLayout {
    page_size: 16,
    kv_heads: 2,
    head_dim: 128,
};

/// `pages` pages of `layout` holding random ordinary values in `format`
/// (fp8 scales 0.01).
pub(super) fn pages(
    gpu: &Gpu,
    rng: &mut ChaCha8Rng,
    format: KvFormat,
    layout: KvLayout,
    pages: usize,
) -> PagedKv {
    let s = gpu.stream().clone();
    let mut kv = gpu.paged_kv(format, layout, pages).unwrap();
    let vectors = pages * layout.page_size * layout.kv_heads;
    let elems = vectors * layout.head_dim;
    let mut fill = || -> Vec<u8> {
        match format {
            KvFormat::Bf16 => (0..elems)
                .flat_map(|_| bf16::from_f32(rng.random_range(-1.0..1.0)).to_le_bytes())
                .collect(),
            // e4m3 bytes with small exponents: ordinary values.
            _ => (0..elems)
                .map(|_| rng.random::<u8>() & 0b1011_0111)
                .collect(),
        }
    };
    s.memcpy_htod(&fill(), &mut kv.k).unwrap();
    s.memcpy_htod(&fill(), &mut kv.v).unwrap();
    if format == KvFormat::Fp8 {
        let sc = vec![0.01f32; vectors];
        s.memcpy_htod(&sc, &mut kv.k_scale).unwrap();
        s.memcpy_htod(&sc, &mut kv.v_scale).unwrap();
    }
    kv
}

/// `len` random query values on the device.
fn queries(gpu: &Gpu, rng: &mut ChaCha8Rng, len: usize) -> CudaSlice<f32> {
    let q: Vec<f32> = (0..len).map(|_| rng.random_range(-1.0..1.0)).collect();
    gpu.upload(&q).unwrap()
}

pub(super) fn check(gpu: &Gpu, seed: u64) {
    let rng = &mut ChaCha8Rng::seed_from_u64(seed);
    // Sequences whose tables are consecutive runs of the pool: decode
    // lengths across one and several partitions, then one prompt's rows.
    let decode_lens = [1usize, 40, 700, 1500];
    let prompt = 300usize;
    let total: usize = decode_lens
        .iter()
        .chain([&prompt])
        .map(|l| l.div_ceil(16))
        .sum();
    let tables: Vec<i32> = (0..total as i32).collect();
    let mut offs = Vec::new();
    let mut at = 0;
    for l in decode_lens {
        offs.push(at);
        at += l.div_ceil(16) as i32;
    }
    let rows = |n: usize| n * HEADS * LAYOUT.head_dim;
    for format in [KvFormat::Bf16, KvFormat::Fp8, KvFormat::Fp8Static] {
        let kv = pages(gpu, rng, format, LAYOUT, total);
        let tables = gpu.upload(&tables).unwrap();
        // Decode: one query a sequence.
        let n = decode_lens.len();
        let q = queries(gpu, rng, rows(n));
        let (doffs, dlens) = (
            gpu.upload(&offs).unwrap(),
            gpu.upload(&decode_lens.map(|l| l as i32)).unwrap(),
        );
        let query = PagedQuery {
            q: &q,
            tables: &tables.slice(..),
            table_off: &doffs.slice(..),
            lens: &dlens.slice(..),
            heads: HEADS,
            scale: 0.088,
        };
        let batch = DecodeBatch {
            seqs: n,
            max_len: 1500,
        };
        let mut scratch = gpu
            .attention_buffers((n, 1500), (HEADS, 2, 128), 0)
            .unwrap();
        let plans = [
            (AttentionKind::Flash, 1504, false, "flash, one partition"),
            (AttentionKind::Flash, 256, false, "flash, merged"),
            (
                AttentionKind::Flash,
                256,
                true,
                "flash, merged in the kernel",
            ),
            (AttentionKind::Shuffle, 256, false, "shuffle, merged"),
        ];
        let mut merged: Option<Vec<f32>> = None;
        for (kind, len, fused_merge, what) in plans {
            let plan = AttentionPlan {
                part_len: Some(len),
                kind: Some(kind),
                fused_merge,
                ..Default::default()
            };
            let mut f = gpu.upload(&vec![f32::NAN; rows(n)]).unwrap();
            let mut h = gpu.upload(&vec![bf16::NAN; rows(n)]).unwrap();
            gpu.paged_attention_to(&kv, &query, batch, plan, &mut scratch, AttnOut::F32(&mut f))
                .unwrap();
            gpu.paged_attention_to(
                &kv,
                &query,
                batch,
                plan,
                &mut scratch,
                AttnOut::Bf16(&mut h),
            )
            .unwrap();
            assert_rounded(gpu, &f, &h, &format!("{format:?} decode, {what}"));
            // The kernel's own merge sums the same partials in another
            // order than the merge launch.
            let rows = gpu.download(&f).unwrap();
            match (kind, fused_merge, &merged) {
                (AttentionKind::Flash, false, None) if len == 256 => merged = Some(rows),
                (_, true, Some(want)) => {
                    let most = rows
                        .iter()
                        .zip(want)
                        .map(|(a, b)| (a - b).abs() / b.abs().max(1e-3))
                        .fold(0.0f32, f32::max);
                    assert!(most < 1e-4, "{format:?} decode, {what}: off by {most}");
                }
                _ => {}
            }
        }
        fused_in_a_graph(
            gpu,
            &kv,
            &query,
            batch,
            &mut scratch,
            &format!("{format:?}"),
        );
        // Prefill: the prompt's rows, each over its own prefix.
        let first = at;
        let q = queries(gpu, rng, rows(prompt));
        let poffs = vec![first; prompt];
        let plens: Vec<i32> = (1..=prompt as i32).collect();
        let tiles = prefill_tiles(&poffs, &plens, HEADS / 2, gpu.prefill_rows());
        let (poffs, plens, tiles) = (
            gpu.upload(&poffs).unwrap(),
            gpu.upload(&plens).unwrap(),
            gpu.upload(&tiles).unwrap(),
        );
        let query = PagedQuery {
            q: &q,
            table_off: &poffs.slice(..),
            lens: &plens.slice(..),
            ..query
        };
        let mut f = gpu.upload(&vec![f32::NAN; rows(prompt)]).unwrap();
        let mut h = gpu.upload(&vec![bf16::NAN; rows(prompt)]).unwrap();
        let tiles = tiles.slice(..);
        gpu.prefill_attention_to(&kv, &query, &tiles, AttnOut::F32(&mut f))
            .unwrap();
        gpu.prefill_attention_to(&kv, &query, &tiles, AttnOut::Bf16(&mut h))
            .unwrap();
        assert_rounded(gpu, &f, &h, &format!("{format:?} prefill"));
    }
}

/// Two launches with the fused merge in one graph, as two layers share
/// scratch and its counters, with programmatic edges where the device has
/// them, replayed twice: every launch writes the rows one eager launch
/// writes, bit for bit (the merging block zeroed the counters, so each
/// launch and replay merges again).
fn fused_in_a_graph(
    gpu: &Gpu,
    kv: &PagedKv,
    query: &PagedQuery<'_>,
    batch: DecodeBatch,
    scratch: &mut AttentionBuffers,
    what: &str,
) {
    let plan = AttentionPlan {
        part_len: Some(256),
        kind: Some(AttentionKind::Flash),
        fused_merge: true,
        ..Default::default()
    };
    let n = batch.seqs * query.heads * LAYOUT.head_dim;
    let mut want = gpu.upload(&vec![f32::NAN; n]).unwrap();
    gpu.paged_attention_to(kv, query, batch, plan, scratch, AttnOut::F32(&mut want))
        .unwrap();
    let want = gpu.download(&want).unwrap();
    let mut a = gpu.upload(&vec![f32::NAN; n]).unwrap();
    let mut b = gpu.upload(&vec![f32::NAN; n]).unwrap();
    let graph = gpu
        .capture(|| {
            gpu.paged_attention_to(kv, query, batch, plan, scratch, AttnOut::F32(&mut a))?;
            gpu.paged_attention_to(kv, query, batch, plan, scratch, AttnOut::F32(&mut b))
        })
        .unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    for replay in 0..2 {
        let nan = vec![f32::NAN; n];
        gpu.stream().memcpy_htod(&nan, &mut a).unwrap();
        gpu.stream().memcpy_htod(&nan, &mut b).unwrap();
        gpu.replay(&graph).unwrap();
        gpu.synchronize().unwrap();
        for (out, which) in [(&a, "first"), (&b, "second")] {
            assert!(
                bits(&gpu.download(out).unwrap()) == bits(&want),
                "{what}: replay {replay}, the {which} fused launch differs from the eager one"
            );
        }
    }
}

fn assert_rounded(gpu: &Gpu, f: &CudaSlice<f32>, h: &CudaSlice<bf16>, what: &str) {
    let f = gpu.download(f).unwrap();
    assert!(
        f.iter().all(|v| v.is_finite()),
        "{what}: f32 rows incomplete"
    );
    let want: Vec<u16> = f.iter().map(|v| bf16::from_f32(*v).to_bits()).collect();
    let got: Vec<u16> = gpu
        .download(h)
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect();
    assert!(
        got == want,
        "{what}: bf16 rows are not the f32 rows rounded"
    );
}
