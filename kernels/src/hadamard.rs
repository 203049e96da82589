//! The orthonormal Walsh-Hadamard transform of head vectors, which
//! [`crate::kv::KvFormat::Fp8Static`] applies to queries and keys after
//! RoPE.
//!
//! Attention scores are dot products, and `H` (Sylvester's Hadamard matrix
//! over `sqrt(n)`) is orthogonal and symmetric, so `(Hq) . (Hk) = q . k`:
//! rotating both changes no score. What it changes is the keys' shape. Keys
//! carry a few outlier channels, and one static scale shared by every token
//! must leave room for them, so it spends the fp8 grid badly on the rest;
//! the rotation spreads each outlier over all `n` channels (a channel of
//! size `a` becomes `n` of size `a / sqrt(n)`), and the largest element of a
//! rotated key is a few times its RMS. On the default model the rotated
//! keys' largest element is 1.2-3x smaller than the raw keys', by layer
//! (docs/perf.md, static fp8 pages).

/// Rotates `x` in place by `H / sqrt(n)`, `n = x.len()` a power of two; the
/// transform is its own inverse. Stage `h` (1, 2, 4, ...) pairs element `j`
/// with `j + h` in runs of `2h`: the order the CUDA kernel adds in, so both
/// round alike.
pub fn rotate(x: &mut [f32]) {
    let n = x.len();
    debug_assert!(n.is_power_of_two(), "hadamard over {n} elements");
    let mut h = 1;
    while h < n {
        for run in x.chunks_exact_mut(2 * h) {
            let (a, b) = run.split_at_mut(h);
            for (a, b) in a.iter_mut().zip(b.iter_mut()) {
                let (x, y) = (*a, *b);
                *a = x + y;
                *b = x - y;
            }
        }
        h *= 2;
    }
    let s = 1.0 / (n as f32).sqrt();
    x.iter_mut().for_each(|v| *v *= s);
}

/// Rotates each `head_dim`-element head of `x` in place.
pub fn rotate_heads(x: &mut [f32], head_dim: usize) {
    x.chunks_exact_mut(head_dim).for_each(rotate);
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
    }

    #[test]
    fn rotating_twice_gives_the_vector_back() {
        for n in [64, 128] {
            let x = random(n, n as u64);
            let mut y = x.clone();
            rotate(&mut y);
            assert!(x.iter().zip(&y).any(|(a, b)| (a - b).abs() > 1e-3));
            rotate(&mut y);
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() < 1e-5, "{a} vs {b}");
            }
        }
    }

    #[test]
    fn rotating_query_and_key_keeps_their_score() {
        let (mut q, mut k) = (random(128, 1), random(128, 2));
        let before: f32 = q.iter().zip(&k).map(|(a, b)| a * b).sum();
        rotate(&mut q);
        rotate(&mut k);
        let after: f32 = q.iter().zip(&k).map(|(a, b)| a * b).sum();
        assert!((before - after).abs() < 1e-4, "{before} vs {after}");
    }

    #[test]
    fn an_outlier_channel_spreads_over_every_channel() {
        let mut x = vec![0.01f32; 128];
        x[17] = 20.0;
        rotate(&mut x);
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        // 20 / sqrt(128) = 1.77, give or take the small channels.
        assert!(amax < 2.0, "largest element {amax}");
        assert!(x.iter().all(|v| v.abs() > 1.5), "every channel carries it");
    }

    #[test]
    fn rotate_heads_rotates_each_head_alone() {
        let x = random(3 * 64, 9);
        let mut y = x.clone();
        rotate_heads(&mut y, 64);
        for (h, chunk) in y.chunks_exact(64).enumerate() {
            let mut want = x[h * 64..(h + 1) * 64].to_vec();
            rotate(&mut want);
            assert_eq!(chunk, &want[..]);
        }
    }
}
