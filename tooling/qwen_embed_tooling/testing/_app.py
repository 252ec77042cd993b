"""The raw ASGI application: routing, auth, counting, faults; answers come from the dialect."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import replace

import orjson

from ._common import (
    _ADMIN_PREFIX,
    _DISCONNECT_WAIT,
    _MODULE,
    _Receive,
    _Reply,
    _Scope,
    _Send,
    _Settings,
    _tokens,
)
from ._dialects import DIALECTS
from ._faults import (
    _MALFORMED_BODY,
    SOAK_FAULTS,
    Fault,
    Rule,
    _as_fault,
    _judge,
    _spoil,
    _spoil_nan,
    _Verdict,
)
from ._models import _Models
from ._state import _Conn, _State

logger = logging.getLogger(_MODULE)


async def _read_body(receive: _Receive) -> bytes | None:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _until_disconnect(receive: _Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _EmbeddingApp:
    """The raw ASGI app: routing, auth, counting, faults; answers come from the dialect."""

    def __init__(
        self, settings: _Settings, state: _State, *, server_closes_after_max: bool
    ) -> None:
        self.settings = settings
        self.state = state
        self.dialect = DIALECTS[settings.dialect](settings)
        self._auth = None if settings.api_key is None else f"Bearer {settings.api_key}".encode()
        self._server_closes_after_max = server_closes_after_max
        self._stopping: asyncio.Event | None = None
        self.models = _Models(settings.server_model)

    # ---- lifecycle (called on the server's loop) -------------------------------------
    def begin_run(self) -> None:
        self._stopping = asyncio.Event()
        self.models.begin_run()

    def request_stop(self) -> None:
        if self._stopping is not None:
            self._stopping.set()

    async def _pause(self, seconds: float) -> bool:
        """Sleep ``seconds``; False when the server started stopping first."""
        stopping = self._stopping
        if stopping is None or seconds <= 0.0:
            return stopping is None or not stopping.is_set()
        try:
            await asyncio.wait_for(stopping.wait(), seconds)
        except TimeoutError:
            return True
        return False

    # ---- routing ---------------------------------------------------------------------
    async def __call__(self, scope: _Scope, receive: _Receive, send: _Send) -> None:
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        method: str = scope["method"]
        conn = self.state.lookup(scope.get("client"))
        if path.startswith(_ADMIN_PREFIX):
            await self._admin(path[len(_ADMIN_PREFIX) :], scope, receive, send, conn)
            return
        if conn is not None:
            conn.requests += 1
        dialect = self.dialect
        if path == dialect.embeddings_path or path in dialect.extra_embeddings_paths:
            if method != "POST":
                await self._send(send, scope, conn, dialect.method_not_allowed())
            else:
                await self._embeddings(scope, receive, send, conn)
            return
        if (
            self._auth is not None
            and path not in dialect.public_paths
            and not self._authorized(scope)
        ):
            await self._send(send, scope, conn, dialect.unauthorized())
        elif (extra := dialect.route(method, path)) is not None:
            await self._send(send, scope, conn, extra)
        elif path in dialect.body_paths:
            body = await _read_body(receive)
            if body is not None:
                await self._send(send, scope, conn, dialect.route_body(method, path, body))
        elif path == dialect.models_path:
            await self._send(send, scope, conn, self._models())
        elif path in dialect.public_paths or path == dialect.health_path:
            await self._send(send, scope, conn, _Reply(200, b"", content_type=b"text/plain"))
        else:
            await self._send(send, scope, conn, dialect.not_found())

    def _models(self) -> _Reply:
        """The dialect's ``/v1/models``, one card per served name (``model_names``)."""
        reply = self.dialect.models()
        if not self.settings.model_names or reply.status != 200:
            return reply
        listing = orjson.loads(reply.body)
        card = listing["data"][0]
        listing["data"] = [
            {k: name if v == self.settings.model else v for k, v in card.items()}
            for name in self.settings.model_names
        ]
        return replace(reply, body=orjson.dumps(listing))

    def _unknown_model(self, body: bytes) -> _Reply | None:
        """vLLM's 404 for a request naming a model the server does not serve (only
        with ``model_names``; a body that is not JSON is left to the dialect)."""
        if not self.settings.model_names:
            return None
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        name = payload.get("model") if isinstance(payload, dict) else None
        if name is None or name in self.settings.model_names:
            return None
        message = f"The model `{name}` does not exist."
        error = {"object": "error", "message": message, "type": "NotFoundError"}
        return _Reply(404, orjson.dumps({**error, "param": None, "code": 404}))

    def _authorized(self, scope: _Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                return bool(value == self._auth)
        return False

    async def _send(
        self,
        send: _Send,
        scope: _Scope,
        conn: _Conn | None,
        reply: _Reply,
        *,
        stop_after: int | None = None,
    ) -> None:
        headers = [
            (b"content-type", reply.content_type),
            (b"content-length", str(len(reply.body)).encode("ascii")),
            *reply.headers,
            *self.dialect.common_headers,
        ]
        if not reply.content_type:  # e.g. axum's empty 404 has no content type
            del headers[0]
        limit = self.settings.max_requests_per_connection
        if (
            limit is not None
            and not self._server_closes_after_max
            and conn is not None
            and conn.requests >= limit
            and scope.get("http_version") != "2"
        ):
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        body = reply.body if stop_after is None else reply.body[:stop_after]
        await send(
            {"type": "http.response.body", "body": body, "more_body": stop_after is not None}
        )

    async def _drop(self, receive: _Receive, conn: _Conn | None, *, reset: bool) -> None:
        self.state.record("reset" if reset else "close")
        if conn is None:  # not registered: cannot happen on a socket this module opened
            logger.warning("cannot drop an unknown connection; answering 500 instead")
            return
        conn.drop(reset=reset)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(_until_disconnect(receive), _DISCONNECT_WAIT)

    # ---- POST /v1/embeddings ---------------------------------------------------------
    async def _embeddings(
        self, scope: _Scope, receive: _Receive, send: _Send, conn: _Conn | None
    ) -> None:
        state = self.state
        state.request_started(conn)
        try:
            body = await _read_body(receive)
            if body is None:
                return
            if self._auth is not None and not self._authorized(scope):
                reply = self.dialect.unauthorized()
                state.record(str(reply.status))
                await self._send(send, scope, conn, reply)
                return
            if (refused := self._unknown_model(body)) is not None:
                await self._reply(send, scope, conn, refused)
                return
            await self._answer(body, scope, receive, send, conn)
        finally:
            state.request_finished(conn)

    def _status_reply(
        self,
        status: int,
        message: str | None,
        body: bytes | None = None,
        *,
        retry_after: str | None = None,
        retry_after_ms: str | None = None,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> _Reply:
        """An error answer: ``body`` as is, or the dialect's body for ``message``."""
        reply = self.dialect.status_error(status, message)
        extra = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
        if retry_after is not None:
            extra.append((b"retry-after", retry_after.encode("latin-1")))
        if retry_after_ms is not None:
            extra.append((b"retry-after-ms", retry_after_ms.encode("latin-1")))
        return _Reply(status, body or reply.body, (*reply.headers, *extra))

    async def _reply(self, send: _Send, scope: _Scope, conn: _Conn | None, reply: _Reply) -> None:
        self.state.record(str(reply.status))
        await self._send(send, scope, conn, reply)

    async def _rule_answer(
        self, verdict: _Verdict, scope: _Scope, receive: _Receive, send: _Send, conn: _Conn | None
    ) -> None:
        """Answer (or drop) a request a rule stopped."""
        rule = verdict.rule
        if rule is None:  # cannot happen
            raise RuntimeError("internal error: rule is None")
        self.state.fault_applied(rule.kind)
        if rule.action in ("close", "reset"):
            await self._drop(receive, conn, reset=rule.action == "reset")
            return
        if rule.kind == "token_cap":
            message = (rule.message or "").replace("{cap}", str(rule.max_tokens))
            reply = self.dialect.error(rule.status, message.replace("{n}", str(verdict.tokens)))
        elif rule.kind == "context_length":
            index = verdict.index or 0
            reply = self.dialect.context_length(
                index, verdict.tokens, rule.max_tokens, rule.name_index
            )
        else:  # poison (action "status"), base64_error
            reply = self._status_reply(rule.status, rule.message, rule.body)
        await self._reply(send, scope, conn, reply)

    async def _answer(
        self, body: bytes, scope: _Scope, receive: _Receive, send: _Send, conn: _Conn | None
    ) -> None:
        """Answer one authorised embedding request: window rules, server models (rate
        limits), request rules, the scripted or random fault, service time, the answer."""
        state = self.state
        dialect = self.dialect
        logged, parsed = dialect.parse(body)
        if logged is not None:
            state.log_received(logged)
        rules = state.active_rules()
        window = next((r for r in rules if r.kind == "window"), None)
        if window is not None:
            state.fault_applied("window")
            reply = self._status_reply(
                window.status, window.message, retry_after=window.retry_after
            )
            await self._reply(send, scope, conn, reply)
            return
        if self.models:
            admitted, retry_after = self.models.admit()
            if not admitted:
                state.fault_applied("rate_limit")
                await self._reply(
                    send, scope, conn, self._status_reply(429, None, retry_after=retry_after)
                )
                return
        verdict = _Verdict([])
        if not isinstance(parsed, _Reply):
            verdict = _judge(rules, parsed.texts, parsed.base64, parsed.one_item_list)
            if verdict.rule is not None:
                await self._rule_answer(verdict, scope, receive, send, conn)
                return
            if verdict.texts is not parsed.texts:  # truncated: embed and count what is left
                state.fault_applied("truncate")
                parsed = replace(parsed, texts=verdict.texts)

        fault = state.take_fault()
        kind = None if fault is None else fault.kind
        if fault is not None and kind == "delay":
            state.fault_applied("delay")
            if not await self._pause(fault.seconds):
                await self._drop(receive, conn, reset=False)  # stopped mid-delay
                return
            fault = kind = None
        if fault is not None and kind == "status":
            state.fault_applied("status")
            reply = self._status_reply(
                fault.status,
                fault.message,
                fault.body,
                retry_after=fault.retry_after,
                retry_after_ms=fault.retry_after_ms,
                headers=fault.headers,
            )
            await self._reply(send, scope, conn, reply)
            return
        if fault is not None and (kind == "close" or (kind == "reset" and fault.after_bytes == 0)):
            state.fault_applied(fault.kind)
            await self._drop(receive, conn, reset=kind == "reset")
            return

        if self.models and not isinstance(parsed, _Reply):
            outcome, slow = await self.models.serve(_tokens(parsed), self._pause)
            if slow:
                state.fault_applied("heavy_tail")
            if outcome == "stopped":
                await self._drop(receive, conn, reset=False)
                return
            if outcome == "full":
                state.fault_applied("queue_full")
                status = dialect.overload_status
                await self._reply(send, scope, conn, self._status_reply(status, None))
                return
        if self.settings.latency > 0.0:
            await self._pause(self.settings.latency)

        texts = 0
        if isinstance(parsed, _Reply):
            reply = parsed
        else:
            vectors = [dialect.vector(t, parsed.dimensions) for t in parsed.texts]
            nan_literal = verdict.nan_literal
            if verdict.nan:
                state.fault_applied("poison")
                vectors = _spoil_nan(vectors, verdict.nan)
            if fault is not None and kind in ("wrong_count", "nan", "zero"):
                state.fault_applied(fault.kind)
                vectors, literal = _spoil(fault, vectors)
                nan_literal = nan_literal or literal
            reply = _Reply(
                200,
                dialect.embeddings(parsed, vectors, nan_literal=nan_literal),
                dialect.response_headers(parsed),
            )
            texts = len(parsed.texts)
        if fault is not None and kind == "malformed":
            state.fault_applied("malformed")
            reply = _Reply(200, fault.body or _MALFORMED_BODY)
        if fault is not None and kind == "reset":
            state.fault_applied("reset")
            cut = len(reply.body) // 2 if fault.after_bytes is None else fault.after_bytes
            await self._send(send, scope, conn, reply, stop_after=min(cut, len(reply.body)))
            await asyncio.sleep(fault.pause)
            await self._drop(receive, conn, reset=True)
            return
        state.record(str(reply.status), texts)
        await self._send(send, scope, conn, reply)

    # ---- /_testing/ ------------------------------------------------------------------
    async def _admin(
        self, name: str, scope: _Scope, receive: _Receive, send: _Send, conn: _Conn | None
    ) -> None:
        """Counters and faults over HTTP, for servers run with ``python -m``."""
        body = await _read_body(receive) or b"{}"
        try:
            args = orjson.loads(body) if body.strip() else {}
            if not isinstance(args, dict):
                raise ValueError("the body must be a JSON object")
            if scope["query_string"] and b"received=1" in scope["query_string"]:
                args["received"] = True
            if name == "inject":
                fault = Fault.make(args.pop("kind"), **args.pop("params", {}))
                args = {"fault": fault.to_dict(), "count": args.get("count", 1)}
            elif name == "rule":
                rule = Rule.make(args.pop("kind"), **args.pop("params", {}))
                name, args = "add_rule", {"rule": rule.to_dict()}
            elif name == "random_faults":
                kinds = [_as_fault((k.pop("kind"), k)) for k in args.get("kinds", [])]
                args["kinds"] = [f.to_dict() for f in kinds or SOAK_FAULTS]
            reply = _Reply(200, orjson.dumps(self.state.command(name, args)))
        except (KeyError, TypeError, ValueError, orjson.JSONDecodeError) as exc:
            reply = self.dialect.request_error(f"{type(exc).__name__}: {exc}")
        await self._send(send, scope, conn, reply)
