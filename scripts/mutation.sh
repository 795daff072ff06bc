#!/usr/bin/env bash
# Mutation testing (a script, not CI; docs/mutation.md has the last run's figures and its survivors explained).
# mutmut 2 changes one thing in a file at a time (a mutant) in a throwaway git worktree of HEAD (never this
# checkout) and runs that file's tests; a mutant is killed when they fail or time out. Prints the kill rate per
# file and writes it, the survivors' diffs and mutmut's cache to reports/mutation/<time>/.
#
# Usage: scripts/mutation.sh [FILE | FILE=TESTS]...
#   FILE        mutate FILE and run its default tests (the table below); no argument: every file in it
#   FILE=TESTS  mutate FILE and run TESTS (pytest arguments, space-separated: quote the whole argument).
#               TESTS may come in stages, "A -- B": a mutant that A does not kill runs B, and the kill rate is
#               printed after each stage (e.g. the tests of before a change, then the ones it added).
# MUTATION_FROM=reports/mutation/<time> goes on from an earlier run: the mutants it killed count as killed (a
# timeout too), the others of the files given run again against TESTS, numbered as stages after that run's.
# Every test session copies one tiny ladder, built once from the unmutated tree (tests/tiny_ladder.py),
# instead of building its own (20-50 s); MUTATION_TINY_LADDER=DIR reuses one that `python -m tests.tiny_ladder`
# built before. Tests on the default ladder read ANYTIME_TEST_LADDER (default: this checkout's ladders/default,
# which `make test` builds). PYTHON names the interpreter (default: this checkout's .venv/bin/python).
# A mutant costs one pytest session (5-15 s on 2 cores): a file of a few hundred takes 20-60 min.
# On a shared machine: nice -n 19 scripts/mutation.sh ...
set -euo pipefail

# The tests that run against each file's mutants: in process and quick, the likeliest killers first (-x stops at
# the first failure). tests/test_routes.py drives the routes' ASGI apps in process on the tiny ladder; the older
# in-process tests of the app come last (the default ladder's take seconds to load).
IN_PROCESS="tests/test_frontdoor.py::test_a_full_queue_is_refused_before_the_body_is_read
  tests/test_frontdoor.py::test_healthz_turns_503_when_the_worker_died_and_readyz_keeps_details_in_the_log
  tests/test_frontdoor.py::test_plans_allow_for_the_path_after_planning tests/test_service.py::test_readyz_is_503_until_warm
  tests/test_security.py::test_without_a_key_everything_is_open_and_openapi_says_so
  tests/test_security.py::test_with_a_key_metrics_stay_open_unless_asked_and_openapi_declares_the_bearer
  tests/test_caution.py::test_auto_answers_move_caution_where_they_are_sent tests/test_service_ensemble.py"
SCHEDULER="tests/test_scheduler.py tests/test_scheduler_details.py tests/test_caution.py
  tests/test_properties.py::test_the_queue_never_loses_a_job"
declare -A TESTS=(
  [service/planner.py]="tests/test_scheduler.py tests/test_caution.py tests/test_properties.py::test_a_plan_never_needs_more_than_the_time_left"
  [service/scheduler.py]="$SCHEDULER tests/test_routes.py $IN_PROCESS"
  [service/routes/classify.py]="tests/test_routes.py $IN_PROCESS"
  [service/routes/health.py]="tests/test_routes.py $IN_PROCESS"
  [service/routes/ladder.py]="tests/test_routes.py $IN_PROCESS"
  [service/routes/docs.py]="tests/test_routes.py $IN_PROCESS"
)
ORDER=(service/planner.py service/scheduler.py service/routes/classify.py service/routes/health.py
  service/routes/ladder.py service/routes/docs.py)

# Runs one mutant's tests, stage by stage, as the process mutmut starts and kills on a timeout; logs which stage
# killed it. mutmut 2 counts only exit status 1 as a kill (a mutant that breaks collection, status 2, would
# survive) and kills only its own child on a timeout (pytest dies with this process: PR_SET_PDEATHSIG).
# pytest loads only the hypothesis plugin (schemathesis' takes 3 s to import, and these tests do not use it).
STAGES_PY='
import ctypes, json, os, signal, subprocess, sys

log, offset, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
stages, current = [], []
for arg in args:
    if arg == "--":
        stages.append(current)
        current = []
    else:
        current.append(arg)
stages.append(current)
diff = subprocess.run(["git", "diff", "--no-color", "-U0"], capture_output=True, text=True).stdout
libc = ctypes.CDLL(None)
rc = 0
for i, tests in enumerate(stages, 1):
    if diff:  # empty for the baseline run
        with open(log, "a") as f:
            f.write(json.dumps({"diff": diff, "stage": offset + i}) + "\n")  # the last one logged hung on a timeout
    pytest = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "_hypothesis_pytestplugin"]
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    rc = subprocess.run([*pytest, *tests], env=env, preexec_fn=lambda: libc.prctl(1, signal.SIGKILL)).returncode
    if rc:
        break
if diff:
    with open(log, "a") as f:
        f.write(json.dumps({"diff": diff, "killed_at": offset + i if rc else None}) + "\n")
sys.exit(1 if rc else 0)
'

# Kill rates per file and stage, from mutmut's cache (every mutant) and the stage log (where each was killed).
SUMMARY_PY='
import json, re, sqlite3, sys

out = sys.argv[1]
stages_by_file = json.load(open(f"{out}/stages.json"))
where: dict[str, int | None] = {}
for line in open(f"{out}/stages.jsonl"):
    entry = json.loads(line)
    # In order: each stage as it starts, then where it was killed (None: survived). A mutant whose last line
    # is a start hung in that stage: mutmut killed it on the timeout.
    where[entry["diff"]] = entry["killed_at"] if "killed_at" in entry else entry["stage"]
by_file: dict[str, list[int | None]] = {}
for diff, stage in where.items():
    name = re.search(r"^\+\+\+ b/(\S+)", diff, re.M)
    if name:
        by_file.setdefault(name.group(1), []).append(stage)
rows = sqlite3.connect(".mutmut-cache").execute(
    "select f.filename, m.status, count(*) from Mutant m join Line l on m.line = l.id"
    " join SourceFile f on l.sourcefile = f.id group by f.filename, m.status"
).fetchall()
files: dict[str, dict[str, int]] = {}
for name, status, n in rows:
    files.setdefault(name, {})[status] = n
lines = ["| file | mutants | tested | stage | killed | survived | kill rate |", "|---|---|---|---|---|---|---|"]
for name, counts in sorted(files.items()):
    total = sum(counts.values())
    tested = total - counts.get("untested", 0) - counts.get("skipped", 0)
    logged = by_file.get(name, [])
    for stage in range(1, stages_by_file.get(name, 1) + 1):
        killed = sum(1 for s in logged if s is not None and s <= stage)
        rate = f"{100 * killed / tested:.1f} %" if tested else "-"
        lines.append(f"| {name} | {total} | {tested} | {stage} | {killed} | {tested - killed} | {rate} |")
table = "\n".join(lines)
print(table)
open(f"{out}/kill-rate.md", "w").write(table + "\n")
survivors = [d for d, s in where.items() if s is None]
open(f"{out}/survivors.diff", "w").write("\n".join(sorted(survivors)))
print(f"{len(survivors)} survivors: {out}/survivors.diff")
'

main() {
  [ -z "${MUTATION_FROM:-}" ] || MUTATION_FROM=$(realpath "$MUTATION_FROM")
  cd "$(dirname "$0")/.."
  local root=$PWD
  PYTHON=${PYTHON:-$root/.venv/bin/python}
  [ -x "$PYTHON" ] || { echo "no $PYTHON: run make venv, or name one with PYTHON=" >&2; exit 2; }
  local args=("$@")
  [ ${#args[@]} -gt 0 ] || args=("${ORDER[@]}")

  local work out
  work=$(mktemp -d /tmp/anytime-mutation.XXXXXX)
  out=$root/reports/mutation/$(date +%Y%m%d-%H%M%S)
  mkdir -p "$out"
  # On the way out, however it ends: keep mutmut's cache with the report, remove the tree.
  # shellcheck disable=SC2064 # expand now: these are fixed paths
  trap "cp '$work/tree/.mutmut-cache' '$out/mutmut-cache.sqlite' 2>/dev/null; git -C '$root' worktree remove --force '$work/tree' >/dev/null 2>&1; rm -rf '$work'" EXIT
  git worktree add --detach "$work/tree" HEAD >/dev/null
  "$PYTHON" -m pip install -q --target "$work/lib" mutmut==2.5.1 2>/dev/null
  cd "$work/tree"
  PATH="$(dirname "$PYTHON"):$PATH"
  export PYTHONPATH="$work/tree:$work/lib" PATH
  export ANYTIME_TEST_LADDER=${ANYTIME_TEST_LADDER:-$root/ladders/default}
  if [ -n "${MUTATION_TINY_LADDER:-}" ]; then
    export ANYTIME_TEST_TINY_LADDER=$MUTATION_TINY_LADDER
  else
    python -m tests.tiny_ladder "$work/tiny" # from the tree before any mutant
    export ANYTIME_TEST_TINY_LADDER=$work/tiny
  fi
  echo "$STAGES_PY" >"$work/stages.py"
  if [ -n "${MUTATION_FROM:-}" ]; then
    cp "$MUTATION_FROM/stages.jsonl" "$MUTATION_FROM/stages.json" "$out/"
    cp "$MUTATION_FROM/mutmut-cache.sqlite" .mutmut-cache
    python - "${args[@]%%=*}" <<'PY'
import sqlite3
import sys

db = sqlite3.connect(".mutmut-cache")
files = "select l.id from Line l join SourceFile f on l.sourcefile = f.id where f.filename in (%s)"
files %= ",".join("?" * len(sys.argv[1:]))
db.execute("update Mutant set status = 'ok_killed' where status in ('bad_timeout', 'ok_suspicious')")
db.execute(
    f"update Mutant set status = 'untested', tested_against_hash = '' where status != 'ok_killed' and line in ({files})",
    sys.argv[1:],
)
db.commit()
PY
  else
    touch "$out/stages.jsonl"
    echo "{}" >"$out/stages.json"
  fi

  local arg file tests offset
  for arg in "${args[@]}"; do
    file=${arg%%=*}
    tests=${TESTS[$file]:-}
    [ "$arg" = "$file" ] || tests=${arg#*=}
    [ -n "$tests" ] || { echo "no tests for $file: give them as $file=TESTS" >&2; exit 2; }
    tests=$(tr -s ' \n' '  ' <<<"$tests") # one line
    offset=$(python - "$out/stages.json" "$file" "$tests" <<'PY'
import json
import sys

path, file, tests = sys.argv[1:]
stages = json.load(open(path))
offset = stages.get(file, 0)
stages[file] = offset + tests.count(" -- ") + 1
json.dump(stages, open(path, "w"))
print(offset)
PY
)
    local runner=$work/run-tests-${file//\//_}.sh
    printf '#!/bin/sh\nexec python %s %s %s %s\n' "$work/stages.py" "$out/stages.jsonl" "$offset" "$tests" >"$runner"
    chmod +x "$runner"
    echo "== $file: $tests"
    python -m mutmut run --paths-to-mutate "$file" --runner "$runner" --tests-dir tests --no-progress \
      --simple-output || true
  done

  python -m mutmut results >"$out/results.txt" || true
  python -c "$SUMMARY_PY" "$out"
}

main "$@" # the whole script is read before it runs: editing it meanwhile cannot derail a run
exit
