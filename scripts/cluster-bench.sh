#!/usr/bin/env bash
# Hello throughput of one node called directly against three nodes behind
# the shipped deploy/nginx/kiln.conf, side by side in one run, all on this
# machine (issue 21's goal: the gateway keeps >= 0.8x). The nodes share a
# throwaway PostgreSQL; wrk (Debian's) sends GETs that carry 64 session
# keys, so nginx spreads them over the nodes.
#
# Then a burst of BURST deploys spread over the three nodes, and how long
# until every node serves every function's last version (scripts/deploy_burst.py).
#
#   scripts/cluster-bench.sh     # ROUNDS=8 DURATION=5 CONNS=64 BURST=1000 NGINX_WORKERS=auto
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-8}
DURATION=${DURATION:-5}
CONNS=${CONNS:-64}
BURST=${BURST:-1000}

cargo build --release --bin kiln -q
cargo build --target wasm32-wasip2 --profile guest -p hello -p misbehave --target-dir target/guests -q
kiln=$PWD/target/release/kiln
guests=target/guests/wasm32-wasip2/guest
component=$guests/hello.wasm
nginx=$(bash scripts/nginx.sh)
pgbin=$(bash scripts/postgres.sh)
command -v wrk >/dev/null || bash scripts/apt-install.sh wrk

tmp=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  as_pg "$pgbin/pg_ctl" -D "$tmp/pg" -m immediate stop >/dev/null 2>&1 || true
  rm -rf "$tmp"
}
trap cleanup EXIT
# initdb refuses to run as root.
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

[ "$(id -u)" = 0 ] && chown postgres "$tmp"
pgport=$(free_port)
as_pg "$pgbin/initdb" -D "$tmp/pg" --auth=trust -U kiln -E UTF8 >/dev/null
as_pg "$pgbin/pg_ctl" -D "$tmp/pg" -l "$tmp/pg.log" -w \
  -o "-p $pgport -k $tmp -c listen_addresses=127.0.0.1 -c fsync=off" start >/dev/null
db="postgres://kiln@127.0.0.1:$pgport/postgres"

ports=()
for i in 1 2 3; do
  port=$(free_port)
  ports+=("$port")
  KILN_ADMIN_TOKEN=bench "$kiln" serve --no-models --database "$db" \
    --listen "127.0.0.1:$port" --data-dir "$tmp/node$i" 2>"$tmp/node$i.log" &
  pids+=($!)
done
for port in "${ports[@]}"; do
  until curl -sf "http://127.0.0.1:$port/healthz" >/dev/null; do sleep 0.2; done
done

# The shipped config with these nodes and a listener of ours.
gw=$(free_port)
mkdir -p "$tmp/nginx"
{
  echo "worker_processes ${NGINX_WORKERS:-auto}; pid $tmp/nginx/pid; error_log $tmp/nginx/error.log warn;"
  echo "events { worker_connections 4096; }"
  echo "http { access_log off; client_body_temp_path $tmp/nginx/body; proxy_temp_path $tmp/nginx/proxy;"
  awk -v gw="$gw" -v nodes="${ports[*]}" '
    /# KILN NODES/ { n = split(nodes, p, " "); for (i = 1; i <= n; i++)
      printf "    server 127.0.0.1:%s max_fails=1 fail_timeout=2s;\n", p[i]; skip = 1; next }
    skip && /^ *server / { next }
    { skip = 0 }
    /^ *listen / { printf "    listen 127.0.0.1:%s;\n", gw; next }
    { print }' deploy/nginx/kiln.conf
  echo "}"
} >"$tmp/nginx/nginx.conf"
"$nginx" -p "$tmp/nginx" -c "$tmp/nginx/nginx.conf" -g "daemon off;" &
pids+=($!)
until curl -s -o /dev/null "http://127.0.0.1:$gw/healthz"; do sleep 0.2; done

key=$(curl -sf -H "authorization: Bearer bench" -d '{"name":"acme"}' \
  "http://127.0.0.1:${ports[0]}/v1/tenants" | python3 -c 'import json,sys; print(json.load(sys.stdin)["api_key"])')
curl -sf -X PUT -H "authorization: Bearer $key" --data-binary "@$component" \
  "http://127.0.0.1:${ports[0]}/v1/functions/hello" >/dev/null
sleep 1

cat >"$tmp/sessions.lua" <<'EOF'
local n = 0
request = function()
  n = n + 1
  return wrk.format("GET", "/fn/acme/hello/", { ["x-session-affinity"] = "s" .. (n % 64) })
end
EOF
rate() {
  wrk -t2 -c"$CONNS" -d"${DURATION}s" -s "$tmp/sessions.lua" "$1" \
    | awk '/Requests\/sec/ { print $2 } /Non-2xx|Socket errors/ { print "WRK: " $0 > "/dev/stderr" }'
}
# Warm every node's compiled component and pooled instances.
rate "http://127.0.0.1:$gw" >/dev/null

echo "rounds=$ROUNDS duration=${DURATION}s connections=$CONNS cores=$(nproc)"
printf '%-6s %12s %12s %7s\n' round direct_rps gateway_rps ratio
: >"$tmp/rounds"
# CPU time (clock ticks) of every process named $1.
ticks() { local t=0 p; for p in $(pgrep -x "$1"); do t=$((t + $(awk '{ print $14 + $15 }' "/proc/$p/stat"))); done; echo "$t"; }
cpu_us=()  # microseconds of CPU a request: kiln direct, kiln and nginx via the gateway
for r in $(seq "$ROUNDS"); do
  k0=$(ticks kiln)
  direct=$(rate "http://127.0.0.1:${ports[0]}")
  k1=$(ticks kiln) n1=$(ticks nginx)
  gateway=$(rate "http://127.0.0.1:$gw")
  k2=$(ticks kiln) n2=$(ticks nginx)
  hz=$(getconf CLK_TCK)
  cpu_us+=("$(awk -v a=$((k1 - k0)) -v b=$((k2 - k1)) -v c=$((n2 - n1)) -v d="$direct" -v g="$gateway" -v s="$DURATION" -v hz="$hz" \
    'BEGIN { f = 1e6 / hz / s; printf "%.0f %.0f %.0f", a * f / d, b * f / g, c * f / g }')")
  echo "$direct $gateway" >>"$tmp/rounds"
  awk -v r="$r" -v d="$direct" -v g="$gateway" 'BEGIN { printf "%-6s %12s %12s %7.3f\n", r, d, g, g / d }'
done
# This machine's rate swings between rounds, so the figure is the ratio of
# the medians of rounds run in turn.
median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
d=$(cut -d' ' -f1 "$tmp/rounds" | median)
g=$(cut -d' ' -f2 "$tmp/rounds" | median)
awk -v d="$d" -v g="$g" 'BEGIN { printf "%-6s %12.0f %12.0f %7.3f\n", "median", d, g, g / d }'
printf '%s\n' "${cpu_us[@]}" | awk '{ a += $1; b += $2; c += $3 } END {
  printf "CPU a request (us): kiln direct %.0f; through the gateway kiln %.0f + nginx %.0f\n", a / NR, b / NR, c / NR }'

urls=()
for port in "${ports[@]}"; do urls+=("http://127.0.0.1:$port"); done
python3 scripts/deploy_burst.py "$key" acme "$BURST" "${urls[@]}" -- \
  "$guests/hello.wasm" "Hello from Kiln!" "$guests/misbehave.wasm" ok
