#!/usr/bin/env bash
# Mutation testing (a script, not CI; docs/mutation.md has the last run's figures and its survivors explained).
# mutmut 2 changes one thing in a file at a time (a mutant) in a throwaway git worktree of HEAD (never this
# checkout) and runs that file's tests; a mutant is killed when they fail or time out. Prints the kill rate
# per file and writes it, mutmut's cache and the survivors' diffs to reports/mutation/<time>/.
#
# Usage: scripts/mutation.sh [FILE | FILE=TESTS]...
#   FILE        mutate FILE and run its default tests (the table below); no argument: every file in it
#   FILE=TESTS  mutate FILE and run TESTS (pytest arguments, space-separated: quote the whole argument)
# Every test session copies one tiny ladder, built once from the unmutated tree (tests/tiny_ladder.py),
# instead of building its own (20-50 s); MUTATION_TINY_LADDER=DIR reuses one that `python -m tests.tiny_ladder`
# built before. Tests on the default ladder read ANYTIME_TEST_LADDER (default: this checkout's ladders/default).
# A mutant costs one pytest session (4-15 s here); a file of a few hundred takes 20-60 min on 2 cores.
# On a shared machine: nice -n 19 scripts/mutation.sh ...
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=$ROOT/.venv/bin/python
[ -x "$PYTHON" ] || PYTHON=$(command -v python3)

# The tests that run against each file's mutants: in-process and quick, the likeliest killers first (-x stops at
# the first failure). tests/test_routes.py drives the routes' ASGI apps in process on the tiny ladder.
declare -A TESTS=(
  [service/planner.py]="tests/test_scheduler.py tests/test_caution.py tests/test_properties.py::test_a_plan_never_needs_more_than_the_time_left"
  [service/scheduler.py]="tests/test_scheduler.py tests/test_caution.py tests/test_properties.py::test_the_queue_never_loses_a_job tests/test_routes.py"
  [service/routes/classify.py]="tests/test_routes.py"
  [service/routes/health.py]="tests/test_routes.py"
  [service/routes/ladder.py]="tests/test_routes.py"
  [service/routes/docs.py]="tests/test_routes.py"
)
ORDER=(service/planner.py service/scheduler.py service/routes/classify.py service/routes/health.py
  service/routes/ladder.py service/routes/docs.py)
ARGS=("$@")
[ ${#ARGS[@]} -gt 0 ] || ARGS=("${ORDER[@]}")

WORK=$(mktemp -d /tmp/anytime-mutation.XXXXXX)
cleanup() { git -C "$ROOT" worktree remove --force "$WORK/tree" >/dev/null 2>&1 || true; }
trap cleanup EXIT
git worktree add --detach "$WORK/tree" HEAD >/dev/null
"$PYTHON" -m pip install -q --target "$WORK/lib" mutmut==2.5.1 2>/dev/null
cd "$WORK/tree"
export PYTHONPATH="$WORK/tree:$WORK/lib" PATH="$(dirname "$PYTHON"):$PATH"
export ANYTIME_TEST_LADDER=${ANYTIME_TEST_LADDER:-$ROOT/ladders/default}
if [ -n "${MUTATION_TINY_LADDER:-}" ]; then
  export ANYTIME_TEST_TINY_LADDER=$MUTATION_TINY_LADDER
else
  python -m tests.tiny_ladder "$WORK/tiny"  # from the tree before any mutant
  export ANYTIME_TEST_TINY_LADDER=$WORK/tiny
fi

for arg in "${ARGS[@]}"; do
  file=${arg%%=*}
  tests=${TESTS[$file]:-}
  [ "$arg" = "$file" ] || tests=${arg#*=}
  [ -n "$tests" ] || { echo "no tests for $file: give them as $file=TESTS" >&2; exit 2; }
  # mutmut 2 counts only exit status 1 as a kill: a mutant that breaks collection (status 2) would survive.
  runner=$WORK/run-tests-$(echo "$file" | tr / _).sh
  printf '#!/bin/sh\npython -m pytest -x -q -p no:cacheprovider %s || exit 1\n' "$tests" >"$runner"
  chmod +x "$runner"
  echo "== $file: $tests"
  python -m mutmut run --paths-to-mutate "$file" --runner "$runner" --tests-dir tests --no-progress --simple-output \
    || true
done

OUT=$ROOT/reports/mutation/$(date +%Y%m%d-%H%M%S)
mkdir -p "$OUT"
cp .mutmut-cache "$OUT/mutmut-cache.sqlite"
python -m mutmut results >"$OUT/results.txt" || true
for arg in "${ARGS[@]}"; do
  file=${arg%%=*}
  python -m mutmut show "$file" >"$OUT/survivors-$(basename "$file" .py).txt" || true
done
python - "$OUT" <<'PY'
import sqlite3
import sys

KILLED = {"ok_killed", "bad_timeout", "ok_suspicious"}  # suspicious: killed, but slower than the baseline run
rows = sqlite3.connect(".mutmut-cache").execute(
    "select f.filename, m.status, count(*) from Mutant m join Line l on m.line = l.id"
    " join SourceFile f on l.sourcefile = f.id group by f.filename, m.status"
).fetchall()
files: dict[str, dict[str, int]] = {}
for name, status, n in rows:
    files.setdefault(name, {})[status] = n
lines = ["| file | mutants | killed | timed out | survived | not run | kill rate |", "|---|---|---|---|---|---|---|"]
for name, counts in sorted(files.items()):
    tested = sum(n for s, n in counts.items() if s not in ("untested", "skipped"))
    killed = sum(counts.get(s, 0) for s in KILLED)
    not_run = counts.get("untested", 0) + counts.get("skipped", 0)
    rate = f"{100 * killed / tested:.1f} %" if tested else "-"
    lines.append(
        f"| {name} | {tested + not_run} | {killed - counts.get('bad_timeout', 0)} | {counts.get('bad_timeout', 0)} "
        f"| {counts.get('bad_survived', 0)} | {not_run} | {rate} |"
    )
table = "\n".join(lines)
print(table)
with open(f"{sys.argv[1]}/kill-rate.md", "w") as f:
    f.write(table + "\n")
print(f"survivors' diffs: {sys.argv[1]}/survivors-*.txt")
PY
