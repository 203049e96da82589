//! The files a function project builds against, carried in the binary so
//! a project needs nothing from Kiln's source tree: the WIT of the
//! `kiln:ai/function@0.2.0` world and the guest helpers for Rust, Python
//! and JavaScript.

use std::path::Path;

/// A file to write under a directory: its relative path and contents.
pub type File = (&'static str, &'static str);

/// `wit/`: Kiln's interface and the WASI 0.2 packages it includes.
pub const WIT: &[File] = &[
    ("kiln-ai.wit", include_str!("../../../wit/kiln-ai.wit")),
    ("deps/cli.wit", include_str!("../../../wit/deps/cli.wit")),
    (
        "deps/clocks.wit",
        include_str!("../../../wit/deps/clocks.wit"),
    ),
    (
        "deps/filesystem.wit",
        include_str!("../../../wit/deps/filesystem.wit"),
    ),
    ("deps/http.wit", include_str!("../../../wit/deps/http.wit")),
    ("deps/io.wit", include_str!("../../../wit/deps/io.wit")),
    (
        "deps/random.wit",
        include_str!("../../../wit/deps/random.wit"),
    ),
    (
        "deps/sockets.wit",
        include_str!("../../../wit/deps/sockets.wit"),
    ),
    // The older version keeps the Rust bindings' module names (`ai0_2_0`)
    // the same as in Kiln's own tree.
    (
        "deps/kiln-ai-0.1.0/kiln-ai.wit",
        include_str!("../../../wit/deps/kiln-ai-0.1.0/kiln-ai.wit"),
    ),
];

/// The version of the WASI packages in [`WIT`].
pub const WASI_VERSION: &str = "0.2.12";

/// The WASI version StarlingMonkey's built-in fetch handler (the engine
/// under componentize-js) exports `wasi:http/incoming-handler` at; a
/// JavaScript build must name the same one. Wasmtime links a 0.2.10
/// component against Kiln's 0.2.12 host as a semver-compatible match.
pub const JS_WASI_VERSION: &str = "0.2.10";

/// The Python helper package `kiln_guest/`.
pub const PYTHON: &[File] = &[
    (
        "kiln_guest/__init__.py",
        include_str!("../../../guest-sdk/python/kiln_guest/__init__.py"),
    ),
    (
        "kiln_guest/http.py",
        include_str!("../../../guest-sdk/python/kiln_guest/http.py"),
    ),
    (
        "kiln_guest/ai.py",
        include_str!("../../../guest-sdk/python/kiln_guest/ai.py"),
    ),
];

/// The JavaScript helper module.
pub const JS_HELPER: File = ("kiln.js", include_str!("../../../guest-sdk/js/kiln.js"));

/// The Rust guest crate `kiln-guest/` (its manifest is written apart: the
/// workspace's inherits fields a project outside it cannot).
pub const RUST_SDK: &[File] = &[
    ("src/lib.rs", include_str!("../../../guest-sdk/src/lib.rs")),
    (
        "src/http.rs",
        include_str!("../../../guest-sdk/src/http.rs"),
    ),
    ("src/ai.rs", include_str!("../../../guest-sdk/src/ai.rs")),
];

/// Writes `files` (relative paths and contents) under `dir`, making
/// directories as needed.
pub fn write(dir: &Path, files: &[(&str, &str)]) -> std::io::Result<()> {
    for (path, text) in files {
        let path = dir.join(path);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(path, text)?;
    }
    Ok(())
}

/// Writes [`WIT`] under `dir` with its WASI packages renamed to
/// `wasi_version` (a 0.2.x at or below [`WASI_VERSION`]); the one
/// function gated on a later version (`exit-with-code`) is left out.
pub fn write_wit(dir: &Path, wasi_version: &str) -> std::io::Result<()> {
    if wasi_version == WASI_VERSION {
        return write(dir, WIT);
    }
    let gate = format!("@since(version = {WASI_VERSION})");
    let renamed: Vec<(&str, String)> = WIT
        .iter()
        .map(|(path, text)| {
            let text = text.replace(&format!("@{WASI_VERSION}"), &format!("@{wasi_version}"));
            let mut out = String::with_capacity(text.len());
            let mut lines = text.lines();
            while let Some(line) = lines.next() {
                if line.trim() == gate {
                    lines.next(); // the gated item (one line) goes with its gate
                    continue;
                }
                out.push_str(line);
                out.push('\n');
            }
            (*path, out)
        })
        .collect();
    let files: Vec<(&str, &str)> = renamed.iter().map(|(p, t)| (*p, t.as_str())).collect();
    write(dir, &files)
}
