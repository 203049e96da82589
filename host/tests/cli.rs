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
    for cmd in ["serve", "tenant", "deploy"] {
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
