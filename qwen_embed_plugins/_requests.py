"""The requests of one client to its replicas, and what their error replies say: no I/O.

``Requests`` builds a batch's ``POST {base_url}/embeddings`` (or the URL learned for the
replica) with the client's headers, timeouts, the time left of the call and a response
size cap fit for the batch; and turns a reply with an error status into this library's
error, every server-supplied string scrubbed of the request's secrets. The API key is
held in its ``Secret``: ``Authorization`` is built only when the transport reads the
headers (``_Headers``), and no ``repr`` or ``vars()`` shows it. A callable key
(``KeyFunction``) is called by the client's driver for each request it sends
(``Requests.keyed``), so that a sync driver calls it and an async one awaits it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from . import _servers as servers
from ._config import EmbeddingConfig, KeyFunction, RequestBody, RequestHeaders
from ._learn import ReplicaState, eos_probe
from ._protocol import encode_request
from ._retry import parse_retry_after
from ._server_text import scrub
from ._transport import Reply, Request
from .errors import ErrorContext, HTTPStatusError, ResponseError, error_from_response

if TYPE_CHECKING:
    from ._balance import Replica
    from ._run import Call

__all__ = ["Requests"]

_EOS = "<|endoftext|>"
_MAX_RESPONSE_FLOOR = 1 << 20
_BYTES_PER_VALUE = 32  # a float in JSON: "-0.012345678901234567," is 22; room to spare
_DIM_GUESS = 8192


class Requests:
    """The requests of one client (one per ``Engine``; see the module docstring)."""

    def __init__(self, config: EmbeddingConfig, model: str) -> None:
        self.config = config
        self.model = model
        self._api_key = config.api_key  # a Secret: never shown by repr or vars()
        self.key_function = config.key_function  # called per request by the drivers
        self.timeouts = config.timeouts
        self.headers = _Headers(self._api_key, config.headers)
        if isinstance(config.extra_body, RequestBody):
            config.extra_body.check()  # a secret field withheld from a pickle
        self._contexts: dict[str, ErrorContext] = {}
        self.append_eos = config.append_eos is True

    @property
    def secret(self) -> str | None:
        """The API key (for the SDK); ``None`` without one."""
        return self.config.api_key_value()

    @property
    def secrets(self) -> tuple[str, ...]:
        """Every secret a request carries (the API key, the credential-like header
        and ``extra_body`` field values): scrubbed from anything the server sends back."""
        key, headers, body = self.secret, self.config.headers, self.config.extra_body
        found: tuple[str, ...] = () if key is None else (key,)
        if self.key_function is not None:
            found += self.key_function.recent()
        if isinstance(headers, RequestHeaders):
            found += headers.secret_values()
        if isinstance(body, RequestBody):
            found += body.secret_values()
        return found

    def ctx(self, replica: Replica) -> ErrorContext:
        """The context of the errors of requests to ``replica`` (built once)."""
        found = self._contexts.get(replica.url)
        if found is None:
            t = self.timeouts
            found = self._contexts[replica.url] = ErrorContext(
                url=replica.label,
                secret=None if self.key_function is not None else self._api_key,
                headers=self.config.headers,
                body=self.config.extra_body,
                connect=t.connect,
                read=t.read,
                write=t.write,
                pool=t.pool,
                total=t.total,
                max_connections=self.config.limits.max_connections,
            )
        return found

    def keyed(self, request: Request, key: str) -> Request:
        """``request`` carrying ``key``: the value of the callable key for this one
        request (``KeyFunction.resolve`` / ``aresolve``), in its ``Authorization``
        header and among the secrets its errors are scrubbed of."""
        return replace(
            request,
            headers=_Headers(key, self.config.headers),
            ctx=replace(request.ctx, secret=key),
        )

    def max_bytes(self, texts: int, state: ReplicaState) -> int:
        """The response size cap of a batch of ``texts`` texts (bytes)."""
        if self.config.max_response_bytes is not None:
            return self.config.max_response_bytes
        dim = state.native_dim or _DIM_GUESS
        return max(_MAX_RESPONSE_FLOOR, texts * dim * _BYTES_PER_VALUE + 65_536)

    def embeddings(
        self,
        replica: Replica,
        state: ReplicaState,
        texts: Sequence[str],
        fmt: str,
        dims: int | None,
        call: Call,
        bare: bool = False,
    ) -> Request:
        """The request embedding ``texts`` on ``replica`` with these options (``fmt``:
        ``encoding_format``; ``dims``: ``dimensions`` sent; ``bare``: the one text as a
        bare string), within the time ``call`` has left."""
        if self.append_eos:
            texts = [t if t.endswith(_EOS) else t + _EOS for t in texts]
        body = encode_request(  # with EmbeddingConfig.extra_body merged in
            texts[0] if bare else texts,
            model=self.model,
            encoding_format=fmt,
            dimensions=dims,
            extra=self.config.extra_body,
        )
        total = self.timeouts.total
        left = call.remaining()
        if left is not None:
            left = max(left, 0.001)
            total = left if total is None else min(total, left)
        url = state.url_override or f"{replica.url}/embeddings"
        return Request(
            "POST",
            url,
            body,
            self.headers,
            self.timeouts,
            total,
            self.max_bytes(len(texts), state),
            self.ctx(replica),
        )

    def tokenize(self, replica: Replica) -> Request:
        """llama.cpp's tokenizer probe on ``replica`` (``_learn.eos_probe``): at most
        5 s, 1 MiB."""
        url, body = eos_probe(replica.url)
        t = self.timeouts
        return Request(
            "POST", url, body, self.headers, t, min(t.total or 5.0, 5.0), 1 << 20, self.ctx(replica)
        )

    def status_error(
        self, reply: Reply, replica: Replica, profile: servers.ServerProfile
    ) -> HTTPStatusError | ResponseError:
        """The error a reply with status 300 or above stands for (a redirect is never
        followed: a ``ResponseError`` saying so)."""
        status = reply.status
        if 300 <= status < 400:
            where = scrub(reply.headers.get("location", ""), *self.secrets)[:200]
            return ResponseError(
                f"{replica.label} answered HTTP {status} (redirect to {where or '?'}); "
                "redirects are not followed, so that the API key never goes elsewhere: "
                "fix base_url",
                url=replica.label,
            )
        error = error_from_response(
            status,
            reply.body,
            url=f"{replica.url}/embeddings",
            headers=reply.headers,
            retry_after=parse_retry_after(reply.headers),
            secret=self.secrets,
        )
        error = servers.refine_error(profile, error)
        if status == 404 and not replica.url.endswith("/v1"):
            error = error.with_context(
                note=" (OpenAI-compatible servers usually serve under /v1: "
                f"try base_url='{replica.label}/v1')"
            )
        return error


class _Headers(Mapping[str, str]):
    """The request headers of a client: its own, the configured ``headers`` (a secret one
    withheld from a pickle raises ``ConfigError`` here), and ``Authorization`` built from
    the ``Secret`` (or a callable key's value for one request) only when the transport
    reads it. No secret appears in a ``repr``."""

    __slots__ = ("_base", "_extra", "_key")

    def __init__(self, key: Any, extra: Mapping[str, str] | None = None) -> None:
        self._key, self._extra = key, extra
        own = {"Content-Type": "application/json", "Accept": "application/json"}
        self._base = own if extra is None else {**extra, **own}  # never the same names

    def _all(self) -> dict[str, str]:
        key = self._key
        if key is None:
            return self._base
        if isinstance(key, KeyFunction):  # the drivers send ``Requests.keyed`` requests
            raise RuntimeError("internal error: a callable key was not resolved")
        value = key if isinstance(key, str) else key.get_secret_value()
        return {**self._base, "Authorization": f"Bearer {value}"}

    def __getitem__(self, name: str) -> str:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._base) + (self._key is not None)

    def __repr__(self) -> str:
        shown = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._key is not None:
            shown["Authorization"] = "Bearer **********"
        return f"_Headers({shown!r}, {self._extra!r})"  # RequestHeaders masks its secrets
