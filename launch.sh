#!/usr/bin/env bash
# vitlab's one entry point.
#   ./launch.sh [RECIPE.yaml] [--set key=value ...] [--resume]   set up, then train (default recipes/default.yaml)
#   ./launch.sh test [pytest args]                                set up, then run the tests
#   ./launch.sh sweep RECIPE --grid key=v1,v2 [--grid ...]        one run per combination (resumable)
#   ./launch.sh analyze RUN_DIR [--against OTHER[:STEP]] [...]    offline analysis of saved checkpoints (cached)
#   ./launch.sh compare RUN_A RUN_B [...]                          runs side by side (analysis.frontends.compare)
#   ./launch.sh pretrained [--onnx F.onnx] [--out F] [--force]    a real ViT-S/14 as timm weights (analysis.sources.pretrained)
#   ./launch.sh python [ARGS]                                     the project's Python (e.g. -m analysis.studies.real_vit)
#   ./launch.sh study recipes/studies/raghu2021.yaml              train + analyse a study, write its report
# Set-up (every command): create .venv if missing, install the project (pip install -e '.[dev]') when this
# checkout's pyproject.toml changed since it installed itself (the stamp .venv/.vitlab-installed records the checkout
# and the sha256 of its pyproject.toml; a second checkout sharing the virtualenv uses it without reinstalling, its own
# code first on PYTHONPATH), install Debian's dataset-fashion-mnist if /usr/share/datasets/fashion-mnist is missing.
# Paths on the command line are relative to the folder you call this from (test's: to the repository).
# Multi-process on CPU: VITLAB_NPROC=2 ./launch.sh ...; on GPUs run 'accelerate config' once and it is used.
# Stopping: SIGTERM / Ctrl-C to this script's pid (it execs the trainer or the launcher) stops the trainers at the end
# of a step with a checkpoint, exit 0; SIGKILL to it stops them the same way (they die with their launcher).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's packages, whichever checkout installed .venv

PYTHON=${PYTHON:-python3}
VENV=${VITLAB_VENV:-$ROOT/.venv}
FMNIST=/usr/share/datasets/fashion-mnist

# The checkout that the virtualenv's editable install points at (pip's direct_url.json), or nothing.
installed_by() {
    sed -n 's|.*"url": *"file://\([^"]*\)".*|\1|p' "$VENV"/lib/python*/site-packages/vitlab-*.dist-info/direct_url.json \
        2>/dev/null | head -n 1
}

# Whether to (re)install this checkout into $VENV: never installed; installed by this checkout from another
# pyproject.toml; or installed by a checkout that no longer exists. A stamp written before it named its checkout
# (empty) is read as then (pyproject.toml newer than it) when the editable install is this checkout's.
needs_install() {
    local stamp=$1 want=$2 have owner
    [ -f "$stamp" ] || return 0
    [ "${VITLAB_REINSTALL:-0}" = 1 ] && return 0
    have=$(cat "$stamp")
    if [ -z "$have" ]; then
        [ "$(installed_by)" = "$ROOT" ] || return 1
        [ "$ROOT/pyproject.toml" -nt "$stamp" ] && return 0
        echo "$want" >"$stamp"
        return 1
    fi
    owner=${have% *}
    if [ "$owner" = "$ROOT" ]; then
        [ "$have" != "$want" ]
        return
    fi
    [ -f "$owner/pyproject.toml" ] || return 0
    if [ "${have##* }" != "${want##* }" ]; then
        echo "[vitlab] $VENV was installed by $owner, whose pyproject.toml differs from this checkout's: if" \
            "dependencies changed, run VITLAB_REINSTALL=1 $ROOT/launch.sh setup (it repoints the editable install)" >&2
    fi
    return 1
}

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        echo "[vitlab] creating $VENV" >&2
        "$PYTHON" -m venv "$VENV"
    fi
    local stamp="$VENV/.vitlab-installed" want
    want="$ROOT $(sha256sum "$ROOT/pyproject.toml" | cut -d ' ' -f 1)"
    if needs_install "$stamp" "$want"; then
        echo "[vitlab] installing the project into $VENV (pip install -e '.[dev]')" >&2
        "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
        (cd "$ROOT" && "$VENV/bin/python" -m pip install -q -e '.[dev]')
        echo "$want" >"$stamp"
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

# `accelerate launch ARGS`, exec'd (no shell left in between, so a signal, even SIGKILL, to this script's pid reaches
# the launcher itself) through train.launch: the first SIGTERM / SIGINT (Ctrl-C) / SIGHUP to it is forwarded as
# SIGTERM to the trainers, which checkpoint and stop cleanly (exit 0), and it exits 0 too, with no traceback (alone,
# torch elastic's agent reports its own SignalException); a trainer's refusal is its one sentence and exit 2; and
# trainers die with it, even by SIGKILL (they get SIGTERM from the kernel: train/cli.py).
run_accelerate() {
    exec "$VENV/bin/python" -m train.launch "$@"
}

stopped_before_start() {
    echo "stopped before the trainers started; nothing was trained (run the same command to start)."
    exit 0
}

accelerate_launch() {
    local nproc=${VITLAB_NPROC:-1}
    local cfg="${HF_HOME:-$HOME/.cache/huggingface}/accelerate/default_config.yaml"
    if [ "$nproc" -gt 1 ] || [ -f "$cfg" ] || [ -n "${ACCELERATE_CONFIG_FILE:-}" ]; then
        # several processes (or accelerate's own config): check the recipe first, so bad input is one sentence and
        # exit 2 here rather than one error per process and accelerate's traceback of the failed launch
        # a stop meanwhile (Ctrl-C, SIGTERM to this script or to the whole job; the check exits 128 + the signal): a
        # clean stop, exit 0, as nothing was started
        trap stopped_before_start TERM INT HUP
        "$VENV/bin/python" -m "${@:2}" --check || {
            local rc=$?
            case $rc in 129 | 130 | 143) stopped_before_start ;; esac
            exit $rc
        }
        trap - TERM INT HUP
    fi
    if [ "$nproc" -gt 1 ] && ! command -v nvidia-smi >/dev/null 2>&1; then
        # CPU, several processes: the combination that really starts N ranks (see docs/training.md)
        ACCELERATE_USE_CPU=true run_accelerate --multi_gpu --num_processes "$nproc" --num_machines 1 \
            --mixed_precision no --dynamo_backend no "$@"
    elif [ -f "$cfg" ] || [ -n "${ACCELERATE_CONFIG_FILE:-}" ]; then
        run_accelerate "$@"
    elif [ "$nproc" -gt 1 ]; then
        run_accelerate --num_processes "$nproc" --num_machines 1 --mixed_precision no --dynamo_backend no "$@"
    else
        # one process, no accelerate config: accelerate launch would only set defaults the trainer sets itself;
        # exec'ing Python keeps signals, exit codes and one-sentence errors direct (accelerate launch turns any
        # non-zero exit into a traceback)
        local module=$2
        shift 2
        exec "$VENV/bin/python" -m "$module" "$@"
    fi
}

cmd=${1:-}
case "$cmd" in
    test)
        shift
        setup
        cd "$ROOT"  # the repository's tests, from the repository (pytest paths are relative to it)
        exec "$VENV/bin/python" -m pytest "$@"
        ;;
    setup)
        setup
        ;;
    sweep | study | analyze | pretrained | compare | python)
        # each command is a module of the project, run by the virtualenv's Python (python: that Python itself)
        shift
        setup
        case "$cmd" in
            python) exec "$VENV/bin/python" "$@" ;;
            sweep) module=train.sweep ;;
            study) module=analysis.studies.study ;;
            analyze) module=analysis ;;
            pretrained) module=analysis.sources.pretrained ;;
            compare) module=analysis.frontends.compare ;;
        esac
        exec "$VENV/bin/python" -m "$module" "$@"
        ;;
    *)
        setup
        recipe=$ROOT/recipes/default.yaml
        if [ $# -gt 0 ] && [[ "$1" != -* ]]; then
            recipe=$1
            shift
        fi
        accelerate_launch -m train --recipe "$recipe" "$@"
        ;;
esac
