//! `kiln loadgen` against a real server with the default model: two
//! tenants' streams, one closed loop and one at a request rate, each
//! measured apart.

use kiln_host::loadgen::{self, LoadArgs};
use kiln_host::model::DEFAULT_MODEL;
use kiln_tests::TestServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loadgen_reports_each_tenants_tokens_and_latencies() {
    let s = TestServer::start_with_models().await;
    let a = s.tenant("a").await;
    let b = s.tenant("b").await;
    let args = LoadArgs {
        server: s.url.clone(),
        model: DEFAULT_MODEL.into(),
        tenants: vec![
            format!("a={a},clients=2,prompt=40,max=4-8")
                .parse()
                .unwrap(),
            // Open loop: Poisson arrivals, 10 a second (about 20 in the run).
            format!("b={b},rate=10,prompt=20,max=4").parse().unwrap(),
            "c=not-a-key,max=2".parse().unwrap(),
        ],
        duration_s: 2.0,
        warmup_s: 0.0,
        prompt_run: None,
    };
    let reports = loadgen::run(args).await.unwrap();
    let names: Vec<_> = reports.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["a", "b", "c"]);
    assert!(reports[1].requests >= 5, "{:?}", reports[1]);
    for r in &reports[..2] {
        assert!(r.requests >= 1 && r.errors == 0, "{r:?}");
        assert!(r.output_tok_s > 0.0, "{r:?}");
        assert!(r.ttft_ms[0] > 0.0 && r.ttft_ms[1] >= r.ttft_ms[0], "{r:?}");
        assert!(r.itl_ms[1] >= r.itl_ms[0], "{r:?}");
    }
    // Prompts are sized in the server's tokens (40 and 20 asked for).
    let sized = |r: &loadgen::TenantReport, want: f64| (r.prompt_tokens_mean - want).abs() <= 2.0;
    assert!(
        sized(&reports[0], 40.0) && sized(&reports[1], 20.0),
        "{reports:?}"
    );
    // A bad key fails every request, and says so.
    assert!(
        reports[2].requests == 0 && reports[2].errors >= 1,
        "{:?}",
        reports[2]
    );
    let table = loadgen::table(&reports);
    assert_eq!(table.lines().count(), 4, "{table}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loadgen_sessions_keep_their_requests_on_their_pool() {
    let s = TestServer::start_with_pools(2, |_| {}).await;
    let a = s.tenant("a").await;
    // Eight clients at once in one session: with no session key the router
    // would spread their first requests, sent together, over both pools by
    // load.
    let args = LoadArgs {
        server: s.url.clone(),
        model: DEFAULT_MODEL.into(),
        tenants: vec![
            format!("a={a},clients=8,prompt=20,max=2,sessions=1")
                .parse()
                .unwrap(),
        ],
        duration_s: 2.0,
        warmup_s: 0.0,
        prompt_run: None,
    };
    let reports = loadgen::run(args).await.unwrap();
    let r = &reports[0];
    // Every client's first request is sent before the end, and counts.
    assert!(r.requests >= 8 && r.errors == 0, "{r:?}");
    let routed = ["0", "1"].map(|p| format!("pool=\"{p}\""));
    let zero = s.metric(&["kiln_pool_requests_total{", &routed[0]]).await;
    let one = s.metric(&["kiln_pool_requests_total{", &routed[1]]).await;
    let (home, other) = (zero.max(one), zero.min(one));
    // The other pool saw at most the two calls that size prompts, which
    // carry no session.
    assert!(
        home >= r.requests as f64 && other <= 2.0,
        "pools {zero} / {one}"
    );
    assert_eq!(s.metric(&["kiln_pool_spills_total"]).await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_share_no_cached_prompt_unless_one_names_anothers_prompts() {
    let s = TestServer::start_with_models().await;
    let a = s.tenant("a").await;
    let load = |prompt_run: Option<&str>| LoadArgs {
        server: s.url.clone(),
        model: DEFAULT_MODEL.into(),
        // Arrivals at a rate (the same times and ids, run after run) keep
        // the requests few enough that none evicts an earlier one's pages.
        tenants: vec![
            format!("a={a},rate=8,clients=4,prompt=64,max=2")
                .parse()
                .unwrap(),
        ],
        duration_s: 1.0,
        warmup_s: 0.0,
        prompt_run: prompt_run.map(str::to_owned),
    };
    let hits = || s.metric(&["kiln_prefix_cache_tokens_total{", "result=\"hit\""]);
    // Run by run: the prompt tokens served from the cache, and requests.
    let mut seen = Vec::new();
    for run in [None, None, Some("again"), Some("again")] {
        let before = hits().await;
        let r = loadgen::run(load(run)).await.unwrap();
        assert!(r[0].requests >= 1 && r[0].errors == 0, "{:?}", r[0]);
        seen.push((hits().await - before, r[0].requests as f64));
    }
    // The probe's hits alone (its long prompt on its short one: 64 words,
    // about a token each on this model), run after run, a named run's
    // first too.
    for (hit, _) in &seen[..3] {
        assert!(*hit <= 80.0, "a run sends prompts of its own: {seen:?}");
    }
    // The repeat's requests each hit at least three full pages (48 of 64
    // tokens) of the prompt the earlier run sent under the same id.
    let again = 48.0 * seen[2].1.min(seen[3].1);
    assert!(seen[3].0 >= again, "{seen:?}");
}
