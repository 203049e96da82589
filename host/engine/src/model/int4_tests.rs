//! GPTQ and AWQ layouts against weights built by hand, and rounding a
//! model's projections.

use super::*;
use safetensors::Dtype;

/// AWQ's packing order, as AutoAWQ packs: nibble `i` holds output
/// `AWQ_ORDER[i]` of eight.
const AWQ_ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];

/// Quants, zeros and scales of a small projection: `N` outputs of `K`
/// inputs in groups of `G`.
const N: usize = 16;
const K: usize = 256;
const G: usize = 128;

fn q(k: usize, n: usize) -> u32 {
    ((k * 7 + n * 3) % 16) as u32
}
fn z(g: usize, n: usize) -> u32 {
    ((g * 5 + n) % 15 + 1) as u32
}
fn s(g: usize, n: usize) -> f16 {
    f16::from_f32(0.01 * (1 + g + n) as f32)
}

fn bytes_u32(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|w| w.to_le_bytes()).collect()
}

fn scales() -> Vec<u8> {
    (0..K / G)
        .flat_map(|g| (0..N).map(move |n| s(g, n)))
        .flat_map(|v| v.to_le_bytes())
        .collect()
}

/// The weight each layout must give: `(q - z) * s`.
fn expected(w: &Weight) {
    let mut row = vec![0.0; K];
    for n in 0..N {
        w.row(n, &mut row);
        for (k, got) in row.iter().enumerate() {
            let g = k / G;
            let want = (q(k, n) as f32 - z(g, n) as f32) * s(g, n).to_f32();
            assert!(
                (got - want).abs() <= 1e-3 * (1.0 + want.abs()),
                "output {n}, input {k}: {got} vs {want}"
            );
        }
    }
}

#[test]
fn gptq_packs_along_the_inputs_and_stores_zeros_minus_one() {
    let mut qweight = vec![0u32; K / 8 * N];
    for k in 0..K {
        for n in 0..N {
            qweight[(k / 8) * N + n] |= q(k, n) << (4 * (k % 8));
        }
    }
    let mut qzeros = vec![0u32; K / G * N / 8];
    for g in 0..K / G {
        for n in 0..N {
            qzeros[g * N / 8 + n / 8] |= (z(g, n) - 1) << (4 * (n % 8));
        }
    }
    let g_idx: Vec<u32> = (0..K).map(|k| (k / G) as u32).collect();
    let (qw, qz, sc, gi) = (
        bytes_u32(&qweight),
        bytes_u32(&qzeros),
        scales(),
        bytes_u32(&g_idx),
    );
    let packed = Packed {
        qweight: TensorView::new(Dtype::I32, vec![K / 8, N], &qw).unwrap(),
        qzeros: TensorView::new(Dtype::I32, vec![K / G, N / 8], &qz).unwrap(),
        scales: TensorView::new(Dtype::F16, vec![K / G, N], &sc).unwrap(),
        g_idx: Some(TensorView::new(Dtype::I32, vec![K], &gi).unwrap()),
    };
    let cfg = serde_json::json!({"quantization_config": {
        "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": false}});
    let qc = QuantConfig::from_hf(&cfg).unwrap().unwrap();
    let w = unpack("q_proj", qc, &packed).unwrap();
    assert_eq!((w.rows(), w.cols(), w.dtype()), (N, K, DType::Int4G128));
    expected(&w);
    // Act-order groups are refused by name.
    let shuffled: Vec<u32> = (0..K).map(|k| ((k + 1) % K / G) as u32).collect();
    let sh = bytes_u32(&shuffled);
    let acted = Packed {
        g_idx: Some(TensorView::new(Dtype::I32, vec![K], &sh).unwrap()),
        ..packed
    };
    let e = unpack("q_proj", qc, &acted).err().unwrap().to_string();
    assert!(e.contains("act-order"), "{e}");
}

#[test]
fn awq_packs_along_the_outputs_in_its_interleaved_order() {
    let pos = |n: usize| AWQ_ORDER.iter().position(|o| *o == n % 8).unwrap();
    let mut qweight = vec![0u32; K * N / 8];
    for k in 0..K {
        for n in 0..N {
            qweight[k * N / 8 + n / 8] |= q(k, n) << (4 * pos(n));
        }
    }
    let mut qzeros = vec![0u32; K / G * N / 8];
    for g in 0..K / G {
        for n in 0..N {
            qzeros[g * N / 8 + n / 8] |= z(g, n) << (4 * pos(n));
        }
    }
    let (qw, qz, sc) = (bytes_u32(&qweight), bytes_u32(&qzeros), scales());
    let packed = Packed {
        qweight: TensorView::new(Dtype::I32, vec![K, N / 8], &qw).unwrap(),
        qzeros: TensorView::new(Dtype::I32, vec![K / G, N / 8], &qz).unwrap(),
        scales: TensorView::new(Dtype::F16, vec![K / G, N], &sc).unwrap(),
        g_idx: None,
    };
    let cfg = serde_json::json!({"quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm",
        "zero_point": true}});
    let qc = QuantConfig::from_hf(&cfg).unwrap().unwrap();
    expected(&unpack("up_proj", qc, &packed).unwrap());
    // Shapes that do not fit are a format error naming the tensor.
    let wrong = Packed {
        scales: TensorView::new(Dtype::F16, vec![K / G, N / 2], &sc[..sc.len() / 2]).unwrap(),
        ..packed
    };
    let e = unpack("up_proj", qc, &wrong).err().unwrap().to_string();
    assert!(e.contains("up_proj") && e.contains("do not fit"), "{e}");
}

#[test]
fn quantization_configs_kiln_cannot_run_are_named() {
    let cfg =
        |q: serde_json::Value| QuantConfig::from_hf(&serde_json::json!({"quantization_config": q}));
    assert_eq!(QuantConfig::from_hf(&serde_json::json!({})).unwrap(), None);
    let v2 = cfg(
        serde_json::json!({"quant_method": "gptq", "bits": 4, "group_size": 64,
        "checkpoint_format": "gptq_v2"}),
    )
    .unwrap()
    .unwrap();
    assert_eq!(v2.packing, Packing::Gptq { zero_offset: 0 });
    assert_eq!(v2.group, 64);
    for (q, says) in [
        (
            serde_json::json!({"quant_method": "gptq", "bits": 8, "group_size": 128}),
            "8-bit",
        ),
        (
            serde_json::json!({"quant_method": "gptq", "bits": 4, "group_size": -1}),
            "groups of -1",
        ),
        (
            serde_json::json!({"quant_method": "awq", "bits": 4, "group_size": 128,
            "version": "gemv"}),
            "gemv",
        ),
        (
            serde_json::json!({"quant_method": "bitsandbytes", "bits": 4, "group_size": 128}),
            "bitsandbytes",
        ),
    ] {
        let e = cfg(q).err().unwrap().to_string();
        assert!(e.contains(says), "{e}");
    }
}
