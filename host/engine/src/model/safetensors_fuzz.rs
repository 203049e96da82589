//! safetensors files against damage: the header is the `safetensors`
//! crate's to check; what Kiln makes of each tensor must never panic.

use super::*;
use proptest::prelude::*;

fn sample() -> Vec<u8> {
    use safetensors::tensor::TensorView;
    let a: Vec<u8> = (0..24).collect();
    let b: Vec<u8> = (0..8).collect();
    let tensors = [
        (
            "a",
            TensorView::new(safetensors::Dtype::F32, vec![2, 3], &a).unwrap(),
        ),
        (
            "b",
            TensorView::new(safetensors::Dtype::BF16, vec![4], &b).unwrap(),
        ),
    ];
    safetensors::serialize(tensors, None).unwrap()
}

#[test]
fn the_sample_gives_its_weights() {
    let blob = sample();
    let st = safetensors::SafeTensors::deserialize(&blob).unwrap();
    assert!(safetensors_weight("a", &st.tensor("a").unwrap()).is_ok());
    assert!(safetensors_weight("b", &st.tensor("b").unwrap()).is_ok());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(crate::fuzz_cases(1000)))]

    #[test]
    fn damaged_files_never_panic(
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut b = sample();
        for (i, v) in &flips {
            let i = i.index(b.len());
            b[i] = *v;
        }
        b.truncate(cut.index(b.len() + 1).max(b.len() / 2));
        if let Ok(st) = safetensors::SafeTensors::deserialize(&b) {
            for name in st.names() {
                if let Ok(t) = st.tensor(name) {
                    let _ = safetensors_weight(name, &t);
                }
            }
        }
    }
}
