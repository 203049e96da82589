#!/usr/bin/env bash
# Installs Debian's nginx for the cluster tests, once, and prints the
# binary's path.
set -euo pipefail
if ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then
  bash "$(dirname "$0")/apt-install.sh" nginx
fi
command -v nginx || echo /usr/sbin/nginx
