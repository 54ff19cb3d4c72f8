#!/usr/bin/env bash
# vitlab's one entry point.
#   ./launch.sh [RECIPE.yaml] [--set key=value ...] [--resume]   set up, then train (default recipes/default.yaml)
#   ./launch.sh test [pytest args]                                set up, then run the tests
#   ./launch.sh sweep RECIPE --grid key=v1,v2 [--grid ...]        one run per combination (resumable)
#   ./launch.sh analyze RUN_DIR [--against OTHER[:STEP]] [...]    offline analysis of saved checkpoints (cached)
#   ./launch.sh study recipes/studies/raghu2021.yaml              train + analyse a study, write its report
# Set-up (every command): create .venv if missing, install the project (pip install -e '.[dev]') when
# pyproject.toml changed, install Debian's dataset-fashion-mnist if /usr/share/datasets/fashion-mnist is missing.
# Multi-process on CPU: VITLAB_NPROC=2 ./launch.sh ...; on GPUs run 'accelerate config' once and it is used.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

PYTHON=${PYTHON:-python3}
VENV=.venv
FMNIST=/usr/share/datasets/fashion-mnist

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        echo "[vitlab] creating $VENV" >&2
        "$PYTHON" -m venv "$VENV"
    fi
    local stamp="$VENV/.vitlab-installed"
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
        echo "[vitlab] installing the project into $VENV (pip install -e '.[dev]')" >&2
        "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
        "$VENV/bin/python" -m pip install -q -e '.[dev]'
        touch "$stamp"
    fi
    if [ ! -d "$FMNIST" ]; then
        if [ "$(id -u)" = 0 ]; then
            echo "[vitlab] installing Debian's dataset-fashion-mnist" >&2
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null
        else
            echo "Fashion-MNIST is missing from $FMNIST: run 'sudo apt-get install -y dataset-fashion-mnist', then run this again." >&2
            exit 2
        fi
    fi
}

accelerate_launch() {
    local nproc=${VITLAB_NPROC:-1}
    local cfg="${HF_HOME:-$HOME/.cache/huggingface}/accelerate/default_config.yaml"
    if [ "$nproc" -gt 1 ] && ! command -v nvidia-smi >/dev/null 2>&1; then
        # CPU, several processes: the combination that really starts N ranks (see FIELD-NOTES / README)
        ACCELERATE_USE_CPU=true exec "$VENV/bin/accelerate" launch --multi_gpu --num_processes "$nproc" --num_machines 1 \
            --mixed_precision no --dynamo_backend no "$@"
    elif [ -f "$cfg" ] || [ -n "${ACCELERATE_CONFIG_FILE:-}" ]; then
        exec "$VENV/bin/accelerate" launch "$@"
    else
        exec "$VENV/bin/accelerate" launch --num_processes "$nproc" --num_machines 1 --mixed_precision no --dynamo_backend no "$@"
    fi
}

cmd=${1:-}
case "$cmd" in
    test)
        shift
        setup
        exec "$VENV/bin/python" -m pytest "$@"
        ;;
    setup)
        setup
        ;;
    sweep)
        shift
        setup
        exec "$VENV/bin/python" -m train.sweep "$@"
        ;;
    study)
        shift
        setup
        exec "$VENV/bin/python" -m analysis.reports.study "$@"
        ;;
    analyze)
        shift
        setup
        exec "$VENV/bin/python" -m analysis "$@"
        ;;
    *)
        setup
        recipe=recipes/default.yaml
        if [ $# -gt 0 ] && [[ "$1" != -* ]]; then
            recipe=$1
            shift
        fi
        accelerate_launch -m train --recipe "$recipe" "$@"
        ;;
esac
