#!/usr/bin/env bash
# Install kvlab and its pinned dependencies into the Python given as $1 (a venv's python).
#   scripts/install.sh PYTHON EXTRAS      e.g.  scripts/install.sh .venv/bin/python dev
# The Makefile (`make install`) and the Binder/JupyterHub image (binder/postBuild) both run
# this, so a course that installs here installs there.
# torch goes FIRST and pinned: an unpinned torch pulled in by another package is a
# multi-GB CUDA build. Where the CPU wheel lies on disk (/opt/wheels) pip takes it from
# there; TORCH_INDEX_URL points pip at another index (Binder: PyTorch's CPU index).
set -euo pipefail
py=${1:?usage: scripts/install.sh PYTHON EXTRAS}
extras=${2:-lab}
cd "$(dirname "$0")/.."
links=()
if [ -d /opt/wheels ]; then links=(--find-links /opt/wheels); fi
torch_src=("${links[@]}")
if [ -n "${TORCH_INDEX_URL:-}" ]; then torch_src+=(--index-url "$TORCH_INDEX_URL"); fi
"$py" -m pip install --quiet --upgrade pip
"$py" -m pip install --quiet "${torch_src[@]}" torch==2.13.0
"$py" -m pip install --quiet "${links[@]}" -e ".[$extras]"
