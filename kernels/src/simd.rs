//! Dot products and axpy, compiled twice: generic, and with AVX2+FMA for
//! CPUs that have it (chosen at run time).

#[inline(always)]
fn dot_body(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; 16];
    let chunks = n / 16;
    for i in 0..chunks {
        let (x, y) = (&a[i * 16..i * 16 + 16], &b[i * 16..i * 16 + 16]);
        for j in 0..16 {
            acc[j] = x[j].mul_add(y[j], acc[j]);
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 16..n {
        s += a[i] * b[i];
    }
    s
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    // SAFETY: every load reads 8 floats at i < n - 15 (or n - 7) of both.
    unsafe {
        while i + 16 <= n {
            s0 = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(i)),
                _mm256_loadu_ps(b.as_ptr().add(i)),
                s0,
            );
            s1 = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(i + 8)),
                _mm256_loadu_ps(b.as_ptr().add(i + 8)),
                s1,
            );
            i += 16;
        }
        if i + 8 <= n {
            s0 = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(i)),
                _mm256_loadu_ps(b.as_ptr().add(i)),
                s0,
            );
            i += 8;
        }
    }
    let v = _mm256_add_ps(s0, s1);
    let h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    let mut s = _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
    while i < n {
        s += a[i] * b[i];
        i += 1;
    }
    s
}

/// Whether the CPU has AVX2 and FMA (checked once).
pub(crate) fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `sum(a[i] * b[i])` over the shorter length.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        return unsafe { dot_avx2(a, b) };
    }
    dot_body(a, b)
}

#[inline(always)]
fn axpy_body(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi = xi.mul_add(alpha, *yi);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn axpy_avx2(alpha: f32, x: &[f32], y: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = x.len().min(y.len());
    let av = _mm256_set1_ps(alpha);
    let mut i = 0;
    // SAFETY: every access touches 8 floats at i <= n - 8 of both.
    unsafe {
        while i + 8 <= n {
            let yp = y.as_mut_ptr().add(i);
            _mm256_storeu_ps(
                yp,
                _mm256_fmadd_ps(_mm256_loadu_ps(x.as_ptr().add(i)), av, _mm256_loadu_ps(yp)),
            );
            i += 8;
        }
    }
    axpy_body(alpha, &x[i..n], &mut y[i..n]);
}

/// `y += alpha * x`.
#[inline]
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        return unsafe { axpy_avx2(alpha, x, y) };
    }
    axpy_body(alpha, x, y)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_naive_sum_for_odd_lengths() {
        for n in [0, 1, 15, 16, 17, 100] {
            let a: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
            let b: Vec<f32> = (0..n).map(|i| 1.0 - i as f32 * 0.25).collect();
            let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            assert!(
                (dot(&a, &b) - want).abs() <= 1e-3 * want.abs().max(1.0),
                "n={n}"
            );
        }
    }
}
