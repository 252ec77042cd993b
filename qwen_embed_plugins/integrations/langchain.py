"""LangChain ``Embeddings`` over the process-wide shared pool: ``QwenPooledEmbeddings``.

The adapter adds nothing but the LangChain surface: its fields map one-to-one onto
``EmbeddingConfig``, and every call goes through the core ``EmbeddingClient`` /
``AsyncEmbeddingClient``, so every instance with equal transport settings (base URL,
API key, timeouts, limits, HTTP/2, TLS verification) shares one connection pool per
process (sync) and per event loop (async).

Needs the ``langchain`` extra (from a checkout: ``pip install -e ".[langchain]"``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from contextlib import contextmanager
from dataclasses import InitVar
from typing import TYPE_CHECKING, Any, ClassVar, Final, Literal, Self

from langchain_core.embeddings import Embeddings
from langchain_core.utils import secret_from_env
from pydantic import ConfigDict, Field, SecretStr, model_validator

from .._config import ENV_API_KEY, OnError, TimeoutArg
from .._protocol import validate_texts
from .._results import EmbeddingList
from .._settings import closest
from ..errors import ConfigError
from ._common import (
    Clients,
    FlatSettings,
    KeyFunctionSetting,
    describe,
    mask_inputs,
    setting,
    wrap_key,
)
from ._names import REFUSED_HINTS, TIMEOUT, Stock, resolve_names, zero_filled

__all__ = ["QwenPooledEmbeddings"]


def _tqdm_missing() -> str:
    from .._install import install_command as _install_command

    return f"show_progress=True needs tqdm: {_install_command('langchain')} (or pip install tqdm)"


# The parameter names of langchain_openai.OpenAIEmbeddings (docs/migration.md).
_STOCK = Stock(
    {
        "chunk_size": "batch_size",
        "timeout": TIMEOUT,
        "request_timeout": TIMEOUT,
        "show_progress_bar": "show_progress",
        "default_headers": "headers",
        "model_kwargs": "extra_body",
        "openai_api_key": "api_key",
        "openai_api_base": "base_url",
        "openai_proxy": "proxy",
    },
    harmless={
        "check_embedding_ctx_length": (False,),
        "tiktoken_enabled": (False,),
        "skip_empty": (False,),
    },
)


PER_CALL: Final = frozenset(
    {"model", "dimensions", "encoding_format", "timeout", "user", "extra_headers", "extra_body"}
    | {"extra_query", "on_error"}
)
"""The keyword arguments the embed methods take besides ``chunk_size``: those
``OpenAIEmbeddings`` passes on to the SDK's ``embeddings.create`` (``extra_query``
refused with a hint), and ``on_error``."""


def _tqdm() -> Any:
    """``tqdm.auto.tqdm`` (console or notebook bar), or an ``ImportError`` saying how
    to install it."""
    try:
        module = importlib.import_module("tqdm.auto")  # tqdm ships no type hints
    except ImportError as exc:
        raise ImportError(_tqdm_missing()) from exc
    return module.tqdm


def _as_texts(texts: Any) -> Any:
    """LangChain passes lists; also take any iterable (a generator is read once), and
    reject what is not a collection of texts with ``InputError`` (not a bare
    ``TypeError`` from ``len()``)."""
    if isinstance(texts, Sized):
        return texts  # lists, tuples; str/sets/mappings are rejected by the client
    if isinstance(texts, Iterable):
        return list(texts)
    return validate_texts(texts, max_chars=None)  # raises InputError naming the type


class QwenPooledEmbeddings(FlatSettings, Embeddings):
    """Qwen3-Embedding (or any OpenAI-compatible ``/v1/embeddings`` server) for LangChain.

    Every instance for the same endpoint and transport settings shares the
    process-wide connection pool of ``qwen_embed_plugins``: one sync HTTP client for
    all threads and one async client per event loop, each with at most
    ``max_connections`` sockets, idle sockets dropped after ``keepalive_expiry`` seconds (below the
    5 s idle timeout of uvicorn-based servers), one retry layer. Constructing an
    instance opens no connection.

    Setup:
        Install the package with its LangChain extra and point it at a server
        (SGLang, vLLM, Infinity, TEI, llama.cpp, ...) serving Qwen3-Embedding:

        ```bash
        pip install -e ".[langchain]"   # in a checkout: there is no PyPI release yet
        export QWEN_EMBED_BASE_URL="http://gpu-box:30000/v1"
        export QWEN_EMBED_API_KEY="..."   # only if the server wants a bearer token
        ```

    Key init args — endpoint:
        base_url: str
            The OpenAI-compatible API root (env ``QWEN_EMBED_BASE_URL``).
        api_key: SecretStr | Callable[[], str] | Callable[[], Awaitable[str]] | None
            Bearer token (env ``QWEN_EMBED_API_KEY``), or a callable returning it,
            called for each request (an async one serves the ``a*`` methods only);
            never pickled.
        model: str
            Model name sent with every request (default
            ``"Qwen/Qwen3-Embedding-0.6B"``, env ``QWEN_EMBED_MODEL``).

    Key init args — embedding params:
        dimensions: int | None
            MRL output size (32..1024 for the 0.6B model); ``None`` = full size.
        query_instruction: str | None
            The Qwen3 retrieval task put before queries; ``None`` for non-Qwen models.
        batch_size: int | "auto"
            Texts per request (default ``"auto"``: from 32, grown while latency stays
            flat in batch size).
        max_concurrency: int
            Requests in flight at once per call (default 4).

    Key init args — pool:
        max_connections: int
            Connections to the endpoint for the whole process (default 20).
        keepalive_expiry: float
            Seconds an idle connection is kept (default 4.0).

    Key init args — per request:
        headers: dict[str, str] | None
            Extra headers on every request; credential-like values masked, never
            pickled.
        extra_body: dict | None
            Extra JSON fields merged into every request body.

    ``OpenAIEmbeddings``' names are aliases with their meaning: ``chunk_size``
    (``batch_size``), ``timeout`` / ``request_timeout`` (seconds, ``None``,
    ``httpx.Timeout`` or a ``(connect, read)`` tuple: every ``*_timeout`` field, as the
    core's ``timeout=`` sets them; a ``*_timeout`` field given too overrides its part),
    ``show_progress_bar`` (``show_progress``), ``default_headers``
    (``headers``), ``model_kwargs`` (``extra_body``), ``openai_api_key``,
    ``openai_api_base``, ``openai_proxy``. Any other unknown name raises, naming the
    closest accepted one (docs/migration.md lists them all).

    ``config=EmbeddingConfig(...)`` is accepted too: the fields not given take its
    values, a field given with it overrides the config's value (``embeddings.config`` is
    the effective config).

    See the field list for every init arg, with its unit and default.

    Instantiate:
        ```python
        from qwen_embed_plugins import QwenPooledEmbeddings

        embed = QwenPooledEmbeddings(
            base_url="http://gpu-box:30000/v1",
            # dimensions=256,        # MRL: shorter vectors
            # query_instruction=None # for non-Qwen models
        )
        ```

    Embed single text:
        ```python
        input_text = "The meaning of life is 42"
        vector = embed.embed_query(input_text)
        print(vector[:3])
        ```
        ```python
        [0.02098247967660427, 0.0037386503536254168, 0.03225111961364746]
        ```

    Embed multiple texts:
        ```python
        input_texts = ["Document 1...", "Document 2..."]
        vectors = embed.embed_documents(input_texts)
        print(len(vectors))
        # The first 3 coordinates for the first vector
        print(vectors[0][:3])
        ```
        ```python
        2
        [-0.0030090874060988426, 0.01494116522371769, 0.05169259011745453]
        ```

    Async:
        ```python
        vector = await embed.aembed_query(input_text)
        print(vector[:3])

        # multiple:
        # await embed.aembed_documents(input_texts)
        ```
        ```python
        [0.02098247967660427, 0.0037386503536254168, 0.03225111961364746]
        ```

    (Sample output from the loopback ``qwen_embed_tooling.testing.EmbeddingServer``,
    whose vectors are deterministic stand-ins, not a model's.)

    Queries are sent as ``Instruct: {query_instruction}\\nQuery:{text}``, documents raw,
    as Qwen3-Embedding expects. ``aembed_documents`` / ``aembed_query`` are natively
    async (no thread executor) and run up to ``max_concurrency`` batches at once.

    Pickling and ``copy.deepcopy`` keep every field; the clients are rebuilt on first
    use in the process the instance lands in, on that process's pool. The API key is
    never written into a pickle: an unpickled instance that had a key re-reads
    ``QWEN_EMBED_API_KEY`` from its environment (worker processes inherit it), unless it
    is unpickled in this process or in one forked from it, where it finds the key
    again; without either, its requests raise ``ConfigError`` naming that fix before
    anything is sent. ``copy.deepcopy`` keeps the key.

    Raises (from the embed methods): ``InputError`` (a text is not a non-empty
    ``str``; nothing is sent), ``HTTPStatusError`` and subclasses, ``TransportError``,
    ``ResponseError``, ``CircuitOpenError``; all are ``QwenEmbedError``.
    """

    # The flat settings (base_url, dimensions, timeouts, pool limits, ...) are
    # FlatSettings' fields (declared in _settings.SETTINGS); these three are declared here.

    api_key: SecretStr | KeyFunctionSetting | None = Field(
        default_factory=secret_from_env(ENV_API_KEY, default=None),
        description=describe(
            "api_key",
            " Also a callable returning the key (sync, or async for the a* methods), "
            "called for each request, as OpenAIEmbeddings takes it.",
        ),
    )

    model: str = setting("model")

    batch_size: int | Literal["auto"] = setting("batch_size")

    # ------------------------------------------------------------------ UI

    on_error: Literal["raise", "skip"] = "raise"
    """What ``embed_documents`` / ``aembed_documents`` do with a text that cannot be
    embedded (empty, whitespace-only, too long, refused by the server): ``"raise"``
    (default) its error, naming its index; ``"skip"``: a zero vector in its place (an
    ``EmbeddingList`` whose ``.errors`` names each skipped index; one WARNING per call),
    so a store still gets one vector per document. Also per call: ``on_error=``."""

    show_progress: bool = False
    """Show a ``tqdm`` progress bar (in texts) that advances once per finished batch
    in ``embed_documents`` / ``aembed_documents``. Needs ``tqdm`` (in the
    ``langchain`` extra). Also accepted as ``show_progress_bar=``."""

    if TYPE_CHECKING:
        # OpenAIEmbeddings' names (``_STOCK``): constructor keywords for type checkers
        # (pydantic's ``dataclass_transform`` signature lists fields only), not fields;
        # the validator renames them to their fields
        chunk_size: InitVar[int | Literal["auto"]] = "auto"
        timeout: InitVar[TimeoutArg] = None
        request_timeout: InitVar[TimeoutArg] = None
        show_progress_bar: InitVar[bool] = False
        default_headers: InitVar[Mapping[str, str] | None] = None
        model_kwargs: InitVar[Mapping[str, Any] | None] = None
        openai_api_key: InitVar[SecretStr | str | Callable[[], Any] | None] = None
        openai_api_base: InitVar[str | None] = None
        openai_proxy: InitVar[str | None] = None
        check_embedding_ctx_length: InitVar[bool] = False
        tiktoken_enabled: InitVar[bool] = False
        skip_empty: InitVar[bool] = False

    # With FlatSettings': extra="forbid", attribute docstrings, inputs hidden in errors.
    model_config = ConfigDict(populate_by_name=True, protected_namespaces=())

    _stock: ClassVar[Stock] = _STOCK
    _model_field: ClassVar[str] = "model"
    _batch_field: ClassVar[str] = "batch_size"
    _key_from_env: ClassVar[Literal["always", "if_it_had_one"]] = "if_it_had_one"

    # ------------------------------------------------------------------ validation

    @model_validator(mode="before")
    @classmethod
    def _mask_key_input(cls, data: Any) -> Any:
        """Wrap a plain-string ``api_key`` at once, in place, so that no validation error
        holds the key in clear: ``ValidationError.errors()`` carries the original input
        mapping (a constructor's own ``**kwargs`` dict; with ``model_validate(d)``, ``d``
        gets the ``SecretStr``). Then rename the stock adapter's parameters to these
        fields, spread a ``config=`` over the fields not given, and refuse unknown names
        with a hint (``ConfigError``, raised as pydantic's ``ValidationError``)."""
        if not isinstance(data, dict):
            return data
        for name in ("api_key", "openai_api_key"):
            if isinstance(data.get(name), str):
                data[name] = SecretStr(data[name])
            elif name in data:
                data[name] = wrap_key(data[name])  # a callable: a KeyFunction
        mask_inputs(data)  # URL credentials (proxy, base_url): pydantic keeps the input
        return resolve_names(cls.__name__, data, cls.model_fields, _STOCK)

    @model_validator(mode="after")
    def _validate_settings(self) -> Self:
        """Check every setting now (the core config validates ranges); open nothing."""
        self._refresh()
        if self.show_progress:
            _tqdm()
        return self

    # ------------------------------------------------------------------ progress

    @contextmanager
    def _progress(self, total: int) -> Iterator[Callable[[int], None] | None]:
        if not self.show_progress:
            yield None
            return
        # Redraw on every finished batch (batches are network round trips, not hot loops).
        bar = _tqdm()(total=total, desc="Embedding", unit="text", mininterval=0, miniters=1)
        try:
            yield bar.update
        finally:
            bar.close()

    # ------------------------------------------------------------------ Embeddings

    def _call(self, chunk_size: int | None, kwargs: dict[str, Any]) -> tuple[Clients, OnError]:
        """The clients and ``on_error`` of one call with ``OpenAIEmbeddings``' per-call
        arguments (``chunk_size``, and what it passes on to the SDK's
        ``embeddings.create``: ``PER_CALL``), applied to this instance's settings for
        this call only.

        Raises:
            ConfigError: an argument with no equivalent (naming what to use), an unknown
                one ("did you mean ..."), a value out of range.
        """
        on_error = kwargs.pop("on_error", self.on_error)
        settings: dict[str, Any] = {}
        if chunk_size:  # stock: ``chunk_size or self.chunk_size``
            settings["batch_size"] = chunk_size
        config = self.config
        headers = dict(config.headers or {})
        body = dict(config.extra_body or {})
        for name, value in kwargs.items():
            if name in ("model", "dimensions", "encoding_format", "timeout"):
                settings[name] = value
            elif name == "extra_headers":
                settings["headers"] = headers = {**headers, **dict(value or {})}
            elif name in ("extra_body", "user"):
                more = {"user": value} if name == "user" else dict(value or {})
                settings["extra_body"] = body = {**body, **more}
            elif name == "extra_query":
                hint = REFUSED_HINTS["default_query"]
                raise ConfigError(f"{type(self).__name__}: extra_query is not supported: {hint}")
            else:
                accepted = sorted((PER_CALL - {"extra_query"}) | {"chunk_size"})
                match = closest(name, accepted)
                also = f"; did you mean {match!r}?" if match else ""
                raise ConfigError(
                    f"{type(self).__name__}: unknown per-call argument {name!r} (accepted: "
                    f"{', '.join(accepted)}){also}"
                )
        return self._clients_with(settings), on_error

    def _finish(self, rows: list[list[float]], client: Any) -> list[list[float]]:
        if isinstance(rows, EmbeddingList):
            return zero_filled(rows, client._known_dim())
        return rows

    def embed_documents(
        self, texts: list[str], chunk_size: int | None = None, **kwargs: Any
    ) -> list[list[float]]:
        """Embed documents (sent raw, without the query instruction).

        Args:
            texts: ``n`` non-empty strings; sent in batches of ``batch_size``, up to
                ``max_concurrency`` batches at once, identical texts sent once.
            chunk_size: texts per request for this call (``None``: ``batch_size``).
            **kwargs: for this call only, as ``OpenAIEmbeddings`` takes them: ``model``,
                ``dimensions``, ``encoding_format``, ``timeout`` (as the constructor's),
                ``user``, ``extra_headers``, ``extra_body`` (merged with ``headers`` /
                ``extra_body``); and ``on_error`` (``"raise"`` or ``"skip"``; default: the
                field).

        Returns:
            ``n x dim`` floats (``dim`` = ``dimensions`` or the model's size), row ``i``
            for ``texts[i]``; ``[]`` for an empty list. With ``on_error="skip"``, an
            ``EmbeddingList``: a text that is empty, whitespace-only or refused by the
            server gets a zero vector of the same size, and ``.errors`` maps its index
            to its error.

        Raises:
            InputError: a text is not a non-empty ``str`` (``.index`` names it).
            ConfigError: a per-call argument with no equivalent, or out of range.
            QwenEmbedError: the server or the network failed after retries.
        """
        texts = _as_texts(texts)
        clients, on_error = self._call(chunk_size, kwargs)
        if isinstance(texts, list) and not texts:
            return []
        client = clients.sync
        if client is None:  # cannot happen
            raise RuntimeError("internal error: client is None")
        with self._progress(len(texts)) as progress:
            rows = client.embed_documents(texts, progress=progress, on_error=on_error)
        return self._finish(rows, client)

    def embed_query(self, text: str, **kwargs: Any) -> list[float]:
        """Embed a search query as ``Instruct: {query_instruction}\\nQuery:{text}``.

        Args:
            text: the query.
            **kwargs: for this call only, as ``embed_documents`` takes them
                (``on_error`` has no effect on a single query).

        Returns:
            ``dim`` floats.

        Raises:
            InputError: ``text`` is not a non-empty ``str``.
            QwenEmbedError: the server or the network failed after retries.
        """
        client = self._call(None, kwargs)[0].sync
        if client is None:  # cannot happen
            raise RuntimeError("internal error: client is None")
        return client.embed_query(text)

    async def aembed_documents(
        self, texts: list[str], chunk_size: int | None = None, **kwargs: Any
    ) -> list[list[float]]:
        """Async ``embed_documents``: natively async on this event loop's shared pool;
        the same arguments.

        Returns:
            ``n x dim`` floats in input order; ``[]`` for an empty list.

        Raises:
            InputError, ConfigError, QwenEmbedError: as ``embed_documents``.
        """
        texts = _as_texts(texts)
        clients, on_error = self._call(chunk_size, kwargs)
        if isinstance(texts, list) and not texts:
            return []
        client = clients.async_
        if client is None:  # cannot happen
            raise RuntimeError("internal error: client is None")
        with self._progress(len(texts)) as progress:
            rows = await client.embed_documents(texts, progress=progress, on_error=on_error)
        return self._finish(rows, client)

    async def aembed_query(self, text: str, **kwargs: Any) -> list[float]:
        """Async ``embed_query`` (with the instruction); ``dim`` floats.

        Raises:
            InputError, ConfigError, QwenEmbedError: as ``embed_query``.
        """
        client = self._call(None, kwargs)[0].async_
        if client is None:  # cannot happen
            raise RuntimeError("internal error: client is None")
        return await client.embed_query(text)
