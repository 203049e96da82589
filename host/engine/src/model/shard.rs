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

/// `w` split over `ranks` for a model of `config`.
pub(crate) fn shard(
    w: &Decoder<Host>,
    config: &ModelConfig,
    ranks: usize,
) -> Result<Decoder<Ranked>, ModelError> {
    let rank = rank_config(config, ranks)?;
    let hd = config.head_dim;
    let (q, kv, ffn) = (rank.heads * hd, rank.kv_heads * hd, rank.ffn);
    let each = |i: usize, n: usize| i * n..(i + 1) * n;
    // A weight format whose blocks straddle a rank's edge does not split.
    let unsplit = |e: kiln_kernels::KernelError| {
        ModelError::Unsupported(format!("{ranks} tensor-parallel ranks: {e}"))
    };
    let split = |m: &Weight, by: &dyn Fn(&Weight, Range<usize>) -> Result<Weight, _>, n: usize| {
        (0..ranks)
            .map(|i| by(m, each(i, n)).map_err(unsplit))
            .collect::<Result<Vec<_>, ModelError>>()
    };
    let rows = |m: &Weight, n| split(m, &|m, r| m.slice_rows(r), n);
    let cols = |m: &Weight, n| split(m, &|m, r| m.slice_cols(r), n);
    let whole = |v: &Vec<f32>| vec![v.clone(); ranks];
    let blocks = (w.blocks.iter())
        .map(|b| {
            let [wq, wk, wv] = b.qkv.as_slice() else {
                return Err(ModelError::Format("a block without q, k and v".into()));
            };
            let [wg, wu] = b.gate_up.as_slice() else {
                return Err(ModelError::Format("a block without gate and up".into()));
            };
            let (wq, wk, wv) = (rows(wq, q)?, rows(wk, kv)?, rows(wv, kv)?);
            let (wg, wu) = (rows(wg, ffn)?, rows(wu, ffn)?);
            let bias = |v: &Vec<f32>, n| (0..ranks).map(|i| v[each(i, n)].to_vec()).collect();
            Ok(Block {
                attn_norm: whole(&b.attn_norm),
                qkv: (0..ranks)
                    .map(|i| vec![wq[i].clone(), wk[i].clone(), wv[i].clone()])
                    .collect(),
                qkv_bias: (b.qkv_bias.as_ref())
                    .map(|[bq, bk, bv]| [bias(bq, q), bias(bk, kv), bias(bv, kv)]),
                wo: cols(&b.wo, q)?,
                ffn_norm: whole(&b.ffn_norm),
                gate_up: (0..ranks)
                    .map(|i| vec![wg[i].clone(), wu[i].clone()])
                    .collect(),
                down: cols(&b.down, ffn)?,
            })
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    let head = w.head();
    let output = (0..ranks)
        .map(|i| {
            head.slice_rows(part(head.rows(), ranks, i))
                .map_err(unsplit)
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Decoder {
        embed: vec![w.embed.clone(); ranks],
        blocks,
        norm: whole(&w.norm),
        output: Some(output),
    })
}

/// Each rank's part of `model` as a model of its own, for a device that
/// runs one rank: its heads, its part of the MLP, and the whole output
/// head (every rank computes all the logits from the same summed rows, so
/// no rank waits on another's before sampling).
pub(crate) fn rank_models(model: &Model, ranks: usize) -> Result<Vec<Model>, ModelError> {
    let config = rank_config(&model.config, ranks)?;
    let head = model.weights.head().clone();
    let Decoder {
        embed,
        blocks,
        norm,
        ..
    } = shard(&model.weights, &model.config, ranks)?;
    let mut parts: Vec<Decoder<Host>> = (0..ranks)
        .map(|_| Decoder {
            embed: embed[0].clone(),
            blocks: Vec::with_capacity(blocks.len()),
            norm: norm[0].clone(),
            output: Some(head.clone()),
        })
        .collect();
    for b in blocks {
        let mut bias = b
            .qkv_bias
            .map(|[q, k, v]| (q.into_iter().zip(k).zip(v)).map(|((q, k), v)| [q, k, v]));
        let each = (b.qkv.into_iter())
            .zip(b.wo)
            .zip(b.gate_up)
            .zip(b.down)
            .zip(b.attn_norm.into_iter().zip(b.ffn_norm));
        for (part, ((((qkv, wo), gate_up), down), (attn_norm, ffn_norm))) in
            parts.iter_mut().zip(each)
        {
            part.blocks.push(Block {
                attn_norm,
                qkv,
                qkv_bias: bias.as_mut().and_then(Iterator::next),
                wo,
                ffn_norm,
                gate_up,
                down,
            });
        }
    }
    Ok(parts
        .into_iter()
        .map(|weights| Model {
            config: config.clone(),
            weights,
            rope: model.rope.clone(),
        })
        .collect())
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
                qkv_bias: None,
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
        let ranks = rank_models(&whole, 2).unwrap();
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
            }
            assert_eq!(values(rank.weights.head()), values(whole.weights.head()));
        }
        let e = rank_models(&whole, 4).err().unwrap().to_string();
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
