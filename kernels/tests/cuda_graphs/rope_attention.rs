//! Decode attention that rotates the step's q/k/v rows (stacked or apart)
//! and writes the new keys and values itself: the same pages and the same
//! output, bit for bit, as the fused RoPE + KV write launch and then
//! attention, for every page format, both RoPE styles, groups of 1, 2, 4
//! and 8, one partition and several, an empty row, and a sequence whose
//! slot the tag check cleared; over fp8 pages with heads of 128, by the
//! flash kernel's four-an-SM build too.

use kiln_kernels::cuda::{
    AttentionPlan, AttnOut, CudaSlice, DecodeBatch, FlashBuild, Gpu, PagedKv, PagedQuery, RopeKv,
    Unrotated,
};
use kiln_kernels::kv::{KvFormat, KvLayout};
use kiln_kernels::ops::{Rope, RopeStyle};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// How a test step rotates and writes its keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum How {
    /// The fused RoPE + KV write launch, then attention.
    Launches,
    /// Attention over the stacked rows.
    Stacked,
    /// Attention over separate q, k and v rows.
    Apart,
    /// Attention over the stacked rows by the flash kernel's four-an-SM
    /// build (where the shape has one).
    FourAnSm,
}

/// Query heads, KV heads, head size.
const SHAPES: [(usize, usize, usize); 4] = [(8, 2, 128), (4, 2, 64), (2, 2, 64), (8, 1, 128)];

/// Each sequence's length with its new token, in two batches: lengths
/// that split into partitions (a short batch splits them to fill the GPU)
/// and a merge, one a whole number of partitions; and lengths in one
/// partition, which the kernel finishes itself, after an empty row (a
/// padded one, or one the tag check cleared).
const BATCHES: [&[usize]; 2] = [&[1, 40, 700, 1024, 1500], &[0, 1, 17, 33, 64]];

/// The pages' bytes and scales, as bits.
fn page_bits(gpu: &Gpu, kv: &PagedKv) -> (Vec<u8>, Vec<u8>, Vec<u32>, Vec<u32>) {
    let bits = |x: Vec<f32>| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
    (
        gpu.download(&kv.k).unwrap(),
        gpu.download(&kv.v).unwrap(),
        bits(gpu.download(&kv.k_scale).unwrap()),
        bits(gpu.download(&kv.v_scale).unwrap()),
    )
}

fn copy_pages(gpu: &Gpu, kv: &PagedKv) -> PagedKv {
    let s = gpu.stream();
    PagedKv {
        format: kv.format,
        layout: kv.layout,
        k: s.clone_dtod(&kv.k).unwrap(),
        v: s.clone_dtod(&kv.v).unwrap(),
        k_scale: s.clone_dtod(&kv.k_scale).unwrap(),
        v_scale: s.clone_dtod(&kv.v_scale).unwrap(),
    }
}

pub(super) fn check(gpu: &Gpu, seed: u64) {
    let rng = &mut ChaCha8Rng::seed_from_u64(seed);
    for lens in BATCHES {
        check_batch(gpu, rng, lens);
    }
}

/// One batch of sequences of `lens_in` over every shape, format and
/// style.
fn check_batch(gpu: &Gpu, rng: &mut ChaCha8Rng, lens_in: &[usize]) {
    let n = lens_in.len();
    let max_len = *lens_in.iter().max().unwrap();
    // Consecutive runs of the pool; each new token's slot in its last page.
    let pages_of: Vec<usize> = lens_in.iter().map(|l| l.div_ceil(16)).collect();
    let total: usize = pages_of.iter().sum();
    let offs: Vec<i32> = pages_of
        .iter()
        .scan(0, |at, p| {
            let o = *at;
            *at += *p as i32;
            Some(o)
        })
        .collect();
    let pos: Vec<i32> = lens_in.iter().map(|l| *l as i32 - 1).collect();
    let mut slots: Vec<i32> = (0..n)
        .map(|s| match pos[s] {
            0.. => (offs[s] + pos[s] / 16) * 16 + pos[s] % 16,
            _ => -1,
        })
        .collect();
    // The tag check's cleared slot writes nothing (its pages stay).
    slots[1] = -1;
    let tables: Vec<i32> = (0..total as i32).collect();
    let lens: Vec<i32> = lens_in.iter().map(|l| *l as i32).collect();
    let (dtables, doffs, dlens) = (
        gpu.upload(&tables).unwrap(),
        gpu.upload(&offs).unwrap(),
        gpu.upload(&lens).unwrap(),
    );
    let (dpos, dslots) = (gpu.upload(&pos).unwrap(), gpu.upload(&slots).unwrap());
    for (heads, kv_heads, hd) in SHAPES {
        let layout = KvLayout {
            page_size: 16,
            kv_heads,
            head_dim: hd,
        };
        let ld = (heads + 2 * kv_heads) * hd;
        for format in [KvFormat::Bf16, KvFormat::Fp8, KvFormat::Fp8Static] {
            for style in [RopeStyle::Interleaved, RopeStyle::Half] {
                let what = format!("{format:?}, {heads}/{kv_heads} heads of {hd}, {style:?}");
                let rows: Vec<f32> = (0..n * ld).map(|_| rng.random_range(-4.0..4.0)).collect();
                let freq = Rope::new(hd, 500000.0, None, style).inv_freq().to_vec();
                let dfreq = gpu.upload(&freq).unwrap();
                let start = super::attention_out::pages(gpu, rng, format, layout, total);
                let (s, p) = (dslots.slice(..), dpos.slice(..));
                let at = RopeKv {
                    slots: &s,
                    pos: &p,
                    inv_freq: &dfreq,
                    tokens: n,
                    heads,
                    interleaved: style == RopeStyle::Interleaved,
                };
                let batch = DecodeBatch { seqs: n, max_len };
                let mut scratch = gpu
                    .attention_buffers((n, max_len), (heads, kv_heads, hd), 0)
                    .unwrap();
                // How: two launches over the stacked rows, or attention
                // that rotates them, stacked or apart.
                let attend = |kv: &mut PagedKv, how: How, scratch: &mut _| -> Vec<f32> {
                    let mut qkv = gpu.upload(&rows).unwrap();
                    let (qd, kd) = (heads * hd, kv_heads * hd);
                    let part = |from: usize, len: usize| -> CudaSlice<f32> {
                        let v: Vec<f32> = (0..n)
                            .flat_map(|t| rows[t * ld + from..t * ld + from + len].to_vec())
                            .collect();
                        gpu.upload(&v).unwrap()
                    };
                    let (q_rows, k_rows, v_rows) = (part(0, qd), part(qd, kd), part(qd + kd, kd));
                    let mut q: CudaSlice<f32> = gpu.upload(&vec![f32::NAN; n * qd]).unwrap();
                    let mut out = gpu.upload(&vec![f32::NAN; n * qd]).unwrap();
                    if how == How::Launches {
                        gpu.rope_kv_write_stacked(kv, &mut qkv, &mut q, &at)
                            .unwrap();
                    }
                    let query = PagedQuery {
                        q: &q,
                        tables: &dtables.slice(..),
                        table_off: &doffs.slice(..),
                        lens: &dlens.slice(..),
                        heads,
                        scale: 0.088,
                    };
                    let rows = match how {
                        How::Launches => None,
                        How::Stacked | How::FourAnSm => Some(Unrotated::Stacked(&qkv)),
                        How::Apart => Some(Unrotated::Apart {
                            q: &q_rows,
                            k: &k_rows,
                            v: &v_rows,
                        }),
                    };
                    let o = AttnOut::F32(&mut out);
                    match rows {
                        Some(rows) => {
                            let plan = AttentionPlan {
                                build: (how == How::FourAnSm).then_some(FlashBuild::FourAnSm),
                                ..Default::default()
                            };
                            gpu.paged_attention_roped(
                                kv, rows, &at, &query, batch, plan, scratch, o,
                            )
                        }
                        None => gpu.paged_attention_to(
                            kv,
                            &query,
                            batch,
                            Default::default(),
                            scratch,
                            o,
                        ),
                    }
                    .unwrap();
                    gpu.download(&out).unwrap()
                };
                let mut kv_a = copy_pages(gpu, &start);
                let want = attend(&mut kv_a, How::Launches, &mut scratch);
                assert!(
                    want.iter().all(|v| v.is_finite()),
                    "{what}: output incomplete"
                );
                // The writes landed: the pages changed where a slot was live.
                assert!(
                    page_bits(gpu, &kv_a) != page_bits(gpu, &start),
                    "{what}: nothing written"
                );
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
                for how in [How::Stacked, How::Apart, How::FourAnSm] {
                    let mut kv_b = copy_pages(gpu, &start);
                    let got = attend(&mut kv_b, how, &mut scratch);
                    assert!(
                        bits(&got) == bits(&want),
                        "{what}, {how:?}: the output differs"
                    );
                    assert!(
                        page_bits(gpu, &kv_b) == page_bits(gpu, &kv_a),
                        "{what}, {how:?}: the pages differ"
                    );
                }
            }
        }
    }
}
