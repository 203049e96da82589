//! `kiln bench`: the engine's throughput and latency at several
//! concurrencies, KV formats and modes, side by side in one run; a bar
//! says which row runs, and `--plot` draws the rows.

use crate::engine_args::{EngineArgs, KvArg, kv_format};

/// `kiln bench`.
#[derive(clap::Args)]
pub struct BenchArgs {
    /// Model, as for `kiln run`.
    #[arg(long, default_value = kiln_host::model::DEFAULT_MODEL)]
    model: String,
    /// Concurrencies to measure, comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 4, 16])]
    concurrency: Vec<usize>,
    /// Prompt tokens per sequence.
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Tokens generated per sequence.
    #[arg(long, default_value_t = 64)]
    gen_tokens: usize,
    /// Instead: time to first token of a --prompt-tokens prompt, cold and
    /// with its prefix cached, this many times each.
    #[arg(long, value_name = "REPS")]
    ttft: Option<usize>,
    /// KV page formats to compare at the same --kv-memory, comma separated
    /// [default: --kv].
    #[arg(long, value_enum, value_delimiter = ',')]
    kv_formats: Vec<KvArg>,
    /// Run the page-tag check on every other decode step and report the
    /// median step with it and without it.
    #[arg(long)]
    integrity_ab: bool,
    /// Run every row without CUDA graphs and then with them.
    #[arg(long)]
    compare_graphs: bool,
    /// Run every row as free text and then under an output format (JSON
    /// that never ends: every token drawn through its mask), side by side.
    #[arg(long)]
    compare_constrained: bool,
    /// Write each row's steps (sequences, tokens, ms, device ms,
    /// preemptions) to DIR/steps-FORMAT[_g]-CONCURRENCY.csv (_g: CUDA
    /// graphs on; `_json`: constrained), names of plain characters that
    /// any copy tool passes.
    #[arg(long, value_name = "DIR")]
    trace: Option<std::path::PathBuf>,
    /// Also draw output tokens/s and ITL p50 against concurrency, a line
    /// per KV format and mode, into this PNG.
    #[arg(long, value_name = "FILE.png")]
    plot: Option<std::path::PathBuf>,
    #[command(flatten)]
    engine: EngineArgs,
}

/// Runs `kiln bench`.
pub fn bench(args: BenchArgs) -> anyhow::Result<()> {
    use kiln_host::model;
    let config = args.engine.config()?;
    let source = model::resolve_model(&args.model, &model::default_cache_dir())?;
    let weights = args.engine.weights;
    let mut loaded = std::sync::Arc::new(model::load_as(&args.model, &source, weights)?);
    if let Some(reps) = args.ttft {
        let (row, _) = kiln_host::bench::ttft(loaded, config, args.prompt_tokens, reps)
            .map_err(anyhow::Error::msg)?;
        println!(
            "model {} | kv {:?} | prompt {} | reps {reps} | threads {}",
            args.model,
            kv_format(args.engine.kv),
            row.prompt_tokens,
            rayon::current_num_threads()
        );
        println!(
            "TTFT cold {:.1} ms | cached {:.1} ms ({} tokens hit) | {:.1}x",
            row.cold_ms,
            row.cached_ms,
            row.cached_tokens,
            row.cold_ms / row.cached_ms
        );
        for (i, (ms, steps)) in row.runs.iter().enumerate() {
            let kind = if i % 2 == 0 { "cold" } else { "cached" };
            let steps: Vec<String> = steps.iter().map(|s| format!("{s:.2}")).collect();
            println!("  {kind} {ms:.1} ms: steps {}", steps.join(" "));
        }
        return Ok(());
    }
    let formats = if args.kv_formats.is_empty() {
        vec![args.engine.kv]
    } else {
        args.kv_formats.clone()
    };
    let mut probe = config.clone();
    probe.kv_memory = 16 << 20;
    // A copy needs no tuned GEMMs (and read 7% slower just after tuning).
    probe.cuda_tune_bf16 = false;
    let (bw, back) = kiln_host::bench::copy_bandwidth(loaded, probe);
    loaded = back;
    println!(
        "model {} | kv memory {} MiB | prompt {} | generate {} | device {:?} | copy {} | threads {}",
        args.model,
        args.engine.kv_memory >> 20,
        args.prompt_tokens,
        args.gen_tokens,
        config.device,
        bw.map_or("-".into(), |b| format!("{b:.0} GB/s")),
        rayon::current_num_threads()
    );
    if matches!(config.device, kiln_kernels::Device::Cuda(_)) {
        // Discarded runs first: a process loads its kernels at their first
        // launch and cuBLAS picks its algorithms at a shape's first GEMM,
        // which would land on the first row alone. One sequence (a lone
        // prompt's steps), then as many as fill a step (up to the largest
        // row's), so full-step shapes are warm too.
        let largest = args.concurrency.iter().copied().max().unwrap_or(1);
        let fill = (config.scheduler.max_tokens_per_step / args.prompt_tokens.max(1))
            .clamp(1, largest.max(1));
        let mut warm = config.clone();
        warm.kv_format = kv_format(formats[0]);
        for concurrency in std::iter::once(1).chain((fill > 1).then_some(fill)) {
            let spec = kiln_host::bench::BenchSpec {
                concurrency,
                prompt_tokens: args.prompt_tokens,
                gen_tokens: 2,
                integrity_ab: false,
                constrained: false,
            };
            loaded = kiln_host::bench::run(loaded, warm.clone(), spec)
                .map_err(anyhow::Error::msg)?
                .1;
        }
    }
    println!("{}", kiln_host::bench::BenchRow::TABLE_HEADER);
    let rows =
        formats.len() * graph_modes_len(&args) * args.concurrency.len() * constrained_len(&args);
    let progress = rows_bar(rows);
    let mut lines: Vec<kiln_host::bench_plot::Line> = Vec::new();
    let graph_modes = if args.compare_graphs {
        vec![false, true]
    } else {
        vec![config.cuda_graphs]
    };
    let constrained_modes = if args.compare_constrained {
        vec![false, true]
    } else {
        vec![false]
    };
    for (format, graphs) in formats
        .iter()
        .flat_map(|f| graph_modes.iter().map(move |g| (*f, *g)))
    {
        for (c, constrained) in
            (args.concurrency.iter()).flat_map(|c| constrained_modes.iter().map(move |k| (*c, *k)))
        {
            let mut config = config.clone();
            config.kv_format = kv_format(format);
            config.cuda_graphs = graphs;
            progress.set_message(format!(
                "kv {:?}{}{} at {c} sequences",
                kv_format(format),
                if graphs { " graphs" } else { "" },
                if constrained { " json" } else { "" },
            ));
            let spec = kiln_host::bench::BenchSpec {
                concurrency: c,
                prompt_tokens: args.prompt_tokens,
                gen_tokens: args.gen_tokens,
                integrity_ab: args.integrity_ab,
                constrained,
            };
            let (row, back) =
                kiln_host::bench::run(loaded, config, spec).map_err(anyhow::Error::msg)?;
            loaded = back;
            let mode = match (graphs, constrained) {
                (false, false) => "",
                (true, false) => "+g",
                (false, true) => "+json",
                (true, true) => "+g+json",
            };
            let label = format!("{:?}{mode}", kv_format(format)).to_lowercase();
            if let Some(dir) = &args.trace {
                std::fs::create_dir_all(dir)?;
                let file = format!("steps-{}-{c}.csv", label.replace('+', "_"));
                row.write_trace(&dir.join(file))?;
            }
            progress.suspend(|| println!("{}", row.table_line(&label, bw)));
            progress.inc(1);
            let point = (c, row.output_tok_s, row.itl_p50_ms);
            match lines.iter_mut().find(|(l, _)| *l == label) {
                Some((_, points)) => points.push(point),
                None => lines.push((label, vec![point])),
            }
        }
    }
    progress.finish_and_clear();
    if let Some(path) = &args.plot {
        let title = format!(
            "kiln bench: {} | prompt {} | generate {} | {:?}",
            args.model, args.prompt_tokens, args.gen_tokens, config.device
        );
        kiln_host::bench_plot::plot(&lines, &title, path)?;
        println!("plot: {}", path.display());
    }
    Ok(())
}

fn graph_modes_len(args: &BenchArgs) -> usize {
    if args.compare_graphs { 2 } else { 1 }
}

fn constrained_len(args: &BenchArgs) -> usize {
    if args.compare_constrained { 2 } else { 1 }
}

/// A bar over the bench's rows on stderr (drawn only on a terminal).
fn rows_bar(rows: usize) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(rows as u64),
        indicatif::ProgressDrawTarget::stderr(),
    );
    let style = indicatif::ProgressStyle::with_template(
        "row {pos}/{len}: {msg} ({elapsed}, about {eta} left)",
    )
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    bar.set_style(style);
    bar
}
