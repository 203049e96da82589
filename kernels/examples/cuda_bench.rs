//! CUDA kernel benchmarks on Llama-3-8B layer shapes: device copy bandwidth
//! (the roofline's ceiling), the decode GEMV against cuBLAS, paged decode
//! attention over bf16 and fp8 pages, and prefill attention (alone with the
//! argument `prefill`; the FP8-row and int4 products alone with
//! `quantized`; decode attention alone with `attention`). Run on a GPU machine after the parity
//! tests (`scripts/gpu.sh` does both); prints one table.
#![allow(clippy::print_stdout, reason = "a benchmark prints its table")]

use std::time::Instant;

use cudarc::driver::CudaSlice;
use half::bf16;
use kiln_kernels::cuda::{
    AttentionKind, AttentionPlan, ClusterMma, DecodeBatch, FlashBuild, GemmShape, Gpu, PARTITION,
    PagedQuery, StackShape, TagLayout, partition_len,
};
use kiln_kernels::kv::{KvFormat, KvLayout};
use rand::{Rng, SeedableRng};

/// cuBLASLt's bf16 algorithms one by one, weights out of L2.
#[path = "bench/bf16_lt.rs"]
mod bf16_lt;
/// cuBLASLt's W8A8 algorithms one by one.
#[path = "bench/fp8_lt.rs"]
mod fp8_lt;
/// Random KV pages for the attention benchmarks.
#[path = "bench/pages.rs"]
mod pages;
/// Prefill attention at the engine's step shapes.
#[path = "bench/prefill.rs"]
mod prefill;
/// Products with FP8-row and int4 weights.
#[path = "bench/quantized.rs"]
mod quantized;

type E = Box<dyn std::error::Error>;

/// Median seconds of one run of `f`, over `reps` samples of 20 back-to-back
/// launches each (so launch gaps overlap), after 3 warm-ups.
fn time(gpu: &Gpu, reps: usize, mut f: impl FnMut() -> Result<(), E>) -> Result<f64, E> {
    for _ in 0..3 {
        f()?;
    }
    gpu.synchronize()?;
    let mut v = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        for _ in 0..20 {
            f()?;
        }
        gpu.synchronize()?;
        v.push(t.elapsed().as_secs_f64() / 20.0);
    }
    v.sort_by(f64::total_cmp);
    Ok(v[reps / 2])
}

/// Median seconds of one run of `f`, from a CUDA graph of 20 runs replayed
/// `reps` times: the kernels' own time, without the host's launch cost
/// (which bounds small launches timed from the host).
fn time_graph(gpu: &Gpu, reps: usize, mut f: impl FnMut() -> Result<(), E>) -> Result<f64, E> {
    let mut err = None;
    let graph = gpu.capture(|| {
        for _ in 0..20 {
            if let Err(e) = f() {
                err = Some(e);
            }
        }
        Ok(())
    })?;
    if let Some(e) = err {
        return Err(e);
    }
    time(gpu, reps, || Ok(gpu.replay(&graph)?)).map(|t| t / 20.0)
}

/// ‖a − b‖ / ‖b‖.
fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

fn main() -> Result<(), E> {
    let mut gpu = Gpu::open(0, true)?;
    // Kernels timed on their own: no programmatic overlap between the
    // launches of a timing graph.
    gpu.set_programmatic(false);
    let s = gpu.stream().clone();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    println!("device: {}", gpu.name());

    // Copy bandwidth: bytes read plus bytes written.
    let n = 1usize << 30;
    let src: CudaSlice<u8> = s.alloc_zeros(n)?;
    let mut dst: CudaSlice<u8> = s.alloc_zeros(n)?;
    let t = time(&gpu, 20, || Ok(s.memcpy_dtod(&src, &mut dst)?))?;
    let copy = 2.0 * n as f64 / t / 1e9;
    println!(
        "copy 1 GiB: {:.3} ms, {copy:.0} GB/s (read + write)",
        t * 1e3
    );
    drop((src, dst));
    // `bf16lt`: cuBLASLt's bf16 algorithms at decode's products.
    if std::env::args().nth(1).as_deref() == Some("bf16lt") {
        return bf16_lt::run(&gpu, &mut rng, copy);
    }
    // `fp8lt`: cuBLASLt's W8A8 algorithms at prefill's products.
    if std::env::args().nth(1).as_deref() == Some("fp8lt") {
        return fp8_lt::run(&gpu, &mut rng);
    }
    // `quantized`: the FP8-row and int4 products alone; `one-row [NxK]`:
    // their one-row products alone, or at one shape (for a profiler).
    match std::env::args().nth(1).as_deref() {
        Some("quantized") => return quantized::quantized_gemv(&mut gpu, &mut rng, copy, false),
        Some("one-row") => return quantized::quantized_gemv(&mut gpu, &mut rng, copy, true),
        _ => {}
    }
    // `attention [BATCHxCTX]`: paged decode attention alone, at every
    // shape of the table or at one.
    if std::env::args().nth(1).as_deref() == Some("attention") {
        if let Some(shape) = std::env::args().nth(2) {
            let (b, c) = shape.split_once('x').ok_or("attention BATCHxCTX")?;
            for format in [KvFormat::Bf16, KvFormat::Fp8, KvFormat::Fp8Static] {
                attention(&gpu, &mut rng, copy, b.parse()?, c.parse()?, format)?;
            }
            return Ok(());
        }
        return attention_table(&gpu, &mut rng, copy);
    }
    // `gemm`: the bf16 products alone.
    let gemm_only = std::env::args().nth(1).as_deref() == Some("gemm");
    if !gemm_only {
        prefill::run(&mut gpu, &mut rng)?;
    }
    if std::env::args().nth(1).as_deref() == Some("prefill") {
        return Ok(());
    }

    // The decode GEMV (up to 8 rows) and the skinny GEMM (from 2) against
    // cuBLAS at Llama-3-8B shapes, stacked
    // q/k/v (6144) and gate/up (28672) included. A kernel that disagrees
    // with cuBLAS prints its error instead of a time, and the rest still
    // runs.
    for mma in ClusterMma::ALL {
        let room: Vec<_> = (1..=8).map(|s| gpu.cluster_room(mma, 8, s)).collect();
        println!("resident clusters of 1-8 blocks ({mma:?}, 64 rows): {room:?}");
    }
    println!(
        "{:>14} {:>3} {:>14} {:>14} {:>14} {:>14} {:>14} {:>14}",
        "n x k",
        "m",
        "gemv GB/s",
        "cublas GB/s",
        "skinny GB/s",
        "cluster GB/s",
        "wgmma GB/s",
        "wgmma2 GB/s"
    );
    for (nn, k) in [
        (4096usize, 4096usize),
        (6144, 4096),
        (28672, 4096),
        (4096, 14336),
    ] {
        let w: Vec<bf16> = (0..nn * k)
            .map(|_| bf16::from_f32(rng.random_range(-0.05..0.05)))
            .collect();
        let w = s.clone_htod(&w)?;
        for m in [1usize, 2, 8, 16, 32, 64] {
            let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let x = s.clone_htod(&x)?;
            let mut out: CudaSlice<f32> = s.alloc_zeros(m * nn)?;
            let mut scratch: CudaSlice<bf16> = s.alloc_zeros(m * k)?;
            let bytes = (nn * k * 2) as f64;
            let shape = GemmShape { m, n: nn, k };
            let stack = StackShape { m, parts: &[nn], k };
            // Check each kernel against cuBLAS (bf16 activations, left in
            // `scratch`) first.
            gpu.cublas_bf16(&x, &w, &mut out, shape, &mut scratch)?;
            let theirs = s.clone_dtoh(&out)?;
            let col = |t: f64| {
                let g = bytes / t / 1e9;
                format!("{g:.0} ({:.0}%)", 100.0 * g / copy)
            };
            let tg = if m <= kiln_kernels::cuda::GEMV_MAX_M {
                gpu.gemv_bf16_parts(&x, &w, &mut [&mut out], stack)?;
                let err = rel_diff(&s.clone_dtoh(&out)?, &theirs);
                if err.is_nan() || err >= 1e-2 {
                    return Err(format!("GEMV {nn}x{k} m={m} vs cuBLAS: rel err {err}").into());
                }
                col(time(&gpu, 50, || {
                    Ok(gpu.gemv_bf16_parts(&x, &w, &mut [&mut out], stack)?)
                })?)
            } else {
                "-".into()
            };
            // The same bf16 product by `gemm`, checked, then timed.
            let mut checked = |gemm: &dyn Fn(&mut CudaSlice<f32>) -> Result<(), E>| {
                gemm(&mut out)?;
                let err = rel_diff(&s.clone_dtoh(&out)?, &theirs);
                if err.is_nan() || err >= 1e-3 {
                    Ok::<String, E>(format!("err {err:.1e}"))
                } else {
                    Ok(col(time(&gpu, 50, || gemm(&mut out))?))
                }
            };
            let ts = if m >= 2 {
                checked(&|o| Ok(gpu.gemm_bf16_skinny(&scratch, &w, &mut [o], stack)?))?
            } else {
                "-".into()
            };
            let mut cluster = |mma: ClusterMma| {
                if m < 2 {
                    return Ok::<String, E>("-".into());
                }
                checked(&|o| Ok(gpu.gemm_bf16_cluster_on(mma, &scratch, &w, &mut [o], stack)?))
            };
            let tl = cluster(ClusterMma::Ldmatrix)?;
            let tw = cluster(ClusterMma::Wgmma)?;
            let tw2 = cluster(ClusterMma::WgmmaOverlap)?;
            let tc = time(&gpu, 50, || {
                Ok(gpu.cublas_bf16(&x, &w, &mut out, shape, &mut scratch)?)
            })?;
            println!(
                "{:>14} {m:>3} {tg:>14} {:>14} {ts:>14} {tl:>14} {tw:>14} {tw2:>14}",
                format!("{nn}x{k}"),
                col(tc),
            );
        }
    }

    if gemm_only {
        return Ok(());
    }
    quantized::quantized_gemv(&mut gpu, &mut rng, copy, false)?;

    // The page-tag check alone, as a step runs it: every sequence's 80
    // pages (1280 tokens of 16), tags all current, so every flag is 1.
    for seqs in [1usize, 64, 256] {
        tag_check(&gpu, seqs, 80)?;
    }

    attention_table(&gpu, &mut rng, copy)
}

/// Paged decode attention over one Llama-3-8B layer (32 query heads over 8
/// KV heads of 128): batch 64 x 4096 (bandwidth) and batch 1 x 1024
/// (latency), each plan checked against the first before timing. Then the
/// decode step the 64-sequence bench times (prompts of 512 and 128
/// generated: 640 tokens at most), and the decode matrix's c=128 and full
/// fp8 batch (232 sequences) at its mean context.
fn attention_table(gpu: &Gpu, rng: &mut rand::rngs::StdRng, copy: f64) -> Result<(), E> {
    for (batch, ctx) in [
        (64usize, 4096usize),
        (1, 1024),
        (64, 640),
        (128, 1152),
        (232, 1152),
    ] {
        for format in [KvFormat::Bf16, KvFormat::Fp8, KvFormat::Fp8Static] {
            attention(gpu, rng, copy, batch, ctx, format)?;
        }
    }
    Ok(())
}

/// Times the tag check of `seqs` sequences of `pages` pages each, after
/// checking that it passes them all.
fn tag_check(gpu: &Gpu, seqs: usize, pages: usize) -> Result<(), E> {
    let s = gpu.stream().clone();
    let entries = seqs * pages;
    // Words: expected tags (two u64 = four u32 per entry), the tables,
    // then each sequence's first entry and the end.
    let mut words = Vec::with_capacity(entries * 5 + seqs + 1);
    let tag = |p: usize| [(p as u64) * 7 + 1, 3u64];
    for p in 0..entries {
        for w in tag(p) {
            words.extend([w as u32, (w >> 32) as u32]);
        }
    }
    words.extend((0..entries).map(|p| p as u32));
    words.extend((0..=seqs).map(|i| (i * pages) as u32));
    let current: Vec<u64> = (0..entries).flat_map(tag).collect();
    let layout = TagLayout {
        expected: 0,
        tables: entries * 4,
        seq_tab: entries * 5,
        ..Default::default()
    };
    let mut inputs = s.clone_htod(&words)?;
    let current = s.clone_htod(&current)?;
    let mut flags: CudaSlice<u32> = s.alloc_zeros(seqs)?;
    gpu.tag_check(
        &mut inputs,
        &layout,
        &current,
        &mut flags.slice_mut(..),
        seqs,
    )?;
    if s.clone_dtoh(&flags)?.iter().any(|f| *f != 1) {
        return Err(format!("tag check of {seqs} sequences failed current tags").into());
    }
    let t = time(gpu, 50, || {
        Ok(gpu.tag_check(
            &mut inputs,
            &layout,
            &current,
            &mut flags.slice_mut(..),
            seqs,
        )?)
    })?;
    println!(
        "tag check {seqs} sequences x {pages} pages: {:.2} us",
        t * 1e6
    );
    Ok(())
}

fn attention(
    gpu: &Gpu,
    rng: &mut rand::rngs::StdRng,
    copy: f64,
    batch: usize,
    ctx: usize,
    format: KvFormat,
) -> Result<(), E> {
    let s = gpu.stream().clone();
    let heads = 32usize;
    let layout = KvLayout {
        page_size: 16,
        kv_heads: 8,
        head_dim: 128,
    };
    let pages_per = ctx / 16;
    let pages = batch * pages_per;
    {
        // Each sequence's pages shuffled across the pool.
        let (kv, order) = pages::random_pages(gpu, rng, format, layout, pages)?;
        let offs: Vec<i32> = (0..=batch).map(|b| (b * pages_per) as i32).collect();
        let lens = vec![ctx as i32; batch];
        let q: Vec<f32> = (0..batch * heads * 128)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let (tables, offs, lens, q) = (
            s.clone_htod(&order)?,
            s.clone_htod(&offs)?,
            s.clone_htod(&lens)?,
            s.clone_htod(&q)?,
        );
        let mut scratch = gpu.attention_buffers((batch, ctx), (heads, 8, 128), 0)?;
        let mut out: CudaSlice<f32> = s.alloc_zeros(batch * heads * 128)?;
        let small = partition_len(batch, 8, ctx, 1).min(PARTITION);
        // The shuffle kernel in partitions of 256 first: every other plan is
        // checked against it (the tensor-core kernel carries Q and the
        // weights as split halves, so they may differ in the sixth digit).
        let mut plans = Vec::new();
        for kind in [AttentionKind::Shuffle, AttentionKind::Flash] {
            // At batch 1 (latency) every partition length the flash
            // kernel takes.
            let parts = match kind {
                AttentionKind::Flash if batch == 1 => vec![64, 128, PARTITION],
                // Longer partitions: fewer block merges per token.
                // Else the sequence in 1 to 8 equal partitions (no more
                // than those of 256 tokens: what the scratch holds).
                AttentionKind::Flash => (1..=8)
                    .map(|p| ctx.div_ceil(p).next_multiple_of(16))
                    .filter(|len| ctx.div_ceil(*len) <= ctx.div_ceil(PARTITION))
                    .collect(),
                AttentionKind::Shuffle => vec![PARTITION, small],
            };
            // Over fp8 pages, every build of the flash kernel.
            let builds: &[Option<FlashBuild>] = match kind {
                AttentionKind::Flash if format != KvFormat::Bf16 => {
                    &[Some(FlashBuild::Plain), Some(FlashBuild::FourAnSm)]
                }
                _ => &[None],
            };
            for part in parts {
                for &build in builds {
                    let plan = AttentionPlan {
                        part_len: Some(part),
                        kind: Some(kind),
                        build,
                        fused_merge: false,
                    };
                    if !plans.contains(&plan) {
                        plans.push(plan);
                    }
                    // Split sequences merged by their last block too.
                    if kind == AttentionKind::Flash && part < ctx && build == builds[0] {
                        plans.push(AttentionPlan {
                            fused_merge: true,
                            ..plan
                        });
                    }
                }
            }
        }
        // Then what the engine picks.
        plans.push(AttentionPlan {
            part_len: None,
            kind: Some(AttentionKind::Flash),
            build: None,
            fused_merge: false,
        });
        let mut first: Option<Vec<f32>> = None;
        let query = PagedQuery {
            q: &q,
            tables: &tables.slice(..),
            table_off: &offs.slice(..),
            lens: &lens.slice(..),
            heads,
            scale: 0.088,
        };
        let seqs = DecodeBatch {
            seqs: batch,
            max_len: ctx,
        };
        for plan in plans {
            let mut run = |out: &mut CudaSlice<f32>| {
                gpu.paged_attention(&kv, &query, seqs, plan, &mut scratch, out)
            };
            // From NaN: a plan that leaves rows unwritten cannot pass on
            // the last plan's output.
            s.memcpy_htod(&vec![f32::NAN; out.len()], &mut out)?;
            run(&mut out)?;
            let got = s.clone_dtoh(&out)?;
            let err = match &first {
                None => {
                    first = Some(got);
                    0.0
                }
                Some(want) => rel_diff(&got, want),
            };
            if err.is_nan() || err >= 1e-2 {
                return Err(format!("attention {plan:?} disagrees: rel err {err}").into());
            }
            let t = time_graph(gpu, 30, || Ok(run(&mut out)?))?;
            let bytes = (batch * ctx * 8 * 2 * format.vector_bytes(128)) as f64;
            let bw = bytes / t / 1e9;
            println!(
                "paged attention {format:?} batch {batch} x ctx {ctx}, {} tokens a part, {}{}{}: \
                 {:.4} ms, {bw:.0} GB/s, {:.0}% of copy (rel err {err:.1e})",
                plan.part_len.map_or("auto".into(), |p| p.to_string()),
                plan.kind.map(|k| format!("{k:?}")).unwrap_or_default(),
                match plan.build {
                    Some(FlashBuild::Plain) => ", three an SM".to_string(),
                    Some(FlashBuild::FourAnSm) => ", four an SM".to_string(),
                    None => String::new(),
                },
                if plan.fused_merge {
                    ", merged in the kernel"
                } else {
                    ""
                },
                t * 1e3,
                100.0 * bw / copy
            );
        }
    }
    Ok(())
}
