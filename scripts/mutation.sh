#!/usr/bin/env bash
# Mutation testing (a script, not CI): mutmut 2 mutates the planner and the scheduler, one mutant at a time,
# in a throwaway git worktree (never this checkout), and runs the fast tests that exercise them:
#   tests/test_scheduler.py (fake engines), tests/test_properties.py (hypothesis), tests/test_frontdoor_units.py
# Prints mutmut's results and the kill rate. Each mutant runs the tests (10-40 s on 2 cores), so a file of a few
# hundred mutants takes an hour or more. Usage: [MUTATION_TESTS="tests/..."] scripts/mutation.sh [FILES...]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
FILES=${*:-service/planner.py service/scheduler.py}
WORK=$(mktemp -d /tmp/anytime-mutation.XXXXXX)
LIB=$WORK/lib
trap 'git -C "$ROOT" worktree remove --force "$WORK/tree" >/dev/null 2>&1 || true' EXIT
git worktree add --detach "$WORK/tree" HEAD >/dev/null
.venv/bin/pip install -q --target "$LIB" mutmut==2.5.1 2>/dev/null
cd "$WORK/tree"
export PYTHONPATH="$WORK/tree:$LIB" PATH="$ROOT/.venv/bin:$PATH"
TESTS=${MUTATION_TESTS:-tests/test_scheduler.py tests/test_properties.py tests/test_frontdoor_units.py}
RUNNER="python -m pytest -x -q -p no:cacheprovider $TESTS"
for f in $FILES; do
  python -m mutmut run --paths-to-mutate "$f" --runner "$RUNNER" --tests-dir tests --no-progress --simple-output || true
done
mkdir -p "$ROOT/reports"; python -m mutmut results | tee "$ROOT/reports/mutation-results.txt" || true
python - <<'PY'
import sqlite3
db = sqlite3.connect(".mutmut-cache")
rows = db.execute("select status, count(*) from Mutant group by status").fetchall()
counts = dict(rows)
killed = counts.get("ok_killed", 0)
total = sum(n for s, n in counts.items() if s != "untested")
print(f"mutants: {counts}; killed {killed} of {total}: {100 * killed / max(total, 1):.1f} %")
PY
