//! Kiln's figures over the last minutes: a ring of samples of `/metrics`,
//! and the rates between consecutive ones.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::parse::Series;

/// What the page plots, read off one parse of `/metrics`: levels, and
/// counters it turns into rates.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sample {
    /// Seconds since the Unix epoch.
    pub t: f64,
    /// KV pages by model and state (`in_use`, `cached`, `free`), summed
    /// over pools.
    pub pages: BTreeMap<(String, String), f64>,
    /// Prompt tokens served from the prefix cache and computed, all
    /// tenants.
    pub prefix: (f64, f64),
    /// Prompt and completion tokens, by tenant.
    pub tokens: BTreeMap<String, (f64, f64)>,
    /// Sum and count of first-token latencies, by tenant.
    pub first_token: BTreeMap<String, (f64, f64)>,
    /// Sequences aborted by the page-tag check.
    pub integrity_aborts: f64,
}

impl Sample {
    /// The sample of `series` taken at `t`.
    pub fn of(t: f64, series: &[Series]) -> Self {
        let mut s = Self {
            t,
            ..Self::default()
        };
        let label = |x: &Series, k: &str| x.labels.get(k).cloned().unwrap_or_default();
        for x in series {
            match x.name.as_str() {
                "kiln_kv_pages" => {
                    *s.pages
                        .entry((label(x, "model"), label(x, "state")))
                        .or_default() += x.value;
                }
                "kiln_prefix_cache_tokens_total" => match label(x, "result").as_str() {
                    "hit" => s.prefix.0 += x.value,
                    _ => s.prefix.1 += x.value,
                },
                "kiln_model_tokens_total" => {
                    let t = s.tokens.entry(label(x, "tenant")).or_default();
                    match label(x, "kind").as_str() {
                        "prompt" => t.0 += x.value,
                        _ => t.1 += x.value,
                    }
                }
                "kiln_model_first_token_seconds_sum" => {
                    s.first_token.entry(label(x, "tenant")).or_default().0 += x.value;
                }
                "kiln_model_first_token_seconds_count" => {
                    s.first_token.entry(label(x, "tenant")).or_default().1 += x.value;
                }
                "kiln_kv_integrity_aborts_total" => s.integrity_aborts += x.value,
                _ => {}
            }
        }
        s
    }
}

/// The last `capacity` samples, one every `interval`.
#[derive(Debug)]
pub struct History {
    interval: Duration,
    capacity: usize,
    samples: Mutex<VecDeque<Sample>>,
}

impl History {
    /// Keeps `span` of samples taken every `interval`.
    pub fn new(interval: Duration, span: Duration) -> Self {
        let capacity = (span.as_secs_f64() / interval.as_secs_f64().max(1e-3)).ceil() as usize + 1;
        Self {
            interval,
            capacity: capacity.max(2),
            samples: Mutex::new(VecDeque::new()),
        }
    }

    /// How often a sample is taken.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// Records a sample of `series` taken now.
    pub fn record(&self, series: &[Series]) {
        let t = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64();
        self.push(Sample::of(t, series));
    }

    /// Records `sample`, dropping the oldest past the capacity.
    pub fn push(&self, sample: Sample) {
        let mut q = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        q.push_back(sample);
        while q.len() > self.capacity {
            q.pop_front();
        }
    }

    /// The series the page plots, one point per pair of consecutive
    /// samples: `t`, `pages` (`{model: {state: [..]}}`, levels),
    /// `hit_rate` (prefix-cache hits over prompt tokens, `null` with no
    /// prompts), `prompt_tps` and `completion_tps` (`{tenant: [..]}`),
    /// `first_token_ms` (`{tenant: [mean or null]}`) and
    /// `integrity_aborts` (totals).
    pub fn to_json(&self) -> serde_json::Value {
        let q = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        let pairs: Vec<(&Sample, &Sample)> = q.iter().zip(q.iter().skip(1)).collect();
        let ratio = |n: f64, d: f64| (d > 0.0).then(|| n / d);
        let mut pages: BTreeMap<&str, BTreeMap<&str, Vec<Option<f64>>>> = BTreeMap::new();
        let mut prompt: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
        let mut completion: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
        let mut first: BTreeMap<&str, Vec<Option<f64>>> = BTreeMap::new();
        let (mut t, mut hit_rate, mut aborts) = (Vec::new(), Vec::new(), Vec::new());
        for (i, (a, b)) in pairs.iter().enumerate() {
            let dt = (b.t - a.t).max(1e-9);
            t.push(b.t);
            let hits = b.prefix.0 - a.prefix.0;
            hit_rate.push(ratio(hits, hits + b.prefix.1 - a.prefix.1));
            aborts.push(b.integrity_aborts);
            for ((model, state), v) in &b.pages {
                // No figure before a model's engine reported: a gap, not 0.
                let row = pages.entry(model).or_default().entry(state).or_default();
                row.resize(i, None);
                row.push(Some(*v));
            }
            for (tenant, (p, c)) in &b.tokens {
                let (p0, c0) = a.tokens.get(tenant).copied().unwrap_or_default();
                let row = prompt.entry(tenant).or_default();
                row.resize(i, 0.0);
                row.push((p - p0) / dt);
                let row = completion.entry(tenant).or_default();
                row.resize(i, 0.0);
                row.push((c - c0) / dt);
            }
            for (tenant, (sum, n)) in &b.first_token {
                let (sum0, n0) = a.first_token.get(tenant).copied().unwrap_or_default();
                let row = first.entry(tenant).or_default();
                row.resize(i, None);
                row.push(ratio(sum - sum0, n - n0).map(|s| s * 1e3));
            }
        }
        serde_json::json!({
            "t": t,
            "pages": pages,
            "hit_rate": hit_rate,
            "prompt_tps": prompt,
            "completion_tps": completion,
            "first_token_ms": first,
            "integrity_aborts": aborts,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::parse;

    fn sample(t: f64, text: &str) -> Sample {
        Sample::of(t, &parse(text))
    }

    #[test]
    fn rates_come_from_consecutive_samples_and_levels_are_kept() {
        let h = History::new(Duration::from_secs(2), Duration::from_secs(60));
        h.push(sample(
            10.0,
            "kiln_kv_pages{model=\"m\",pool=\"0\",state=\"free\"} 8\n\
             kiln_kv_pages{model=\"m\",pool=\"1\",state=\"free\"} 8\n\
             kiln_model_tokens_total{tenant=\"a\",model=\"m\",kind=\"completion\"} 10\n\
             kiln_prefix_cache_tokens_total{tenant=\"a\",model=\"m\",result=\"hit\"} 0\n\
             kiln_prefix_cache_tokens_total{tenant=\"a\",model=\"m\",result=\"miss\"} 100\n",
        ));
        h.push(sample(
            12.0,
            "kiln_kv_pages{model=\"m\",pool=\"0\",state=\"free\"} 6\n\
             kiln_kv_pages{model=\"m\",pool=\"1\",state=\"free\"} 8\n\
             kiln_model_tokens_total{tenant=\"a\",model=\"m\",kind=\"completion\"} 30\n\
             kiln_prefix_cache_tokens_total{tenant=\"a\",model=\"m\",result=\"hit\"} 75\n\
             kiln_prefix_cache_tokens_total{tenant=\"a\",model=\"m\",result=\"miss\"} 125\n\
             kiln_model_first_token_seconds_sum{tenant=\"a\",model=\"m\"} 0.5\n\
             kiln_model_first_token_seconds_count{tenant=\"a\",model=\"m\"} 2\n",
        ));
        let j = h.to_json();
        assert_eq!(j["t"], serde_json::json!([12.0]));
        assert_eq!(j["pages"]["m"]["free"], serde_json::json!([14.0]));
        assert_eq!(j["completion_tps"]["a"], serde_json::json!([10.0]));
        assert_eq!(j["hit_rate"], serde_json::json!([0.75]));
        assert_eq!(j["first_token_ms"]["a"], serde_json::json!([250.0]));
    }

    #[test]
    fn the_ring_keeps_only_its_span() {
        let h = History::new(Duration::from_secs(1), Duration::from_secs(3));
        for i in 0..10 {
            h.push(sample(i as f64, ""));
        }
        assert_eq!(h.to_json()["t"], serde_json::json!([7.0, 8.0, 9.0]));
        assert_eq!(
            h.to_json()["hit_rate"],
            serde_json::json!([null, null, null])
        );
    }
}
