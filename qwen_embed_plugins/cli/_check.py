"""``check_server``: what an OpenAI-compatible embedding server is and supports.

Probes health, the model list, one embedding (vector size and norm), base64, MRL
``dimensions``, the batch limit, HTTP/2, the idle keep-alive timeout the server
enforces, and a latency sample through the pooled client; returns a ``CheckReport`` with
one finding per probe and advice for each (``_check_report``), and the library's own
warnings logged during the check as its notes. Prints nothing (the CLI renders it).

The whole check has one deadline (``timeout``, the CLI's ``--timeout``): every probe
runs within the time left of it. The HTTP probes are exchanges on the library's own
transport (``_probe.Probes``), with its caps, deadline and scrubbing; the latency and
truncation samples run through the client, with the time left as its deadline.

Advice names the server's own settings only for the server that answers: the library's
own reading of the ``GET /models`` answer (``_servers.identify_models``, then the
embedding answer's headers) says which one it is, and a server it does not recognise
gets advice that names each candidate. A base URL without the API's path
(``/v1``) is diagnosed by asking the same server under ``/v1``.
"""

from __future__ import annotations

import base64
import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any, Final, Literal

import numpy as np
import orjson

from .. import (
    DEFAULT_MODEL,
    BatchTooLargeError,
    ConnectError,
    ConnectTimeout,
    EmbeddingClient,
    EmbeddingConfig,
    Limits,
    QwenEmbedError,
    RetryConfig,
    close_all,
)
from .._corpus import corpus
from .._servers import identify_models, identify_response
from .._transport import Reply
from .._transport._exceptions import certificate_failure
from ._check_report import CheckFinding, CheckReport, ServerIdentity, library_notes
from ._probe import (
    CHECK_TIMEOUT,
    PROBE_BUDGET,
    Background,
    Probes,
    api_root,
    measure_idle_timeout,
    models_in,
    probe_http2,
    status_error,
)

__all__ = ["check_server", "dimensions_advice"]

_PROBE_TEXT: Final = "What is a Python list comprehension?"

# What to do when a server refuses or ignores MRL ``dimensions``, per server (the
# ``server=`` names of the client's detection). Facts: _servers.py's profile sources.
_CLIENT_SLICES: Final = "the client slices and renormalises client-side"
_DIMENSIONS_ADVICE: Final[dict[str, str]] = {
    "sglang": "SGLang: start it with --json-model-override-args "
    "'{\"is_matryoshka\": true}' to serve MRL `dimensions`; meanwhile " + _CLIENT_SLICES,
    "vllm": "vLLM: start it with --hf-overrides '{\"is_matryoshka\": true}' to serve MRL "
    "`dimensions`; meanwhile " + _CLIENT_SLICES,
    "tei": "nothing to do: Text Embeddings Inference's OpenAI route has no `dimensions`; "
    + _CLIENT_SLICES,
    "llamacpp": "nothing to do: llama.cpp does not read `dimensions`; " + _CLIENT_SLICES,
    "ollama": "nothing to do: Ollama truncates only below the model's size; " + _CLIENT_SLICES,
    "infinity": "nothing to do: " + _CLIENT_SLICES,
    "dashscope": "nothing to do: DashScope serves a fixed list of sizes; the client asks "
    "for the next one up and slices",
    "siliconflow": "nothing to do: SiliconFlow serves a fixed list of sizes; the client "
    "asks for the next one up and slices",
}
_DIMENSIONS_UNKNOWN: Final = (
    "nothing to do: " + _CLIENT_SLICES + ". To serve MRL `dimensions`: vLLM --hf-overrides "
    "'{\"is_matryoshka\": true}', SGLang --json-model-override-args "
    "'{\"is_matryoshka\": true}'"
)
_BATCH_SETTING: Final[dict[str, str]] = {
    "tei": " (or start TEI with a larger --max-client-batch-size)",
}
_MODELS_ADVICE: Final[dict[str, str]] = {
    "tei": "nothing to do: Text Embeddings Inference has no /models; it serves the model "
    "it was started with, whatever --model says",
}


_QWEN3_DIMS: Final = {
    "qwen3-embedding-0.6b": 1024,
    "qwen3-embedding-4b": 2560,
    "qwen3-embedding-8b": 4096,
}


def _known_dims(model: str) -> int | None:
    """Full vector size of a Qwen3-Embedding model name or path, else ``None``."""
    lowered = model.lower().rstrip("/").replace("_", "-")
    return next((d for name, d in _QWEN3_DIMS.items() if lowered.endswith(name)), None)


def dimensions_advice(server: str | None) -> str:
    """The advice for a server (``server=`` name, ``None``: not identified) that
    refuses or ignores ``dimensions``."""
    return _DIMENSIONS_ADVICE.get(server or "", _DIMENSIONS_UNKNOWN)


def _identify(detection: Any) -> tuple[ServerIdentity | None, str | None]:
    """The server a ``_servers.Detection`` names (``None`` when generic), and the
    embeddings URL it found instead of ``{base_url}/embeddings`` (Infinity without
    ``--url-prefix /v1``), if any."""
    if detection is None:
        return None, None
    profile = detection.profile
    identity = ServerIdentity(str(profile.name), str(profile.title), str(detection.source))
    return identity, detection.embeddings_url


def _first_vector(body: bytes) -> np.ndarray[Any, np.dtype[np.float32]] | None:
    try:
        item = orjson.loads(body)["data"][0]["embedding"]
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        return None
    if isinstance(item, list):
        return np.asarray(item, dtype=np.float32)
    return None


class _Probe:
    """One check run: the probe client, the target and what was learned so far."""

    def __init__(
        self, http: Probes, base_url: str, api_key: str | None, verify: bool | str, model: str
    ) -> None:
        self.http = http
        self.base_url = base_url
        self.api_key = api_key
        self.verify = verify
        self.model = model
        self.url = f"{base_url}/embeddings"
        self.moved_from: str | None = None
        self.server: ServerIdentity | None = None

    @property
    def server_name(self) -> str | None:
        return None if self.server is None or self.server.name == "openai" else self.server.name

    def post(self, texts: list[str], fmt: str = "float", dimensions: int | None = None) -> Reply:
        """POST ``texts`` to the embeddings URL, within the check's time left.

        Raises:
            QwenEmbedError: no complete answer.
        """
        body: dict[str, Any] = {"model": self.model, "input": texts, "encoding_format": fmt}
        if dimensions is not None:
            body["dimensions"] = dimensions
        return self.http.send("POST", self.url, orjson.dumps(body))

    def message(self, reply: Reply) -> str:
        err = status_error(
            reply.status, reply.body, url=self.url, headers=reply.headers, secret=self.api_key
        )
        return str(err)

    def v1_hint(self) -> str | None:
        """``--base-url .../v1`` when the base URL lacks the API path that the same
        server answers under, else ``None``."""
        if self.base_url.endswith("/v1"):
            return None
        candidate = f"{self.base_url}/v1"
        try:
            models = models_in(self.http.get_models(candidate), self.api_key)
        except QwenEmbedError:  # any failure (transport, TLS, the deadline): no hint
            return None
        return None if models is None else candidate


def check_server(
    base_url: str,
    *,
    api_key: str | None = None,
    verify: bool | str = True,
    model: str | None = None,
    max_idle: float = 6.5,
    batch_probe_max: int = 128,
    samples: int = 10,
    step: Callable[[str], None] | None = None,
    timeout: float = CHECK_TIMEOUT,
    probe_budget: float = PROBE_BUDGET,
) -> CheckReport:
    """Probe what an OpenAI-compatible embedding server is and supports.

    Args:
        base_url: the API root (``.../v1``).
        api_key: bearer token, or ``None``.
        verify: TLS verification (``True``, ``False`` or a CA bundle path).
        model: the model to probe (default: the first one ``/models`` lists).
        max_idle: longest idle wait when measuring the keep-alive timeout (seconds).
        batch_probe_max: largest batch the batch-limit probe sends (texts).
        samples: warm single-text requests in the latency sample.
        step: called with each probe's name before it runs (for a spinner).
        timeout: seconds the whole check may take: every probe runs within the time
            left (one that finds none fails, naming it), the keep-alive wait included.
        probe_budget: seconds each ``GET`` probe (``/health``, ``/models``, HTTP/2, the
            keep-alive probe's request) may take, within ``timeout``.

    Returns:
        a ``CheckReport``. Probes never raise: a failure becomes a ``"fail"`` finding,
        and probes that depend on a failed one are left out. What the library logs at
        WARNING meanwhile (e.g. the truncated long input of the truncation probe) is
        in its ``notes``; those records still reach the application's own handlers.

    Raises:
        ConfigError: a malformed ``base_url``, or ``verify`` names a CA file that does
            not exist (from the client's settings).
    """
    with library_notes() as notes:
        report = _check_server(
            base_url,
            api_key=api_key,
            verify=verify,
            model=model,
            max_idle=max_idle,
            batch_probe_max=batch_probe_max,
            samples=samples,
            step=step,
            timeout=timeout,
            probe_budget=probe_budget,
        )
    return dataclasses.replace(report, notes=tuple(notes))


def _check_server(
    base_url: str,
    *,
    api_key: str | None,
    verify: bool | str,
    model: str | None,
    max_idle: float,
    batch_probe_max: int,
    samples: int,
    step: Callable[[str], None] | None,
    timeout: float,
    probe_budget: float,
) -> CheckReport:
    """`check_server` without its notes."""
    from .._transport._contract import quiet_header_loggers

    quiet_header_loggers(api_key)  # no backend's log record shows the key
    deadline = time.monotonic() + timeout
    base_url = base_url.rstrip("/")
    say = step or (lambda name: None)
    findings: list[CheckFinding] = []
    label = EmbeddingConfig(base_url=base_url, verify=verify).endpoint

    def report(probe: _Probe | None = None) -> CheckReport:
        return CheckReport(
            label,
            model if probe is None else probe.model,
            findings,
            None if probe is None else probe.server,
        )

    with Probes(
        base_url, api_key=api_key, verify=verify, deadline=deadline, budget=timeout
    ) as http:
        # ---- health
        say("health")
        try:
            resp = http.send("GET", f"{api_root(base_url)}/health", within=probe_budget)
        except QwenEmbedError as exc:
            findings.append(_unreachable(label, exc))
            return report()
        status: Literal["ok", "info"] = "ok" if resp.status < 400 else "info"
        findings.append(
            CheckFinding(
                "health",
                status,
                f"GET /health: {resp.status}" + ("" if status == "ok" else " (no health endpoint)"),
                resp.status,
            )
        )

        # ---- models (the answer also says which server this is: the client's own
        # reading of it, _servers.identify_models, so advice can name its settings)
        say("models")
        models: list[str] = []
        models_status: int | None = None
        models_error: str | None = None
        detection: Any = None
        try:
            resp = http.get_models(base_url, within=probe_budget)
        except QwenEmbedError as exc:
            models_error = str(exc)
        else:
            models_status, models = resp.status, models_in(resp, api_key) or []
            detection = identify_models(resp.status, resp.headers, resp.body, base_url=base_url)
        chosen = model or (models[0] if models else DEFAULT_MODEL)
        probe = _Probe(http, base_url, api_key, verify, chosen)
        probe.server, moved = _identify(detection)
        if moved is not None:  # the API is not where base_url says: probe it there
            probe.url, probe.moved_from = moved, probe.url
        models_finding = _models_finding(models, models_status, models_error)
        if models_finding.status != "ok" and (
            advice := _MODELS_ADVICE.get(probe.server_name or "")
        ):
            models_finding = dataclasses.replace(models_finding, advice=advice)
        findings.append(models_finding)

        # ---- embedding
        say("embedding")
        finding, float_vec = _embedding_finding(probe)
        findings.append(finding)
        if float_vec is None:
            return report(probe)
        dim = int(float_vec.size)
        # The keep-alive probe mostly waits (up to max_idle s) on its own idle
        # connection: it runs beside the other probes, not after them.
        bounds = (max_idle, deadline, probe_budget)
        keepalive = Background("keepalive", _keepalive_finding, base_url, verify, api_key, *bounds)

        say("base64")
        findings.append(_base64_finding(probe, float_vec))
        say("dimensions")
        findings.append(_dimensions_finding(probe, dim))
        say("batch_limit")
        findings.append(_batch_limit_finding(probe, batch_probe_max))

    say("http2")
    findings.append(_http2_finding(base_url, verify, api_key, deadline, probe_budget))
    say("keepalive")
    findings.append(keepalive.result())
    say("latency")
    left = deadline - time.monotonic()
    if left < 0.01:
        findings.append(
            CheckFinding(
                "latency",
                "fail",
                f"not measured: the check's --timeout of {timeout:g} s ran out",
                None,
                "raise --timeout",
            )
        )
        return report(probe)
    # the client's own calls, within the time left (its deadline for every call)
    retry = RetryConfig(deadline=left, query_deadline=left)
    cfg = EmbeddingConfig(
        base_url=base_url, api_key=api_key, verify=verify, model=probe.model, retry=retry
    )
    from .._metrics import stats

    before = dict(stats().get(cfg.endpoint, {}).get("fallbacks", {}))
    findings.append(_latency_sample(cfg, samples))
    say("truncation")
    left = deadline - time.monotonic()
    if left < 0.01:
        summary = f"not checked: the check's --timeout of {timeout:g} s ran out"
        findings.append(CheckFinding("truncation", "info", summary, None, "raise --timeout"))
        return report(probe)
    retry = RetryConfig(deadline=left, query_deadline=left)
    findings.extend(_client_findings(cfg.replace(retry=retry), before))
    return report(probe)


def _unreachable(label: str, exc: QwenEmbedError) -> CheckFinding:
    """The health finding of a first probe that got no answer."""
    if isinstance(exc, ConnectError | ConnectTimeout):
        certificate = certificate_failure(exc) or "certificate verification" in str(exc)
        return CheckFinding(
            "health",
            "fail",
            f"cannot reach {label}: {exc}",
            None,
            "check the URL, the port, and that the server is running"
            + ("; for a private CA pass --ca /path/to/ca.pem" if certificate else ""),
        )
    return CheckFinding(
        "health",
        "fail",
        f"GET /health got no usable answer from {label}: {exc}",
        None,
        "the server (or a proxy in front of it) answers HTTP wrongly or too slowly; see its log",
    )


_LONG_TEXT = "The quick brown fox jumps over the lazy dog near the river bank. " * 400


def _client_findings(cfg: EmbeddingConfig, before: dict[str, int]) -> list[CheckFinding]:
    """What the client itself learned from the server's answers during the check (its
    fallback counters since ``before``): silent truncation of a long input (the
    ``usage`` it reports) and, on llama.cpp, whether it appends ``<|endoftext|>`` (the
    token Qwen3-Embedding pools)."""
    from .._metrics import stats

    label = cfg.endpoint
    try:
        EmbeddingClient(cfg).embed_documents([_LONG_TEXT, "short"])
    except QwenEmbedError as exc:
        return [CheckFinding("truncation", "info", f"a long input failed: {exc}")]
    after = stats().get(label, {}).get("fallbacks", {})
    out: list[CheckFinding] = []
    truncated = after.get("truncated_input", 0) - before.get("truncated_input", 0)
    if truncated:
        out.append(
            CheckFinding(
                "truncation",
                "warn",
                "the server embedded only the start of a ~6,000-token input (its usage "
                "reports far fewer tokens): long texts are silently truncated",
                truncated,
                "split long documents into chunks below the server's context length",
            )
        )
    else:
        out.append(
            CheckFinding(
                "truncation",
                "ok",
                "a ~6,000-token input was embedded whole (or the server reports no usage)",
            )
        )
    if after.get("eos_missing", 0) - before.get("eos_missing", 0):
        out.append(
            CheckFinding(
                "eos",
                "warn",
                "the server does not append <|endoftext|>, the token Qwen3-Embedding pools",
                False,
                "set append_eos=True (or start llama.cpp so that it adds the EOS token)",
            )
        )
    return out


def _models_finding(models: list[str], status: int | None, error: str | None) -> CheckFinding:
    if models:
        return CheckFinding("models", "ok", f"models: {', '.join(models)}", models)
    if error is not None:
        return CheckFinding("models", "info", f"GET /models failed: {error}", [])
    if status is not None and status < 400:
        return CheckFinding("models", "info", "GET /models lists no model", [])
    return CheckFinding("models", "info", f"GET /models: HTTP {status}", [])


def _embedding_finding(
    probe: _Probe,
) -> tuple[CheckFinding, np.ndarray[Any, np.dtype[np.float32]] | None]:
    advice: str | None
    try:
        resp = probe.post([_PROBE_TEXT])
    except QwenEmbedError as exc:
        return CheckFinding("embedding", "fail", f"POST /embeddings: {exc}"), None
    if resp.status >= 400:
        message = probe.message(resp)
        if resp.status == 404 and (hint := probe.v1_hint()) is not None:
            advice = (
                f"the OpenAI API of this server is under {hint}, not {probe.base_url}: "
                f"pass --base-url {hint}"
            )
        elif resp.status in (401, 403):
            advice = "check --api-key (or QWEN_EMBED_API_KEY)"
        elif resp.status == 404:
            advice = (
                "check --model (see the models finding) and the path of --base-url "
                "(the API root, where /embeddings is)"
            )
        else:
            advice = "check --model (see the models finding)"
        return CheckFinding("embedding", "fail", message, resp.status, advice), None
    if probe.server_name is None:  # not recognised from /models: its answer may say
        found = identify_response(resp.headers)
        if found is not None:
            probe.server = _identify(found)[0]
    vec = _first_vector(resp.body)
    if vec is None:
        return CheckFinding("embedding", "fail", "the response holds no float embedding"), None
    dim = int(vec.size)
    norm = float(np.linalg.norm(vec))
    expected = _known_dims(probe.model)
    status: Literal["ok", "warn", "info"] = "ok"
    advice = None
    if expected is not None and expected != dim:
        status = "warn"
        advice = (
            f"{probe.model} has {expected} dimensions; the server returns {dim}: is the "
            "model name right, or does the server truncate?"
        )
    elif abs(norm - 1.0) > 1e-3:
        status = "info"
        advice = "nothing to do: the client L2-normalises (normalize=True, the default)"
    summary = f"{probe.model}: {dim} dimensions, norm {norm:.4f}"
    if status == "info":
        summary += " (not unit length)"
    if probe.moved_from is not None:
        root = probe.url.rsplit("/", 1)[0]
        status = "warn"
        summary += f", served at {probe.url} (not {probe.moved_from})"
        advice = (
            f"pass --base-url {root}: the API is at the server root (Infinity started "
            "without --url-prefix /v1); this client finds it, other tools may not"
        )
    value = {"dim": dim, "norm": round(norm, 6)}
    return CheckFinding("embedding", status, summary, value, advice), vec


def _base64_finding(probe: _Probe, float_vec: np.ndarray[Any, Any]) -> CheckFinding:
    try:
        resp = probe.post([_PROBE_TEXT], fmt="base64")
        if resp.status >= 400:
            return CheckFinding(
                "base64",
                "warn",
                f"encoding_format=base64 refused ({resp.status})",
                False,
                "nothing to do: encoding_format='auto' falls back to float once "
                "(responses are ~4x larger)",
            )
        item = orjson.loads(resp.body)["data"][0]["embedding"]
    except (QwenEmbedError, KeyError, IndexError, TypeError, ValueError) as exc:
        return CheckFinding("base64", "warn", f"base64 probe failed: {exc}", None)
    if not isinstance(item, str):
        return CheckFinding(
            "base64",
            "info",
            "base64 ignored: floats returned",
            False,
            "nothing to do: the client decodes either form",
        )
    b64 = np.frombuffer(base64.b64decode(item), dtype="<f4")
    same = b64.shape == float_vec.shape and bool(np.allclose(b64, float_vec, atol=1e-5))
    return CheckFinding(
        "base64",
        "ok" if same else "warn",
        "base64 supported" + ("" if same else " but differs from the float response"),
        True,
        None if same else "use encoding_format='float'",
    )


def _dimensions_finding(probe: _Probe, dim: int) -> CheckFinding:
    want = 256 if dim > 256 else max(1, dim // 2)
    advice = dimensions_advice(probe.server_name)
    try:
        resp = probe.post([_PROBE_TEXT], dimensions=want)
    except QwenEmbedError as exc:
        return CheckFinding("dimensions", "warn", f"dimensions probe failed: {exc}", None)
    if resp.status >= 400:
        return CheckFinding(
            "dimensions", "warn", f"dimensions={want} refused ({resp.status})", False, advice
        )
    vec = _first_vector(resp.body)
    got = 0 if vec is None else int(vec.size)
    if vec is None or got != want:
        return CheckFinding(
            "dimensions", "warn", f"dimensions={want} ignored (got {got} dimensions)", False, advice
        )
    n = float(np.linalg.norm(vec))
    unit = abs(n - 1.0) < 1e-3
    return CheckFinding(
        "dimensions",
        "ok" if unit else "warn",
        f"dimensions={want} served" + ("" if unit else f", not renormalised (norm {n:.3f})"),
        True,
        None if unit else "nothing to do: the client renormalises (normalize=True, the default)",
    )


def _batch_limit_finding(probe: _Probe, bound: int) -> CheckFinding:
    """The most texts per request the server takes, up to ``bound``.

    32 texts first (the default batch size; it also warms a server started without a
    warm-up), then ``bound``: two requests when the server takes both or states its
    limit. Only after a refusal that states no limit are the sizes in between tried,
    largest first. The texts are a few words each: the probe counts texts, and a real
    model embeds long ones slowly (on a CPU, the former ascending series of 1,000
    passages of 200 characters was most of the check's time). Each request waits for its answer as
    long as the check's time left (a large batch on a CPU server is slow, and slowness
    is not a limit).
    """
    sizes = [s for s in (8, 32, 64, 128, 256, 512, 1024, 2048) if s < bound] + [bound]
    texts = [" ".join(p.split()[:6]) for p in corpus(bound)]
    setting = _BATCH_SETTING.get(probe.server_name or "", "")

    def attempt(size: int) -> CheckFinding | str | None:
        """``None``: taken; a finding: the server stated its limit; else why not."""
        try:
            resp = probe.post(texts[:size])
        except QwenEmbedError as exc:
            return f"failed: {exc}"
        if resp.status < 400:
            return None
        err = status_error(resp.status, resp.body, url=probe.url, secret=probe.api_key)
        limit = err.limit if isinstance(err, BatchTooLargeError) else None
        if limit is None:
            return f"refused ({resp.status}: {err.message[:120]})"
        return CheckFinding(
            "batch_limit",
            "warn" if limit < 32 else "ok",
            f"the server accepts at most {limit} texts per request",
            limit,
            f"set batch_size={limit} (the client also learns it from the error)" + setting
            if limit < 32
            else "batch_size=32 (the default) fits",
        )

    largest_ok = 0
    refused: tuple[int, str] | None = None  # the smallest size refused, and why
    first = min(32, bound)
    for size in [first, bound] if bound > first else [first]:
        outcome = attempt(size)
        if isinstance(outcome, CheckFinding):
            return outcome
        if outcome is None:
            largest_ok = size
            continue
        refused = (size, outcome)
        for smaller in reversed([s for s in sizes if largest_ok < s < size]):
            outcome = attempt(smaller)
            if isinstance(outcome, CheckFinding):
                return outcome
            if outcome is None:
                largest_ok = smaller
                break
            refused = (smaller, outcome)
        break
    if refused is None:
        return CheckFinding(
            "batch_limit",
            "ok",
            f"{largest_ok} texts per request accepted (probe bound)",
            largest_ok,
            "batch_size=32 (the default) fits",
        )
    if not largest_ok:
        return CheckFinding(
            "batch_limit",
            "warn",
            f"batch of {refused[0]} texts {refused[1]}",
            None,
            f"see the server's log: not even {refused[0]} short texts were embedded",
        )
    return CheckFinding(
        "batch_limit",
        "warn",
        f"batch of {refused[0]} texts {refused[1]}; {largest_ok} accepted",
        largest_ok,
        f"use batch_size <= {largest_ok}",
    )


def _http2_finding(
    base_url: str, verify: bool | str, api_key: str | None, deadline: float, budget: float
) -> CheckFinding:
    version = probe_http2(
        base_url, verify=verify, api_key=api_key, timeout=budget, deadline=deadline
    )
    if version is None and time.monotonic() >= deadline:
        return CheckFinding("http2", "info", "not probed: the check's --timeout ran out")
    if version == "HTTP/2":
        how = "ALPN h2" if base_url.startswith("https") else "h2c prior knowledge"
        return CheckFinding(
            "http2",
            "ok",
            f"HTTP/2 offered ({how})",
            True,
            "http2=True multiplexes every request over one connection (fewer handshakes)",
        )
    return CheckFinding(
        "http2",
        "info",
        "HTTP/1.1 only",
        False,
        "keep http2=False (the default); the pool keeps up to "
        "Limits.max_connections HTTP/1.1 connections alive",
    )


def _keepalive_finding(
    base_url: str,
    verify: bool | str,
    api_key: str | None,
    max_idle: float,
    deadline: float,
    budget: float,
) -> CheckFinding:
    try:
        idle = measure_idle_timeout(
            base_url,
            verify=verify,
            api_key=api_key,
            max_idle=max_idle,
            deadline=deadline,
            budget=budget,
        )
    except OSError as exc:
        return CheckFinding("keepalive", "warn", f"keep-alive probe failed: {exc}")
    expiry = Limits().keepalive_expiry
    if idle is None:
        return CheckFinding(
            "keepalive",
            "ok",
            f"idle connections kept for more than {max_idle:.1f} s",
            None,
            f"keepalive_expiry={expiry:g} s (the default) is safe",
        )
    if idle <= 0.05:
        return CheckFinding(
            "keepalive",
            "warn",
            "the server closes the connection after each response",
            0.0,
            "no keep-alive: every request pays TCP (and TLS) set-up; enable "
            "keep-alive on the server or its proxy",
        )
    safe = idle > expiry + 0.25
    suggestion = max(0.5, math.floor((idle - 0.5) * 2) / 2)
    return CheckFinding(
        "keepalive",
        "ok" if safe else "warn",
        f"the server closes idle connections after {idle:.2f} s",
        round(idle, 3),
        f"keepalive_expiry={expiry:g} s (the default) is below it: safe"
        if safe
        else f"set Limits(keepalive_expiry={suggestion:g}) (below the server's "
        f"{idle:.1f} s), or reused sockets fail with 'Server disconnected'",
    )


def _latency_sample(cfg: EmbeddingConfig, samples: int) -> CheckFinding:
    """Single-text queries through the pooled client, as an application sends them."""
    client = EmbeddingClient(cfg)
    close_all()  # the first request opens a new connection: measured as such
    try:
        return _timed_queries(client, samples)
    finally:
        close_all()  # leave no idle connection behind


def _timed_queries(client: EmbeddingClient, samples: int) -> CheckFinding:
    times: list[float] = []
    texts = corpus(samples + 1)
    try:
        for i in range(max(2, samples + 1)):
            started = time.perf_counter()
            client.embed_query_array(texts[i % len(texts)])
            times.append((time.perf_counter() - started) * 1000.0)
    except QwenEmbedError as exc:
        return CheckFinding("latency", "fail", f"embedding through the client failed: {exc}")
    cold, warm = times[0], times[1:]
    p50 = float(np.median(warm))
    value = {
        "cold_ms": round(cold, 2),
        "p50_ms": round(p50, 2),
        "min_ms": round(min(warm), 2),
        "max_ms": round(max(warm), 2),
    }
    advice = None
    if cold > p50 * 1.5 and cold - p50 > 5:
        advice = (
            f"a new connection costs {cold - p50:.0f} ms more than a reused one: "
            "share one client per process (this library does)"
        )
    return CheckFinding(
        "latency",
        "ok",
        f"single-text query: first {cold:.1f} ms (new connection), then p50 {p50:.1f} ms "
        f"(min {min(warm):.1f}, max {max(warm):.1f}) over {len(warm)} requests",
        value,
        advice,
    )
