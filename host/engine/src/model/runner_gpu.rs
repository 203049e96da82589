//! A runner's place on GPUs: the whole model on one (with decode's own
//! copy of the weights where the phases have their own), or split over
//! tensor-parallel ranks on several.

use kiln_kernels::KernelError;

use super::{Place, Reserve, RunnerOptions};
use crate::model::gpu::{FoldFormats, GpuKv, GpuModel, GpuRank, RankSum};
use crate::model::shard::rank_model;
use crate::model::step::RunLane;
use crate::model::{Loaded, Model};

/// The whole model on GPU `n`, taking the weights a previous runner gave
/// back if they match.
pub(super) fn gpu_place(loaded: &Loaded, o: &RunnerOptions, n: usize) -> Result<Place, String> {
    if o.side_lane && !o.graphs {
        return Err(
            "disaggregation on a GPU needs CUDA graphs on (--cuda-graphs on): \
                    its lanes run on streams of their own, which graphs need too"
                .into(),
        );
    }
    let kept = loaded.gpu_weights.lock().ok().and_then(|mut s| s.take());
    let upload = |m: &Model| GpuModel::upload(m, n, o.graphs).map(Box::new);
    let (model, mut decode) = match kept {
        Some((ordinal, model, decode)) if ordinal == n && model.uses_graphs() == o.graphs => {
            (Ok(model), decode)
        }
        _ => {
            let decode = loaded.decode.as_ref().map(upload).transpose();
            (upload(&loaded.model), decode.map_err(|e| e.to_string())?)
        }
    };
    let mut model = model.map_err(|e| e.to_string())?;
    for m in std::iter::once(&mut model).chain(decode.as_mut()) {
        configure(m, o)?;
        if o.side_lane {
            m.open_side_lane().map_err(|e| e.to_string())?;
            // Weights a failed engine gave back may have left the decode
            // stream ahead; a new engine starts level.
            if let Err(e) = m.set_urgent(RunLane::Main, false) {
                tracing::warn!("decode lane priority left as it was: {e}");
            }
        }
    }
    tracing::info!(device = model.device_name(), "model weights on the GPU");
    if o.tune_bf16 {
        // Before the KV pages take the memory its weight copies borrow.
        let decoder = match decode.as_mut() {
            Some(d) => d,
            None => &mut model,
        };
        // An optimization: where it fails, cuBLAS's own choices serve.
        match decoder.tune_bf16(o.reserve.rows) {
            Ok((kept, timed)) => tracing::info!(kept, timed, "bf16 decode products tuned"),
            Err(e) => tracing::warn!("bf16 decode products left to cuBLAS's choice: {e}"),
        }
    } else {
        for m in std::iter::once(&mut model).chain(decode.as_mut()) {
            m.clear_bf16_tuning().map_err(|e| e.to_string())?;
        }
    }
    let mut kv = pages(&model, o)?;
    let Reserve { tokens, rows } = o.reserve;
    let fail = |e| reserve_failed(o, e);
    // Disaggregated, the side lane prefills and the main lane
    // decodes, a token a sequence, on the decode weights where
    // the phases have their own.
    let prefill_lane = if o.side_lane {
        RunLane::Side
    } else {
        RunLane::Main
    };
    model
        .reserve(&mut kv, prefill_lane, (tokens, tokens, rows))
        .map_err(fail)?;
    if o.side_lane {
        let decoder = decode.as_deref().unwrap_or(&*model);
        decoder
            .reserve(&mut kv, RunLane::Main, (rows, tokens.max(rows), rows))
            .map_err(fail)?;
    }
    Ok(Place::Gpu(model, Box::new(kv), decode))
}

/// Sets a GPU model's paths as `o` asks.
fn configure(m: &mut GpuModel, o: &RunnerOptions) -> Result<(), String> {
    m.set_programmatic(o.programmatic);
    let q = FoldFormats {
        int4: o.fold_int4,
        fp8: o.fold_fp8,
    };
    m.set_fold(o.fold, q);
    m.set_skinny(o.skinny);
    m.set_int4_rows(o.int4_rows);
    m.set_cluster(o.cluster);
    m.set_rope_in_attention(o.rope_in_attention);
    m.set_attention(o.attention);
    m.set_bf16_mlp(o.bf16_mlp, o.bf16_mlp_decode);
    m.set_prefill_warps(o.prefill_warps)
        .map_err(|e| e.to_string())
}

/// A GPU model's KV pages as `o` asks.
fn pages(m: &GpuModel, o: &RunnerOptions) -> Result<GpuKv, String> {
    let mut kv = (m.kv(o.kv_format, o.page_size, o.num_pages)).map_err(|e| e.to_string())?;
    kv.set_tensor_prefill(o.tensor_prefill);
    Ok(kv)
}

fn reserve_failed(o: &RunnerOptions, e: KernelError) -> String {
    let Reserve { tokens, rows } = o.reserve;
    format!("working buffers for steps of {tokens} tokens and {rows} sequences: {e}")
}

/// The model split over `o.ranks` ranks on GPUs `first`, `first + 1`, ...
/// (wrapping around the GPUs there are), with decode's copy of the weights
/// split alike where the phases have their own: on as many different GPUs
/// their projections are summed by NCCL, in graphs where `o` asks; ranks
/// that share a GPU sum through the host, without graphs (slow: for tests
/// on one GPU).
pub(super) fn gpu_ranks(
    loaded: &Loaded,
    o: &RunnerOptions,
    first: usize,
) -> Result<Vec<GpuRank>, String> {
    if o.side_lane {
        return Err(
            "tensor-parallel ranks on GPUs run one lane: turn --pd off (a prefill pool of \
             its own, --prefill-device, works with ranks)"
                .into(),
        );
    }
    let count = kiln_kernels::cuda::Gpu::count().map_err(|e| e.to_string())?;
    let ordinals: Vec<usize> = (0..o.ranks).map(|i| (first + i) % count.max(1)).collect();
    // (first + i) % count are as many GPUs as ranks where there are enough.
    let apart = count >= o.ranks;
    if !apart {
        tracing::warn!(
            ranks = o.ranks,
            gpus = count,
            "tensor-parallel ranks share GPUs: their sums go through the host, without graphs"
        );
    }
    // Each rank's parts are cut one rank at a time, so the host holds the
    // model and one part.
    let upload = |m: &Model| {
        (ordinals.iter().enumerate())
            .map(|(i, n)| {
                let part = rank_model(m, o.ranks, i).map_err(|e| e.to_string())?;
                GpuModel::upload(&part, *n, o.graphs && apart).map_err(|e| e.to_string())
            })
            .collect::<Result<Vec<_>, _>>()
    };
    let models = upload(&loaded.model)?;
    let decodes = loaded.decode.as_ref().map(upload).transpose()?;
    let sums = if apart {
        GpuModel::nccl_sums(&models).map_err(|e| e.to_string())?
    } else {
        RankSum::through_host(o.ranks)
    };
    let mut decodes = decodes.map(Vec::into_iter);
    let mut ranks = Vec::with_capacity(o.ranks);
    for (mut model, sum) in models.into_iter().zip(sums) {
        let mut decode = decodes.as_mut().and_then(Iterator::next);
        for m in std::iter::once(&mut model).chain(decode.as_mut()) {
            m.set_rank_sum(sum.clone());
            configure(m, o)?;
        }
        let mut kv = pages(&model, o)?;
        let Reserve { tokens, rows } = o.reserve;
        let fail = |e| reserve_failed(o, e);
        (model.reserve(&mut kv, RunLane::Main, (tokens, tokens, rows))).map_err(fail)?;
        if let Some(d) = &decode {
            // Decode's passes are one token a sequence.
            (d.reserve(&mut kv, RunLane::Main, (rows, tokens.max(rows), rows))).map_err(fail)?;
        }
        ranks.push(GpuRank { model, kv, decode });
    }
    tracing::info!(
        ranks = o.ranks,
        ?ordinals,
        phases_apart = loaded.decode.is_some(),
        "model weights split over GPU ranks"
    );
    Ok(ranks)
}
