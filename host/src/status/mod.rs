//! The operator's status page (`GET /status`) and its data
//! (`GET /v1/status`, admin or metrics token): Kiln's own metrics now, and
//! a history of them over the last minutes, sampled in the background.
//!
//! Every figure comes from the Prometheus exposition `/metrics` serves
//! ([`crate::metrics::Metrics::encode`]), parsed back ([`parse`]), so the
//! page and `/metrics` cannot disagree about what a number means.

mod history;
mod parse;

pub use history::{History, Sample};
pub use parse::{Series, parse};

/// The page: HTML with uPlot (MIT, vendored) and its own script inlined,
/// so it needs nothing from outside the server.
pub const PAGE: &str = concat!(
    include_str!("page_head.html"),
    "<style>",
    include_str!("vendor/uPlot.min.css"),
    "</style><script>",
    include_str!("vendor/uPlot.iife.min.js"),
    "</script><script>",
    include_str!("page.js"),
    "</script>",
    include_str!("page_body.html"),
);

/// The JSON `/v1/status` answers: `series`, every sample now (histogram
/// buckets left out), and `history`, the derived figures over time.
pub fn snapshot(metrics_text: &str, history: &History) -> serde_json::Value {
    let now: Vec<Series> = parse(metrics_text)
        .into_iter()
        .filter(|s| !s.name.ends_with("_bucket"))
        .collect();
    serde_json::json!({
        "interval_s": history.interval().as_secs_f64(),
        "series": now,
        "history": history.to_json(),
    })
}
