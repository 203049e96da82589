//! NCCL sums across GPUs (tensor-parallel ranks): every rank gets the sum
//! of every rank's part in place, and a sum that one rank never joins ends
//! once the ranks are stopped, instead of holding its GPU for good. Needs
//! two GPUs or more, so ignored unless asked for (`KILN_TEST_DEVICE=cuda`
//! with `--include-ignored`), and skipped, saying so, on one GPU.

use std::time::{Duration, Instant};

use kiln_kernels::cuda::Gpu;

/// Each GPU, opened on a stream of its own; `None` (and a message) where
/// there are fewer than two.
fn gpus() -> Option<Vec<Gpu>> {
    let count = Gpu::count().expect("CUDA");
    if count < 2 {
        eprintln!("SKIPPED: {count} GPU(s); NCCL's tests need two or more");
        return None;
    }
    Some(
        (0..count)
            .map(|i| Gpu::open(i, true).expect("GPU"))
            .collect(),
    )
}

#[test]
#[ignore = "needs two GPUs: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn every_rank_gets_the_sum_of_every_ranks_part() {
    let Some(gpus) = gpus() else { return };
    let refs: Vec<&Gpu> = gpus.iter().collect();
    let ranks = Gpu::nccl_ranks(&refs).unwrap();
    let n = 10_000;
    // Rank r's part: (r + 1) * (i % 7) at i, and a tail past n it keeps.
    let part = |r: usize| -> Vec<f32> { (0..n + 5).map(|i| ((r + 1) * (i % 7)) as f32).collect() };
    let mut bufs: Vec<_> = (gpus.iter().enumerate())
        .map(|(r, g)| g.upload(&part(r)).unwrap())
        .collect();
    // Each rank queues its sum from its own thread, as the ranks' steps do.
    std::thread::scope(|s| {
        for ((g, rank), buf) in gpus.iter().zip(&ranks).zip(&mut bufs) {
            s.spawn(move || g.all_reduce_sum(rank, buf, n).unwrap());
        }
    });
    let scale: usize = (1..=gpus.len()).sum();
    for (r, (g, buf)) in gpus.iter().zip(&bufs).enumerate() {
        let got = g.download(buf).unwrap();
        for (i, v) in got.iter().enumerate() {
            let want = if i < n {
                scale * (i % 7)
            } else {
                (r + 1) * (i % 7)
            };
            assert_eq!(*v, want as f32, "rank {r} at {i}");
        }
    }
}

#[test]
#[ignore = "needs two GPUs: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn a_sum_one_rank_never_joins_ends_when_the_ranks_are_stopped() {
    let Some(gpus) = gpus() else { return };
    let refs: Vec<&Gpu> = gpus.iter().collect();
    let ranks = Gpu::nccl_ranks(&refs).unwrap();
    let mut buf = gpus[0].upload(&vec![1.0f32; 4096]).unwrap();
    let start = Instant::now();
    let waited = std::thread::scope(|s| {
        let (g, rank, buf) = (&gpus[0], &ranks[0], &mut buf);
        let waiting = s.spawn(move || {
            g.all_reduce_sum(rank, buf, 4096).unwrap();
            // Waits for the stream: for good, were the sum never ended.
            let _ = g.download(buf);
            start.elapsed()
        });
        std::thread::sleep(Duration::from_millis(500));
        assert!(!waiting.is_finished(), "the sum ended with a rank missing");
        // Rank 1 failed instead of queuing its sum.
        assert!(ranks[1].stop_all().unwrap());
        waiting.join().unwrap()
    });
    assert!(waited < Duration::from_secs(30), "waited {waited:?}");
    // Stopped for good: a later sum is refused, and a second stop is none.
    let e = gpus[0].all_reduce_sum(&ranks[0], &mut buf, 16).unwrap_err();
    assert!(e.to_string().contains("aborted"), "{e}");
    assert!(!ranks[0].stop_all().unwrap());
}
