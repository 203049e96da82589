//! The engine settings `run`, `bench` and `serve` share, as command-line
//! arguments, and what they parse into.

use kiln_host::serving::devices::DeviceSpec;

/// Engine settings shared by `run`, `bench` and `serve`. The engine's A/B
/// switches (`--cuda-graphs`, `--cuda-pdl`, `--cuda-fold`,
/// `--device-sampling`, `--tensor-prefill`, `--cuda-skinny`,
/// `--cuda-cluster`, `--cuda-bf16-mlp`, `--prefill-warps`) keep their
/// defaults unless a benchmark asks: they are left out of the help.
#[derive(clap::Args)]
pub(crate) struct EngineArgs {
    /// Weights of the projections: `native` (as the model stores them),
    /// `bf16`, `fp8` (e4m3 rows, a scale per output channel) or `int4`
    /// (groups of 128, f16 scale and offset), converted at load; or one for
    /// each phase, as in `prefill=fp8,decode=int4` (two copies: a step's
    /// one-token rows run on decode's); `,head=FORMAT` converts the output
    /// head too (`int4,head=int4`; else it stays as stored).
    #[arg(long, default_value = "native")]
    pub(crate) weights: kiln_host::model::WeightPlan,
    /// KV page format.
    #[arg(long, value_enum, default_value_t = KvArg::Fp8)]
    pub(crate) kv: KvArg,
    /// KV memory budget (of each model on each device): bytes, or with a
    /// unit (`512MiB`, `2GiB`).
    #[arg(long, default_value = "512MiB", value_parser = kiln_host::config::parse_size)]
    pub(crate) kv_memory: usize,
    /// Check KV page tags before each step.
    #[arg(long, value_enum, default_value_t = OnOff::On)]
    kv_integrity: OnOff,
    /// Where the forward pass runs: `cpu`, `cuda` or `cuda:N`; for `serve`
    /// also several GPUs, `cuda:all` or a list such as `cuda:0,1` (each
    /// runs --decode-pools pools of each model).
    #[arg(long, default_value = "cpu")]
    pub(crate) device: DeviceSpec,
    /// Most sequences running at once [default: 64 on the CPU, 256 on CUDA].
    #[arg(long)]
    max_seqs: Option<usize>,
    /// Most tokens one step computes (prefill chunks and decodes); at least
    /// --max-seqs [default: 256 on the CPU, 2048 on CUDA, or --max-seqs if more].
    #[arg(long)]
    step_tokens: Option<usize>,
    /// While tenants compete (one tenant's streams beside another's prompts
    /// or streams), keep a step within this many lone decode steps' time
    /// by cutting its prompt tokens, then its decodes, shared by tenant
    /// (0: no target) [default: 1.8 on CUDA, 0 on the CPU].
    #[arg(long)]
    step_target: Option<f64>,
    /// On CUDA, capture greedy decode steps (up to 256 sequences) as CUDA
    /// graphs and replay them.
    #[arg(long, value_enum, default_value_t = OnOff::On, hide = true)]
    cuda_graphs: OnOff,
    /// On CUDA (sm_90 and up), let each kernel of a captured step start
    /// while the one before it finishes (programmatic dependent launch).
    #[arg(long, value_enum, default_value_t = OnOff::On, hide = true)]
    cuda_pdl: OnOff,
    /// On CUDA, fold the norms and SiLU-and-multiply of one-token steps
    /// into their GEMVs (bf16 weights).
    #[arg(long, value_enum, default_value_t = OnOff::On, hide = true)]
    cuda_fold: OnOff,
    /// On CUDA, fold int4 tiles' one-token steps too (5% faster at one
    /// sequence than the separate launches beside them; docs/perf.md).
    #[arg(long, value_enum, default_value_t = OnOff::On, hide = true)]
    cuda_fold_int4: OnOff,
    /// On CUDA, fold FP8 rows' one-token steps too: each product quantizes
    /// its activation row itself, so no norm, SiLU or quantizer launch runs
    /// (10% faster at one sequence on an H200; docs/perf.md).
    #[arg(long, value_enum, default_value_t = OnOff::On, hide = true)]
    cuda_fold_fp8: OnOff,
    /// On CUDA, int4 products of 2 to 8 rows (decode of a few sequences)
    /// run in one launch with the rows in the MMAs' columns (`off`: a
    /// fragment launch and the GEMV).
    #[arg(long, value_enum, default_value_t = OnOff::On, hide = true)]
    cuda_int4_rows: OnOff,
    /// On CUDA, time cuBLASLt's algorithms for the decode step's bf16
    /// products at load (weights out of L2) and run the fastest where it
    /// beats cuBLAS's own choice (`off`: cuBLAS's choice).
    #[arg(long, value_enum, default_value_t = OnOff::On, hide = true)]
    cuda_tune_bf16: OnOff,
    /// On CUDA, sample (temperature, top-k, top-p) on the device.
    #[arg(long, value_enum, default_value_t = OnOff::On, hide = true)]
    device_sampling: OnOff,
    /// On CUDA, attend prefill chunks with the tensor-core prefill kernel
    /// (off: one decode-attention query per token).
    #[arg(long, value_enum, default_value_t = OnOff::On, hide = true)]
    tensor_prefill: OnOff,
    /// On CUDA, run bf16 products of 2-16 rows (small decode batches) on
    /// the skinny tensor-core GEMM instead of cuBLAS.
    #[arg(long, value_enum, default_value_t = OnOff::On, hide = true)]
    cuda_skinny: OnOff,
    /// On CUDA (sm_90 and up), run bf16 products of 17-64 rows (decode
    /// batches) on the cluster GEMM, which splits each weight tile's
    /// columns over a thread-block cluster, instead of cuBLAS.
    #[arg(long, value_enum, default_value_t = OnOff::Off, hide = true)]
    cuda_cluster: OnOff,
    /// On CUDA, decode steps' attention rotates the q/k/v rows and writes
    /// the new keys and values into their pages itself, where a separate
    /// launch did before it.
    #[arg(long, value_enum, default_value_t = OnOff::On, hide = true)]
    cuda_rope_in_attention: OnOff,
    /// On CUDA, the flash attention kernel's build decode steps run over
    /// fp8 pages with heads of 128: each launch picks (auto), loads in
    /// registers (plain) or held to four blocks an SM (four).
    #[arg(long, value_enum, default_value_t = FlashBuildArg::Auto, hide = true)]
    cuda_flash_build: FlashBuildArg,
    /// On CUDA, decode attention that splits sequences into partitions
    /// merges them in its own last block of each sequence, where a merge
    /// launch follows it.
    #[arg(long, value_enum, default_value_t = OnOff::Off, hide = true)]
    cuda_fused_merge: OnOff,
    /// On CUDA, warps a block of prefill attention takes: 4 (three blocks
    /// an SM) or 8 (one block, twice the query rows per key tile read)
    /// [default: 4 for bf16 pages, 8 for fp8 pages].
    #[arg(long, hide = true)]
    prefill_warps: Option<usize>,
    /// On CUDA, run the MLP of prefill steps in bf16 (one GEMM over the
    /// stacked gate/up weights with a bf16 product, as PyTorch's bf16
    /// models do).
    #[arg(long, value_enum, default_value_t = OnOff::On, hide = true)]
    cuda_bf16_mlp: OnOff,
    /// On CUDA, with the bf16 MLP, decode steps past the skinny GEMM's 16
    /// sequences run it too (one gate/up GEMM where they run two).
    #[arg(long, value_enum, default_value_t = OnOff::On, hide = true)]
    cuda_bf16_mlp_decode: OnOff,
    /// Prefill/decode disaggregation: a prefill lane admits and computes
    /// prompts and a decode lane runs the streams, each with its own
    /// queue, token budget and step, over one KV pool (a sequence changes
    /// lanes at its first token, its pages staying where they are).
    /// `auto` turns it on for `serve` on one GPU with CUDA graphs, where
    /// the prefill lane's steps run beside the decode lane's on a stream of
    /// their own, and off elsewhere (`run` and `bench` measure one lane
    /// unless asked).
    #[arg(long, value_enum, default_value_t = PdArg::Auto)]
    pd: PdArg,
    /// Split the model over N tensor-parallel ranks: each holds 1/N of the
    /// heads and of the MLP, and KV pages of its own KV heads. On CUDA the
    /// ranks take GPUs N, N + 1, ... from `--device cuda:N` and sum their
    /// parts by NCCL (ranks that must share a GPU sum through the host,
    /// slowly, without graphs); on the CPU they run in lockstep.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    tensor_parallel: u16,
}

impl EngineArgs {
    /// The engine settings of a command that runs one engine (`run`,
    /// `bench`); fails at once (before any model loads) when the device
    /// cannot be used or `--device` names several.
    pub(crate) fn config(&self) -> anyhow::Result<kiln_host::engine::EngineConfig> {
        let device = self.device.single().map_err(anyhow::Error::msg)?;
        self.config_on(&[device], false)
    }

    /// The devices `--device` names (`cuda:all` counted) and the engine
    /// settings of the first (`ServedModels::start_on` places each pool);
    /// fails at once when any of them cannot be used. With a `prefill_pool`
    /// of its own the decode pools only recompute what they preempt, so
    /// `--pd auto` leaves them one lane.
    pub(crate) fn devices(
        &self,
        prefill_pool: bool,
    ) -> anyhow::Result<(Vec<kiln_kernels::Device>, kiln_host::engine::EngineConfig)> {
        let count = || kiln_kernels::cuda::Gpu::count().map_err(|e| e.to_string());
        let devices = self.device.resolve(count).map_err(anyhow::Error::msg)?;
        let config = self.config_on(&devices, !prefill_pool)?;
        Ok((devices, config))
    }

    /// The settings for engines on `devices` (one or more, all probed);
    /// `auto_pd`: whether `--pd auto` may disaggregate them (a server's
    /// pools that prefill their own prompts, not a command's fixed batch).
    fn config_on(
        &self,
        devices: &[kiln_kernels::Device],
        auto_pd: bool,
    ) -> anyhow::Result<kiln_host::engine::EngineConfig> {
        anyhow::ensure!(
            devices.len() <= 1 || self.tensor_parallel == 1,
            "--tensor-parallel {}: an engine's ranks take GPUs from the one --device names \
             on (cuda:N, N + 1, ...); name one device",
            self.tensor_parallel
        );
        for d in devices {
            if let kiln_kernels::Device::Cuda(n) = *d {
                kiln_kernels::cuda::Gpu::probe(n)?;
            }
        }
        let device = devices.first().copied().unwrap_or_default();
        anyhow::ensure!(
            matches!(self.prefill_warps, None | Some(4 | 8)),
            "--prefill-warps {}: a block of prefill attention takes 4 or 8 warps",
            self.prefill_warps.unwrap_or_default()
        );
        let gpu = matches!(device, kiln_kernels::Device::Cuda(_));
        let max_running = self.max_seqs.unwrap_or(if gpu { 256 } else { 64 });
        let step_tokens = if gpu { 2048 } else { 256 };
        let scheduler = kiln_host::engine::SchedulerConfig {
            max_running,
            // Unset, at least a token for each running sequence.
            max_tokens_per_step: self.step_tokens.unwrap_or(max_running.max(step_tokens)),
            step_target: self
                .step_target
                .unwrap_or(if gpu { DEFAULT_STEP_TARGET } else { 0.0 }),
        };
        // Each running sequence decodes a token a step: a step of fewer
        // tokens would leave the newest streams (and every prompt) waiting
        // behind the oldest for as long as those run.
        anyhow::ensure!(
            scheduler.max_running >= 1 && scheduler.max_tokens_per_step >= scheduler.max_running,
            "--step-tokens {} with --max-seqs {}: a step computes at least a token for each \
             running sequence, so --step-tokens must be at least --max-seqs (and that at least 1)",
            scheduler.max_tokens_per_step,
            scheduler.max_running
        );
        Ok(kiln_host::engine::EngineConfig {
            kv_format: kv_format(self.kv),
            kv_memory: self.kv_memory,
            integrity: self.kv_integrity == OnOff::On,
            device,
            scheduler,
            cuda_graphs: self.cuda_graphs == OnOff::On,
            cuda_pdl: self.cuda_pdl == OnOff::On,
            cuda_fold: self.cuda_fold == OnOff::On,
            cuda_fold_int4: self.cuda_fold_int4 == OnOff::On,
            cuda_fold_fp8: self.cuda_fold_fp8 == OnOff::On,
            cuda_int4_rows: self.cuda_int4_rows == OnOff::On,
            cuda_tune_bf16: self.cuda_tune_bf16 == OnOff::On,
            device_sampling: self.device_sampling == OnOff::On,
            tensor_prefill: self.tensor_prefill == OnOff::On,
            cuda_skinny: self.cuda_skinny == OnOff::On,
            cuda_cluster: self.cuda_cluster == OnOff::On,
            cuda_rope_in_attention: self.cuda_rope_in_attention == OnOff::On,
            cuda_attention: kiln_kernels::cuda::AttentionPlan {
                build: self.cuda_flash_build.build(),
                fused_merge: self.cuda_fused_merge == OnOff::On,
                ..Default::default()
            },
            prefill_warps: self.prefill_warps,
            cuda_bf16_mlp: self.cuda_bf16_mlp == OnOff::On,
            cuda_bf16_mlp_decode: self.cuda_bf16_mlp_decode == OnOff::On,
            pd: self.pd.on(
                auto_pd && gpu,
                self.tensor_parallel,
                self.cuda_graphs == OnOff::On,
            ),
            tensor_parallel: usize::from(self.tensor_parallel),
        })
    }
}

/// The step target on CUDA. The aim is a stream's inter-token latency
/// beside another tenant's burst within 2x its latency alone; that
/// latency is ~5% above the lone step the target counts in (host time,
/// sampling), so a target of 2 lands just over 2x (docs/perf.md) and the
/// default keeps a margin under it.
const DEFAULT_STEP_TARGET: f64 = 1.8;

/// KV page formats.
#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum KvArg {
    /// fp8 e4m3, a scale per vector: the closest to bf16.
    Fp8,
    /// fp8 e4m3, one static scale, keys Hadamard-rotated: half of bf16.
    Fp8Static,
    /// bfloat16.
    Bf16,
}

/// A switch.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum OnOff {
    On,
    Off,
}

/// `--pd`'s values.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum PdArg {
    Auto,
    On,
    Off,
}

impl PdArg {
    /// Whether an engine disaggregates. `auto` does where it pays: a
    /// server on one GPU with graphs, whose prefill lane runs on a stream
    /// of its own beside the decode lane while prompts keep arriving (more
    /// output and a third of the TTFT at 256 clients, docs/perf.md). On
    /// the CPU the lanes' steps would only take turns; ranks and
    /// graph-less engines cannot open the second stream (an explicit `on`
    /// there fails at start, saying why); a fixed batch (`bench`, `run`)
    /// keeps the one-lane figures it is compared by.
    fn on(self, serving_on_gpu: bool, tensor_parallel: u16, graphs: bool) -> bool {
        match self {
            PdArg::On => true,
            PdArg::Off => false,
            PdArg::Auto => serving_on_gpu && tensor_parallel == 1 && graphs,
        }
    }
}

/// `--cuda-flash-build`'s values.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum FlashBuildArg {
    Auto,
    Plain,
    Four,
}

impl FlashBuildArg {
    fn build(self) -> Option<kiln_kernels::cuda::FlashBuild> {
        use kiln_kernels::cuda::FlashBuild;
        match self {
            FlashBuildArg::Auto => None,
            FlashBuildArg::Plain => Some(FlashBuild::Plain),
            FlashBuildArg::Four => Some(FlashBuild::FourAnSm),
        }
    }
}

pub(crate) fn kv_format(kv: KvArg) -> kiln_kernels::kv::KvFormat {
    match kv {
        KvArg::Fp8 => kiln_kernels::kv::KvFormat::Fp8,
        KvArg::Fp8Static => kiln_kernels::kv::KvFormat::Fp8Static,
        KvArg::Bf16 => kiln_kernels::kv::KvFormat::Bf16,
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::{EngineArgs, PdArg};

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        engine: EngineArgs,
    }

    fn config(args: &[&str]) -> anyhow::Result<kiln_host::engine::EngineConfig> {
        let argv = std::iter::once("kiln").chain(args.iter().copied());
        Cli::try_parse_from(argv)?.engine.config()
    }

    #[test]
    fn a_step_of_fewer_tokens_than_running_sequences_is_refused() {
        for args in [
            &["--max-seqs", "512", "--step-tokens", "256"][..],
            &["--step-tokens", "0"],
            &["--max-seqs", "0"],
        ] {
            let e = config(args).expect_err("refused").to_string();
            assert!(
                e.contains("--step-tokens must be at least --max-seqs"),
                "{e}"
            );
        }
        assert!(config(&["--max-seqs", "256", "--step-tokens", "256"]).is_ok());
        // Unset, the step's tokens follow the sequences.
        let many = config(&["--max-seqs", "300"]).unwrap().scheduler;
        assert_eq!(many.max_tokens_per_step, 300);
    }

    #[test]
    fn disaggregation_is_on_by_default_only_for_a_server_on_one_gpu_with_graphs() {
        assert!(PdArg::Auto.on(true, 1, true));
        assert!(!PdArg::Auto.on(false, 1, true), "the CPU, or bench");
        assert!(!PdArg::Auto.on(true, 2, true), "tensor-parallel ranks");
        assert!(!PdArg::Auto.on(true, 1, false), "no CUDA graphs");
        assert!(PdArg::On.on(false, 1, true) && !PdArg::Off.on(true, 1, true));
        // On the CPU, and for bench and run, the default stays one lane.
        assert!(!config(&[]).unwrap().pd);
        assert!(config(&["--pd", "on"]).unwrap().pd);
        let argv = ["kiln", "--device", "cpu"];
        let (_, serving) = Cli::try_parse_from(argv)
            .unwrap()
            .engine
            .devices(false)
            .unwrap();
        assert!(!serving.pd, "a server on the CPU");
    }
}
