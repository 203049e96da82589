//! `kiln loadgen`: drives a running server's OpenAI API (streamed
//! completions) with several tenants at once, each with its own clients
//! (closed loop) or request rate (Poisson arrivals), and prompt and output
//! lengths (fixed or uniform over a range), and reports per tenant the
//! output tokens/s, time to first token and inter-token latency.

use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

mod report;

use report::{Sample, report};
pub use report::{TenantReport, table};

/// A length drawn uniformly from `min..=max` for each request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lengths {
    /// The shortest.
    pub min: usize,
    /// The longest.
    pub max: usize,
}

impl Lengths {
    /// Always `n`.
    pub fn fixed(n: usize) -> Self {
        Self { min: n, max: n }
    }

    /// One request's length.
    fn draw(&self, rng: &mut StdRng) -> usize {
        rng.random_range(self.min..=self.max)
    }
}

impl FromStr for Lengths {
    type Err = String;

    /// `N` or `MIN-MAX`.
    fn from_str(s: &str) -> Result<Self, String> {
        let count = |v: &str| {
            v.parse::<usize>()
                .map_err(|_| format!("{v} is not a count (N or MIN-MAX)"))
        };
        let l = match s.split_once('-') {
            Some((a, b)) => Self {
                min: count(a)?,
                max: count(b)?,
            },
            None => Self::fixed(count(s)?),
        };
        if l.min > l.max {
            return Err(format!("{s}: the range runs backwards"));
        }
        Ok(l)
    }
}

/// One tenant's share of the load.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantLoad {
    /// The tenant's name (for the report).
    pub name: String,
    /// Its API key.
    pub key: String,
    /// Without a rate: clients sending one request after another. With
    /// one: the most requests in flight at once (an arrival past it waits).
    pub clients: usize,
    /// Requests per second, arriving as a Poisson process (none: closed
    /// loop).
    pub rate: Option<f64>,
    /// Tokens in each prompt (as the server's tokenizer counts them).
    pub prompt_tokens: Lengths,
    /// `max_tokens` of each request.
    pub max_tokens: Lengths,
    /// Session keys its requests carry in `x-session-affinity`, round
    /// robin by client (closed loop) or arrival (none: no header).
    pub sessions: usize,
}

/// What a tenant's load looks like on the command line.
const FORM: &str =
    "NAME=KEY[,clients=N][,rate=PER_S][,prompt=TOKENS|MIN-MAX][,max=TOKENS|MIN-MAX][,sessions=N]";

/// Requests in flight at once for a rate without `clients`.
const RATE_CLIENTS: usize = 1024;

impl FromStr for TenantLoad {
    type Err = String;

    /// [`FORM`].
    fn from_str(s: &str) -> Result<Self, String> {
        let mut parts = s.split(',');
        let head = parts.next().unwrap_or_default();
        let Some((name, key)) = head.split_once('=') else {
            return Err(format!("`{s}`: expected {FORM}"));
        };
        let mut load = TenantLoad {
            name: name.into(),
            key: key.into(),
            clients: 0,
            rate: None,
            prompt_tokens: Lengths::fixed(512),
            max_tokens: Lengths::fixed(64),
            sessions: 0,
        };
        for part in parts {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| format!("`{part}`: expected KEY=VALUE"))?;
            let bad = |e: String| format!("`{part}`: {e}");
            match k {
                "clients" => {
                    load.clients = v.parse().map_err(|_| bad(format!("{v} is not a count")))?
                }
                "rate" => {
                    let r: f64 = v
                        .parse()
                        .map_err(|_| bad(format!("{v} is not requests per second")))?;
                    if !(r > 0.0 && r.is_finite()) {
                        return Err(bad("the rate must be above 0".into()));
                    }
                    load.rate = Some(r);
                }
                "prompt" => load.prompt_tokens = v.parse().map_err(bad)?,
                "max" => load.max_tokens = v.parse().map_err(bad)?,
                "sessions" => {
                    load.sessions = (v.parse().ok())
                        .filter(|n| *n > 0)
                        .ok_or_else(|| bad(format!("{v} is not a count of at least 1")))?
                }
                _ => return Err(format!("`{k}`: use clients, rate, prompt, max or sessions")),
            }
        }
        if load.clients == 0 && part_given(s, "clients") {
            return Err(format!("`{s}`: clients must be at least 1"));
        }
        if load.clients == 0 {
            load.clients = if load.rate.is_some() { RATE_CLIENTS } else { 1 };
        }
        if load.name.is_empty() || load.key.is_empty() || load.max_tokens.min == 0 {
            return Err(format!("`{s}`: name, key and max must be non-empty"));
        }
        Ok(load)
    }
}

/// Whether `s` sets `key`.
fn part_given(s: &str, key: &str) -> bool {
    s.split(',')
        .skip(1)
        .any(|p| p.split_once('=').is_some_and(|(k, _)| k == key))
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
    /// `NAME=KEY[,clients=N][,rate=PER_S][,prompt=TOKENS|MIN-MAX][,max=TOKENS|MIN-MAX]`
    /// (1 client, 512 prompt tokens, 64 generated by default; with a rate,
    /// Poisson arrivals with at most `clients` in flight, 1024 unless
    /// given; a range draws each request's length uniformly).
    #[arg(long = "tenant", required = true)]
    pub tenants: Vec<TenantLoad>,
    /// Seconds during which clients start requests (those running at the
    /// end finish and count).
    #[arg(long, default_value_t = 30.0)]
    pub duration_s: f64,
    /// Seconds at the start left out, so the report is of the steady state
    /// rather than the first burst (with N clients, the first N prompts
    /// all arrive at once): latencies are of the requests sent after it,
    /// output tok/s of the tokens that arrive after it.
    #[arg(long, default_value_t = 0.0)]
    pub warmup_s: f64,
    /// Begins every prompt's tag, so that no prompt of this run shares a
    /// cached prefix with an earlier run's on the same server; name an
    /// earlier run's to send its prompts again (default: one drawn from the
    /// clock).
    #[arg(long)]
    pub prompt_run: Option<String>,
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

/// Sends `body` to the server's completions endpoint as the tenant of `key`,
/// in `session` where given.
async fn completion(
    http: &reqwest::Client,
    args: &LoadArgs,
    (key, session): (&str, Option<&str>),
    body: &Value,
) -> reqwest::Result<reqwest::Response> {
    let url = format!("{}/v1/completions", args.server.trim_end_matches('/'));
    let mut req = http.post(url).bearer_auth(key).json(body);
    if let Some(session) = session {
        req = req.header("x-session-affinity", session);
    }
    req.send().await
}

/// One request: its tenant's key and session, prompt tag and words, and
/// `max_tokens`.
struct Request<'a> {
    key: &'a str,
    session: Option<String>,
    tag: String,
    words: usize,
    max_tokens: usize,
}

/// One streamed completion, timed.
async fn one(
    http: &reqwest::Client,
    args: &LoadArgs,
    run_start: Instant,
    r: Request<'_>,
) -> anyhow::Result<Sample> {
    let body = json!({
        "model": args.model,
        "prompt": prompt(&r.tag, r.words),
        "max_tokens": r.max_tokens,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let start = Instant::now();
    let mut resp = completion(http, args, (r.key, r.session.as_deref()), &body).await?;
    if !resp.status().is_success() {
        bail!(
            "status {}: {}",
            resp.status(),
            resp.text().await.unwrap_or_default()
        );
    }
    let (mut sample, mut last, mut buf) = (Sample::default(), None::<Instant>, Vec::new());
    sample.started_s = (start - run_start).as_secs_f64();
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
                sample.prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
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

/// How the model's tokenizer counts a prompt of `words` words: tokens per
/// word and a fixed part (the tag, special tokens), from the
/// `usage.prompt_tokens` of two calls (a byte-level tokenizer makes several
/// tokens of a word, a trained one about one).
async fn prompt_size(
    http: &reqwest::Client,
    args: &LoadArgs,
    run: &str,
) -> anyhow::Result<(f64, f64)> {
    let (short, long) = (64, 320);
    // A tag the length of a request's that no request has, so no request
    // hits the probe's pages.
    let tag = format!("{run}-p-0-0");
    for t in &args.tenants {
        let mut counts = Vec::new();
        for words in [short, long] {
            let body = json!({"model": args.model, "prompt": prompt(&tag, words), "max_tokens": 1});
            let resp = completion(http, args, (&t.key, None), &body).await?;
            let ok = resp.status().is_success();
            let v: Value = resp
                .json()
                .await
                .context("the probe's answer is not JSON")?;
            match v["usage"]["prompt_tokens"].as_u64().filter(|_| ok) {
                Some(n) => counts.push(n as f64),
                None => tracing::warn!(tenant = %t.name, "the probe call failed: {v}"),
            }
        }
        if let [a, b] = counts[..] {
            let per_word = (b - a) / (long - short) as f64;
            return Ok((per_word, a - per_word * short as f64));
        }
    }
    bail!("no tenant's key could make the probe calls that size prompts")
}

/// What one tenant's requests got: samples and failures.
type Got = (Vec<Sample>, usize);

/// Adds one request's outcome to `got`; false when it failed.
fn record(got: &mut Got, name: &str, result: anyhow::Result<Sample>) -> bool {
    match result {
        Ok(s) => {
            got.0.push(s);
            true
        }
        Err(e) => {
            tracing::warn!(tenant = %name, "request failed: {e:#}");
            got.1 += 1;
            false
        }
    }
}

/// The shared parts of a run: the HTTP client, the settings, how words
/// become tokens, and when requests stop starting.
struct Run {
    http: reqwest::Client,
    args: LoadArgs,
    /// What begins every prompt's tag.
    tag: String,
    per_word: f64,
    fixed: f64,
    start: Instant,
    deadline: Instant,
}

impl Run {
    /// Request `n` of tenant `ti`'s source `c`, its lengths drawn, in
    /// session `turn` of the tenant's sessions.
    fn request<'a>(
        &self,
        t: &'a TenantLoad,
        (id, turn): ((usize, usize, usize), usize),
        rng: &mut StdRng,
    ) -> Request<'a> {
        let tokens = t.prompt_tokens.draw(rng);
        Request {
            key: &t.key,
            session: (t.sessions > 0).then(|| format!("{}-{}", t.name, turn % t.sessions)),
            tag: format!("{}-{}-{}-{}", self.tag, id.0, id.1, id.2),
            words: ((tokens as f64 - self.fixed) / self.per_word)
                .round()
                .max(1.0) as usize,
            max_tokens: t.max_tokens.draw(rng),
        }
    }

    /// One closed-loop client: a request, then the next, until the end.
    async fn client(self: Arc<Self>, ti: usize, c: usize) -> Got {
        let t = &self.args.tenants[ti];
        let mut rng = StdRng::seed_from_u64((ti * 1_000_003 + c) as u64);
        let mut got = (Vec::new(), 0);
        let mut n = 0;
        while Instant::now() < self.deadline {
            n += 1;
            // A client stays in one session, as a user's turns do.
            let r = self.request(t, ((ti, c, n), c), &mut rng);
            if !record(
                &mut got,
                &t.name,
                one(&self.http, &self.args, self.start, r).await,
            ) {
                // A failing client does not spin.
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        got
    }

    /// Poisson arrivals at `rate` per second until the end, at most the
    /// tenant's `clients` in flight.
    async fn arrivals(self: Arc<Self>, ti: usize, rate: f64) -> anyhow::Result<Got> {
        let t = &self.args.tenants[ti];
        let slots = Arc::new(tokio::sync::Semaphore::new(t.clients));
        let mut rng = StdRng::seed_from_u64(ti as u64 * 7919 + 1);
        let (mut next, mut n, mut flying) = (Instant::now(), 0, Vec::new());
        loop {
            // Exponential gaps: 1 - u is in (0, 1], so its log is finite.
            next += Duration::from_secs_f64(-(1.0 - rng.random::<f64>()).ln() / rate);
            if next >= self.deadline {
                break;
            }
            tokio::time::sleep_until(next.into()).await;
            let slot = slots.clone().acquire_owned().await?;
            n += 1;
            let run = self.clone();
            let id = (ti, 0, n);
            let draw = StdRng::seed_from_u64(rng.random());
            flying.push(tokio::spawn(async move {
                let mut draw = draw;
                let t = &run.args.tenants[ti];
                let result = one(
                    &run.http,
                    &run.args,
                    run.start,
                    run.request(t, (id, n), &mut draw),
                )
                .await;
                drop(slot);
                result
            }));
        }
        let mut got = (Vec::new(), 0);
        for f in flying {
            record(&mut got, &t.name, f.await?);
        }
        Ok(got)
    }
}

/// A prompt run's tag drawn from the clock: a run that does not name one
/// sends prompts no earlier run sent.
pub fn fresh_prompt_run() -> String {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    format!("{:08x}", now.unwrap_or_default().as_micros() as u32)
}

/// Runs the load and reports per tenant, in the order given.
pub async fn run(args: LoadArgs) -> anyhow::Result<Vec<TenantReport>> {
    anyhow::ensure!(
        (0.0..args.duration_s).contains(&args.warmup_s),
        "--warmup-s {} leaves nothing to count: it must be at least 0 and below --duration-s {}",
        args.warmup_s,
        args.duration_s
    );
    let http = reqwest::Client::builder().build()?;
    let tag = args.prompt_run.clone().unwrap_or_else(fresh_prompt_run);
    let (per_word, fixed) = prompt_size(&http, &args, &tag).await?;
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(args.duration_s);
    let run = Arc::new(Run {
        http,
        args,
        tag,
        per_word,
        fixed,
        start,
        deadline,
    });
    let mut tasks = Vec::new();
    for (ti, t) in run.args.tenants.iter().enumerate() {
        match t.rate {
            Some(rate) => {
                let arrivals = tokio::spawn(run.clone().arrivals(ti, rate));
                tasks.push((ti, tokio::spawn(async move { arrivals.await? })));
            }
            None => {
                for c in 0..t.clients {
                    let client = run.clone().client(ti, c);
                    tasks.push((ti, tokio::spawn(async move { Ok(client.await) })));
                }
            }
        }
    }
    let mut per: Vec<Got> = vec![(Vec::new(), 0); run.args.tenants.len()];
    for (ti, task) in tasks {
        let (samples, errors) = task.await??;
        per[ti].0.extend(samples);
        per[ti].1 += errors;
    }
    let secs = start.elapsed().as_secs_f64();
    let warmup_s = run.args.warmup_s;
    Ok(run
        .args
        .tenants
        .iter()
        .zip(per)
        .map(|(t, (samples, errors))| report(&t.name, samples, errors, secs, warmup_s))
        .collect())
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
                t.rate,
                t.prompt_tokens,
                t.max_tokens
            ),
            (
                "a",
                "sk-1",
                200,
                None,
                Lengths::fixed(1024),
                Lengths::fixed(256)
            )
        );
        let d: TenantLoad = "b=sk-2".parse().unwrap();
        assert_eq!(
            (d.clients, d.prompt_tokens, d.max_tokens),
            (1, Lengths::fixed(512), Lengths::fixed(64))
        );
        let r: TenantLoad = "c=k,rate=2.5,prompt=100-300,max=8-64".parse().unwrap();
        assert_eq!((r.rate, r.clients), (Some(2.5), RATE_CLIENTS));
        assert_eq!(r.prompt_tokens, Lengths { min: 100, max: 300 });
        assert_eq!(r.max_tokens, Lengths { min: 8, max: 64 });
        let capped: TenantLoad = "c=k,rate=1,clients=4".parse().unwrap();
        assert_eq!((capped.clients, capped.sessions), (4, 0));
        let s: TenantLoad = "s=k,clients=8,sessions=3".parse().unwrap();
        assert_eq!(s.sessions, 3);
        for bad in [
            "a=k,sessions=0",
            "a=k,sessions=x",
            "a",
            "a=k,clients=x",
            "a=k,speed=3",
            "=k",
            "a=k,clients=0",
            "a=k,rate=0",
            "a=k,rate=-1",
            "a=k,prompt=300-100",
            "a=k,max=0",
            "a=k,max=x-4",
        ] {
            assert!(bad.parse::<TenantLoad>().is_err(), "{bad}");
        }
    }

    #[test]
    fn drawn_lengths_cover_their_range_and_stay_in_it() {
        let l: Lengths = "10-13".parse().unwrap();
        let mut rng = StdRng::seed_from_u64(1);
        let seen: std::collections::BTreeSet<usize> = (0..200).map(|_| l.draw(&mut rng)).collect();
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), [10, 11, 12, 13]);
        assert_eq!(Lengths::fixed(7).draw(&mut rng), 7);
    }

    #[test]
    fn prompts_have_their_words_and_differ_by_tag() {
        let p = prompt("0-1-1", 100);
        assert_eq!(p.split(' ').count(), 101);
        assert_ne!(p, prompt("0-1-2", 100));
    }
}
