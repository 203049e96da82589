//! NCCL sums across GPUs (tensor-parallel ranks): every rank gets the sum
//! of every rank's part in place, and a sum that one rank never joins,
//! queued or captured in a graph, ends once the ranks are stopped, instead
//! of holding its GPU for good. Needs
//! two GPUs or more, so ignored unless asked for (`KILN_TEST_DEVICE=cuda`
//! with `--include-ignored`), and skipped, saying so, on one GPU.

use std::time::{Duration, Instant};

use kiln_kernels::cuda::{Gpu, NcclRank};

/// Each GPU, opened on a stream of its own, and an NCCL rank on each;
/// `None` (and a message) where there are fewer than two.
fn ranks() -> Option<(Vec<Gpu>, Vec<NcclRank>)> {
    let count = Gpu::count().expect("CUDA");
    if count < 2 {
        eprintln!("SKIPPED: {count} GPU(s); NCCL's tests need two or more");
        return None;
    }
    let gpus: Vec<Gpu> = (0..count)
        .map(|i| Gpu::open(i, true).expect("GPU"))
        .collect();
    let ranks = Gpu::nccl_ranks(&gpus.iter().collect::<Vec<_>>()).unwrap();
    Some((gpus, ranks))
}

#[test]
#[ignore = "needs two GPUs: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn every_rank_gets_the_sum_of_every_ranks_part() {
    let Some((gpus, ranks)) = ranks() else { return };
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

/// How long `wait` (a rank waiting for a sum rank `stopper` never joins)
/// took to end once `stopper` stopped the ranks, half a second in, and what
/// it gave.
fn ended_by_stop<T: Send>(
    ranks: &[NcclRank],
    stopper: usize,
    wait: impl FnOnce() -> T + Send,
) -> (Duration, T) {
    std::thread::scope(|s| {
        let waiting = s.spawn(move || {
            let got = wait();
            (Instant::now(), got)
        });
        std::thread::sleep(Duration::from_millis(500));
        assert!(
            !waiting.is_finished(),
            "the sum ended (or failed) with a rank missing"
        );
        // The stopper failed instead of queuing its sum; the stop returns
        // at once, the abort going on beside it.
        let stopped = Instant::now();
        assert!(ranks[stopper].stop_all());
        let took = stopped.elapsed();
        assert!(took < Duration::from_secs(1), "the stop took {took:?}");
        let (ended, got) = waiting.join().unwrap();
        (ended.duration_since(stopped), got)
    })
}

#[test]
#[ignore = "needs two GPUs: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn a_sum_one_rank_never_joins_ends_when_the_ranks_are_stopped() {
    let Some((gpus, ranks)) = ranks() else { return };
    let mut buf = gpus[0].upload(&vec![1.0f32; 4096]).unwrap();
    let (ended, ()) = ended_by_stop(&ranks, 1, || {
        gpus[0].all_reduce_sum(&ranks[0], &mut buf, 4096).unwrap();
        // Waits for the stream: for good, were the sum never ended.
        let _ = gpus[0].download(&buf);
    });
    assert!(
        ended < Duration::from_secs(20),
        "ended {ended:?} after the stop"
    );
    // Stopped for good: a later sum is refused, and a second stop is none.
    let e = gpus[0].all_reduce_sum(&ranks[0], &mut buf, 16).unwrap_err();
    assert!(e.to_string().contains("aborted"), "{e}");
    assert!(!ranks[0].stop_all());
}

#[test]
#[ignore = "needs two GPUs: KILN_TEST_DEVICE=cuda and --include-ignored"]
fn a_captured_sum_one_rank_never_joins_ends_when_the_ranks_are_stopped() {
    let Some((gpus, ranks)) = ranks() else { return };
    // The last rank waits and the first stops: the last communicator is
    // aborted last, by the abort that then waits for the graph to go.
    let last = gpus.len() - 1;
    let g = &gpus[last];
    let mut buf = g.upload(&vec![1.0f32; 4096]).unwrap();
    let graph = g
        .capture(|| g.all_reduce_sum(&ranks[last], &mut buf, 4096))
        .unwrap();
    let (ended, graph) = ended_by_stop(&ranks, 0, move || {
        g.replay(&graph).unwrap();
        let _ = g.download(&buf);
        graph
    });
    assert!(
        ended < Duration::from_secs(20),
        "ended {ended:?} after the stop"
    );
    // NCCL ends an abort once no graph holds the communicators: the graph
    // goes first, as the engine's ranks drop theirs before their weights.
    drop(graph);
    let start = Instant::now();
    drop(ranks);
    assert!(start.elapsed() < Duration::from_secs(20));
}
