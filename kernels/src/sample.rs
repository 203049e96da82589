//! Picking the next token from logits.

use rand::Rng;

/// Index of the largest logit (the first one on ties; NaN never wins, 0 when
/// every logit is NaN).
pub fn argmax(logits: &[f32]) -> u32 {
    // NaN never wins (as on the GPU): the first non-NaN value starts.
    let mut best: Option<(usize, f32)> = None;
    for (i, v) in logits.iter().enumerate() {
        if !v.is_nan() && best.is_none_or(|(_, b)| *v > b) {
            best = Some((i, *v));
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}

/// Takes every token `mask` does not allow out of `logits`: token `v` is
/// allowed when bit `v % 32` of word `v / 32` is set (words past the mask
/// allow nothing).
pub fn mask_logits(logits: &mut [f32], mask: &[u32]) {
    for (w, chunk) in logits.chunks_mut(32).enumerate() {
        let bits = mask.get(w).copied().unwrap_or(0);
        if bits == u32::MAX {
            continue;
        }
        for (b, l) in chunk.iter_mut().enumerate() {
            if bits >> b & 1 == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

/// Sampling settings for one draw.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// Temperature; 0 (or less) is greedy.
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches `top_p` (1 = all).
    pub top_p: f32,
}

impl SamplingParams {
    /// Whether sampling is the argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == 1
    }
}

/// Draws a token: greedy at temperature 0, else softmax(logits / T)
/// restricted by top-k then top-p.
pub fn sample(logits: &[f32], p: SamplingParams, rng: &mut impl Rng) -> u32 {
    if p.is_greedy() {
        return argmax(logits);
    }
    sample_with_uniform(logits, p, rng.random::<f32>())
}

/// [`sample`] with its one uniform draw `u` in `[0, 1)` made by the caller
/// (a device samples with the draw the host's seeded generator made).
pub fn sample_with_uniform(logits: &[f32], p: SamplingParams, u: f32) -> u32 {
    if p.is_greedy() {
        return argmax(logits);
    }
    // Impossible tokens (a mask's) never take part; the argmax is possible
    // unless every token is impossible.
    let mut idx: Vec<u32> = (0..logits.len() as u32)
        .filter(|i| logits[*i as usize] > f32::NEG_INFINITY)
        .collect();
    if idx.is_empty() {
        return argmax(logits);
    }
    let k = if p.top_k == 0 {
        logits.len()
    } else {
        p.top_k.min(logits.len())
    };
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, |a, b| {
            logits[*b as usize].total_cmp(&logits[*a as usize])
        });
        // Logits equal to the k-th largest all stay in: which of them
        // would be "the" k-th is arbitrary, and the device's radix select
        // cannot tell them apart either.
        let kth = logits[idx[k - 1] as usize];
        let mut end = k;
        for i in k..idx.len() {
            if logits[idx[i] as usize] == kth {
                idx.swap(end, i);
                end += 1;
            }
        }
        idx.truncate(end);
    }
    // Largest first; equal logits by index, so a draw is reproducible.
    idx.sort_unstable_by(|a, b| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    });
    // Weights and running sums in f64: over a whole vocabulary, f32 sums
    // drift by more than a small token's probability.
    let max = logits[idx[0] as usize] as f64;
    let t = p.temperature as f64;
    let mut probs: Vec<f64> = idx
        .iter()
        .map(|i| ((logits[*i as usize] as f64 - max) / t).exp())
        .collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|v| *v /= total);
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (i, v) in probs.iter().enumerate() {
            acc += v;
            if acc >= p.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
        // Logits equal to the nucleus's last all stay in, as at the k-th.
        let edge = logits[idx[keep - 1] as usize];
        while keep < probs.len() && logits[idx[keep] as usize] == edge {
            keep += 1;
        }
        probs.truncate(keep);
    }
    let total: f64 = probs.iter().sum();
    let mut r = u as f64 * total;
    for (i, v) in probs.iter().enumerate() {
        r -= v;
        if r <= 0.0 {
            return idx[i];
        }
    }
    idx[probs.len() - 1]
}

/// Most alternatives [`logprobs`] returns beside the chosen token (as
/// OpenAI's `top_logprobs`).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// The natural-log probability of `chosen` under softmax(`logits`) (the
/// model's distribution, before temperature, top-k or top-p), and the
/// `top` most likely tokens with theirs, most likely first (equal logits
/// by id). Sums in f64; a NaN logit counts as impossible.
pub fn logprobs(logits: &[f32], chosen: u32, top: usize) -> (f32, Vec<(u32, f32)>) {
    let value = |v: f32| {
        if v.is_nan() {
            f64::NEG_INFINITY
        } else {
            v as f64
        }
    };
    let max = logits
        .iter()
        .map(|v| value(*v))
        .fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = logits.iter().map(|v| (value(*v) - max).exp()).sum();
    let log_z = max + sum.ln();
    let lp = |i: u32| {
        logits
            .get(i as usize)
            .map_or(f64::NEG_INFINITY, |v| value(*v) - log_z) as f32
    };
    let top = top.min(logits.len());
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let order = |a: &u32, b: &u32| {
        value(logits[*b as usize])
            .total_cmp(&value(logits[*a as usize]))
            .then(a.cmp(b))
    };
    if top > 0 && top < idx.len() {
        idx.select_nth_unstable_by(top - 1, order);
    }
    idx.truncate(top);
    idx.sort_unstable_by(order);
    (lp(chosen), idx.into_iter().map(|i| (i, lp(i))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn logprobs_are_a_distribution_with_the_most_likely_first() {
        let logits = [1.0f32, 3.0, -2.0, 3.0, 0.5];
        let (chosen, top) = logprobs(&logits, 2, 5);
        let total: f64 = top.iter().map(|(_, lp)| (*lp as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
        // Equal logits by id; the chosen token's figure is its own.
        let ids: Vec<u32> = top.iter().map(|(i, _)| *i).collect();
        assert_eq!(ids, [1, 3, 0, 4, 2]);
        assert_eq!(chosen, top[4].1);
        assert!((top[0].1 - top[1].1).abs() < 1e-7);
        // log p(1) - log p(2) is the logits' difference.
        assert!((top[0].1 - chosen - 5.0).abs() < 1e-5);
    }

    #[test]
    fn logprobs_keep_the_top_few_of_a_large_vocabulary() {
        let logits: Vec<f32> = (0..50_000)
            .map(|i| ((i * 7919) % 1000) as f32 / 100.0)
            .collect();
        let (_, top) = logprobs(&logits, 0, MAX_TOP_LOGPROBS);
        assert_eq!(top.len(), MAX_TOP_LOGPROBS);
        assert!(top.windows(2).all(|w| w[0].1 >= w[1].1));
        let best = logits.iter().cloned().fold(f32::MIN, f32::max);
        assert_eq!(logits[top[0].0 as usize], best);
        assert!(top.iter().all(|(_, lp)| *lp < 0.0));
        // None at all, and a NaN that never counts.
        assert!(logprobs(&logits, 0, 0).1.is_empty());
        let (lp, top) = logprobs(&[f32::NAN, 0.0], 0, 2);
        assert_eq!(lp, f32::NEG_INFINITY);
        assert_eq!(top[0], (1, 0.0));
    }

    #[test]
    fn argmax_takes_the_first_largest_and_never_a_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, f32::NAN, 2.0, 1.0]), 3);
        assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY]), 1);
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
        assert_eq!(argmax(&[]), 0);
    }

    #[test]
    fn logits_tied_with_the_kth_largest_all_stay_candidates() {
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 2,
            top_p: 1.0,
        };
        // Tokens 1 and 2 tie for second: both are candidates, so the top
        // of the draw's range reaches token 2 (candidates 0, 1, 2).
        let logits = [3.0, 2.0, 2.0, 1.0];
        assert_eq!(sample_with_uniform(&logits, p, 0.999), 2);
        assert_eq!(sample_with_uniform(&logits, p, 0.7), 1);
        assert_eq!(sample_with_uniform(&logits, p, 0.1), 0);
        // Token 3 is never one.
        assert!((0..100).all(|i| sample_with_uniform(&logits, p, i as f32 / 100.0) != 3));
    }

    #[test]
    fn logits_tied_at_the_nucleus_edge_all_stay_in() {
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.5,
        };
        // Token 0 alone holds less than half; tokens 1 and 2 tie after it,
        // so both join the nucleus and a high draw reaches token 2.
        let logits = [2.0, 1.9, 1.9, -5.0];
        assert_eq!(sample_with_uniform(&logits, p, 0.999), 2);
        assert!((0..100).all(|i| sample_with_uniform(&logits, p, i as f32 / 100.0) != 3));
    }

    #[test]
    fn greedy_and_top_k_one_pick_the_argmax() {
        let logits = [0.1, 3.0, 2.9, -1.0];
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let greedy = SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
        };
        assert_eq!(sample(&logits, greedy, &mut rng), 1);
        let k1 = SamplingParams {
            temperature: 1.0,
            top_k: 1,
            top_p: 1.0,
        };
        assert_eq!(sample(&logits, k1, &mut rng), 1);
    }

    #[test]
    fn top_k_and_top_p_restrict_the_candidates_and_seeds_repeat() {
        let logits = [0.0, 1.0, 1.1, 5.0, 4.9];
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 2,
            top_p: 1.0,
        };
        let draw = |seed| {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            (0..50)
                .map(|_| sample(&logits, p, &mut rng))
                .collect::<Vec<_>>()
        };
        let a = draw(9);
        assert!(a.iter().all(|t| *t == 3 || *t == 4));
        assert!(a.contains(&3) && a.contains(&4));
        assert_eq!(a, draw(9));
        let tight = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.3,
        };
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2);
        assert!((0..50).all(|_| sample(&logits, tight, &mut rng) == 3));
    }
}
