//! The shipped Kubernetes manifests (`deploy/k8s/`) pass a schema
//! validator: built-in kinds against Kubernetes' own schemas, the Gateway
//! API kinds against `deploy/k8s/schemas/`; a typo fails it.

use std::path::Path;

use kiln_tests::{python_venv, workspace};

fn validate(files: &[&Path]) -> (bool, String) {
    let python = python_venv(
        "pyenv-k8s",
        "import kubernetes_validate, jsonschema, yaml",
        &["kubernetes-validate==1.37.0", "jsonschema==4.26.0"],
    );
    let out = std::process::Command::new(python)
        .arg(workspace().join("scripts").join("validate_k8s.py"))
        .args(files)
        .output()
        .expect("running validate_k8s.py");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn shipped_manifests_are_valid_and_a_typo_is_caught() {
    let dir = workspace().join("deploy").join("k8s");
    let (kiln, gateway) = (dir.join("kiln.yaml"), dir.join("inference-gateway.yaml"));
    let (ok, text) = validate(&[&kiln, &gateway]);
    assert!(ok, "{text}");
    for kind in [
        "Deployment/kiln:",
        "Service/kiln:",
        "InferencePool/kiln:",
        "HTTPRoute/kiln:",
    ] {
        assert!(
            text.contains(&format!("{kind} ok")),
            "{kind} not checked:\n{text}"
        );
    }

    let tmp = tempfile::tempdir().unwrap();
    for (file, from, to) in [
        (&kiln, "  replicas: 3", "  replica: 3"),
        (&gateway, "  targetPorts:", "  targetPort:"),
    ] {
        let shipped = std::fs::read_to_string(file).unwrap();
        assert!(shipped.contains(from), "{from:?} not in {}", file.display());
        let broken = tmp.path().join("broken.yaml");
        std::fs::write(&broken, shipped.replace(from, to)).unwrap();
        let (ok, text) = validate(&[&broken]);
        assert!(!ok, "{to:?} passed:\n{text}");
        assert!(
            text.contains(to.trim().trim_end_matches(": 3").trim_end_matches(':')),
            "{text}"
        );
    }
}
