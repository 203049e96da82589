#!/usr/bin/env bash
# Installs Debian's PostgreSQL server for the control-plane tests, once,
# and prints the directory of its binaries (initdb, pg_ctl).
set -euo pipefail
find_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1; }
if [ -z "$(find_bin)" ] || [ ! -x "$(find_bin)/initdb" ]; then
  bash "$(dirname "$0")/apt-install.sh" postgresql
fi
find_bin
