"""Validates Kubernetes manifests offline: built-in kinds against
kubernetes-validate's bundled schemas (strict: unknown fields fail), the
Gateway API kinds against the schemas in deploy/k8s/schemas/. Exit status 1
on any problem, including a kind no schema covers.

    python scripts/validate_k8s.py deploy/k8s/*.yaml
"""

import json
import pathlib
import sys

import jsonschema
import kubernetes_validate
import yaml

K8S_VERSION = "1.37.0"
SCHEMAS = pathlib.Path(__file__).resolve().parent.parent / "deploy" / "k8s" / "schemas"
CUSTOM = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-v1.json",
}


def problems(doc):
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in CUSTOM:
        schema = json.loads((SCHEMAS / CUSTOM[key]).read_text())
        validator = jsonschema.Draft202012Validator(schema)
        return [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError as e:
        return [f"no schema for {key}: {e}"]
    except kubernetes_validate.ValidationError as e:
        return [f"{'/'.join(map(str, e.path))}: {e.message}"]
    return []


def main(paths):
    bad = 0
    for path in paths:
        for i, doc in enumerate(yaml.safe_load_all(pathlib.Path(path).read_text())):
            if doc is None:
                continue
            name = f"{path}#{i} {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            found = problems(doc)
            for p in found:
                print(f"{name}: {p}")
            bad += bool(found)
            if not found:
                print(f"{name}: ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
