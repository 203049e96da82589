//! Function projects: `kiln init` scaffolds one, `kiln build` turns one
//! into a component, in Rust (cargo), Python (componentize-py) or
//! JavaScript (componentize-js). The WIT and the guest helpers come from
//! the binary itself ([`embedded`]), so they always match the server.

pub mod embedded;
mod init;

use std::path::{Path, PathBuf};
use std::process::Command;

pub use init::init;

/// The language of a function project.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Lang {
    /// A cargo crate (`Cargo.toml`), built for `wasm32-wasip2`.
    Rust,
    /// `app.py` with a class `IncomingHandler`.
    Python,
    /// `app.js` with a Workers-style `export default { fetch }`.
    Js,
}

/// The pinned componentize-py the project's scripts and `kiln init` use.
pub const COMPONENTIZE_PY: &str = "componentize-py==0.25.1";
/// The pinned componentize-js the project's scripts and `kiln init` use.
pub const COMPONENTIZE_JS: &str = "@bytecodealliance/componentize-js@0.23.0";

/// Why a project could not be made or built.
#[derive(Debug, thiserror::Error)]
pub enum ProjectError {
    /// The directory holds no project Kiln knows.
    #[error(
        "{0} holds no Cargo.toml, app.py or app.js: pass a built .wasm, or a project directory (make one with `kiln init`)"
    )]
    Unknown(PathBuf),
    /// A build tool is not installed.
    #[error("{tool} not found: {fix}")]
    ToolMissing {
        /// The tool.
        tool: &'static str,
        /// How to install it.
        fix: String,
    },
    /// A build tool ran and failed.
    #[error("{tool} failed ({status}):\n{output}")]
    ToolFailed {
        /// The tool.
        tool: &'static str,
        /// Its exit status.
        status: std::process::ExitStatus,
        /// What it printed.
        output: String,
    },
    /// The project's name is not a valid function name.
    #[error("the project's directory names its function: {0}")]
    Name(String),
    /// The build ran but made no component.
    #[error("{0}")]
    NoComponent(String),
    /// `kiln init`'s target already exists.
    #[error("{0} already exists; choose another name or remove it")]
    Exists(PathBuf),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ProjectError + '_ {
    move |source| ProjectError::Io {
        path: path.to_owned(),
        source,
    }
}

/// The language of the project in `dir`.
pub fn detect(dir: &Path) -> Result<Lang, ProjectError> {
    if dir.join("Cargo.toml").is_file() {
        Ok(Lang::Rust)
    } else if dir.join("app.py").is_file() {
        Ok(Lang::Python)
    } else if dir.join("app.js").is_file() {
        Ok(Lang::Js)
    } else {
        Err(ProjectError::Unknown(dir.to_owned()))
    }
}

/// Where the Python and JavaScript build tools are. A tool left `None` is
/// looked for in the project (`.venv/bin`, `node_modules/.bin`), then on
/// PATH.
#[derive(Debug, Clone, Default)]
pub struct Tools {
    /// The `componentize-py` executable.
    pub componentize_py: Option<PathBuf>,
    /// The `componentize-js` executable.
    pub componentize_js: Option<PathBuf>,
}

impl Tools {
    /// The tools named by `KILN_COMPONENTIZE_PY` and `KILN_COMPONENTIZE_JS`.
    pub fn from_env() -> Self {
        Self {
            componentize_py: std::env::var_os("KILN_COMPONENTIZE_PY").map(PathBuf::from),
            componentize_js: std::env::var_os("KILN_COMPONENTIZE_JS").map(PathBuf::from),
        }
    }
}

/// Builds the project in `dir` with the tools the environment names;
/// returns the component's path. Python and JavaScript builds work in
/// `dir/.kiln-build/` and write `app.wasm` there.
pub fn build(dir: &Path) -> Result<PathBuf, ProjectError> {
    build_with(dir, &dir.join(".kiln-build"), &Tools::from_env())
}

/// Builds the project in `dir`, Python and JavaScript in the scratch
/// directory `work` (emptied first); returns the component's path.
pub fn build_with(dir: &Path, work: &Path, tools: &Tools) -> Result<PathBuf, ProjectError> {
    match detect(dir)? {
        Lang::Rust => build_rust(dir),
        Lang::Python => build_python(dir, work, tools),
        Lang::Js => build_js(dir, work, tools),
    }
}

fn run(tool: &'static str, cmd: &mut Command) -> Result<String, ProjectError> {
    tracing::debug!(?cmd, "building");
    let out = cmd.output().map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => ProjectError::ToolMissing {
            tool,
            fix: format!("{:?} is not installed", cmd.get_program()),
        },
        _ => ProjectError::Io {
            path: PathBuf::from(cmd.get_program()),
            source: e,
        },
    })?;
    if !out.status.success() {
        let mut output = String::from_utf8_lossy(&out.stderr).into_owned();
        // cargo's stdout is its JSON messages; the diagnostics are on stderr.
        if tool != "cargo" {
            output.push_str(&String::from_utf8_lossy(&out.stdout));
        }
        return Err(ProjectError::ToolFailed {
            tool,
            status: out.status,
            output,
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn build_rust(dir: &Path) -> Result<PathBuf, ProjectError> {
    // rust-toolchain.toml lists the target, but rustup only adds it by
    // itself where RUSTUP_AUTO_INSTALL allows; adding it is a no-op else.
    let _ = Command::new("rustup")
        .args(["target", "add", "wasm32-wasip2"])
        .current_dir(dir)
        .output();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = run(
        "cargo",
        Command::new(cargo)
            .current_dir(dir)
            .args(["build", "--release", "--target", "wasm32-wasip2"])
            .args(["--message-format", "json-render-diagnostics"]),
    )?;
    // The last artifact that is a .wasm is the package's own cdylib.
    out.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["reason"] == "compiler-artifact")
        .flat_map(|v| {
            v["filenames"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|f| f.as_str().map(PathBuf::from))
                .collect::<Vec<_>>()
        })
        .rfind(|f| f.extension().is_some_and(|e| e == "wasm"))
        .ok_or_else(|| {
            ProjectError::NoComponent(format!(
                "cargo built no .wasm in {}: is the crate type `cdylib`?",
                dir.display()
            ))
        })
}

/// The given tool, else the project's own, else `name` on PATH.
fn tool(given: &Option<PathBuf>, local: &Path, name: &str) -> PathBuf {
    given
        .clone()
        // Absolute: the tool may run in another directory.
        .or_else(|| local.is_file().then(|| std::path::absolute(local).ok())?)
        .unwrap_or_else(|| PathBuf::from(name))
}

fn missing(tool: &'static str, fix: String) -> impl FnOnce(ProjectError) -> ProjectError {
    move |e| match e {
        ProjectError::ToolMissing { .. } => ProjectError::ToolMissing { tool, fix },
        e => e,
    }
}

fn fresh(work: &Path) -> Result<PathBuf, ProjectError> {
    if work.exists() {
        std::fs::remove_dir_all(work).map_err(io(work))?;
    }
    std::fs::create_dir_all(work).map_err(io(work))?;
    // Absolute, as the tools run in other directories.
    std::path::absolute(work).map_err(io(work))
}

fn build_python(dir: &Path, work: &Path, tools: &Tools) -> Result<PathBuf, ProjectError> {
    let work = fresh(work)?;
    embedded::write_wit(&work.join("wit"), embedded::WASI_VERSION).map_err(io(&work))?;
    embedded::write(&work.join("python"), embedded::PYTHON).map_err(io(&work))?;
    let exe = tool(
        &tools.componentize_py,
        &dir.join(".venv/bin/componentize-py"),
        "componentize-py",
    );
    let out = work.join("app.wasm");
    run(
        "componentize-py",
        Command::new(exe)
            .current_dir(dir)
            .arg("-d")
            .arg(work.join("wit"))
            .args(["-w", "kiln:ai/function@0.2.0", "componentize"])
            // The project's own modules first: a kiln_guest of its own wins.
            .args(["-p", "."])
            .arg("-p")
            .arg(work.join("python"))
            .arg("app")
            .arg("-o")
            .arg(&out),
    )
    .map_err(missing(
        "componentize-py",
        format!("install it with `pip install {COMPONENTIZE_PY}`, or set KILN_COMPONENTIZE_PY"),
    ))?;
    Ok(out)
}

/// Serves the app module's default export (Workers' module syntax)
/// through StarlingMonkey's fetch event.
const JS_ENTRY: &str = "import app from \"./app.js\";\n\
    addEventListener(\"fetch\", (event) => event.respondWith(app.fetch(event.request)));\n";

fn build_js(dir: &Path, work: &Path, tools: &Tools) -> Result<PathBuf, ProjectError> {
    let work = fresh(work)?;
    copy_sources(dir, &work)?;
    if !work.join(embedded::JS_HELPER.0).exists() {
        embedded::write(&work, &[embedded::JS_HELPER]).map_err(io(&work))?;
    }
    std::fs::write(work.join("kiln-entry.js"), JS_ENTRY).map_err(io(&work))?;
    embedded::write_wit(&work.join("wit"), embedded::JS_WASI_VERSION).map_err(io(&work))?;
    let exe = tool(
        &tools.componentize_js,
        &dir.join("node_modules/.bin/componentize-js"),
        "componentize-js",
    );
    // componentize-js resolves the app's imports from its working
    // directory, so it runs inside the copy.
    run(
        "componentize-js",
        Command::new(exe).current_dir(&work).args([
            "--wit",
            "wit",
            "--world-name",
            "function",
            "-o",
            "app.wasm",
            "kiln-entry.js",
        ]),
    )
    .map_err(missing(
        "componentize-js",
        format!(
            "run `npm install` in the project (its package.json pins it) or `npm install -g {COMPONENTIZE_JS}`, or set KILN_COMPONENTIZE_JS"
        ),
    ))?;
    Ok(work.join("app.wasm"))
}

/// Copies the project's files (not `node_modules` or dot-directories)
/// into `to`.
fn copy_sources(from: &Path, to: &Path) -> Result<(), ProjectError> {
    for entry in std::fs::read_dir(from).map_err(io(from))? {
        let entry = entry.map_err(io(from))?;
        let name = entry.file_name();
        let name_str = name.to_string_lossy();
        if name_str.starts_with('.') || name_str == "node_modules" {
            continue;
        }
        let (src, dst) = (entry.path(), to.join(&name));
        if src.is_dir() {
            std::fs::create_dir_all(&dst).map_err(io(&dst))?;
            copy_sources(&src, &dst)?;
        } else {
            std::fs::copy(&src, &dst).map_err(io(&src))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_install_script_pins_the_versions_kiln_names() {
        let script = include_str!("../../../scripts/guest-tools.sh");
        assert!(script.contains(&format!("py_pkg=\"{COMPONENTIZE_PY}\"")));
        assert!(script.contains(&format!("js_pkg=\"{COMPONENTIZE_JS}\"")));
    }

    #[test]
    fn a_directory_without_a_project_says_what_would_make_one() {
        let tmp = tempfile::tempdir().unwrap();
        let err = detect(tmp.path()).unwrap_err().to_string();
        assert!(err.contains("app.py") && err.contains("kiln init"), "{err}");
        std::fs::write(tmp.path().join("app.js"), "").unwrap();
        assert_eq!(detect(tmp.path()).unwrap(), Lang::Js);
        std::fs::write(tmp.path().join("app.py"), "").unwrap();
        assert_eq!(detect(tmp.path()).unwrap(), Lang::Python);
    }

    #[test]
    fn a_missing_componentize_py_says_how_to_install_it() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("app.py"), "").unwrap();
        let tools = Tools {
            componentize_py: Some(tmp.path().join("no-such-tool")),
            componentize_js: None,
        };
        let err = build_with(tmp.path(), &tmp.path().join(".kiln-build"), &tools)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("pip install {COMPONENTIZE_PY}")),
            "{err}"
        );
    }

    #[test]
    fn wit_for_javascript_names_wasi_0_2_10_throughout() {
        let tmp = tempfile::tempdir().unwrap();
        embedded::write_wit(tmp.path(), embedded::JS_WASI_VERSION).unwrap();
        let cli = std::fs::read_to_string(tmp.path().join("deps/cli.wit")).unwrap();
        assert!(cli.starts_with("package wasi:cli@0.2.10;"), "{cli}");
        assert!(!cli.contains("exit-with-code"));
        for (path, _) in embedded::WIT {
            let text = std::fs::read_to_string(tmp.path().join(path)).unwrap();
            assert!(!text.contains(embedded::WASI_VERSION), "{path}");
        }
    }
}
