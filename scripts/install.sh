#!/usr/bin/env bash
# Installs everything GPUMix needs on a fresh Debian machine: Python packages
# (pinned) and, for the browser test, Debian's chromium. Never downloads a
# browser build of its own (playwright drives /usr/bin/chromium).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check -r requirements.txt
if [ "${GPUMIX_SKIP_BROWSER:-0}" != "1" ] && [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = "0" ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  fi
fi
