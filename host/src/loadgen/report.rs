//! `kiln loadgen`'s measurements and what it reports of them: per tenant,
//! output tokens per second and TTFT and ITL percentiles, with the first
//! seconds of a run left out on request.

/// One request's measurements.
#[derive(Debug, Default, Clone)]
pub(super) struct Sample {
    /// When the request was sent, seconds from the run's start.
    pub(super) started_s: f64,
    /// Time to the first text, ms.
    pub(super) ttft_ms: f64,
    /// Times between text chunks, ms.
    pub(super) itl_ms: Vec<f64>,
    /// Completion tokens (the usage count).
    pub(super) tokens: u64,
    /// Prompt tokens (the usage count).
    pub(super) prompt_tokens: u64,
}

/// What one tenant got.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantReport {
    /// The tenant.
    pub name: String,
    /// Requests that streamed to their end.
    pub requests: usize,
    /// Requests that failed (status or transport).
    pub errors: usize,
    /// Completion tokens per second of the run.
    pub output_tok_s: f64,
    /// Prompt tokens a request had, on average.
    pub prompt_tokens_mean: f64,
    /// Time to the first text, median and 95th percentile, ms.
    pub ttft_ms: [f64; 2],
    /// Time between text chunks, median and 95th percentile, ms.
    pub itl_ms: [f64; 2],
}

/// The `q` quantile of sorted `v` (0 when empty).
fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// One tenant's report over a run of `secs` seconds, counting only the
/// requests sent from `warmup_s` on (and the tokens over that window).
pub(super) fn report(
    name: &str,
    samples: Vec<Sample>,
    errors: usize,
    secs: f64,
    warmup_s: f64,
) -> TenantReport {
    // Tokens over the window, from every request: those of the first
    // burst that stream on past the warm-up count too.
    let tokens: f64 = samples.iter().map(|s| tokens_from(s, warmup_s)).sum();
    let samples: Vec<Sample> = samples
        .into_iter()
        .filter(|s| s.started_s >= warmup_s)
        .collect();
    let mut ttft: Vec<f64> = samples.iter().map(|s| s.ttft_ms).collect();
    let mut itl: Vec<f64> = samples.iter().flat_map(|s| s.itl_ms.clone()).collect();
    ttft.sort_by(f64::total_cmp);
    itl.sort_by(f64::total_cmp);
    TenantReport {
        name: name.to_string(),
        requests: samples.len(),
        errors,
        output_tok_s: tokens / (secs - warmup_s).max(1e-9),
        prompt_tokens_mean: samples.iter().map(|s| s.prompt_tokens).sum::<u64>() as f64
            / samples.len().max(1) as f64,
        ttft_ms: [quantile(&ttft, 0.5), quantile(&ttft, 0.95)],
        itl_ms: [quantile(&itl, 0.5), quantile(&itl, 0.95)],
    }
}

/// The tokens of `s` that arrived from `from_s` (seconds from the run's
/// start) on: its usage count shared evenly among its text chunks.
fn tokens_from(s: &Sample, from_s: f64) -> f64 {
    let chunks = 1 + s.itl_ms.len();
    let mut at = s.started_s + s.ttft_ms / 1e3;
    let mut late = usize::from(at >= from_s);
    for gap in &s.itl_ms {
        at += gap / 1e3;
        late += usize::from(at >= from_s);
    }
    s.tokens as f64 * late as f64 / chunks as f64
}

/// The report as a table.
pub fn table(reports: &[TenantReport]) -> String {
    let mut out = format!(
        "{:>12} {:>8} {:>6} {:>7} {:>11} {:>9} {:>9} {:>8} {:>8}\n",
        "tenant",
        "requests",
        "errors",
        "prompt",
        "output t/s",
        "TTFT p50",
        "TTFT p95",
        "ITL p50",
        "ITL p95"
    );
    for r in reports {
        out += &format!(
            "{:>12} {:>8} {:>6} {:>7.0} {:>11.1} {:>9.1} {:>9.1} {:>8.2} {:>8.2}\n",
            r.name,
            r.requests,
            r.errors,
            r.prompt_tokens_mean,
            r.output_tok_s,
            r.ttft_ms[0],
            r.ttft_ms[1],
            r.itl_ms[0],
            r.itl_ms[1]
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_sent_during_the_warm_up_are_not_counted() {
        let sample = |started_s, ttft_ms, itl_ms| Sample {
            started_s,
            ttft_ms,
            itl_ms,
            tokens: 100,
            prompt_tokens: 8,
        };
        let burst = vec![
            sample(0.0, 3000.0, vec![10.0]),
            // Sent in the burst, its second half streamed after it.
            sample(0.0, 4000.0, vec![2000.0]),
            sample(6.0, 200.0, vec![10.0]),
        ];
        let all = report("t", burst.clone(), 0, 20.0, 0.0);
        assert_eq!((all.requests, all.ttft_ms[1]), (3, 4000.0));
        assert_eq!(all.output_tok_s, 300.0 / 20.0);
        let steady = report("t", burst, 1, 20.0, 5.0);
        assert_eq!((steady.requests, steady.errors), (1, 1));
        assert_eq!(steady.ttft_ms, [200.0, 200.0]);
        assert_eq!(steady.output_tok_s, 150.0 / 15.0);
    }

    #[test]
    fn quantiles_pick_the_nearest_rank_and_zero_when_empty() {
        assert_eq!(quantile(&[1.0, 2.0, 3.0, 4.0, 5.0], 0.5), 3.0);
        assert_eq!(quantile(&[], 0.95), 0.0);
    }
}
