#!/usr/bin/env bash
# Installs Debian packages without letting their post-install start system
# services (the tests start throwaway instances of their own). Needs root
# (CI and these machines run as root) or sudo.
set -euo pipefail
sudo=""
if [ "$(id -u)" != 0 ]; then sudo=sudo; fi
export DEBIAN_FRONTEND=noninteractive
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
  $sudo chmod +x "$policy"
  trap '$sudo rm -f "$policy"' EXIT
fi
$sudo apt-get -o DPkg::Lock::Timeout=300 update -qq >&2
$sudo apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends "$@" >&2
