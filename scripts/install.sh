#!/usr/bin/env bash
# Installs everything GPUMix needs on a fresh Debian/Ubuntu machine:
#  - the Python packages of requirements.txt (pinned) into a project-local virtual
#    environment, .venv/, so it works where the system interpreter refuses
#    `pip install` (PEP 668, "externally managed"); the system pip is never called;
#  - the Debian packages the tests use, only those missing, as root or with sudo:
#    python3-venv (when the interpreter has no ensurepip), postgresql (PostgreSQL store
#    tests), slurmd slurmctld munge slurm-client (SLURM tests), chromium (the browser
#    test: playwright drives /usr/bin/chromium, never a browser build of its own) and
#    iproute2 and util-linux (`ip`, `tc`, `nsenter`: network namespaces of the SLURM test
#    cluster and of the emulated datacenters, `executor launch --emulate-wan`).
# torch stays at its pinned version; its build is chosen (see choose_torch): the CUDA build
# where `nvidia-smi -L` lists a GPU, the CPU build elsewhere. The CPU choice refuses to let pip
# pull a CUDA build (check_torch_is_cpu); the CUDA choice takes the default index's release.
#
# usage: bash scripts/install.sh [--torch auto|cpu|cuda] [--check]
#   --torch B  auto (default): cuda where nvidia-smi lists a GPU, else cpu; or as asked
#   --check    print the torch build it would install and the commands, run none of them
# environment (all optional):
#   GPUMIX_VENV=DIR             the virtual environment (default .venv)
#   GPUMIX_PYTHON=EXE           the interpreter that creates it (default python3)
#   GPUMIX_REQUIREMENTS=FILE    the requirements file (default requirements.txt)
#   GPUMIX_SKIP_TEST_PACKAGES=1 no Debian packages for the tests (the dashboard needs none)
set -euo pipefail
cd "$(dirname "$0")/.."

CHECK=0
TORCH=auto
usage_error() { echo "install.sh: $1 (usage: install.sh [--torch auto|cpu|cuda] [--check])" >&2; exit 2; }
while [ "$#" -gt 0 ]; do
  case "$1" in
    --check) CHECK=1 ;;
    --torch) [ "$#" -gt 1 ] || usage_error "--torch needs a value"; TORCH=$2; shift ;;
    --torch=*) TORCH=${1#--torch=} ;;
    *) usage_error "unknown argument '$1'" ;;
  esac
  shift
done
case "$TORCH" in auto|cpu|cuda) ;; *) usage_error "--torch must be auto, cpu or cuda, not '$TORCH'" ;; esac
VENV=${GPUMIX_VENV:-.venv}
PY=${GPUMIX_PYTHON:-python3}
REQS=${GPUMIX_REQUIREMENTS:-requirements.txt}
VPY="$VENV/bin/python"

# run CMD...: runs it, or with --check prints it (shell-quoted) after a '+'.
run() {
  if [ "$CHECK" = 1 ]; then printf '+'; printf ' %q' "$@"; printf '\n'; else "$@"; fi
}

as_root() {
  if [ "$(id -u)" = 0 ]; then run env DEBIAN_FRONTEND=noninteractive "$@"
  elif command -v sudo >/dev/null; then run sudo env DEBIAN_FRONTEND=noninteractive "$@"
  else echo "install.sh: '$*' needs root (no sudo here)" >&2; return 1
  fi
}

deb_installed() {
  dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"
}

install_debian_packages() {
  local want=() missing=() p
  # Debian's own python3 makes venvs only with python3-venv (its ensurepip wheels)
  case "$(readlink -f "$(command -v "$PY")")" in /usr/bin/*) want+=(python3-venv) ;; esac
  if [ "${GPUMIX_SKIP_TEST_PACKAGES:-0}" != 1 ]; then
    want+=(postgresql slurmd slurmctld munge slurm-client chromium iproute2 util-linux)
  fi
  [ "${#want[@]}" -gt 0 ] || return 0
  if ! command -v dpkg-query >/dev/null || ! command -v apt-get >/dev/null; then
    echo "install.sh: not a Debian system: install ${want[*]} yourself" >&2
    return 0
  fi
  for p in "${want[@]}"; do deb_installed "$p" || missing+=("$p"); done
  [ "${#missing[@]}" -gt 0 ] || return 0
  as_root apt-get update -qq
  as_root apt-get install -y -qq "${missing[@]}" >/dev/null
}

create_venv() {
  if [ -x "$VPY" ] && "$VPY" -c "import pip" 2>/dev/null; then return 0; fi
  run "$PY" -m venv --clear "$VENV"
}

# torch_spec: the torch==X line of the requirements file or of a file it includes (-r), or nothing.
torch_spec() {
  local dir f
  dir=$(dirname "$REQS")
  for f in "$REQS" $(sed -nE 's/^-r[[:space:]]*([^[:space:]]+).*/\1/p' "$REQS"); do
    case "$f" in /*) ;; "$REQS") ;; *) f="$dir/$f" ;; esac
    grep -hE '^torch==' "$f" 2>/dev/null && return 0
  done
  return 0
}

# choose_torch: sets TORCH to cpu or cuda and says which and why, in one line.
choose_torch() {
  local why gpu=""
  if [ "$TORCH" = auto ] && command -v nvidia-smi >/dev/null; then
    gpu=$(grep -m1 '^GPU ' <<<"$(timeout 30 nvidia-smi -L 2>/dev/null || true)" || true)
  fi
  if [ "$TORCH" != auto ]; then why="asked with --torch $TORCH"
  elif ! command -v nvidia-smi >/dev/null; then TORCH=cpu; why="no nvidia-smi on PATH"
  elif [ -n "$gpu" ]; then TORCH=cuda; why="nvidia-smi lists a GPU: $gpu"
  else TORCH=cpu; why="nvidia-smi lists no GPU"
  fi
  echo "install.sh: torch build: $TORCH ($why)"
}

# The CUDA build: the default index's release itself. `===` takes exactly that version, never a
# local +cpu wheel that a find-links folder (pip config) offers beside it.
install_torch_cuda() {
  local spec
  spec=$(torch_spec)
  [ -n "$spec" ] || return 0
  run "$VPY" -m pip install --quiet --disable-pip-version-check "torch===${spec#torch==}"
}

# A plain torch==X from the package index is the CUDA build on Linux (gigabytes of CUDA
# libraries); only a +cpu wheel (a local wheel folder, or the PyTorch CPU index) is taken.
# pip's dry run resolves without downloading the wheel, so a wrong choice costs nothing.
check_torch_is_cpu() {
  local spec report url
  spec=$(torch_spec)
  [ -n "$spec" ] || return 0
  if [ "$CHECK" = 1 ]; then
    run "$VPY" -m pip install --dry-run --no-deps --quiet --report REPORT "$spec"; return 0
  fi
  if "$VPY" -c "import sys, torch; sys.exit(torch.__version__ != '${spec#torch==}+cpu')" 2>/dev/null; then
    return 0
  fi
  report=$(mktemp)
  "$VPY" -m pip install --dry-run --no-deps --quiet --report "$report" "$spec"
  url=$("$VPY" -c "import json, sys; print(' '.join(i['download_info']['url'] for i in json.load(open(sys.argv[1]))['install']))" "$report")
  rm -f "$report"
  case "$url" in
    *+cpu*|*%2Bcpu*|"") ;;
    *) echo "install.sh: pip would install a CUDA build of torch ($url); give it the CPU build:" \
            "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/install.sh --torch cpu" >&2
       exit 1 ;;
  esac
}

choose_torch
install_debian_packages
create_venv
if [ "$TORCH" = cuda ]; then install_torch_cuda; else check_torch_is_cpu; fi
run "$VPY" -m pip install --quiet --disable-pip-version-check -r "$REQS"
