#!/usr/bin/env bash
# Build .venv-sglang: SGLang 0.5.23 on CPU (no GPU, no CUDA wheels) beside pdflow, for the SGLang
# backend's tests (`make test-sglang`) and for the side-by-side SGLang baseline benchmarks.
#
# Order matters: torch 2.13.0 CPU first (the wheel on this machine's disk), so nothing later can
# pull a CUDA torch; then sglang itself with --no-deps (its metadata pins torch 2.14.1, flashinfer,
# sgl-kernel, cuda-python...); then only the packages its disaggregation modules import; then
# pdflow editable. A torchvision import stub (scripts/sglang_env/) stands in for the only
# torchvision wheels reachable here, which are CUDA builds that fail to import with CPU torch.
#
# Safe to re-run: a stamp in the env skips every install while this script, pyproject.toml and
# the imports are unchanged (about 10 s, most of it importing sglang for the check).
#
# Environment: PDFLOW_PYTHON (default python3.11, else python3), SGLANG_VENV (default .venv-sglang).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

SGLANG_VERSION=0.5.23
TORCH_SPEC="torch==2.13.0"
VENV=${SGLANG_VENV:-.venv-sglang}
STAMP="$VENV/.pdflow-sglang-stamp"
# What sglang's disaggregation modules import (found one ImportError at a time), pinned to the
# versions tested here. mooncake is needed at run time only (the transfer engine).
SGLANG_IMPORT_DEPS=(
  numpy==2.4.6 orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 requests==2.34.2 triton==3.9.0
  packaging==26.4 pillow==13.0.0 starlette==1.10.0 msgspec==0.23.0 pyzmq==27.3.0
  pydantic==2.14.4 tqdm==4.70.1 ipython==9.18.1 aiohttp==3.14.5 transformers==5.19.0
  dill==0.4.1 apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 compressed-tensors==0.18.0
  gguf==0.19.0 prometheus-client==0.26.0 mooncake-transfer-engine-non-cuda==0.3.13.post1
  # the scheduler's disaggregation queues (disaggregation/prefill.py, decode.py) and
  # managers/scheduler.py, which the backend tests and SGLang's own queue tests import
  openai==3.57.0 partial-json-parser==0.2.1.1.post7 einops==0.8.2 setproctitle==1.3.8
  fastapi==0.165.0 uvloop==0.23.0
)
PDFLOW_EXTRAS="mooncake,dev"

log() { printf '[setup-sglang] %s\n' "$*"; }
die() { printf '[setup-sglang] error: %s\n' "$*" >&2; exit 1; }
started=$SECONDS

import_check() {
  "$VENV/bin/python" - <<'PY'
import warnings
warnings.filterwarnings("ignore")
import torch
assert "+cpu" in torch.__version__, f"torch is {torch.__version__}, not the CPU build"
import mooncake.engine  # noqa: F401
import sglang.srt.disaggregation.utils  # noqa: F401
import sglang.srt.disaggregation.mooncake.conn  # noqa: F401
import sglang.srt.disaggregation.decode  # noqa: F401
import sglang.srt.disaggregation.prefill  # noqa: F401
import sglang.srt.managers.multi_tokenizer_mixin  # noqa: F401
import pdflow.sglang.conn  # noqa: F401
PY
}

wanted="$(cat "${BASH_SOURCE[0]}" pyproject.toml scripts/sglang_env/* | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$wanted" ] && import_check 2>/dev/null; then
  log "up to date ($VENV, stamp matches) in $((SECONDS - started)) s"
  exit 0
fi

python_bin=${PDFLOW_PYTHON:-}
if [ -z "$python_bin" ]; then
  if command -v python3.11 >/dev/null; then python_bin=python3.11; else python_bin=python3; fi
fi
"$python_bin" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
  || die "$python_bin is $("$python_bin" -V 2>&1); the sglang $SGLANG_VERSION wheel is cp311"
for lib in libibverbs1 librdmacm1; do
  dpkg-query -W -f='${Status}' "$lib" 2>/dev/null | grep -q "install ok installed" \
    || die "Debian package $lib is missing (mooncake links it): run 'make setup' first"
done

if ! "$VENV/bin/python" -c 'import sys' 2>/dev/null; then
  log "creating $VENV"
  rm -rf "$VENV"
  "$python_bin" -m venv "$VENV"
fi
PIP=("$VENV/bin/pip" install --progress-bar off -q)

log "1/4 $TORCH_SPEC (CPU wheel) first"
"${PIP[@]}" "$TORCH_SPEC"
"$VENV/bin/python" -c 'import torch; assert "+cpu" in torch.__version__, torch.__version__'

log "2/4 sglang==$SGLANG_VERSION --no-deps (its pins would pull CUDA wheels)"
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"

log "3/4 what sglang's disaggregation modules import"
# pip warns that sglang's own pins are unmet; expected, since they are GPU-only packages.
"${PIP[@]}" "${SGLANG_IMPORT_DEPS[@]}" "$TORCH_SPEC" 2>&1 | grep -v -E "sglang .* requires|incompatible|dependency resolver" || true

log "4/4 pdflow editable [$PDFLOW_EXTRAS] and the torchvision import stub"
"${PIP[@]}" -e ".[$PDFLOW_EXTRAS]" "$TORCH_SPEC" 2>&1 | grep -v -E "sglang .* requires|incompatible|dependency resolver" || true
site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
printf '%s\nimport pdflow_torchvision_stub\n' "$PWD/scripts/sglang_env" > "$site/pdflow-torchvision-stub.pth"

import_check || die "the env does not import; see the output above"
printf '%s\n' "$wanted" > "$STAMP"
log "ready in $((SECONDS - started)) s: $VENV ($("$VENV/bin/python" -c 'import torch, sglang; print("torch", torch.__version__, "sglang", sglang.__version__)'))"
