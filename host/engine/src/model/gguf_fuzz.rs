//! The reader against damaged and hostile files: it answers every input
//! with a model or an error, never a panic or a crash.

use super::*;
use proptest::prelude::*;

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// A small valid GGUF v3: metadata of several types (a nested array among
/// them) and two tensors with their data.
fn sample() -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(2u64.to_le_bytes()); // tensors
    b.extend(4u64.to_le_bytes()); // metadata
    string(&mut b, "general.name");
    b.extend(8u32.to_le_bytes());
    string(&mut b, "tiny");
    string(&mut b, "tiny.block_count");
    b.extend(4u32.to_le_bytes());
    b.extend(2u32.to_le_bytes());
    string(&mut b, "tokenizer.ggml.tokens");
    b.extend(9u32.to_le_bytes());
    b.extend(8u32.to_le_bytes());
    b.extend(2u64.to_le_bytes());
    string(&mut b, "a");
    string(&mut b, "b");
    string(&mut b, "nested");
    b.extend(9u32.to_le_bytes());
    b.extend(9u32.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    b.extend(6u32.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    b.extend(1.5f32.to_le_bytes());
    for (name, dims, dtype, offset) in [("w", &[4u64, 2][..], 0u32, 0u64), ("q", &[32], 8, 32)] {
        string(&mut b, name);
        b.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(dtype.to_le_bytes());
        b.extend(offset.to_le_bytes());
    }
    b.resize(b.len().div_ceil(32) * 32, 0);
    b.extend((0..32 + 34).map(|i| i as u8));
    b
}

/// Opens `bytes` as a file and touches everything a loader reads.
fn read(bytes: &[u8]) -> Result<(), ModelError> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.gguf");
    std::fs::write(&path, bytes).unwrap();
    let g = Gguf::open(&path)?;
    for name in g.tensors.keys() {
        let _ = g.tensor_bytes(name);
    }
    for key in g.meta.keys() {
        let _ = (
            g.int(key),
            g.float(key),
            g.str(key),
            g.strings(key),
            g.ints(key),
        );
    }
    Ok(())
}

#[test]
fn the_sample_is_a_valid_file() {
    read(&sample()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("f.gguf"), sample()).unwrap();
    let g = Gguf::open(&dir.path().join("f.gguf")).unwrap();
    assert_eq!(g.strings("tokenizer.ggml.tokens"), Some(vec!["a", "b"]));
    assert_eq!(g.tensor_bytes("q").unwrap().1.len(), 34);
}

#[test]
fn deeply_nested_arrays_are_an_error_not_a_stack_overflow() {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    string(&mut b, "deep");
    b.extend(9u32.to_le_bytes());
    for _ in 0..100_000 {
        b.extend(9u32.to_le_bytes());
        b.extend(1u64.to_le_bytes());
    }
    let e = read(&b).unwrap_err().to_string();
    assert!(e.contains("nested"), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(crate::fuzz_cases(500)))]

    /// Bytes flipped, cut off or inserted anywhere: an error or a model.
    #[test]
    fn damaged_files_never_panic(
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..8),
        cut in any::<prop::sample::Index>(),
        insert in prop::collection::vec(any::<u8>(), 0..16),
        at in any::<prop::sample::Index>(),
    ) {
        let mut b = sample();
        for (i, v) in &flips {
            let i = i.index(b.len());
            b[i] = *v;
        }
        let at = at.index(b.len());
        b.splice(at..at, insert);
        b.truncate(cut.index(b.len() + 1));
        let _ = read(&b);
    }
}
