//! The load figures of the Kubernetes Gateway API Inference Extension's
//! model-server protocol, under vLLM's names, so its endpoint picker can
//! route to the Kiln node with the shortest queue and the most free KV.
//! They name models, never tenants, so they may be served without a token.

use std::fmt::Write;

use kiln_runtime::ModelLoad;

/// A gauge family: its name, help, and its value for a model.
type Family = (&'static str, &'static str, fn(&ModelLoad) -> f64);

/// The exposition of `loads`: per model, `vllm:num_requests_waiting`,
/// `vllm:num_requests_running`, `vllm:kv_cache_usage_perc` (a 0-1
/// fraction, as vLLM's; also under its older name
/// `vllm:gpu_cache_usage_perc`) and `vllm:cache_config_info` (value 1, its
/// labels the page size and count). The picker reads the first series of
/// each name, so a node serving one model is the clear case.
pub fn render(loads: &[ModelLoad]) -> String {
    let mut out = String::new();
    let families: [Family; 4] = [
        (
            "vllm:num_requests_waiting",
            "Requests waiting to run",
            |l| l.waiting as f64,
        ),
        ("vllm:num_requests_running", "Requests in the batch", |l| {
            l.running as f64
        }),
        (
            "vllm:kv_cache_usage_perc",
            "Fraction of KV pages in use (1 = full)",
            |l| usage(l),
        ),
        // The name endpoint pickers up to v1.0 of the extension read.
        (
            "vllm:gpu_cache_usage_perc",
            "Fraction of KV pages in use (1 = full); the older name",
            |l| usage(l),
        ),
    ];
    for (name, help, value) in families {
        let _ = writeln!(out, "# HELP {name} {help}.\n# TYPE {name} gauge");
        for l in loads {
            let _ = writeln!(out, "{name}{{model_name=\"{}\"}} {}", l.model, value(l));
        }
    }
    let name = "vllm:cache_config_info";
    let _ = writeln!(out, "# HELP {name} KV cache layout.\n# TYPE {name} gauge");
    for l in loads {
        let _ = writeln!(
            out,
            "{name}{{model_name=\"{}\",block_size=\"{}\",num_gpu_blocks=\"{}\"}} 1",
            l.model, l.page_tokens, l.kv_pages
        );
    }
    out
}

fn usage(l: &ModelLoad) -> f64 {
    if l.kv_pages == 0 {
        return 0.0;
    }
    l.kv_pages.saturating_sub(l.kv_pages_free) as f64 / l.kv_pages as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_model_gets_vllms_four_figures() {
        let load = ModelLoad {
            model: "m".into(),
            running: 3,
            waiting: 2,
            kv_pages: 200,
            kv_pages_free: 150,
            page_tokens: 16,
        };
        let text = render(&[load]);
        let series = crate::status::parse(&text);
        let value = |key: &str| series.iter().find(|s| s.key == key).map(|s| s.value);
        assert_eq!(
            value("vllm:num_requests_waiting{model_name=\"m\"}"),
            Some(2.0)
        );
        assert_eq!(
            value("vllm:num_requests_running{model_name=\"m\"}"),
            Some(3.0)
        );
        assert_eq!(
            value("vllm:kv_cache_usage_perc{model_name=\"m\"}"),
            Some(0.25)
        );
        let info = series
            .iter()
            .find(|s| s.name == "vllm:cache_config_info")
            .unwrap();
        assert_eq!(info.labels["block_size"], "16");
        assert_eq!(info.labels["num_gpu_blocks"], "200");
        assert!(text.contains("# TYPE vllm:kv_cache_usage_perc gauge"));
    }
}
