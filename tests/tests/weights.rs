//! Weight formats (`--weights int4`, `--weights fp8`) held to bf16 weights
//! on the default model (SmolLM2-135M-Instruct, its Q4_1 blocks
//! dequantized to bf16, then requantized): teacher-forced next-token
//! agreement and mean KL.

use std::sync::LazyLock;

use kiln_host::engine::{Engine, EngineConfig};
use kiln_host::model::{WeightFormat, WeightPlan};
use kiln_kernels::kv::KvFormat;
use kiln_tests::{Forced, default_model_as};

const PROMPTS: [&str; 8] = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Who wrote Hamlet?",
    "Explain gravity in one sentence.",
    "Translate 'hello' into Spanish.",
    "How many legs does a spider have?",
    "Describe a cat in five words.",
];

fn engine(weights: impl Into<WeightPlan>) -> Engine {
    Engine::new(
        default_model_as(weights),
        EngineConfig {
            kv_format: KvFormat::Bf16,
            kv_memory: 64 << 20,
            ..Default::default()
        },
    )
    .expect("engine")
}

/// The bf16 weights' continuations and logits, shared by every test here.
static BF16: LazyLock<Forced> =
    LazyLock::new(|| Forced::by(&mut engine(WeightFormat::Bf16), &PROMPTS));

/// (agreeing positions, positions, mean KL in nats) of `weights` against
/// bf16 weights.
fn against_bf16(weights: impl Into<WeightPlan> + std::fmt::Debug + Copy) -> (usize, usize, f64) {
    against_bf16_on(&mut engine(weights), weights)
}

/// [`against_bf16`] on an engine already loaded with `weights`.
fn against_bf16_on(other: &mut Engine, weights: impl std::fmt::Debug) -> (usize, usize, f64) {
    let (agree, total, kl) = BF16.against(other);
    eprintln!(
        "{weights:?} vs bf16 weights: argmax agreement {agree}/{total} = {:.4}, mean KL {kl:.5} nats",
        agree as f64 / total as f64
    );
    (agree, total, kl)
}

/// Measured on these prompts (188 positions): 140/188 (0.745) and a mean
/// KL of 0.368 nats, against 133/188 and 0.378 for plain min-max rounding.
/// This 135M model's argmax is fragile: the same run with 8-bit Q8_0
/// weights agrees on 181/188 (0.963, KL 0.002), so int4 cannot reach the
/// 95% that larger models do. The bounds hold today's quantizer to its
/// figures and fail plain min-max rounding's KL.
#[test]
fn int4_weights_agree_with_bf16_weights_under_teacher_forcing() {
    let (agree, total, kl) = against_bf16(WeightFormat::Int4);
    let rate = agree as f64 / total as f64;
    assert!(rate >= 0.72, "agreement {rate}");
    assert!(kl <= 0.373, "mean KL {kl}");
}

/// FP8 rows (e4m3, a scale per output channel) as W8A8: every activation
/// row, one-row decode steps included, goes to e4m3 with a scale per
/// token, as FP8 tensor cores read them on the GPU (as batched decode rows
/// always did, so a sequence's numbers no longer depend on its batch's
/// size). Measured 164/188 (0.872) and a mean KL of 0.0501 nats; with the
/// one-row steps' activations in f32 (W8A16) it was 169/188 and 0.0348,
/// and with every row's, 170/188 and 0.0275. Issue 18 asks 98%; on this
/// model 8-bit Q8_0 weights reach only 0.963 (see above), and e4m3 keeps 3
/// mantissa bits against Q8_0's 7.
#[test]
fn fp8_weights_agree_with_bf16_weights_under_teacher_forcing() {
    let (agree, total, kl) = against_bf16(WeightFormat::Fp8);
    let rate = agree as f64 / total as f64;
    assert!(rate >= 0.86, "agreement {rate}");
    assert!(kl <= 0.053, "mean KL {kl}");
}

/// The output head as int4 too (`--weights int4,head=int4`; this model's
/// head is its tied embedding, which stays as stored for the gather). Measured
/// 133/188 (0.707) and a mean KL of 0.468 nats, against the int4
/// projections' 140/188 and 0.368 with the head as stored (Q8_0): on this
/// small model (a 576-wide head in groups of 64) the head's rounding costs 7
/// positions, which is why the head stays as stored unless asked.
#[test]
fn an_int4_head_is_read_in_int4_and_costs_a_bounded_share_of_agreement() {
    let plan: WeightPlan = "int4,head=int4".parse().expect("plan");
    // The head is int4: the file's tied 49152 x 576 head is Q8_0 (34 bytes
    // a block of 32), int4 groups of 64 take 36 bytes, half a byte a
    // weight less.
    let mut head = engine(plan);
    let saved = engine(WeightFormat::Int4).weight_bytes() - head.weight_bytes();
    assert_eq!(saved, 49152 * 576 / 2, "bytes an int4 head saves a step");
    let (agree, total, kl) = against_bf16_on(&mut head, plan);
    let rate = agree as f64 / total as f64;
    assert!(rate >= 0.69, "agreement {rate}");
    assert!(kl <= 0.48, "mean KL {kl}");
}
