//! The CUDA C source Kiln compiles at run time, and the kernels it loads
//! from it by name.

/// The CUDA C source of every kernel: one file per operation, its
/// launchers in the `.rs` file of the same name. `common.cu` (includes,
/// macros, reductions, the KV layout) comes first; each file after it uses
/// only what the files before it define.
pub const SOURCE: &str = concat!(
    include_str!("common.cu"),
    include_str!("norm.cu"),
    include_str!("act.cu"),
    include_str!("embed.cu"),
    include_str!("kv.cu"),
    include_str!("hadamard.cu"),
    include_str!("rope.cu"),
    include_str!("tags.cu"),
    include_str!("convert.cu"),
    include_str!("attention_mma.cu"),
    include_str!("attention.cu"),
    include_str!("attention_flash_io.cu"),
    include_str!("attention_flash.cu"),
    include_str!("gemv.cu"),
    include_str!("gemv_norm.cu"),
    include_str!("quant.cu"),
    include_str!("fp8_act.cu"),
    include_str!("fp8_mma.cu"),
    include_str!("int4.cu"),
    include_str!("int4_one.cu"),
    include_str!("fp8_fold.cu"),
    include_str!("int4_rows.cu"),
    include_str!("skinny.cu"),
    include_str!("cluster.cu"),
    include_str!("sample.cu"),
    include_str!("prefill.cu")
);

/// Every kernel the source defines by name, file by file (the flash
/// attention kernels are listed by [`super::attention_plan::attention_kernels`]).
pub(super) const KERNELS: &[&str] = &[
    // norm.cu, act.cu, embed.cu
    "rmsnorm_residual",
    "silu_mul",
    "silu_mul_pairs",
    "embed_bf16",
    // kv.cu, hadamard.cu, rope.cu
    "kv_write_bf16",
    "kv_write_fp8",
    "kv_pages_copy",
    "hadamard_rows",
    "rope",
    "rope_kv_write_bf16",
    "rope_kv_write_fp8",
    "rope_kv_write_fp8s",
    // tags.cu
    "tag_check",
    "tag_scatter",
    // convert.cu
    "to_bf16",
    "add_bias",
    "gather_rows",
    // attention.cu
    "attention_part_bf16_g1",
    "attention_part_bf16_g2",
    "attention_part_bf16_g3",
    "attention_part_bf16_g4",
    "attention_part_bf16_g5",
    "attention_part_bf16_g6",
    "attention_part_bf16_g7",
    "attention_part_bf16_g8",
    "attention_part_fp8_g1",
    "attention_part_fp8_g2",
    "attention_part_fp8_g3",
    "attention_part_fp8_g4",
    "attention_part_fp8_g5",
    "attention_part_fp8_g6",
    "attention_part_fp8_g7",
    "attention_part_fp8_g8",
    "attention_merge",
    // gemv.cu, gemv_norm.cu
    "gemv_bf16_1_u4",
    "gemv_bf16_2_u4",
    "gemv_bf16_3_u4",
    "gemv_bf16_4_u4",
    "gemv_bf16_5_u4",
    "gemv_bf16_6_u4",
    "gemv_bf16_7_u4",
    "gemv_bf16_8_u4",
    "gemv_bf16_resid",
    "gemv_bf16_normed",
    "gemv_bf16_normed_silu",
    // quant.cu
    "gemv_q8_0",
    "gemv_q4_0",
    "gemv_q4_1",
    "gemv_fp8row",
    "gemv_fp8row_1",
    "dequant_fp8row",
    "embed_fp8row",
    "embed_fp8_packed",
    "dequant_q8_0",
    "dequant_q4_0",
    "dequant_q4_1",
    "embed_q8_0",
    "embed_q4_0",
    "embed_q4_1",
    "dequant_fp8row_bf16",
    // fp8_act.cu
    "quant_rows_e4m3",
    "quant_rows_e4m3_bf16",
    "silu_mul_pairs_e4m3",
    "rmsnorm_residual_e4m3",
    // fp8_mma.cu
    "gemm_e4m3_nb1_f32",
    "gemm_e4m3_nb2_f32",
    "gemm_e4m3_nb1_bf16",
    "gemm_e4m3_nb2_bf16",
    // int4.cu
    "int4_xfrag",
    "gemv_int4_g64",
    "gemv_int4_g128",
    "gemv_int4_one_g64_r1_w8",
    "gemv_int4_one_g64_r2_w8",
    "gemv_int4_one_g64_r2_w16",
    "gemv_int4_one_g128_r1_w8",
    "gemv_int4_one_g128_r2_w8",
    "gemv_int4_one_g128_r2_w16",
    "gemv_int4_fold_g64_w8",
    "gemv_int4_fold_g64_w16",
    "gemv_int4_fold_g128_w8",
    "gemv_int4_fold_g128_w16",
    // fp8_fold.cu
    "gemv_e4m3_fold",
    // int4_rows.cu
    "gemv_int4_rows4_g64_w8",
    "gemv_int4_rows4_g64_w16",
    "gemv_int4_rows4_g128_w8",
    "gemv_int4_rows4_g128_w16",
    "gemv_int4_rows8_g64_w8",
    "gemv_int4_rows8_g64_w16",
    "gemv_int4_rows8_g128_w8",
    "gemv_int4_rows8_g128_w16",
    "gemm_int4_g64_nb2",
    "gemm_int4_g64_nb4",
    "gemm_int4_g64_nb8",
    "gemm_int4_g128_nb2",
    "gemm_int4_g128_nb4",
    "gemm_int4_g128_nb8",
    "dequant_int4_bf16",
    "embed_int4",
    // skinny.cu
    "gemm_bf16_skinny_nb1",
    "gemm_bf16_skinny_nb2",
    "gemm_bf16_skinny_nb4",
    "gemm_bf16_skinny_nb8",
    // sample.cu
    "sample_rows",
    "argmax_rows",
    "mask_rows",
    "top_logprobs_rows",
    "chosen_logprobs_rows",
    // prefill.cu
    "prefill_bf16_d64_w4",
    "prefill_bf16_d128_w4",
    "prefill_fp8_d64_w4",
    "prefill_fp8_d128_w4",
    "prefill_bf16_d64_w8",
    "prefill_bf16_d128_w8",
    "prefill_fp8_d64_w8",
    "prefill_fp8_d128_w8",
];

#[cfg(test)]
mod tests {
    use super::super::attention_plan;
    use super::{KERNELS, SOURCE};

    #[test]
    fn every_kernel_the_source_defines_by_name_is_loaded() {
        let loaded: Vec<String> = KERNELS
            .iter()
            .map(|k| k.to_string())
            .chain(attention_plan::attention_kernels())
            .collect();
        let mut named = 0;
        for def in SOURCE.split("extern \"C\" __global__").skip(1) {
            // `void [__launch_bounds__(..)] name(`: the word before the
            // first parenthesis after the bounds.
            let head = def.split('{').next().unwrap_or_default();
            let mut head = head.trim_start().trim_start_matches("void").trim_start();
            // Attributes before the name: launch bounds, cluster dims.
            while head.starts_with("__launch_bounds__") || head.starts_with("CL_DIMS") {
                head = head
                    .split_once(')')
                    .map_or("", |(_, rest)| rest)
                    .trim_start();
            }
            let before = head.split('(').next().unwrap_or_default();
            let name = before
                .rsplit(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '#'))
                .next()
                .unwrap_or_default();
            // Macro templates (`NAME`, `gemv_bf16_##M`) name no kernel.
            if name == "NAME" || name.contains('#') {
                continue;
            }
            named += 1;
            assert!(
                loaded.iter().any(|k| k == name),
                "kernel `{name}` is defined but never loaded"
            );
        }
        assert!(named >= 10, "found only {named} kernels by name");
        assert!(loaded.iter().any(|k| k == "rope_kv_write_fp8"));
    }
}
