"""Corpus embedding on Ray Data: `embed_dataset` and `embed_files`.

Ray Data does the distribution (blocks, actor pool, retries, back-pressure, progress);
this module adds only the embedding step, as a ``map_batches`` callable class: each Ray
actor builds one `EmbeddingClient` in ``__init__`` and keeps it, so each actor process
holds one shared connection pool for its whole life, and sends up to ``max_in_flight``
requests at once over it::

    import ray
    from qwen_embed_plugins.ray import embed_dataset

    ds = ray.data.read_parquet("corpus/")                         # a "text" column
    ds = embed_dataset(ds, base_url="http://gpu-box:30000/v1", concurrency=4)
    ds.write_parquet("embedded/")                                 # + "embedding" column

Two batch sizes, not to be confused:

* ``batch_size``: rows per ``map_batches`` call (one Arrow table handed to an actor);
* ``request_batch_size``: texts per HTTP request (the client's ``batch_size``; default
  ``"auto"``, from 32, or 256 for a call of more than 1,024 rows). One call of
  ``batch_size`` rows is sent as ``ceil(batch_size / request_batch_size)`` requests,
  ``max_in_flight`` of them at a time.

Output: the input table unchanged plus ``output_column``, an Arrow
``fixed_size_list<float32>[dim]`` built without copying from the decoded ``n x dim``
float32 array. Rows keep their order within each block (Ray Data may reorder blocks
unless ``DataContext.execution_options.preserve_order`` is set).

With ``on_error="skip"`` a row whose text fails (not a string, empty, too long, or
rejected by the server for that input) gets a null embedding and a message in
``error_column``; endpoint failures (connection, 5xx, timeouts, auth) still fail the job.
An actor whose server never answered fails fast like any client (connection failures
retried for ``RetryConfig.wait_for_server`` seconds, default 2 s, then a ``ConnectError``
naming the URL); pass ``retry=RetryConfig(wait_for_server=...)`` for a job started before
its server.

Importing this module sets ``RAY_USAGE_STATS_ENABLED=0`` unless the variable is already
set, so a Ray instance started afterwards (by `embed_files`, or automatically by the
first dataset) never reports usage statistics online.

The API key and a proxy password are never pickled (see ``_config.Secret``,
``_server_text.ProxyURL``; a proxy with a password must be in the workers' environment as
``QWEN_EMBED_PROXY``). An explicit ``api_key=``, and the values of credential-like
``headers=`` (``X-Api-Key``, ...) and of credential-like ``extra_body`` fields (never
pickled either), travel to
the workers through Ray's object store (``ray.put``): what Ray pickles for the actors
holds only its ``ObjectRef``, and each actor reads them with ``ray.get`` (see
``_WorkerKey``); nothing logs it (Ray logs a ``runtime_env``, env vars included, when it
creates one, so the key is not sent that way). Without ``api_key=``, each worker reads
``QWEN_EMBED_API_KEY`` from its own environment (on a local Ray instance started by this
module, workers inherit the driver's; on a cluster set it in the nodes' environment).

Tracing (the ``otel`` extra): the driver's current OpenTelemetry span, when one records,
travels to the actors as W3C trace headers (``_tracing.carrier``), and each batch's
calls are its children there; the actors export their spans through the tracer provider
of their own process (set it in a ``worker_process_setup_hook``; docs/tracing.md).

Needs the ``ray`` extra (from a checkout: ``pip install -e ".[ray]"``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import numpy as np
import numpy.typing as npt
import pyarrow as pa  # type: ignore[import-untyped]

from ._client import EmbeddingClient
from ._config import (
    NOT_GIVEN,
    EmbeddingConfig,
    Limits,
    NotGiven,
    ProxyURL,
    RequestBody,
    is_secret_header,
    known_model_dims,
)
from ._corpus import dataset_files
from ._flat import config_from
from ._protocol import validate_text
from ._tracing import attached, carrier
from .errors import BadRequestError, ConfigError, InputError

# Nothing may phone home: Ray's usage statistics are off unless the user set the variable
# (it must be set before Ray starts, and Ray auto-starts on the first dataset).
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

try:
    import ray
    import ray.data
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    from ._install import install_command as _install_command

    raise ImportError(f"qwen_embed_plugins.ray needs Ray Data: {_install_command('ray')}") from exc

if TYPE_CHECKING:
    from ray.data import Dataset

__all__ = ["DEFAULT_ERROR_COLUMN", "EmbedFilesResult", "OnError", "embed_dataset", "embed_files"]

FloatArray = npt.NDArray[np.float32]

OnError = Literal["raise", "skip"]
"""What a failing row does: ``"raise"`` fails the job; ``"skip"`` gives the row a null
embedding and a message in the error column."""

DEFAULT_ERROR_COLUMN: Final = "embedding_error"
"""Name of the error column added with ``on_error="skip"`` (a string, null when the row
was embedded)."""


# --------------------------------------------------------------------------- Ray set-up


def _ensure_ray(address: str | None) -> None:
    """``ray.init`` once: a local instance by default (no dashboard, no usage stats), or the
    cluster at ``address`` / ``RAY_ADDRESS``. Does nothing when Ray is already initialised."""
    if ray.is_initialized():
        return
    if address is None and not os.environ.get("RAY_ADDRESS"):
        ray.init(include_dashboard=False)
    else:
        ray.init(address=address)


class _WorkerKey:
    """The secrets on their way to the Ray actors, held in Ray's object store: an
    explicit API key (or ``None``), the credential-like header values (name -> value)
    and an ``extra_body`` holding credential-like fields (whole, or ``None``).

    Pickling it (as Ray does with the actors' constructor arguments, or ``pickle``)
    carries only the ``ObjectRef``, an id; ``repr`` shows no key. The actor reads the
    key with ``ray.get``. The driver's dataset keeps the reference, so the object lives
    as long as the dataset can run.
    """

    __slots__ = ("_ref",)

    def __init__(self, ref: Any) -> None:
        self._ref = ref

    @classmethod
    def put(
        cls, key: str | None, headers: Mapping[str, str], body: dict[str, Any] | None = None
    ) -> _WorkerKey:
        """Store ``key``, the secret ``headers`` and ``body`` in the object store
        (``ray.put``)."""
        return cls(ray.put((key, dict(headers), body)))

    def get(self) -> tuple[str | None, dict[str, str], dict[str, Any] | None]:
        """The key, the secret headers and the body (``ray.get``), in an actor."""
        key, headers, body = ray.get(self._ref)
        return key, headers, body

    def restore(self, config: EmbeddingConfig) -> EmbeddingConfig:
        """``config`` (as unpickled in an actor) with the key and the secret header
        values put back."""
        key, secret, body = self.get()
        changes: dict[str, Any] = {} if key is None else {"api_key": key}
        if body is not None:
            changes["extra_body"] = body
        if secret and config.headers is not None:
            kept = config.headers
            changes["headers"] = {k: secret[k] if k in secret else kept[k] for k in kept}
        return config.replace(**changes)

    def __repr__(self) -> str:
        return "_WorkerKey(<in Ray's object store>)"

    def __reduce__(self) -> tuple[type[_WorkerKey], tuple[Any]]:
        return (_WorkerKey, (self._ref,))


def _client_config(
    base_url: Any, max_in_flight: int, request_batch_size: int | None, settings: dict[str, Any]
) -> tuple[EmbeddingConfig, bool, _WorkerKey | None]:
    """The config each actor rebuilds its client from, checked here in the driver.

    Returns the config (without an explicit key), whether the workers must find a key in
    ``QWEN_EMBED_API_KEY`` (the driver read one from there: a pickled config re-reads the
    key from the environment), and the explicit ``api_key`` and the credential-like
    header values (which a pickle withholds), put in the object store.
    """
    if "max_concurrency" in settings or "batch_size" in settings:
        raise ConfigError(
            "embed_dataset: use max_in_flight= (requests in flight per actor) and "
            "request_batch_size= (texts per request) instead of max_concurrency / batch_size"
        )
    if request_batch_size is not None:
        settings = {**settings, "batch_size": request_batch_size}
    pool_given = "limits" in settings or "max_connections" in settings
    if not pool_given and max_in_flight > Limits().max_connections:
        settings = {**settings, "max_connections": max_in_flight}
    config = config_from(
        {"base_url": base_url, "max_concurrency": max_in_flight, **settings},
        owner="embed_dataset",
    )
    proxy = config.proxy
    if isinstance(proxy, ProxyURL) and not proxy.in_environment():
        raise ConfigError(
            "embed_dataset: a proxy password cannot be shipped to Ray workers (it is never "
            "pickled); set QWEN_EMBED_PROXY to the proxy URL in the workers' environment "
            "instead (inherited by a local Ray instance, or pass runtime_env)"
        )
    if config.key_function is not None:
        raise ConfigError(
            "embed_dataset: api_key as a callable cannot reach Ray workers (they may run "
            "on other machines, and a callable's pickle can carry the credential it "
            "wraps); pass the key as a str (shipped through Ray's object store, never "
            "pickled) or set QWEN_EMBED_API_KEY in the workers' environment (runtime_env)"
        )
    explicit = settings.get("api_key", NOT_GIVEN)
    key = config.api_key_value()
    headers = config.headers or {}
    secret = {name: headers[name] for name in headers if is_secret_header(name)}
    extra = config.extra_body
    body = dict(extra) if isinstance(extra, RequestBody) and extra.masked() != extra else None
    if isinstance(explicit, NotGiven) or key is None:
        found = secret or body is not None
        return config, key is not None, _WorkerKey.put(None, secret, body) if found else None
    return config.replace(api_key=None), False, _WorkerKey.put(key, secret, body)


def _compute(concurrency: int | tuple[int, int]) -> Any:
    """``concurrency`` (actors) as Ray Data's ``ActorPoolStrategy``."""
    if isinstance(concurrency, tuple):
        if len(concurrency) != 2:
            raise ConfigError(f"concurrency must be an int or (min, max), got {concurrency!r}")
        low, high = concurrency
        return ray.data.ActorPoolStrategy(min_size=low, max_size=high)
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ConfigError(f"concurrency must be a positive int or (min, max), got {concurrency!r}")
    return ray.data.ActorPoolStrategy(size=concurrency)


# --------------------------------------------------------------------------- per-row errors


def _text_problem(text: object, max_chars: int | None) -> str | None:
    """Why ``text`` cannot be sent (the client's own check, ``validate_text``), as the
    error column says it, or ``None``."""
    try:
        validate_text(text, None, max_chars=max_chars)
    except InputError as exc:
        return _row_error(exc)
    return None


def _row_error(exc: Exception) -> str:
    """The error-column message for one failed row."""
    if isinstance(exc, BadRequestError):
        return f"{type(exc).__name__} (HTTP {exc.status}): {exc.message}"
    return f"{type(exc).__name__}: {exc}"


def _embed_skipping(
    client: EmbeddingClient, texts: Sequence[object]
) -> tuple[list[tuple[list[int], FloatArray]], list[str | None]]:
    """Embed ``texts``, isolating the rows that fail.

    Texts that cannot be sent (null, empty, too long) are found first; the others go in
    one call with ``on_error="skip"``: the client isolates inputs the server refuses or
    fails on (bisection) and embeds every other one. Endpoint failures (an outage past
    the deadline, authentication, an open breaker) propagate.

    Returns:
        ``(parts, errors)``: ``parts`` holds ``(rows, vectors)`` pairs, ``vectors`` the
        ``len(rows) x dim`` float32 array for those row indices (its rows of failed
        inputs are NaN); ``errors[i]`` is ``None`` or why row ``i`` failed.
    """
    max_chars = client.config.max_text_chars
    errors: list[str | None] = [_text_problem(t, max_chars) for t in texts]
    good = [i for i, e in enumerate(errors) if e is None]
    if not good:
        return [], errors
    sendable = [str(texts[i]) for i in good]  # every one a str (checked above)
    result = client.embed_documents_array(sendable, on_error="skip")
    for j, exc in result.errors.items():
        errors[good[j]] = _row_error(exc)
    if result.vectors.shape[1] == 0:  # every input failed
        return [], errors
    return [(good, result.vectors)], errors


# --------------------------------------------------------------------------- the actor


def _vectors_column(vectors: FloatArray, dim: int, mask: np.ndarray | None = None) -> Any:
    """``n x dim`` float32 -> Arrow ``fixed_size_list<float32>[dim]`` sharing its memory."""
    flat = pa.array(np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1))
    if mask is None:
        return pa.FixedSizeListArray.from_arrays(flat, dim)
    return pa.FixedSizeListArray.from_arrays(flat, dim, mask=pa.array(mask))


class _EmbedBatch:
    """The ``map_batches`` callable class: one client (one pool) per Ray actor."""

    def __init__(
        self,
        config: EmbeddingConfig,
        column: str,
        output_column: str,
        error_column: str,
        on_error: OnError,
        needs_key: bool,
        api_key: _WorkerKey | None = None,
        trace: dict[str, str] | None = None,
    ) -> None:
        self._trace = trace  # the driver's trace context (W3C headers): the calls' parent
        if api_key is not None:
            config = api_key.restore(config)
        if needs_key and config.api_key_value() is None:
            raise ConfigError(
                "the driver has an API key but this Ray worker has no QWEN_EMBED_API_KEY in "
                "its environment; set it on the cluster's nodes, or pass api_key= to "
                "embed_dataset (it reaches the workers through Ray's object store)"
            )
        self._client = EmbeddingClient(config)
        self._column = column
        self._output = output_column
        self._error = error_column
        self._skip = on_error == "skip"
        self._dim: int | None = config.dimensions

    def _known_dim(self) -> int:
        """The vector size, for a batch with no embedded row (empty or all failed)."""
        if self._dim is None:
            self._dim = known_model_dims(self._client.config.model or "")
        if self._dim is None:  # ask the server once
            self._dim = int(self._client.embed_documents_array(["dimension probe"]).shape[1])
        return self._dim

    def __call__(self, batch: pa.Table) -> pa.Table:
        with attached(self._trace):  # the calls' spans: children of the driver's span
            return self._table(batch)

    def _table(self, batch: pa.Table) -> pa.Table:
        if self._column not in batch.column_names:
            raise InputError(
                f"column {self._column!r} is not in the dataset; columns: {batch.column_names}"
            )
        texts = batch.column(self._column).to_pylist()
        if not self._skip:
            if not texts:
                empty = np.empty((0, self._known_dim()), dtype=np.float32)
                return batch.append_column(self._output, _vectors_column(empty, empty.shape[1]))
            try:
                vectors = self._client.embed_documents_array(texts)
            except InputError as exc:
                raise InputError(
                    f"column {self._column!r}: {exc} (row {exc.index} of a {len(texts)}-row "
                    "batch; on_error='skip' keeps going and reports such rows)",
                    index=exc.index,
                ) from exc
            self._dim = int(vectors.shape[1])
            return batch.append_column(self._output, _vectors_column(vectors, self._dim))
        parts, errors = _embed_skipping(self._client, texts)
        if len(parts) == 1 and len(parts[0][0]) == len(texts):  # every row sent: no copy
            vectors = parts[0][1]
            self._dim = int(vectors.shape[1])
            failed = [e is not None for e in errors]
            mask = np.array(failed, dtype=bool) if any(failed) else None
            column = _vectors_column(vectors, self._dim, mask)
        else:
            dim = int(parts[0][1].shape[1]) if parts else self._known_dim()
            self._dim = dim
            vectors = np.zeros((len(texts), dim), dtype=np.float32)
            for rows, arr in parts:
                vectors[rows] = arr
            mask = np.array([e is not None for e in errors], dtype=bool)
            column = _vectors_column(vectors, dim, mask)
        out = batch.append_column(self._output, column)
        return out.append_column(self._error, pa.array(errors, type=pa.string()))


# --------------------------------------------------------------------------- public API


def embed_dataset(
    ds: Dataset,
    *,
    column: str = "text",
    output_column: str = "embedding",
    base_url: str | Sequence[str] | None = None,
    concurrency: int | tuple[int, int] = 1,
    batch_size: int = 1024,
    num_cpus: float = 0.5,
    max_in_flight: int = 4,
    request_batch_size: int | None = None,
    on_error: OnError = "raise",
    error_column: str = DEFAULT_ERROR_COLUMN,
    runtime_env: Mapping[str, Any] | None = None,
    **settings: Any,
) -> Dataset:
    """Add an embedding column to a Ray Dataset (lazy: runs when the dataset is consumed).

    Args:
        ds: the input dataset; ``column`` holds the texts (documents, sent raw).
        column: the text column.
        output_column: the new column: Arrow ``fixed_size_list<float32>[dim]``, one
            ``dim``-float vector per row (``dim`` = the model's size, or ``dimensions``).
        base_url: the server's API root (e.g. ``http://gpu-box:30000/v1``), passed to
            ``EmbeddingConfig`` unchanged (a list of replicas once the core takes one);
            default ``QWEN_EMBED_BASE_URL`` of the driver.
        concurrency: Ray actors embedding at once (each one client and one pool): an
            int, or ``(min, max)`` for an autoscaling pool.
        batch_size: rows per ``map_batches`` call (one Arrow table per call).
        num_cpus: CPUs Ray reserves per actor (fractional allowed; the work is I/O and
            decoding, about 0.5 CPU per actor at full speed on loopback).
        max_in_flight: HTTP requests in flight at once per actor (the client's
            ``max_concurrency``); the pool's ``max_connections`` is raised to match if
            below it.
        request_batch_size: texts per HTTP request (the client's ``batch_size``, default
            ``"auto"``: found from the server's latencies, from 32; capped by the
            server's own limit).
        on_error: ``"raise"`` (default: the first bad row fails the job, Ray wrapping the
            ``QwenEmbedError``) or ``"skip"`` (failed rows get a null embedding and a
            message in ``error_column``; endpoint failures still raise).
        error_column: the error column's name (``on_error="skip"`` only).
        runtime_env: Ray ``runtime_env`` for the actors (e.g. ``env_vars``).
        **settings: any other ``EmbeddingConfig`` field (``model``, ``dimensions``,
            ``timeout``, ``retry``, ``http2``, ``api_key``, ...) or flat setting, as the
            core clients take them (``read_timeout``, ``max_retries``, ...; an unknown
            name raises ``ConfigError`` naming the closest one). An explicit ``api_key``
            reaches the actors through Ray's object store, never in a pickle or a log
            (see the module doc).

    Returns:
        A new ``ray.data.Dataset``: the input columns plus ``output_column`` (and
        ``error_column`` with ``on_error="skip"``).

    Raises:
        ConfigError: a setting is invalid (checked here, before any actor starts).
        InputError: ``column`` is not in the dataset's schema (when Ray knows it already).
        ray.exceptions.RayTaskError: at execution, when a batch failed (``on_error="raise"``,
            or an endpoint failure): Ray Data re-raises it with the ``QwenEmbedError``'s
            type and message in its text (the exception object itself is not kept).
    """
    if on_error not in ("raise", "skip"):
        raise ConfigError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size (rows per call) must be a positive int, got {batch_size!r}")
    if not (isinstance(num_cpus, int | float) and num_cpus >= 0):
        raise ConfigError(f"num_cpus must be a number >= 0, got {num_cpus!r}")
    config, needs_key, api_key = _client_config(
        base_url, max_in_flight, request_batch_size, settings
    )
    compute = _compute(concurrency)
    schema = ds.schema(fetch_if_missing=False)
    if schema is not None and column not in schema.names:
        raise InputError(f"column {column!r} is not in the dataset; columns: {schema.names}")
    kwargs: dict[str, Any] = {}
    if runtime_env is not None:
        kwargs["runtime_env"] = dict(runtime_env)
    result: Dataset = ds.map_batches(
        _EmbedBatch,
        fn_constructor_kwargs={
            "config": config,
            "column": column,
            "output_column": output_column,
            "error_column": error_column,
            "on_error": on_error,
            "needs_key": needs_key,
            "api_key": api_key,
            "trace": carrier(),
        },
        batch_size=batch_size,
        batch_format="pyarrow",  # Arrow in, Arrow out: no pandas/numpy conversion
        compute=compute,
        num_cpus=num_cpus,
        udf_modifying_row_count=False,
        **kwargs,
    )
    return result


@dataclass(frozen=True, slots=True)
class EmbedFilesResult:
    """What `embed_files` wrote.

    Attributes:
        output_dir: the directory holding the Parquet files.
        files: the Parquet file names written, sorted (empty for a URI output).
        rows: rows written (all input rows); ``None`` for a URI output (not read back).
        failed_rows: rows with a null embedding (``on_error="skip"``; else 0); ``None``
            for a URI output.
    """

    output_dir: str
    files: tuple[str, ...]
    rows: int | None
    failed_rows: int | None


def embed_files(
    input: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    output_dir: str | os.PathLike[str],
    *,
    column: str = "text",
    output_column: str = "embedding",
    base_url: str | Sequence[str] | None = None,
    input_format: str | None = None,
    overwrite: bool = False,
    address: str | None = None,
    concurrency: int | tuple[int, int] = 1,
    batch_size: int = 1024,
    num_cpus: float = 0.5,
    max_in_flight: int = 4,
    request_batch_size: int | None = None,
    on_error: OnError = "raise",
    error_column: str = DEFAULT_ERROR_COLUMN,
    **settings: Any,
) -> EmbedFilesResult:
    """Embed Parquet or JSON Lines files into a directory of Parquet files, on Ray Data.

    What ``qwen-embed embed --ray --input corpus.parquet --output out_dir/ --column text``
    runs. Starts a local Ray instance unless one is running (or ``address`` /
    ``RAY_ADDRESS`` names a cluster); shows Ray's own progress. Output rows are the input
    rows with their columns plus ``output_column`` (see `embed_dataset`).

    Args:
        input: a file, a directory of files, or a list of them (local paths, or URIs
            Ray can read on a cluster).
        output_dir: the directory to create. A local one is written to a temporary
            sibling first and renamed when every row is written, so a failed run leaves
            no partial output.
        input_format: ``"parquet"`` or ``"jsonl"``; default from the file suffixes.
        overwrite: replace ``output_dir`` if it exists (else ``FileExistsError``).
        address: a Ray cluster address (default ``RAY_ADDRESS``, else local).
        Other arguments: as for `embed_dataset`.

    Returns:
        An `EmbedFilesResult` (files, rows, failed rows), read back from the written
        Parquet footers.

    Raises:
        FileExistsError: ``output_dir`` exists and ``overwrite`` is false.
        FileNotFoundError: a local input path does not exist.
        ConfigError, InputError: as for `embed_dataset`; the input format is unknown.
        ray.exceptions.RayTaskError: a batch failed (see `embed_dataset`).
    """
    paths, fmt = dataset_files(input, input_format)
    out = os.fspath(output_dir)
    is_uri = "://" in out
    if not is_uri and os.path.exists(out) and not overwrite:
        raise FileExistsError(f"output directory exists: {out} (pass overwrite=True)")
    _ensure_ray(address)
    ds = ray.data.read_parquet(paths) if fmt == "parquet" else ray.data.read_json(paths, lines=True)
    ds = embed_dataset(
        ds,
        column=column,
        output_column=output_column,
        base_url=base_url,
        concurrency=concurrency,
        batch_size=batch_size,
        num_cpus=num_cpus,
        max_in_flight=max_in_flight,
        request_batch_size=request_batch_size,
        on_error=on_error,
        error_column=error_column,
        **settings,
    )
    if is_uri:
        mode = ray.data.SaveMode.OVERWRITE if overwrite else ray.data.SaveMode.CREATE
        ds.write_parquet(out, mode=mode)
        return EmbedFilesResult(out, (), None, None)
    target = Path(out).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        ds.write_parquet(str(staging))
        if target.exists():
            old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
            target.rename(old)
            staging.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            staging.rename(target)
    except BaseException:
        with contextlib.suppress(OSError):
            shutil.rmtree(staging)
        raise
    return _summary(target, error_column if on_error == "skip" else None)


def _summary(target: Path, error_column: str | None) -> EmbedFilesResult:
    """Rows and failed rows of the written files, from the Parquet footers (the error
    column's null counts), reading the error column itself only where a footer has no
    statistics."""
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    files = sorted(p.name for p in target.glob("*.parquet"))
    rows = failed = 0
    for name in files:
        meta = pq.ParquetFile(target / name).metadata
        rows += meta.num_rows
        if error_column is None or meta.num_rows == 0:
            continue
        index = meta.schema.names.index(error_column)
        nulls = 0
        for g in range(meta.num_row_groups):
            stats = meta.row_group(g).column(index).statistics
            if stats is None or not stats.has_null_count:
                column = pq.read_table(target / name, columns=[error_column]).column(0)
                nulls = int(column.null_count)
                break
            nulls += int(stats.null_count)
        failed += meta.num_rows - nulls
    return EmbedFilesResult(str(target), tuple(files), rows, failed)
