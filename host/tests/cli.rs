//! The `kiln` binary's command line.

use std::process::Command;

fn kiln(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .expect("running kiln");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn help_documents_every_command() {
    let (ok, text) = kiln(&["--help"]);
    assert!(ok, "{text}");
    for cmd in ["serve", "tenant", "deploy", "init", "build"] {
        assert!(text.contains(cmd), "`{cmd}` missing from:\n{text}");
    }
    let (ok, text) = kiln(&["serve", "--help"]);
    assert!(ok);
    for flag in [
        "--listen",
        "--data-dir",
        "--tls-cert",
        "--tls-key",
        "--cpu-limit-ms",
    ] {
        assert!(text.contains(flag), "`{flag}` missing from:\n{text}");
    }
    let (ok, text) = kiln(&["deploy", "--help"]);
    assert!(ok);
    assert!(
        text.contains("--tenant") && text.contains("--name"),
        "{text}"
    );
}

#[test]
fn tls_flags_must_come_together() {
    let (ok, text) = kiln(&["serve", "--tls-cert", "cert.pem"]);
    assert!(!ok);
    assert!(text.contains("--tls-key"), "{text}");
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

fn get(port: u16, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

#[test]
fn serve_prints_the_generated_token_once_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let start = || {
        Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args([
                "serve",
                "--no-models",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--data-dir",
            ])
            .arg(dir.path())
            .env_remove("KILN_ADMIN_TOKEN")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawning kiln serve")
    };
    for round in 0..2 {
        let child = start();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let health = loop {
            if let Some(r) = get(port, "/healthz") {
                break r;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "server did not come up"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        assert!(health.starts_with("HTTP/1.1 200"), "{health}");
        let status = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "kiln serve exited with {:?}",
            out.status
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        let token = std::fs::read_to_string(dir.path().join("admin-token")).unwrap();
        // Printed on the first start only.
        assert_eq!(stderr.contains(token.trim()), round == 0, "{stderr}");
    }
}

#[test]
fn run_prints_one_json_object_with_the_generation() {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args([
            "run",
            "--prompt",
            "What is the capital of France?",
            "--chat",
        ])
        .args([
            "--temperature",
            "0",
            "--max-tokens",
            "8",
            "--kv",
            "bf16",
            "--kv-memory",
            "64MiB",
            "--json",
        ])
        .output()
        .expect("running kiln run");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("stdout is one JSON object");
    assert!(v["text"].as_str().unwrap().contains("Paris"), "{v}");
    let ids = v["token_ids"].as_array().unwrap();
    assert_eq!(v["completion_tokens"].as_u64().unwrap() as usize, ids.len());
    assert!(v["prompt_tokens"].as_u64().unwrap() > 10);
}

#[test]
fn run_splits_the_model_over_tensor_parallel_ranks_or_says_why_not() {
    let args = |ranks: &str| {
        Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(["run", "--prompt", "What is the capital of France?"])
            .args(["--chat", "--temperature", "0", "--max-tokens", "8"])
            .args(["--kv", "bf16", "--kv-memory", "64MiB", "--json"])
            .args(["--tensor-parallel", ranks])
            .output()
            .expect("running kiln run")
    };
    let text = |ranks: &str| {
        let out = args(ranks);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["text"].as_str().unwrap().to_owned()
    };
    let split = text("3");
    assert!(split.contains("Paris"), "{split}");
    assert_eq!(split, text("1"));
    let out = args("2");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("9 query heads"),
        "{err}"
    );
    let (ok, err) = kiln(&["run", "--prompt", "x", "--tensor-parallel", "0"]);
    assert!(!ok && err.contains("tensor-parallel"), "{err}");
}

#[test]
fn bad_sizes_and_missing_models_are_clear_errors() {
    let (ok, text) = kiln(&["run", "--prompt", "x", "--kv-memory", "12 parsecs"]);
    assert!(!ok && text.contains("size unit"), "{text}");
    let (ok, text) = kiln(&["run", "--prompt", "x", "--model", "/no/such/model.gguf"]);
    assert!(!ok && text.contains("neither"), "{text}");
}

#[test]
fn device_cuda_without_cuda_fails_with_a_clear_error() {
    let (ok, out) = kiln(&[
        "run",
        "--model",
        "synthetic:smollm2-135m",
        "--prompt",
        "hi",
        "--max-tokens",
        "2",
        "--device",
        "cuda",
    ]);
    if ok {
        // A machine with a working GPU: the run went through on it.
        return;
    }
    assert!(
        out.contains("device unavailable") || out.contains("CUDA"),
        "an unclear error: {out}"
    );
    let (ok, out) = kiln(&["run", "--prompt", "hi", "--device", "tpu"]);
    assert!(!ok && out.contains("use cpu, cuda or cuda:N"), "{out}");
}

#[test]
fn several_devices_are_for_serve_alone() {
    for devices in ["cuda:all", "cuda:0,1"] {
        let (ok, out) = kiln(&["bench", "--concurrency", "1", "--device", devices]);
        assert!(
            !ok && out.contains("runs one engine on one device"),
            "{out}"
        );
    }
    let (ok, out) = kiln(&["serve", "--device", "cuda:0,0"]);
    assert!(!ok && out.contains("GPU 0 twice"), "{out}");
    let (ok, out) = kiln(&["serve", "--device", "cuda:0,1", "--tensor-parallel", "2"]);
    assert!(!ok && out.contains("name one device"), "{out}");
}

#[test]
fn bench_draws_its_rows_into_a_png() {
    let dir = tempfile::tempdir().unwrap();
    let png = dir.path().join("bench.png");
    let (ok, text) = kiln(&[
        "bench",
        "--concurrency",
        "1,2",
        "--prompt-tokens",
        "16",
        "--gen-tokens",
        "4",
        "--kv-formats",
        "bf16,fp8",
        "--kv-memory",
        "32MiB",
        "--plot",
        png.to_str().unwrap(),
    ]);
    assert!(ok, "{text}");
    // Two formats at two concurrencies: four rows, then the picture.
    let rows = text
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|label| label.starts_with("bf16") || label.starts_with("fp8"))
        .count();
    assert_eq!(rows, 4, "{text}");
    let bytes = std::fs::read(&png).expect("the plot");
    assert!(
        bytes.starts_with(b"\x89PNG") && bytes.len() > 10_000,
        "{} bytes",
        bytes.len()
    );
}

#[test]
fn init_refuses_a_name_that_is_not_a_function_name() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("Not_Valid");
    let (ok, text) = kiln(&["init", "--lang", "python", bad.to_str().unwrap()]);
    assert!(!ok);
    assert!(text.contains("[a-z0-9-]{1,63}"), "{text}");
    let (ok, text) = kiln(&["build", dir.path().to_str().unwrap()]);
    assert!(!ok);
    assert!(text.contains("kiln init"), "{text}");
}

#[test]
fn build_runs_the_projects_own_componentize_js_from_a_relative_path() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let (ok, text) = kiln(&[
        "init",
        "--lang",
        "js",
        dir.path().join("hi").to_str().unwrap(),
    ]);
    assert!(ok, "{text}");
    // A stand-in for npm's componentize-js: it runs in the build's copy
    // of the project and writes the component there.
    let bin = dir.path().join("hi/node_modules/.bin");
    std::fs::create_dir_all(&bin).unwrap();
    let fake = bin.join("componentize-js");
    std::fs::write(
        &fake,
        "#!/bin/sh\ntest -f kiln-entry.js && test -f kiln.js && echo wasm > app.wasm\n",
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .current_dir(dir.path())
        .args(["build", "hi"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let wasm = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert_eq!(std::fs::read_to_string(&wasm).unwrap(), "wasm\n", "{wasm}");
}
