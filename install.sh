#!/usr/bin/env bash
# Set napkin up for ${PYTHON:-python3}.    usage: ./install.sh [--test]
#
#   --test   also install the test tools (pytest, hypothesis, pytest-xdist)
#
# Safe to run again: it installs only what is missing and says one line.
#
# * torch: if `import torch` fails, torch==2.13.0 is installed first.  It is
#   pinned because an unpinned `pip install torch` may pull gigabytes of CUDA
#   packages; where pip is set up with the CPU wheels (as here) the pin picks
#   the CPU build.  Set TORCH_INDEX_URL to install torch from another index
#   (for instance PyTorch's CPU wheel index).  An installed torch is never
#   replaced: napkin's own install leaves a satisfied dependency alone.
# * napkin is installed editable, in setuptools' "compat" mode, which puts
#   the repository root itself on sys.path.  That is what keeps
#   `from generated.attention import attention` working (generated/ is not a
#   package napkin ships: it is what `napkin compile` writes into the
#   checkout), and it means edits to napkin/, grammars/ and templates/ take
#   effect without reinstalling.  A copied (non-editable) install would leave
#   two napkins to drift apart: the one in site-packages that the `napkin`
#   script runs and the checkout that `python -m pytest` imports.
# * graphviz's `dot` draws the pictures; without it napkin writes .dot text.
#   As root with apt-get it is installed quietly, otherwise a hint is printed.
set -euo pipefail

usage() { echo "usage: ./install.sh [--test]" >&2; }

with_test=0
for arg in "$@"; do
  case "$arg" in
    --test) with_test=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "install.sh: unknown option '$arg'" >&2; usage; exit 2 ;;
  esac
done

PY="${PYTHON:-python3}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"

if ! command -v "$PY" >/dev/null 2>&1; then
  echo "install.sh: '$PY' not found; set PYTHON to a Python >= 3.11" >&2
  exit 1
fi
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "install.sh: napkin needs Python >= 3.11; '$PY' is $("$PY" -V 2>&1)" >&2
  exit 1
fi

export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
pip_install() { "$PY" -m pip install -q "$@"; }

# 1. torch, only when missing.
if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
  echo "install.sh: installing torch 2.13.0 (CPU build) ..."
  if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
    pip_install "torch==2.13.0" --index-url "$TORCH_INDEX_URL"
  else
    pip_install "torch==2.13.0"
  fi
fi

# 2. napkin itself (plus the test tools with --test).  Build with the
# setuptools already installed when it is recent enough (no download, and
# fast on re-runs); otherwise let pip fetch one into an isolated build.
# 70.1 is where setuptools gained bdist_wheel itself: an older one needs a
# `wheel` package of matching age (a venv's bundled setuptools next to a new
# `wheel` cannot build at all).
target="."
[[ $with_test == 1 ]] && target=".[test]"
build_flags=()
if "$PY" -c 'import sys, setuptools
v = tuple(int(p) for p in setuptools.__version__.split(".")[:2])
sys.exit(v < (70, 1))' >/dev/null 2>&1; then
  build_flags+=(--no-build-isolation)
fi
pip_install "${build_flags[@]}" --config-settings editable_mode=compat -e "$target"

# 3. graphviz's dot (optional).
# apt_install PKG: quietly, as root with apt-get only; refresh the lists once
# if the first try fails.  Returns non-zero when it could not.
apt_install() {
  command -v apt-get >/dev/null 2>&1 && [[ "$(id -u)" == 0 ]] || return 1
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" >/dev/null 2>&1 && return 0
  apt-get update -qq >/dev/null 2>&1 \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" >/dev/null 2>&1
}
if ! command -v dot >/dev/null 2>&1; then
  if ! apt_install graphviz; then
    echo "install.sh: graphviz's 'dot' is not installed; pictures will be written as .dot text (install graphviz for SVG)"
  fi
fi

# 4. With --test: Debian's chromium, for the test that opens `napkin report`'s
# HTML page in a headless browser and checks the screenshot is not blank
# (that one test skips, saying why, where chromium cannot be had).
if [[ $with_test == 1 ]] && ! command -v chromium >/dev/null 2>&1; then
  if ! apt_install chromium; then
    echo "install.sh: chromium is not installed; the HTML report's screenshot test will skip"
  fi
fi

# 5. One line to say it worked, and how to run it when the script folder is
# not on PATH.
version="$("$PY" -m napkin --version)"
if command -v napkin >/dev/null 2>&1; then
  echo "install.sh: $version ready ($PY); try: napkin demo"
else
  echo "install.sh: $version ready ($PY); the 'napkin' script is not on PATH, use: $PY -m napkin demo"
fi
