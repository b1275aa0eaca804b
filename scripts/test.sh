#!/usr/bin/env bash
# The whole test suite on the emu backend (what CI runs): bash scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec python3 -m pytest -q "$@"
