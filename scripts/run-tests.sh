#!/usr/bin/env bash
# Runs pytest on the arguments given. A suite that must have tests fails when
# none were collected (pytest's exit status 5): a typo in a path or a marker, or
# tests that stopped being collected, must not pass as green.
#
#   --allow-empty   (first argument) for a selection that may legitimately be
#                   empty, such as a marker no test carries yet: "no tests
#                   collected" then counts as success.
set -uo pipefail
cd "$(dirname "$0")/.."
allow_empty=0
if [ "${1:-}" = "--allow-empty" ]; then
    allow_empty=1
    shift
fi
.venv/bin/python -m pytest "$@"
status=$?
if [ "$status" -eq 5 ]; then
    if [ "$allow_empty" -eq 1 ]; then
        echo "no tests were collected for this selection (allowed: --allow-empty)"
        exit 0
    fi
    echo "run-tests: no tests were collected for: $*" >&2
    echo "run-tests: this suite must have tests; pass --allow-empty only where none is fine" >&2
fi
exit "$status"
