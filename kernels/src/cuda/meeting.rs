//! Meetings of tensor-parallel ranks, each on its own thread: the vote
//! before a step's kernels ([`Vote`]) and the sum through the host for
//! ranks that share a GPU ([`HostSum`]). A meeting a rank misses, or one
//! a failed rank breaks off, fails every later round at once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use cudarc::driver::CudaSlice;

use super::Gpu;
use crate::KernelError;

type R<T = ()> = Result<T, KernelError>;

/// A meeting of ranks, each on its own thread: each brings an item, and
/// all get every rank's, in rank order, once the last has come. A rank
/// that does not come in time ([`PATIENCE`]) breaks the meeting: that round
/// and every later one fail at once (the runner that owns it is remade),
/// so no round can pair with another's items.
pub struct Meeting<T> {
    ranks: usize,
    patience: Duration,
    state: Mutex<Round<T>>,
    turned: Condvar,
}

/// How long a rank waits for the others.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// The items brought so far, the last round's, and how many have ended.
struct Round<T> {
    items: Vec<Option<T>>,
    arrived: usize,
    ended: u64,
    done: Arc<Vec<T>>,
    broken: bool,
}

impl<T> Meeting<T> {
    /// A meeting of `ranks` ranks.
    pub fn new(ranks: usize) -> Self {
        Self::with_patience(ranks, PATIENCE)
    }

    /// A meeting of `ranks` ranks that waits `patience` for each.
    pub fn with_patience(ranks: usize, patience: Duration) -> Self {
        Self {
            ranks,
            patience,
            state: Mutex::new(Round {
                items: (0..ranks).map(|_| None).collect(),
                arrived: 0,
                ended: 0,
                done: Arc::new(Vec::new()),
                broken: false,
            }),
            turned: Condvar::new(),
        }
    }

    /// Brings `item` as rank `rank`'s and waits for every rank's.
    pub fn gather(&self, rank: usize, item: T) -> R<Arc<Vec<T>>> {
        let mut m = self.state.lock().map_err(|_| broken())?;
        if m.broken {
            return Err(broken());
        }
        m.items[rank] = Some(item);
        m.arrived += 1;
        let round = m.ended;
        if m.arrived == self.ranks {
            let items: Option<Vec<T>> = m.items.iter_mut().map(Option::take).collect();
            m.done = Arc::new(items.ok_or_else(broken)?);
            m.arrived = 0;
            m.ended += 1;
            self.turned.notify_all();
            return Ok(Arc::clone(&m.done));
        }
        let (mut m, _) = (self.turned)
            .wait_timeout_while(m, self.patience, |m| m.ended == round && !m.broken)
            .map_err(|_| broken())?;
        if m.ended == round {
            if m.broken {
                return Err(broken());
            }
            m.broken = true;
            self.turned.notify_all();
            // This rank's own error: it says why the step failed.
            return Err(KernelError::Cuda(format!(
                "tensor-parallel ranks: another rank did not come within {:?}",
                self.patience
            )));
        }
        Ok(Arc::clone(&m.done))
    }

    /// Breaks the meeting off: the ranks waiting in it now, and every
    /// later round, fail at once (for a rank that failed where the others
    /// would wait for it).
    pub fn break_off(&self) {
        let mut m = self.state.lock().unwrap_or_else(|p| p.into_inner());
        m.broken = true;
        self.turned.notify_all();
    }
}

fn broken() -> KernelError {
    KernelError::OtherRank("another rank failed".into())
}

/// The ranks' vote, each step, that every rank reached its kernels: NCCL's
/// sums wait on the device for every rank, so a rank that failed before
/// launching would hang the others for good; with the vote they launch
/// nothing and fail too.
pub struct Vote {
    votes: Meeting<bool>,
    voted: Vec<AtomicBool>,
}

impl Vote {
    /// A vote of `ranks` ranks.
    pub fn new(ranks: usize) -> Self {
        Self::with_meeting(Meeting::new(ranks), ranks)
    }

    fn with_meeting(votes: Meeting<bool>, ranks: usize) -> Self {
        Self {
            votes,
            voted: (0..ranks).map(|_| AtomicBool::new(false)).collect(),
        }
    }

    /// A new step begins for `rank`: it has not voted.
    pub fn begin(&self, rank: usize) {
        self.voted[rank].store(false, Ordering::SeqCst);
    }

    /// `rank` reached its step's kernels: fine if every rank did.
    pub fn agree(&self, rank: usize) -> R {
        self.voted[rank].store(true, Ordering::SeqCst);
        let votes = self.votes.gather(rank, true)?;
        if votes.iter().all(|v| *v) {
            Ok(())
        } else {
            Err(KernelError::OtherRank(
                "another rank failed before this step's kernels".into(),
            ))
        }
    }

    /// `rank`'s step failed: if it had not voted, it votes no.
    pub fn failed(&self, rank: usize) {
        if !self.voted[rank].swap(true, Ordering::SeqCst) {
            let _ = self.votes.gather(rank, false);
        }
    }
}

/// Ranks' sums through the host, for ranks that share a GPU: each waits
/// for its stream, sends its part, and gets back the sum in rank order
/// (the same bytes on every rank).
pub struct HostSum {
    parts: Meeting<Vec<f32>>,
}

impl HostSum {
    /// A meeting point for `ranks` ranks, each on its own thread.
    pub fn new(ranks: usize) -> Arc<Self> {
        Arc::new(Self {
            parts: Meeting::new(ranks),
        })
    }

    /// Rank `rank`'s first `n` elements of `x` replaced by every rank's
    /// sum (waits for `g`'s stream and for every other rank).
    pub fn all_reduce_sum(&self, g: &Gpu, rank: usize, x: &mut CudaSlice<f32>, n: usize) -> R {
        let part = g.download_range(x, 0..n)?;
        let parts = self.parts.gather(rank, part)?;
        let mut sum = parts[0].clone();
        for p in &parts[1..] {
            sum.iter_mut().zip(p).for_each(|(s, v)| *s += v);
        }
        g.upload_into(&sum, x)
    }

    /// Ends every rank's sums: those waiting now and every later one fail
    /// at once.
    pub fn stop(&self) {
        self.parts.break_off();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_gets_every_rounds_items_in_rank_order() {
        let meeting = Meeting::new(3);
        std::thread::scope(|s| {
            for rank in 0..3 {
                let meeting = &meeting;
                s.spawn(move || {
                    for round in 0..50 {
                        let got = meeting.gather(rank, (round, rank)).unwrap();
                        assert_eq!(*got, vec![(round, 0), (round, 1), (round, 2)]);
                    }
                });
            }
        });
    }

    #[test]
    fn a_rank_failing_before_its_kernels_stops_the_others_at_once() {
        let vote = Vote::with_meeting(Meeting::with_patience(2, Duration::from_secs(30)), 2);
        let start = std::time::Instant::now();
        std::thread::scope(|s| {
            let ok = s.spawn(|| {
                vote.begin(0);
                vote.agree(0)
            });
            vote.begin(1);
            vote.failed(1);
            let e = ok.join().unwrap().unwrap_err().to_string();
            assert!(e.contains("failed before this step's kernels"), "{e}");
        });
        // A rank that fails after voting yes votes no more (a vote with no
        // other rank coming would wait the patience out).
        for rank in 0..2 {
            vote.begin(rank);
        }
        std::thread::scope(|s| {
            let other = s.spawn(|| vote.agree(1));
            vote.agree(0).unwrap();
            vote.failed(0);
            other.join().unwrap().unwrap();
        });
        let waited = start.elapsed();
        assert!(waited < Duration::from_secs(5), "waited {waited:?}");
    }

    #[test]
    fn a_rank_that_never_comes_fails_that_round_and_every_later_one() {
        let meeting = Meeting::with_patience(2, Duration::from_millis(50));
        let e = meeting.gather(0, 1).unwrap_err().to_string();
        assert!(e.contains("did not come"), "{e}");
        // The late rank finds the meeting broken rather than pairing its
        // item with the next round's.
        let e = meeting.gather(1, 2).unwrap_err().to_string();
        assert!(e.contains("another rank failed"), "{e}");
        assert!(meeting.gather(0, 3).is_err());
    }

    #[test]
    fn a_meeting_broken_off_releases_its_waiting_ranks_at_once() {
        let meeting = Meeting::with_patience(2, Duration::from_secs(30));
        let start = std::time::Instant::now();
        std::thread::scope(|s| {
            let waiting = s.spawn(|| meeting.gather(0, 1));
            while start.elapsed() < Duration::from_millis(50) {
                std::thread::yield_now();
            }
            meeting.break_off();
            let e = waiting.join().unwrap().unwrap_err().to_string();
            assert!(e.contains("another rank failed"), "{e}");
        });
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(meeting.gather(1, 2).is_err());
    }
}
