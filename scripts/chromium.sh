#!/usr/bin/env bash
# Installs Debian's Chromium for the status page's browser test, once, and
# prints its path.
set -euo pipefail
if ! command -v chromium >/dev/null; then
  bash "$(dirname "$0")/apt-install.sh" chromium
fi
command -v chromium
