#!/usr/bin/env bash
# Installs Debian's nginx for the cluster tests, once, without starting its
# system service (the tests run throwaway instances of their own), and
# prints the binary's path. Needs root (CI and these machines run as root)
# or sudo.
set -euo pipefail
if ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then
  sudo=""
  if [ "$(id -u)" != 0 ]; then sudo=sudo; fi
  export DEBIAN_FRONTEND=noninteractive
  # Keep the package's post-install from starting a daemon on port 80.
  policy=/usr/sbin/policy-rc.d
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
    $sudo chmod +x "$policy"
    trap '$sudo rm -f "$policy"' EXIT
  fi
  $sudo apt-get update -qq >&2
  $sudo apt-get install -y -qq --no-install-recommends nginx >&2
fi
command -v nginx || echo /usr/sbin/nginx
