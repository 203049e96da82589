#!/usr/bin/env bash
# Installs Debian's Chromium for the status page's browser test, once, and
# prints its path. Needs root (CI and these machines run as root) or sudo.
set -euo pipefail
if ! command -v chromium >/dev/null; then
  sudo=""
  if [ "$(id -u)" != 0 ]; then sudo=sudo; fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq >&2
  $sudo apt-get install -y -qq --no-install-recommends chromium >&2
fi
command -v chromium
