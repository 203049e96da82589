//! A model's weights split over tensor-parallel ranks (docs/architecture.md,
//! "Tensor parallelism"): each rank holds 1/R of the query and KV heads
//! (q, k and v by output rows, o by input columns) and 1/R of the MLP's
//! hidden width (gate and up by output rows, down by input columns), so a
//! block's two projections into the residual stream each end in a sum of
//! the ranks' parts (an all-reduce). The output head splits by vocabulary
//! rows, its parts joined before sampling; norms and the embedding are
//! whole on every rank.

use std::ops::Range;

use kiln_kernels::matmul::Weight;

use super::arch::{Backend, Block, Decoder};
use super::cpu::{Host, Model};
use super::{ModelConfig, ModelError};

/// Weights split over ranks: each holds one part a rank.
pub(crate) struct Ranked;

impl Backend for Ranked {
    type Vector = Vec<Vec<f32>>;
    type Matrix = Vec<Weight>;
    type Stack = Vec<Vec<Weight>>;

    fn matrix_bytes(m: &Vec<Weight>) -> usize {
        m.iter().map(Weight::size_bytes).sum()
    }

    fn stack_bytes(s: &Vec<Vec<Weight>>) -> usize {
        s.iter().map(Self::matrix_bytes).sum()
    }
}

/// The shape of one rank's part of a model of `config` over `ranks`, or
/// why it does not split: heads, KV heads and the MLP's width must divide
/// evenly.
pub(crate) fn rank_config(config: &ModelConfig, ranks: usize) -> Result<ModelConfig, ModelError> {
    if ranks == 0 {
        return Err(ModelError::Unsupported(
            "tensor parallelism needs at least one rank".into(),
        ));
    }
    for (what, n) in [
        ("query heads", config.heads),
        ("KV heads", config.kv_heads),
        ("MLP width", config.ffn),
    ] {
        if !n.is_multiple_of(ranks) {
            return Err(ModelError::Unsupported(format!(
                "{ranks} tensor-parallel ranks: the model's {n} {what} do not split evenly; \
                 choose a number of ranks that divides {}, {} and {}",
                config.heads, config.kv_heads, config.ffn
            )));
        }
    }
    Ok(ModelConfig {
        heads: config.heads / ranks,
        kv_heads: config.kv_heads / ranks,
        ffn: config.ffn / ranks,
        ..config.clone()
    })
}

/// Rank `rank`'s range of `n` things split `ranks` ways, the first ranks
/// one longer where they do not divide (vocabulary rows).
pub(crate) fn part(n: usize, ranks: usize, rank: usize) -> Range<usize> {
    let (each, extra) = (n / ranks, n % ranks);
    let start = rank * each + rank.min(extra);
    start..start + each + usize::from(rank < extra)
}

/// Rank `i`'s part of block `b` of a model of `config` over `ranks`.
fn rank_block(
    b: &Block<Host>,
    config: &ModelConfig,
    ranks: usize,
    i: usize,
) -> Result<Block<Host>, ModelError> {
    let rank = rank_config(config, ranks)?;
    let hd = config.head_dim;
    let (q, kv, ffn) = (rank.heads * hd, rank.kv_heads * hd, rank.ffn);
    let each = |n: usize| i * n..(i + 1) * n;
    // A weight format whose blocks straddle a rank's edge does not split.
    let unsplit = |e: kiln_kernels::KernelError| {
        ModelError::Unsupported(format!("{ranks} tensor-parallel ranks: {e}"))
    };
    let rows = |m: &Weight, n| m.slice_rows(each(n)).map_err(unsplit);
    let cols = |m: &Weight, n| m.slice_cols(each(n)).map_err(unsplit);
    let [wq, wk, wv] = b.qkv.as_slice() else {
        return Err(ModelError::Format("a block without q, k and v".into()));
    };
    let [wg, wu] = b.gate_up.as_slice() else {
        return Err(ModelError::Format("a block without gate and up".into()));
    };
    Ok(Block {
        attn_norm: b.attn_norm.clone(),
        qkv: vec![rows(wq, q)?, rows(wk, kv)?, rows(wv, kv)?],
        qkv_bias: (b.qkv_bias.as_ref()).map(|[bq, bk, bv]| {
            [
                bq[each(q)].to_vec(),
                bk[each(kv)].to_vec(),
                bv[each(kv)].to_vec(),
            ]
        }),
        wo: cols(&b.wo, q)?,
        ffn_norm: b.ffn_norm.clone(),
        gate_up: vec![rows(wg, ffn)?, rows(wu, ffn)?],
        down: cols(&b.down, ffn)?,
    })
}

/// `w` split over `ranks` for a model of `config`, the head by
/// vocabulary rows.
pub(crate) fn shard(
    w: &Decoder<Host>,
    config: &ModelConfig,
    ranks: usize,
) -> Result<Decoder<Ranked>, ModelError> {
    let mut blocks = Vec::with_capacity(w.blocks.len());
    for b in &w.blocks {
        let parts = (0..ranks)
            .map(|i| rank_block(b, config, ranks, i))
            .collect::<Result<Vec<_>, _>>()?;
        let mut block = Block::<Ranked> {
            attn_norm: Vec::new(),
            qkv: Vec::new(),
            qkv_bias: b.qkv_bias.as_ref().map(|_| Default::default()),
            wo: Vec::new(),
            ffn_norm: Vec::new(),
            gate_up: Vec::new(),
            down: Vec::new(),
        };
        for p in parts {
            block.attn_norm.push(p.attn_norm);
            block.qkv.push(p.qkv);
            if let (Some(to), Some(from)) = (block.qkv_bias.as_mut(), p.qkv_bias) {
                to.iter_mut().zip(from).for_each(|(t, f)| t.push(f));
            }
            block.wo.push(p.wo);
            block.ffn_norm.push(p.ffn_norm);
            block.gate_up.push(p.gate_up);
            block.down.push(p.down);
        }
        blocks.push(block);
    }
    let head = w.head();
    let output = (0..ranks)
        .map(|i| head.slice_rows(part(head.rows(), ranks, i)))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Decoder {
        embed: vec![w.embed.clone(); ranks],
        blocks,
        norm: vec![w.norm.clone(); ranks],
        output: Some(output),
    })
}

/// Rank `rank`'s part of `model` as a model of its own, for a device that
/// runs one rank: its heads, its part of the MLP, and the whole output
/// head (every rank computes all the logits from the same summed rows, so
/// no rank waits on another's before sampling). One rank at a time, so a
/// host holds the model and one rank's part, not every rank's.
pub(crate) fn rank_model(model: &Model, ranks: usize, rank: usize) -> Result<Model, ModelError> {
    let config = rank_config(&model.config, ranks)?;
    let w = &model.weights;
    let blocks = (w.blocks.iter())
        .map(|b| rank_block(b, &model.config, ranks, rank))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Model {
        config,
        weights: Decoder {
            embed: w.embed.clone(),
            blocks,
            norm: w.norm.clone(),
            output: Some(w.head().clone()),
        },
        rope: model.rope.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Arch;
    use kiln_kernels::ops::{Rope, RopeStyle};

    /// A two-block model of 4 query heads and 2 KV heads of 2, numbered
    /// weights (every element says where it came from).
    fn tiny() -> Model {
        let config = ModelConfig {
            arch: Arch::Llama,
            vocab: 10,
            hidden: 8,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 2,
            ffn: 6,
            eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: None,
            rope_style: RopeStyle::Half,
            context_length: 64,
        };
        let mut next = 0.0;
        let mut w = |rows: usize, cols: usize| {
            let v = (0..rows * cols).map(|_| {
                next += 1.0;
                next
            });
            Weight::from_f32(rows, cols, v.collect()).unwrap()
        };
        let blocks = (0..2)
            .map(|_| Block::<Host> {
                attn_norm: vec![1.0; 8],
                qkv: vec![w(8, 8), w(4, 8), w(4, 8)],
                qkv_bias: Some([8, 4, 4].map(|n| (0..n).map(|i| i as f32).collect())),
                wo: w(8, 8),
                ffn_norm: vec![1.0; 8],
                gate_up: vec![w(6, 8), w(6, 8)],
                down: w(8, 6),
            })
            .collect();
        Model {
            config,
            weights: Decoder {
                embed: w(10, 8),
                blocks,
                norm: vec![1.0; 8],
                output: Some(w(10, 8)),
            },
            rope: Rope::new(2, 10000.0, None, RopeStyle::Half),
        }
    }

    fn values(w: &Weight) -> Vec<f32> {
        let mut out = vec![0.0; w.rows() * w.cols()];
        out.chunks_exact_mut(w.cols().max(1))
            .enumerate()
            .for_each(|(r, row)| w.row(r, row));
        out
    }

    #[test]
    fn each_rank_model_holds_its_heads_and_mlp_part_of_every_block_and_the_whole_head() {
        let whole = tiny();
        let ranks: Vec<Model> = (0..2).map(|i| rank_model(&whole, 2, i).unwrap()).collect();
        for (i, rank) in ranks.iter().enumerate() {
            assert_eq!(
                (rank.config.heads, rank.config.kv_heads, rank.config.ffn),
                (2, 1, 3)
            );
            for (b, w) in rank.weights.blocks.iter().zip(&whole.weights.blocks) {
                let part = |m: &Weight, rows: usize| {
                    values(&m.slice_rows(i * rows..(i + 1) * rows).unwrap())
                };
                let cols =
                    |m: &Weight, n: usize| values(&m.slice_cols(i * n..(i + 1) * n).unwrap());
                assert_eq!(values(&b.qkv[0]), part(&w.qkv[0], 4));
                assert_eq!(values(&b.qkv[1]), part(&w.qkv[1], 2));
                assert_eq!(values(&b.qkv[2]), part(&w.qkv[2], 2));
                assert_eq!(values(&b.gate_up[1]), part(&w.gate_up[1], 3));
                assert_eq!(values(&b.wo), cols(&w.wo, 4));
                assert_eq!(values(&b.down), cols(&w.down, 3));
                let (bias, whole_bias) =
                    (b.qkv_bias.as_ref().unwrap(), w.qkv_bias.as_ref().unwrap());
                assert_eq!(bias[0], whole_bias[0][i * 4..(i + 1) * 4]);
                assert_eq!(bias[2], whole_bias[2][i * 2..(i + 1) * 2]);
            }
            assert_eq!(values(rank.weights.head()), values(whole.weights.head()));
        }
        let e = rank_model(&whole, 4, 0).err().unwrap().to_string();
        assert!(e.contains("2 KV heads"), "{e}");
    }

    #[test]
    fn parts_cover_every_row_once_in_order() {
        for (n, ranks) in [(10, 3), (9, 3), (2, 4), (128256, 2)] {
            let parts: Vec<_> = (0..ranks).map(|i| part(n, ranks, i)).collect();
            assert_eq!(parts[0].start, 0);
            assert_eq!(parts[ranks - 1].end, n);
            assert!(parts.windows(2).all(|p| p[0].end == p[1].start));
            let (lo, hi) = (
                parts.iter().map(Range::len).min(),
                parts.iter().map(Range::len).max(),
            );
            assert!(hi.unwrap() - lo.unwrap() <= 1, "{parts:?}");
        }
    }
}
