//! Which decode attention kernel a launch runs and how it splits its
//! sequences: the flash kernels' names and builds, the partition model
//! (whole waves of resident blocks), and the scratch it needs. Plain
//! arithmetic, tested without a GPU; attention.rs launches what it picks.

/// Most tokens per attention partition (`PART` in the source).
pub const PARTITION: usize = 256;

/// Tokens per partition the flash kernel starts from (see
/// [`partition_len`]).
pub const FLASH_PARTITION: usize = 1024;

/// Most tokens per partition a plan may ask of the flash kernel (its shared
/// memory holds one page index per page of a partition).
pub const FLASH_MAX_PARTITION: usize = 4096;

/// Every flash attention kernel, per format, group size and head size.
pub(crate) fn attention_kernels() -> Vec<String> {
    flash_kernels().into_iter().map(|k| k.name).collect()
}

/// The builds of a flash kernel (the same operations on the same bytes,
/// so the same output bits; they differ in how they hold their loads).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlashBuild {
    /// Each warp's next chunk loaded into registers (over fp8 pages, three
    /// blocks an SM).
    Plain,
    /// The same held to 128 registers, four blocks an SM (it spills): fp8
    /// pages, heads of 128.
    FourAnSm,
}

/// Whether a launch of `blocks` flash blocks runs the build of four an SM,
/// where the device holds `three` blocks of the usual build at once and
/// `four` of that one: where it overflows one wave of the first and fits
/// one of the second. (H100, fp8, 64 sequences of 640 tokens in one
/// partition, 512 blocks: 45.3 us on three an SM, 40.5 on four; 128
/// sequences, 1024 blocks, either way several waves: 72.5 against 75.8.)
pub(super) fn one_wave_of_four(blocks: usize, three: usize, four: usize) -> bool {
    blocks > three && blocks <= four
}

/// A flash kernel: its name, group and head size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct FlashKernel {
    pub name: String,
    pub group: usize,
    pub hd: usize,
}

/// Every flash attention kernel, every build.
pub(super) fn flash_kernels() -> Vec<FlashKernel> {
    let mut kernels = Vec::new();
    for fmt in ["bf16", "fp8"] {
        for group in 1..=8 {
            for hd in [64, 128] {
                let base = format!("attention_flash_{fmt}_g{group}_d{hd}");
                for build in [FlashBuild::Plain, FlashBuild::FourAnSm] {
                    if let Some(name) = build_name(&base, build) {
                        kernels.push(FlashKernel { name, group, hd });
                    }
                }
            }
        }
    }
    kernels
}

/// The name of `build` of flash kernel `name`, where it has one (the
/// four-an-SM build exists for fp8 pages and heads of 128: the others run
/// four blocks an SM already or take too many registers to).
pub(super) fn build_name(name: &str, build: FlashBuild) -> Option<String> {
    let fp8_d128 = name.starts_with("attention_flash_fp8_") && name.ends_with("_d128");
    match build {
        FlashBuild::Plain => Some(name.to_string()),
        FlashBuild::FourAnSm => fp8_d128.then(|| format!("{name}_r4")),
    }
}

/// Threads of a flash attention block (`FLASH_WARPS` warps).
pub(super) const FLASH_THREADS: usize = 128;

/// Shared memory of a flash launch, as attention_flash.cu lays it out: Q's
/// fragments (at most `hd * 32` bytes), the warps' `red`, and one page
/// index per page of a partition, and one more.
pub(super) fn flash_shared(group: usize, hd: usize, page_size: usize, part: usize) -> usize {
    let warps = FLASH_THREADS / 32;
    let red = warps * (group * hd + 2 * group) * 4;
    let pages = (part.div_ceil(page_size) + 1) * 4;
    hd * 32 + red + pages
}

/// Fewest tokens per partition: a 16-token chunk for each warp of a flash
/// block (on the H200 at batch 1 x 1024, partitions of 64 ran in 7.2 us
/// against 7.8 for 32 and 128).
const MIN_PARTITION: usize = 64;

/// Blocks a decode attention launch aims for (two per SM of an H100 or
/// H200): below this, partitions shrink so a small batch still spreads
/// its reads over the whole GPU instead of queueing them in a few blocks.
const TARGET_BLOCKS: usize = 264;

/// A flash block's fixed cost (setup, the closing merge of its warps), in
/// tokens' worth of its reading time: the constant of [`partition_len`]'s
/// model.
const FLASH_BLOCK_COST: usize = 768;

/// Tokens per flash attention partition for `seqs` sequences of up to
/// `max_len` over `kv_heads`, when `resident` blocks run at once on the
/// device (blocks per SM times SMs).
///
/// A small batch (fewer than [`TARGET_BLOCKS`] blocks in partitions of
/// [`FLASH_PARTITION`]) halves its partitions until it has that many, down
/// to [`MIN_PARTITION`]: latency. A big one splits each sequence into
/// equal partitions, as many as minimize the launch's time modelled as
/// whole waves of resident blocks times each block's tokens plus
/// [`FLASH_BLOCK_COST`]: a last wave that leaves most SMs idle costs as
/// much as a full one. (H200, fp8 with e4m3 scores, batch 64 x 4096, 396
/// resident blocks: 1, 2, 3, 4 partitions read at 76, 81, 79, 76% of copy;
/// the model picks 2. bf16, 264 resident: 101, 99, 98, 97%; it picks 1.
/// Batch 232 x 1152, fp8: 1 and 2 partitions at 79 and 65%; it picks 1.)
pub fn partition_len(seqs: usize, kv_heads: usize, max_len: usize, resident: usize) -> usize {
    let pairs = seqs * kv_heads;
    if pairs * max_len.div_ceil(FLASH_PARTITION) < TARGET_BLOCKS {
        return split_len(seqs, kv_heads, max_len, FLASH_PARTITION);
    }
    let resident = resident.max(1);
    // At most the partitions of the shuffle kernel (what scratch holds).
    (1..=max_len.div_ceil(PARTITION).max(1))
        .map(|p| max_len.div_ceil(p).next_multiple_of(16))
        .filter(|len| *len <= FLASH_MAX_PARTITION)
        .min_by_key(|len| {
            let blocks = pairs * max_len.div_ceil(*len);
            blocks.div_ceil(resident) * (len + FLASH_BLOCK_COST)
        })
        .unwrap_or(FLASH_PARTITION)
}

/// The most partitions a launch of `seqs` sequences takes at any length up
/// to `cap` (either kernel). Not the count at `cap` itself: a length a
/// little past half of it may halve its partitions once more. Where halving
/// stops at a partition `p`, the launch at `2p` had fewer than
/// [`TARGET_BLOCKS`] blocks, so `p` gives at most twice that many per
/// sequence; else partitions are [`PARTITION`] (or, for the flash kernel,
/// longer) or [`MIN_PARTITION`] long.
fn max_parts(seqs: usize, kv_heads: usize, cap: usize) -> usize {
    let halved = 2 * TARGET_BLOCKS.div_ceil((seqs * kv_heads).max(1));
    cap.div_ceil(PARTITION)
        .max(halved.min(cap.div_ceil(MIN_PARTITION)))
        .max(1)
}

/// As [`partition_len`], starting from `most` tokens.
pub(super) fn split_len(seqs: usize, kv_heads: usize, max_len: usize, most: usize) -> usize {
    let mut len = most;
    while len > MIN_PARTITION && seqs * kv_heads * max_len.div_ceil(len) < TARGET_BLOCKS {
        len /= 2;
    }
    len
}

/// Partitions (of every head) that attention over up to `seqs` sequences
/// of at most `max_len` may need: for every batch size up to `seqs` (a
/// smaller batch splits into more partitions).
pub(super) fn attention_rows(seqs: usize, kv_heads: usize, max_len: usize) -> usize {
    (1..=seqs.max(1))
        .map(|b| b * max_parts(b, kv_heads, max_len))
        .max()
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Resident fp8 and bf16 flash blocks on an H200 (3 and 2 per SM).
    const FP8_H200: usize = 396;
    const BF16_H200: usize = 264;

    #[test]
    fn small_batches_halve_their_partitions_to_fill_the_gpu() {
        // 8 sequences of 1280: halved until 320 blocks.
        assert_eq!(partition_len(8, 8, 1280, FP8_H200), 256);
        // One sequence never goes below a chunk per warp.
        assert_eq!(partition_len(1, 8, 1280, FP8_H200), MIN_PARTITION);
        for seqs in [1, 2, 3, 8] {
            for max_len in [1, 15, 64, 1000, 1280, 4096] {
                let p = partition_len(seqs, 8, max_len, FP8_H200);
                if seqs * 8 * max_len.div_ceil(FLASH_PARTITION) >= TARGET_BLOCKS {
                    continue;
                }
                assert!(p.is_power_of_two() && (MIN_PARTITION..=FLASH_PARTITION).contains(&p));
                // Shorter only while the launch is below its target.
                if p < FLASH_PARTITION {
                    assert!(seqs * 8 * max_len.div_ceil(2 * p) < TARGET_BLOCKS);
                }
            }
        }
    }

    #[test]
    fn fp8_blocks_run_four_an_sm_only_where_that_makes_one_wave() {
        // 132 SMs: 396 blocks of three an SM, 528 of four.
        let (three, four) = (396, 528);
        // 64 sequences x 8 KV heads, one partition each.
        assert!(one_wave_of_four(512, three, four));
        assert!(one_wave_of_four(397, three, four));
        assert!(one_wave_of_four(528, three, four));
        // One wave already, or several either way.
        for blocks in [1, 264, 396, 529, 1024, 2048] {
            assert!(!one_wave_of_four(blocks, three, four), "{blocks}");
        }
        // A device where the build still ran three an SM gains nothing.
        assert!(!one_wave_of_four(512, three, three));
    }

    #[test]
    fn only_fp8_kernels_of_heads_of_128_have_other_builds() {
        let base = "attention_flash_fp8_g4_d128";
        assert_eq!(
            build_name(base, FlashBuild::FourAnSm).as_deref(),
            Some("attention_flash_fp8_g4_d128_r4")
        );
        for none in ["attention_flash_fp8_g4_d64", "attention_flash_bf16_g4_d128"] {
            assert_eq!(build_name(none, FlashBuild::FourAnSm), None);
            assert_eq!(build_name(none, FlashBuild::Plain).as_deref(), Some(none));
        }
        // 2 formats x 8 groups x 2 head sizes, and the four-an-SM build of
        // each fp8 d128 kernel.
        assert_eq!(flash_kernels().len(), 32 + 8);
    }

    #[test]
    fn flash_blocks_fit_four_an_sm_in_the_default_shared_memory() {
        // An H100 or H200 SM: 228 KiB, 1 KiB of it reserved per block;
        // the kernels' own static 128 bytes (ptxas, sm_90a) too.
        let per_sm = |bytes: usize| (228 << 10) / (bytes + 1024 + 128);
        for group in 1..=8 {
            let most = flash_shared(group, 128, 16, FLASH_MAX_PARTITION);
            assert!(most < 48 << 10, "{group}: {most}");
            assert!(per_sm(most) >= 4, "{group}: {most}");
        }
    }

    #[test]
    fn big_batches_split_sequences_evenly_into_whole_waves() {
        // 64 x 4096, fp8: 2 partitions (1024 blocks, 2.6 waves of 396), as
        // measured best; bf16 (264 resident): one (2 waves).
        assert_eq!(partition_len(64, 8, 4096, FP8_H200), 2048);
        assert_eq!(partition_len(64, 8, 4096, BF16_H200), 4096);
        // The full fp8 batch of the decode matrix: one partition a sequence
        // (4.7 waves) rather than 1024 + 128.
        assert_eq!(partition_len(232, 8, 1152, FP8_H200), 1152);
        for seqs in [17, 64, 128, 232, 256] {
            for max_len in [1000, 1280, 4096, 32768] {
                for resident in [FP8_H200, BF16_H200, 1] {
                    let p = partition_len(seqs, 8, max_len, resident);
                    assert!(p.is_multiple_of(16) && p <= FLASH_MAX_PARTITION, "{p}");
                    // Equal partitions: the last is shorter than the
                    // others by less than a 16-token chunk per partition.
                    let parts = max_len.div_ceil(p);
                    assert!(parts * p - max_len < 16 * parts, "{max_len} in {p}");
                    // The shuffle kernel's split is never longer, so
                    // scratch sized for it covers the flash kernel's.
                    assert!(split_len(seqs, 8, max_len, PARTITION) <= p);
                }
            }
        }
    }

    #[test]
    fn scratch_covers_every_length_up_to_its_capacity() {
        // A context a little past half the capacity can take more
        // partitions than the capacity itself (4 KV heads, one sequence:
        // 8193 tokens in 129 partitions of 64, 16384 in 128 of 128).
        assert!(max_parts(1, 4, 16384) >= 8193usize.div_ceil(64));
        for kv_heads in [1, 2, 4, 8] {
            for seqs in [1, 2, 3, 5, 8, 17, 33, 64, 256] {
                for cap in [1, 63, 100, 1000, 4096, 8200, 16384, 33024] {
                    let most = max_parts(seqs, kv_heads, cap);
                    for len in 1..=cap {
                        for resident in [1, BF16_H200, FP8_H200] {
                            let flash = partition_len(seqs, kv_heads, len, resident);
                            assert!(len.div_ceil(flash) <= most, "{seqs} x {len} / {cap}");
                        }
                        let shuffle = split_len(seqs, kv_heads, len, PARTITION);
                        assert!(len.div_ceil(shuffle) <= most, "{seqs} x {len} / {cap}");
                    }
                }
            }
        }
    }
}
