//! A sequence's pages moved through one buffer of pages (prefill on one
//! engine, decode on another): the bytes read back from the pages they
//! were written into must hold, through the CPU's reading of the same
//! layout, each layer's own keys and values.

use kiln_kernels::backend::{AttentionCase, layer_case};
use kiln_kernels::kv::{KvFormat, KvPages};

use super::attention::{LLAMA3, SMALL, attention_case};
use super::{backend, rng};

/// Largest error of a stored element against `max`, the vector's largest
/// magnitude: half a bf16 step, or half an e4m3 step at the top binade.
fn tolerance(format: KvFormat) -> f32 {
    match format {
        KvFormat::Bf16 => 1.0 / 128.0,
        KvFormat::Fp8 | KvFormat::Fp8Static => 1.0 / 14.0,
    }
}

/// Checks that `bytes` (pages `to`, each page's layers in turn) hold each
/// layer's rows where the block tables put them before the move.
fn check_moved(case: &AttentionCase, layers: usize, from: &[u32], to: &[u32], bytes: &[u8]) {
    let per = case.layout.page_bytes(case.format);
    assert_eq!(bytes.len(), per * layers * to.len());
    let mut pools: Vec<KvPages> = (0..layers)
        .map(|_| KvPages::new(case.format, case.layout, case.num_pages))
        .collect();
    let mut parts = bytes.chunks(per);
    for &p in to {
        for pool in &mut pools {
            pool.write_page(p as usize, parts.next().unwrap()).unwrap();
        }
    }
    let (ps, hd) = (case.layout.page_size, case.layout.head_dim);
    let mut got = vec![0.0f32; hd];
    for (l, pool) in pools.iter().enumerate() {
        for row in &layer_case(case, l).rows {
            let i = from
                .iter()
                .position(|p| *p as usize == row.slot / ps)
                .unwrap();
            let (page, slot) = (to[i] as usize, row.slot % ps);
            for (value, want) in [(false, &row.k), (true, &row.v)] {
                for h in 0..case.layout.kv_heads {
                    pool.read(value, page, slot, h, &mut got);
                    let want = &want[h * hd..(h + 1) * hd];
                    let max = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                    for (g, w) in got.iter().zip(want) {
                        let what = format!("{:?} layer {l} page {page} slot {slot}", case.format);
                        assert!(
                            (g - w).abs() <= tolerance(case.format) * max,
                            "{what}: {g} vs {w}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn pages_moved_through_a_buffer_hold_each_layers_keys_and_values() {
    let (be, mut r) = (backend(), rng());
    for format in [KvFormat::Bf16, KvFormat::Fp8, KvFormat::Fp8Static] {
        for shape in [SMALL, LLAMA3] {
            let (mut case, _, _) = attention_case(&mut r, format, &[37, 20], shape);
            let from: Vec<u32> = case.tables.concat();
            // Fresh pages past the case's pool, in reverse order.
            let to: Vec<u32> = (0..from.len() as u32)
                .map(|i| (case.num_pages + from.len()) as u32 - 1 - i)
                .collect();
            case.num_pages += from.len();
            let layers = 3;
            let bytes = be.kv_pages_moved(&case, layers, &from, &to).unwrap();
            check_moved(&case, layers, &from, &to, &bytes);
        }
    }
}
