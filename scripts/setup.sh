#!/usr/bin/env bash
# Prepare this machine for pdflow: Debian libraries, a Python 3.11 virtualenv in .venv, and the
# project installed editable with all extras. Safe to re-run: it only does what is missing, and
# skips the Python installs while pyproject.toml is unchanged (stamp file in .venv).
#
# Environment: PDFLOW_PYTHON picks the interpreter (default: python3.11, else python3).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

APT_PACKAGES=(libibverbs1 librdmacm1 chromium iproute2)
TORCH_SPEC="torch==2.13.0"
EXTRAS="kernels,mooncake,bench,dev"
VENV=.venv
STAMP="$VENV/.pdflow-setup-stamp"

log() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }
started=$SECONDS

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

# -- Debian packages: the Mooncake engine links libibverbs/librdmacm even for TCP; chromium
#    renders traces in the trace-view tests; iproute2 (ip, tc) builds the chaos harness's
#    network namespaces and its partition, one-way and slow-link faults.
missing=()
for package in "${APT_PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done
if [ "${#missing[@]}" -gt 0 ]; then
  command -v apt-get >/dev/null || die "need Debian packages ${missing[*]} but apt-get is absent"
  log "apt-get update, then install: ${missing[*]}"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    "${missing[@]}"
else
  log "Debian packages present: ${APT_PACKAGES[*]}"
fi

# -- Python interpreter: 3.11 or newer.
python_bin=${PDFLOW_PYTHON:-}
if [ -z "$python_bin" ]; then
  if command -v python3.11 >/dev/null; then python_bin=python3.11; else python_bin=python3; fi
fi
command -v "$python_bin" >/dev/null || die "no $python_bin on PATH; install Python 3.11"
"$python_bin" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || die "$python_bin is $("$python_bin" -V 2>&1); pdflow needs Python 3.11+"

# -- Virtualenv: (re)create when missing or broken.
if ! "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  log "creating $VENV with $("$python_bin" -V 2>&1)"
  rm -rf "$VENV"
  if ! "$python_bin" -m venv "$VENV" 2>/dev/null; then
    # Debian's own python3 ships venv/ensurepip separately.
    rm -rf "$VENV"
    command -v apt-get >/dev/null || die "$python_bin -m venv failed; install its venv module"
    log "installing python3-venv (apt-get)"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3-venv
    "$python_bin" -m venv "$VENV"
  fi
fi

# -- Python packages, skipped while the stamp matches pyproject.toml and the imports work.
wanted="$(sha256sum pyproject.toml | cut -d' ' -f1) $TORCH_SPEC [$EXTRAS]"
installed_versions() {
  "$VENV/bin/python" -c 'import importlib.metadata as m
names = ("pdflow", "torch", "mooncake-transfer-engine-non-cuda")
print(", ".join(f"{name} {m.version(name)}" for name in names))'
}
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$wanted" ] && installed_versions >/dev/null 2>&1; then
  log "Python packages up to date (stamp matches pyproject.toml)"
else
  log "installing $TORCH_SPEC first (pins the torch that triton and the kernels use)"
  "$VENV/bin/pip" install --progress-bar off "$TORCH_SPEC"
  log "installing pdflow editable with extras [$EXTRAS]"
  "$VENV/bin/pip" install --progress-bar off -e ".[$EXTRAS]"
  "$VENV/bin/python" -c 'import pdflow, torch, mooncake.engine' \
    || die "installed packages do not import; see the pip output above"
  printf '%s\n' "$wanted" > "$STAMP"
fi

log "ready in $((SECONDS - started)) s: $("$VENV/bin/python" -V), $(installed_versions)"
