//! The status page, opened in headless Chromium (Debian's package, which
//! `scripts/chromium.sh` installs): every figure it shows equals the
//! `/metrics` sample it names, its plots are drawn, and a screenshot is
//! saved to `target/screenshots/status-page.png`.

use std::collections::HashMap;
use std::time::Duration;

use kiln_tests::{TestServer, installed_by, workspace};

/// Chromium, headless, on `url` with `extra` (what to produce); stdout.
fn headless(url: &str, extra: &[&str]) -> String {
    let profile = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(installed_by("chromium.sh"))
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--window-size=1400,1500",
            // Lets the page's fetch and first draw finish before the dump.
            "--virtual-time-budget=5000",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(extra)
        .arg(url)
        .output()
        .expect("running chromium");
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The `(data-series, text)` pairs of the page's figures.
fn figures(dom: &str) -> Vec<(String, String)> {
    let unescape = |s: &str| {
        s.replace("&quot;", "\"")
            .replace("&lt;", "<")
            .replace("&gt;", ">")
            .replace("&amp;", "&")
    };
    dom.split("data-series=\"")
        .skip(1)
        .filter_map(|part| {
            let (key, rest) = part.split_once('"')?;
            let text = rest.split_once('>')?.1.split('<').next()?;
            Some((unescape(key), unescape(text)))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_page_shows_the_metrics_figures_and_plots_them() {
    let s =
        TestServer::start_with_pools(1, |c| c.status_interval = Duration::from_millis(250)).await;
    for tenant in ["acme", "beta"] {
        let key = s.tenant(tenant).await;
        for _ in 0..2 {
            let body = serde_json::json!({
                "model": "smollm2-135m-instruct",
                "messages": [{"role": "user", "content": "Name three colours of the sea."}],
                "max_tokens": 8,
            });
            let (status, v) = s.openai(&key, "/v1/chat/completions", None, &body).await;
            assert_eq!(status, 200, "{v}");
        }
    }
    tokio::time::sleep(Duration::from_secs(1)).await;

    let url = format!("{}/status#token={}", s.url, s.admin);
    let u = url.clone();
    let dom = tokio::task::spawn_blocking(move || headless(&u, &["--dump-dom"]))
        .await
        .unwrap();
    let metrics: HashMap<String, f64> = kiln_host::status::parse(
        &s.http
            .get(format!("{}/metrics", s.url))
            .bearer_auth(&s.admin)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap(),
    )
    .into_iter()
    .map(|x| (x.key, x.value))
    .collect();

    assert!(
        dom.contains("data-loaded=\"true\""),
        "the page never loaded:\n{dom}"
    );
    let shown = figures(&dom);
    for (key, text) in &shown {
        let on_page: f64 = text.parse().unwrap_or_else(|_| panic!("{key}: {text:?}"));
        assert_eq!(Some(&on_page), metrics.get(key), "{key}");
    }
    let names: Vec<&str> = shown.iter().map(|(k, _)| k.as_str()).collect();
    for state in ["in_use", "cached", "free"] {
        let found = names
            .iter()
            .any(|k| k.starts_with("kiln_kv_pages{") && k.contains(&format!("state=\"{state}\"")));
        assert!(found, "no KV pages {state} in {names:?}");
    }
    // Each pool's preemptions, at 0 until one happens.
    assert!(
        names
            .iter()
            .any(|k| k.starts_with("kiln_engine_preemptions_total{")),
        "no preemptions in {names:?}"
    );
    for tenant in ["acme", "beta"] {
        for kind in ["prompt", "completion"] {
            let found = names.iter().any(|k| {
                k.starts_with("kiln_model_tokens_total{")
                    && k.contains(&format!("tenant=\"{tenant}\""))
                    && k.contains(&format!("kind=\"{kind}\""))
            });
            assert!(found, "no {kind} tokens of {tenant} in {names:?}");
        }
        let ttft = format!("kiln_model_first_token_seconds_count{{tenant=\"{tenant}\"");
        assert!(names.iter().any(|k| k.starts_with(&ttft)), "{names:?}");
    }
    assert!(
        names.iter().any(|k| k.contains("result=\"hit\"")),
        "{names:?}"
    );
    let drawn = dom.matches("class=\"uplot").count();
    assert_eq!(drawn, 5, "plots drawn: {drawn}");

    let shot = workspace().join("target").join("screenshots");
    std::fs::create_dir_all(&shot).unwrap();
    let shot = shot.join("status-page.png");
    let _ = std::fs::remove_file(&shot);
    let arg = format!("--screenshot={}", shot.display());
    tokio::task::spawn_blocking(move || headless(&url, &[&arg]))
        .await
        .unwrap();
    let png = std::fs::read(&shot).expect("a screenshot");
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 20_000,
        "{} bytes",
        png.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_data_needs_the_admin_or_metrics_token() {
    let s = TestServer::start().await;
    let page = s
        .http
        .get(format!("{}/status", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 200);
    assert!(page.text().await.unwrap().contains("uPlot"));
    let anon = s
        .http
        .get(format!("{}/v1/status", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(anon.status(), 401);
    let key = s.tenant("acme").await;
    let tenant = s
        .http
        .get(format!("{}/v1/status", s.url))
        .bearer_auth(&key)
        .send()
        .await
        .unwrap();
    assert_eq!(tenant.status(), 401);
    let v = s.get_json(&s.admin, "/v1/status").await;
    assert!(v["series"].as_array().is_some_and(|a| !a.is_empty()), "{v}");
    assert!(v["history"]["t"].is_array(), "{v}");
}
