#!/usr/bin/env bash
# Create (or bring up to date) the separate venv that runs the Tunix peer benchmarks.
#
#   tools/peers/setup_tunix_env.sh            # -> .venv-bench at the repo root
#   VENV_BENCH=/tmp/vb tools/peers/setup_tunix_env.sh
#
# Idempotent: a stamp file holds the sha256 of requirements-tunix.txt; when it matches
# and the venv imports Tunix, nothing is installed. Tunix never goes into .venv (its pins
# clash with alignax's). Needs only the package registry pip is configured for.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${VENV_BENCH:-$root/.venv-bench}"
req="$here/requirements-tunix.txt"
stamp="$venv/.requirements-tunix.sha256"

if [[ -n "${PYTHON:-}" ]]; then
  py="$PYTHON"
elif command -v python3.11 >/dev/null 2>&1; then
  py=python3.11
else
  py=python3
fi

want="$(sha256sum "$req" | cut -d' ' -f1)"
check='import qwix, tunix.sft.dpo.dpo_trainer, tunix.rl.grpo.grpo_learner, tunix.models.llama3.params, jax, importlib.metadata as m; print("tunix", m.version("google-tunix"), "jax", jax.__version__)'

if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  if JAX_PLATFORMS=cpu "$venv/bin/python" -c "$check" >/dev/null 2>&1; then
    echo "setup_tunix_env: $venv is up to date"
    exit 0
  fi
fi

if [[ ! -x "$venv/bin/python" ]]; then
  "$py" -c 'import sys; assert sys.version_info[:2] >= (3, 11), "Tunix 0.1.7 needs Python >= 3.11"'
  echo "setup_tunix_env: creating $venv with $("$py" --version)"
  "$py" -m venv "$venv"
fi

rm -f "$stamp"
"$venv/bin/python" -m pip install --disable-pip-version-check --quiet -r "$req"
JAX_PLATFORMS=cpu HF_HUB_OFFLINE=1 "$venv/bin/python" -c "$check"
echo "$want" > "$stamp"
echo "setup_tunix_env: $venv ready"
