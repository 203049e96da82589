//! Element-wise and per-row kernels of a llama-family forward pass.

/// The RMSNorm's factor `1 / sqrt(ss / d + eps)` for a row of `d` whose
/// squares sum to `ss`.
pub fn norm_factor(ss: f32, d: usize, eps: f32) -> f32 {
    1.0 / (ss / d as f32 + eps).sqrt()
}

/// `out = x / rms(x) * weight`, per row of `weight.len()`.
pub fn rmsnorm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let inv = norm_factor(xr.iter().map(|v| v * v).sum::<f32>(), d, eps);
        for ((o, v), w) in or.iter_mut().zip(xr).zip(weight) {
            *o = v * inv * w;
        }
    }
}

/// `x += y`.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// `gate[i] = silu(gate[i]) * up[i]`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// In-place softmax.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// Which elements RoPE rotates together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Pairs `(x[2i], x[2i+1])`: GGUF llama weights (ggml "normal").
    Interleaved,
    /// Pairs `(x[i], x[i + d/2])`: Hugging Face weights ("neox").
    Half,
}

/// Llama 3's frequency-dependent RoPE scaling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Scaling {
    /// Overall factor applied to low frequencies.
    pub factor: f32,
    /// Wavelengths above `original / low_freq_factor` are fully scaled.
    pub low_freq_factor: f32,
    /// Wavelengths below `original / high_freq_factor` are unscaled.
    pub high_freq_factor: f32,
    /// Context length the model was pre-trained with.
    pub original_max_position: f32,
}

/// Rotary position embedding for heads of `dim` elements.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f32>,
    style: RopeStyle,
}

impl Rope {
    /// RoPE with base `theta`, optionally Llama-3 scaled.
    pub fn new(dim: usize, theta: f32, scaling: Option<Llama3Scaling>, style: RopeStyle) -> Self {
        let inv_freq = (0..dim / 2)
            .map(|i| {
                let f = 1.0 / theta.powf(2.0 * i as f32 / dim as f32);
                match scaling {
                    None => f,
                    Some(s) => {
                        let low_wl = s.original_max_position / s.low_freq_factor;
                        let high_wl = s.original_max_position / s.high_freq_factor;
                        let wl = 2.0 * std::f32::consts::PI / f;
                        if wl < high_wl {
                            f
                        } else if wl > low_wl {
                            f / s.factor
                        } else {
                            let smooth = (s.original_max_position / wl - s.low_freq_factor)
                                / (s.high_freq_factor - s.low_freq_factor);
                            (1.0 - smooth) * f / s.factor + smooth * f
                        }
                    }
                }
            })
            .collect();
        Self { inv_freq, style }
    }

    /// Divides each frequency by its factor (GGUF's `rope_freqs`, which is
    /// how llama.cpp stores Llama 3.1 scaling).
    pub fn with_freq_factors(mut self, factors: &[f32]) -> Result<Self, crate::KernelError> {
        if factors.len() != self.inv_freq.len() {
            return Err(crate::KernelError::Shape(format!(
                "{} RoPE frequency factors for {} frequencies",
                factors.len(),
                self.inv_freq.len()
            )));
        }
        for (f, d) in self.inv_freq.iter_mut().zip(factors) {
            *f /= d;
        }
        Ok(self)
    }

    /// The inverse frequencies, one per rotated pair.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// Which elements rotate together.
    pub fn style(&self) -> RopeStyle {
        self.style
    }

    /// Rotates every head in `x` (`heads × dim`) for position `pos`.
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let half = self.inv_freq.len();
        let dim = half * 2;
        for head in x.chunks_exact_mut(dim) {
            for (i, f) in self.inv_freq.iter().enumerate() {
                let (sin, cos) = (pos as f32 * f).sin_cos();
                let (a, b) = match self.style {
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    RopeStyle::Half => (i, i + half),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * cos - x1 * sin;
                head[b] = x0 * sin + x1 * cos;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rmsnorm_of_constant_row_is_the_weight() {
        let mut out = vec![0.0; 4];
        rmsnorm(&[3.0; 4], &[1.0, 2.0, 3.0, 4.0], 0.0, &mut out);
        assert_eq!(out, vec![1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn rope_preserves_norm_and_styles_pair_differently() {
        let x: Vec<f32> = (0..8).map(|i| i as f32).collect();
        for style in [RopeStyle::Interleaved, RopeStyle::Half] {
            let rope = Rope::new(8, 10000.0, None, style);
            let mut y = x.clone();
            rope.apply(&mut y, 5);
            let n = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
            assert!((n(&x) - n(&y)).abs() < 1e-3);
            let mut z = x.clone();
            rope.apply(&mut z, 0);
            assert_eq!(z, x, "position 0 is the identity");
        }
        let (mut a, mut b) = (x.clone(), x.clone());
        Rope::new(8, 10000.0, None, RopeStyle::Interleaved).apply(&mut a, 3);
        Rope::new(8, 10000.0, None, RopeStyle::Half).apply(&mut b, 3);
        assert_ne!(a, b);
    }

    /// Llama 3.1's published scaling.
    const LLAMA3: Llama3Scaling = Llama3Scaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position: 8192.0,
    };

    #[test]
    fn llama3_scaling_leaves_high_frequencies_alone() {
        let s = LLAMA3;
        let plain = Rope::new(128, 500000.0, None, RopeStyle::Half);
        let scaled = Rope::new(128, 500000.0, Some(s), RopeStyle::Half);
        assert_eq!(plain.inv_freq[0], scaled.inv_freq[0]);
        assert!((plain.inv_freq[63] / scaled.inv_freq[63] - 8.0).abs() < 1e-3);
    }

    #[test]
    fn freq_factors_reproduce_llama3_scaling() {
        let s = LLAMA3;
        let plain = Rope::new(128, 500000.0, None, RopeStyle::Half);
        let scaled = Rope::new(128, 500000.0, Some(s), RopeStyle::Half);
        let factors: Vec<f32> = plain
            .inv_freq
            .iter()
            .zip(&scaled.inv_freq)
            .map(|(p, s)| p / s)
            .collect();
        let via = plain.with_freq_factors(&factors).unwrap();
        for (a, b) in via.inv_freq.iter().zip(&scaled.inv_freq) {
            assert!((a - b).abs() <= 1e-6 * b.abs());
        }
        assert!(scaled.with_freq_factors(&[1.0]).is_err());
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut x = vec![1.0, 2.0, 3.0, -1e9];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[3] == 0.0 && x[2] > x[1]);
    }
}
