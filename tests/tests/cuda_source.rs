//! The CUDA kernels compile: NVRTC (from PyPI, no GPU needed) builds the
//! source Kiln compiles at run time, for Hopper and Ampere, so a CUDA error
//! fails CI instead of the next GPU session.

use std::process::{Command, Stdio};

use kiln_tests::{python_with_nvrtc, workspace};

#[test]
fn cuda_source_compiles_with_nvrtc_for_hopper_and_ampere() {
    let python = python_with_nvrtc();
    let dir = workspace().join("target").join("nvrtc-check");
    std::fs::create_dir_all(&dir).unwrap();
    let source = dir.join("kiln.cu");
    std::fs::write(&source, kiln_kernels::cuda::SOURCE).unwrap();
    // One process an architecture, side by side (each takes a few seconds
    // of one core with the check's fast-compile option).
    let archs = ["compute_90a", "compute_90", "compute_80"];
    let checks: Vec<_> = archs
        .iter()
        .map(|arch| {
            Command::new(&python)
                .arg(workspace().join("scripts").join("nvrtc_check.py"))
                .arg(&source)
                .arg(arch)
                .stdout(Stdio::piped())
                .spawn()
                .expect("run the NVRTC check")
        })
        .collect();
    for (arch, check) in archs.iter().zip(checks) {
        let out = check.wait_with_output().expect("wait for the NVRTC check");
        let log = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "NVRTC rejected the kernels for {arch}:\n{log}"
        );
        assert!(log.contains(&format!("{arch}: ok")), "{log}");
    }
}
