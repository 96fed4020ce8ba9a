#!/usr/bin/env bash
# Make sure Debian's Chromium is at /usr/bin/chromium: the console's browser tests
# (tests/api/test_console.py) drive it with Playwright, which may not download a
# browser of its own here (never `playwright install`). A fresh machine lacks it:
# install it from Debian's packages (the machine runs as root). Fails loudly.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then exit 0; fi
if [ "$(id -u)" != 0 ]; then
  echo "/usr/bin/chromium is missing: apt-get install chromium (as root)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends chromium
[ -x /usr/bin/chromium ] || { echo "chromium did not install at /usr/bin/chromium" >&2; exit 1; }
