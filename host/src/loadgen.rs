//! `kiln loadgen`: drives a running server's OpenAI API (streamed
//! completions) with several tenants at once, each with its own number of
//! clients, prompt length and output length, and reports per tenant the
//! output tokens/s, time to first token and inter-token latency.

use std::str::FromStr;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};

/// One tenant's share of the load.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantLoad {
    /// The tenant's name (for the report).
    pub name: String,
    /// Its API key.
    pub key: String,
    /// Clients sending one request after another.
    pub clients: usize,
    /// Words in each prompt (a word is about one token).
    pub prompt_words: usize,
    /// `max_tokens` of each request.
    pub max_tokens: usize,
}

impl FromStr for TenantLoad {
    type Err = String;

    /// `NAME=KEY[,clients=N][,prompt=WORDS][,max=TOKENS]`.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut parts = s.split(',');
        let head = parts.next().unwrap_or_default();
        let Some((name, key)) = head.split_once('=') else {
            return Err(format!(
                "`{s}`: expected NAME=KEY[,clients=N][,prompt=WORDS][,max=TOKENS]"
            ));
        };
        let mut load = TenantLoad {
            name: name.into(),
            key: key.into(),
            clients: 1,
            prompt_words: 512,
            max_tokens: 64,
        };
        for part in parts {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| format!("`{part}`: expected KEY=VALUE"))?;
            let n: usize = v
                .parse()
                .map_err(|_| format!("`{part}`: {v} is not a count"))?;
            match k {
                "clients" => load.clients = n,
                "prompt" => load.prompt_words = n,
                "max" => load.max_tokens = n,
                _ => return Err(format!("`{k}`: use clients, prompt or max")),
            }
        }
        if load.name.is_empty() || load.key.is_empty() || load.clients == 0 || load.max_tokens == 0
        {
            return Err(format!(
                "`{s}`: name, key, clients and max must be non-empty"
            ));
        }
        Ok(load)
    }
}

/// `kiln loadgen`'s settings.
#[derive(clap::Args, Debug)]
pub struct LoadArgs {
    /// The server's base URL.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub server: String,
    /// The model to call.
    #[arg(long, default_value = crate::model::DEFAULT_MODEL)]
    pub model: String,
    /// A tenant's load, repeatable:
    /// `NAME=KEY[,clients=N][,prompt=WORDS][,max=TOKENS]` (1 client, 512
    /// words, 64 tokens by default).
    #[arg(long = "tenant", required = true)]
    pub tenants: Vec<TenantLoad>,
    /// Seconds during which clients start requests (those running at the
    /// end finish and count).
    #[arg(long, default_value_t = 30.0)]
    pub duration_s: f64,
}

/// One request's measurements.
#[derive(Debug, Default, Clone)]
struct Sample {
    ttft_ms: f64,
    itl_ms: Vec<f64>,
    tokens: u64,
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

/// A prompt of `words` words that begins with `tag`, so no two requests
/// share a cached prefix.
fn prompt(tag: &str, words: usize) -> String {
    const WORDS: [&str; 8] = [
        "river", "stone", "lamp", "garden", "window", "cloud", "bread", "music",
    ];
    let mut p = format!("{tag}:");
    for i in 0..words {
        p.push(' ');
        p.push_str(WORDS[(i * 7 + tag.len() * 3 + i / 8) % WORDS.len()]);
    }
    p
}

/// One streamed completion, timed.
async fn one(
    http: &reqwest::Client,
    args: &LoadArgs,
    t: &TenantLoad,
    tag: &str,
) -> anyhow::Result<Sample> {
    let body = json!({
        "model": args.model,
        "prompt": prompt(tag, t.prompt_words),
        "max_tokens": t.max_tokens,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let start = Instant::now();
    let mut resp = http
        .post(format!(
            "{}/v1/completions",
            args.server.trim_end_matches('/')
        ))
        .bearer_auth(&t.key)
        .json(&body)
        .send()
        .await?;
    if !resp.status().is_success() {
        bail!(
            "status {}: {}",
            resp.status(),
            resp.text().await.unwrap_or_default()
        );
    }
    let (mut sample, mut last, mut buf) = (Sample::default(), None::<Instant>, Vec::new());
    while let Some(chunk) = resp.chunk().await? {
        buf.extend_from_slice(&chunk);
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&event);
            let Some(data) = text.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                return Ok(sample);
            }
            let v: Value = serde_json::from_str(data).context("an SSE chunk that is not JSON")?;
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                sample.tokens = n;
            }
            if v["choices"][0]["text"]
                .as_str()
                .is_some_and(|s| !s.is_empty())
            {
                let now = Instant::now();
                match last {
                    None => sample.ttft_ms = (now - start).as_secs_f64() * 1e3,
                    Some(l) => sample.itl_ms.push((now - l).as_secs_f64() * 1e3),
                }
                last = Some(now);
            }
        }
    }
    bail!("the stream ended without [DONE]")
}

/// Runs the load and reports per tenant, in the order given.
pub async fn run(args: LoadArgs) -> anyhow::Result<Vec<TenantReport>> {
    let http = reqwest::Client::builder().build()?;
    let args = std::sync::Arc::new(args);
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(args.duration_s);
    let mut tasks = Vec::new();
    for (ti, t) in args.tenants.iter().enumerate() {
        for c in 0..t.clients {
            let (http, args, t) = (http.clone(), args.clone(), t.clone());
            tasks.push(tokio::spawn(async move {
                let mut got = (Vec::new(), 0usize);
                let mut n = 0;
                while Instant::now() < deadline {
                    n += 1;
                    match one(&http, &args, &t, &format!("{ti}-{c}-{n}")).await {
                        Ok(s) => got.0.push(s),
                        Err(e) => {
                            tracing::warn!(tenant = %t.name, "request failed: {e:#}");
                            got.1 += 1;
                        }
                    }
                }
                (ti, got)
            }));
        }
    }
    let mut per: Vec<(Vec<Sample>, usize)> = vec![(Vec::new(), 0); args.tenants.len()];
    for task in tasks {
        let (ti, (samples, errors)) = task.await?;
        per[ti].0.extend(samples);
        per[ti].1 += errors;
    }
    let secs = start.elapsed().as_secs_f64();
    Ok(args
        .tenants
        .iter()
        .zip(per)
        .map(|(t, (samples, errors))| {
            let mut ttft: Vec<f64> = samples.iter().map(|s| s.ttft_ms).collect();
            let mut itl: Vec<f64> = samples.iter().flat_map(|s| s.itl_ms.clone()).collect();
            ttft.sort_by(f64::total_cmp);
            itl.sort_by(f64::total_cmp);
            TenantReport {
                name: t.name.clone(),
                requests: samples.len(),
                errors,
                output_tok_s: samples.iter().map(|s| s.tokens).sum::<u64>() as f64 / secs,
                ttft_ms: [quantile(&ttft, 0.5), quantile(&ttft, 0.95)],
                itl_ms: [quantile(&itl, 0.5), quantile(&itl, 0.95)],
            }
        })
        .collect())
}

/// The report as a table.
pub fn table(reports: &[TenantReport]) -> String {
    let mut out = format!(
        "{:>12} {:>8} {:>6} {:>11} {:>9} {:>9} {:>8} {:>8}\n",
        "tenant", "requests", "errors", "output t/s", "TTFT p50", "TTFT p95", "ITL p50", "ITL p95"
    );
    for r in reports {
        out += &format!(
            "{:>12} {:>8} {:>6} {:>11.1} {:>9.1} {:>9.1} {:>8.2} {:>8.2}\n",
            r.name,
            r.requests,
            r.errors,
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
    fn tenant_loads_parse_with_defaults_and_reject_what_they_cannot_use() {
        let t: TenantLoad = "a=sk-1,clients=200,prompt=1024,max=256".parse().unwrap();
        assert_eq!(
            (
                t.name.as_str(),
                t.key.as_str(),
                t.clients,
                t.prompt_words,
                t.max_tokens
            ),
            ("a", "sk-1", 200, 1024, 256)
        );
        let d: TenantLoad = "b=sk-2".parse().unwrap();
        assert_eq!((d.clients, d.prompt_words, d.max_tokens), (1, 512, 64));
        for bad in ["a", "a=k,clients=x", "a=k,speed=3", "=k", "a=k,clients=0"] {
            assert!(bad.parse::<TenantLoad>().is_err(), "{bad}");
        }
    }

    #[test]
    fn prompts_have_their_words_and_differ_by_tag() {
        let p = prompt("0-1-1", 100);
        assert_eq!(p.split(' ').count(), 101);
        assert_ne!(p, prompt("0-1-2", 100));
        assert_eq!(quantile(&[1.0, 2.0, 3.0, 4.0, 5.0], 0.5), 3.0);
        assert_eq!(quantile(&[], 0.95), 0.0);
    }
}
