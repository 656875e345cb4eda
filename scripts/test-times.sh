#!/usr/bin/env bash
# Sums up a `cargo test` log whose lines each begin with the time they arrived (as
# .ci/run writes it): the ten slowest test binaries with their wall times, the tests
# libtest reported running over 60 s, and the passed/failed totals.
set -euo pipefail
log="$1"

echo "slowest test binaries (wall time from start to result):"
awk '
    $2 == "Running" && match($0, /deps\/[^ )]*/) {
        name = substr($0, RSTART + 5, RLENGTH - 5); sub(/-[0-9a-f]+$/, "", name); t0 = $1
    }
    $2 == "Doc-tests" { name = "doc-tests " $3; t0 = $1 }
    $2 == "test" && $3 == "result:" && name != "" { printf "%8.1f s  %s\n", $1 - t0, name; name = "" }
' "$log" | sort -rn | head -10

echo "tests that ran over 60 s (libtest's warnings; one line each):"
grep -o 'test [^ ]* has been running for over 60 seconds' "$log" | awk '{ print "  " $2 }' | sort -u || echo "  none"

awk '$2 == "test" && $3 == "result:" { p += $5; f += $7 } END { printf "all: %d passed, %d failed\n", p, f }' "$log"
