#!/usr/bin/env bash
# Installs the Python and JavaScript guest toolchains, pinned, from PyPI and
# npm into target/guest-tools (or $KILN_GUEST_TOOLS), once; prints where
# they are as KILN_COMPONENTIZE_PY=... and KILN_COMPONENTIZE_JS=... lines,
# the variables `kiln build` reads. The versions match
# kiln_host::project::{COMPONENTIZE_PY, COMPONENTIZE_JS}.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${KILN_GUEST_TOOLS:-$root/target/guest-tools}
py_pkg="componentize-py==0.25.1"
js_pkg="@bytecodealliance/componentize-js@0.23.0"

py=$dir/py/bin/componentize-py
if ! "$py" --version 2>/dev/null | grep -qx "componentize-py ${py_pkg#*==}"; then
  python3 -m venv "$dir/py"
  "$dir/py/bin/pip" install --quiet --disable-pip-version-check "$py_pkg" >&2
fi

js=$dir/js/node_modules/.bin/componentize-js
if ! "$js" --version 2>/dev/null | grep -qx "${js_pkg##*@}"; then
  mkdir -p "$dir/js"
  npm install --prefix "$dir/js" --no-audit --no-fund --loglevel=error "$js_pkg" >&2
fi

echo "KILN_COMPONENTIZE_PY=$py"
echo "KILN_COMPONENTIZE_JS=$js"
