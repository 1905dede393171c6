#!/usr/bin/env bash
# Prints the path of a shim to LD_PRELOAD when this machine advertises AMX but traps its instructions
# (llama.cpp built with -march=native then dies with SIGILL on its first prompt), and nothing otherwise.
# .ci/run and docs/development.md use it; it is a workaround for such machines, not part of localrt.
set -uo pipefail
grep -qw amx_tile /proc/cpuinfo 2>/dev/null || exit 0
command -v gcc >/dev/null 2>&1 || exit 0
here="$(cd "$(dirname "$0")" && pwd)"
out="${XDG_CACHE_HOME:-$HOME/.cache}/localrt-ci/amx"
mkdir -p "$out"
gcc -O1 -mamx-tile -o "$out/probe" "$here/probe.c" 2>/dev/null || exit 0
bash -c '"$1"; exit $?' _ "$out/probe" >/dev/null 2>&1
[ $? -eq 132 ] || exit 0
gcc -O2 -shared -fPIC -o "$out/noamx.so" "$here/noamx.c" -ldl || exit 0
echo "$out/noamx.so"
