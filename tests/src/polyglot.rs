//! Python and JavaScript guests, built with the toolchains that
//! `scripts/guest-tools.sh` installs from PyPI and npm.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use kiln_host::project::{self, Tools};

use crate::workspace;

/// The pinned componentize-py and componentize-js, installed under
/// `target/guest-tools` by the project's script on first use.
pub fn guest_tools() -> Tools {
    static TOOLS: OnceLock<Tools> = OnceLock::new();
    TOOLS
        .get_or_init(|| {
            let stdout = crate::script_output("guest-tools.sh");
            let path = |var: &str| {
                stdout
                    .lines()
                    .find_map(|l| l.strip_prefix(var)?.strip_prefix('='))
                    .map(PathBuf::from)
            };
            Tools {
                componentize_py: path("KILN_COMPONENTIZE_PY"),
                componentize_js: path("KILN_COMPONENTIZE_JS"),
            }
        })
        .clone()
}

/// Builds the project at `dir` (relative to the workspace) with the
/// pinned tools, in `target/guest-builds/`; returns the component's bytes.
/// Builds run one at a time: each is a CPU-heavy process of its own.
pub fn build_project(dir: &str) -> Vec<u8> {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let tools = guest_tools();
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let work = workspace()
        .join("target")
        .join("guest-builds")
        .join(dir.replace('/', "-"));
    let wasm = project::build_with(&workspace().join(dir), Path::new(&work), &tools)
        .unwrap_or_else(|e| panic!("building {dir}: {e}"));
    std::fs::read(&wasm).unwrap_or_else(|e| panic!("{}: {e}", wasm.display()))
}
