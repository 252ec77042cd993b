"""Errors are built once, with their context (``.index``, ``.replica``, ``.attempts``) as
fields: a layer that adds context builds a new error (``QwenEmbedError.with_context``)
and never rewrites the ``.args`` of, or sets an attribute on, an error already built.

- the library's source (AST) holds no ``.args`` assignment and no attribute set on an
  exception outside its class's constructor;
- an error that gets a caller's index on the way up (bisection, a server naming the
  input, a LlamaIndex batch further down the caller's list), the replica-by-replica
  "every replica failed" message and the ``/v1`` hint of a 404: fields and text, on the
  sync and async paths and through both adapters, against loopback servers.
"""

from __future__ import annotations

import ast
import asyncio
import pickle
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

import qwen_embed_plugins as q
from qwen_embed_plugins import _balance as balance
from qwen_embed_plugins._engine import Engine
from qwen_embed_plugins._run import Send, run_sync
from qwen_embed_plugins._transport import Reply
from qwen_embed_tooling.testing import EmbeddingServer

ROOT = Path(q.__file__).parent
SOURCES = sorted(ROOT.rglob("*.py"))
FAST = q.RetryConfig(backoff_initial=0.01, backoff_max=0.05)
TEXTS = [f"passage {i}: a quiet text about item {i * 37 % 101}" for i in range(24)]

# ``logging.LogRecord.args``, rewritten by the log filter that scrubs the key: a log
# record, not an exception
NOT_EXCEPTIONS = {("_transport/_contract.py", "record")}
# where an error is built: its class's constructors and the two helpers that build a
# new error whole (unpickling, ``with_context``) before anything else holds it
BUILDERS = {("errors.py", name) for name in ("__init__", "with_context", "_rebuild_error")}
EXCEPTION_DUNDERS = {"__cause__", "__context__", "__traceback__", "__notes__"}


def _is_exception_type(node: ast.expr | None) -> bool:
    """An annotation or class name that names an exception type."""
    if node is None:
        return False
    text = ast.unparse(node)
    return any(
        part.strip().endswith(("Error", "Exception", "Timeout"))
        for part in text.replace("|", ",").replace("[", ",").replace("]", ",").split(",")
    )


def _exception_names(func: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The names that hold an exception in ``func``: ``except ... as name``, parameters
    annotated with an exception type, and names bound to an exception built here."""
    names: set[str] = set()
    for arg in (*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs):
        if _is_exception_type(arg.annotation):
            names.add(arg.arg)
    for node in ast.walk(func):
        if isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if _is_exception_type(node.annotation):
                names.add(node.target.id)
        elif (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and _is_exception_type(node.value.func)
        ):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def _rewrites(path: Path) -> list[str]:
    """Each place in the module ``path`` that changes an error already built."""
    return _rewrites_in(path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8"))


def _rewrites_in(rel: str, code: str) -> list[str]:
    """Each place in ``code`` (the module ``rel``) that changes an error already built."""
    tree = ast.parse(code)
    found: list[str] = []
    for func in _functions(tree):
        if (rel, func.name) in BUILDERS:
            continue
        held = _exception_names(func)
        for node in ast.walk(func):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            elif isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                first = node.args[0] if node.args else None
                if (
                    name in ("setattr", "object.__setattr__")
                    and isinstance(first, ast.Name)
                    and first.id in held
                ):
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
                if name.endswith(".add_note"):
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            for target in targets:
                if not isinstance(target, ast.Attribute):
                    continue
                owner = ast.unparse(target.value)
                if (rel, owner) in NOT_EXCEPTIONS:
                    continue
                if (
                    target.attr == "args"
                    or target.attr in EXCEPTION_DUNDERS
                    or (isinstance(target.value, ast.Name) and target.value.id in held)
                ):
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(node).splitlines()[0]}")
    return found


@pytest.mark.unit
def test_no_error_is_changed_after_it_is_built() -> None:
    """No ``.args =``, no ``exc.attr =`` / ``setattr(exc, ...)``, no ``__cause__`` /
    ``__context__`` / ``__notes__`` assignment, no ``add_note`` in the library outside
    the constructors of ``errors.py``: context comes as fields of a new error."""
    found = [hit for path in SOURCES for hit in _rewrites(path)]
    assert not found, "errors changed after they were built:\n" + "\n".join(found)


@pytest.mark.unit
def test_the_source_check_sees_a_rewrite() -> None:
    """The check above finds each form it forbids (so that its silence means something)."""
    code = (
        "def f(error: QwenEmbedError, n: int) -> None:\n"
        "    error._server_wide = True\n"
        "    n.x = 1\n"
        "def g() -> None:\n"
        "    try:\n"
        "        pass\n"
        "    except ValueError as exc:\n"
        "        exc.args = ('x',)\n"
        "        exc.index = 3\n"
        "        setattr(exc, 'replica', 'r')\n"
        "        exc.add_note('n')\n"
        "    other.__context__ = None\n"
    )
    tree = ast.parse(code)
    held = {f.name: _exception_names(f) for f in _functions(tree)}
    assert held == {"f": {"error"}, "g": {"exc"}}
    hits = _rewrites_in("sample.py", code)
    assert len(hits) == 6, hits  # every line but ``n.x = 1``


@pytest.mark.unit
def test_with_context_builds_a_new_error_and_leaves_the_old_one() -> None:
    """``with_context``: same type, the fields given, the others kept, the note appended
    and the secrets scrubbed from the new message; the chained cause carried over; the
    original untouched; the new error pickles whole."""
    key = "sk-with-context-secret-123"
    try:
        try:
            raise OSError("connection reset")
        except OSError as low:
            raise q.RemoteProtocolError(f"dropped ({key})", url="http://h:1/v1") from low
    except q.RemoteProtocolError as caught:
        old = caught
    new = old.with_context(index=4, replica="http://h:1/v1", note=" [more]", secrets=(key,))
    assert type(new) is q.RemoteProtocolError
    assert new is not old
    assert str(new) == "dropped (***) [more]"
    assert (new.index, new.replica, new.attempts, new.url, new.sent) == (
        4,
        "http://h:1/v1",
        None,
        "http://h:1/v1",
        True,
    )
    assert new.__cause__ is old.__cause__
    assert new.__traceback__ is old.__traceback__
    assert (str(old), old.index, old.replica) == (f"dropped ({key})", None, None)
    status = q.errors.error_from_response(503, b'{"message": "busy"}', url="http://h:1/v1")
    again = status.with_context(attempts=3)
    assert (type(again), again.status, again.message, again.attempts) == (
        q.OverloadedError,
        503,
        "busy",
        3,
    )
    back = pickle.loads(pickle.dumps(new))
    assert (type(back), str(back), back.index, back.replica) == (
        q.RemoteProtocolError,
        str(new),
        4,
        "http://h:1/v1",
    )
    assert key.encode() not in pickle.dumps(new)
    with pytest.raises(TypeError, match="no field"):
        old.with_context(status=500)


# --------------------------------------------------------------------------- engine, no socket


@pytest.mark.unit
def test_bisection_pins_the_index_on_a_new_error_and_leaves_the_inner_one() -> None:
    """A dropped connection caused by one text of 8: the call raises a new error of the
    transport's type, built with the caller's index, the replica and the attempts; the
    error the transport raised is left exactly as it was built."""
    url = "http://errors-context.test/v1"
    eng = Engine(q.EmbeddingConfig(base_url=url, model="m", encoding_format="float", retry=FAST))
    thrown: list[q.RemoteProtocolError] = []

    def send(op: Send) -> Reply:
        texts = orjson.loads(op.request.body)["input"]
        texts = [texts] if isinstance(texts, str) else texts
        if "poison" in texts:
            error = q.RemoteProtocolError("server closed the connection", url=url)
            thrown.append(error)
            raise error
        data = [{"index": i, "embedding": [1.0, 2.0, 3.0]} for i in range(len(texts))]
        return Reply(200, {}, orjson.dumps({"data": data}), fresh=True)

    texts = [f"text {i}" for i in range(8)]
    texts[5] = "poison"
    call = eng.new_call(query=False)
    with pytest.raises(q.RemoteProtocolError) as info:
        run_sync(eng.batch_flow(call, texts, [100 + i for i in range(8)]), send)
    error = info.value
    assert (error.index, error.replica, error.attempts) == (105, url, 1)
    assert str(error) == "server closed the connection [input index 105 of this call]"
    assert thrown
    assert all(error is not inner for inner in thrown)
    for inner in thrown:  # as the transport built them
        assert (inner.index, inner.replica, inner.attempts) == (None, None, None)
        assert str(inner) == "server closed the connection"
        assert inner.args == ("server closed the connection",)
    clone = pickle.loads(pickle.dumps(error))
    assert type(clone) is type(error)
    assert (clone.index, clone.replica, clone.attempts, str(clone)) == (
        105,
        url,
        1,
        str(error),
    )


# --------------------------------------------------------------------------- loopback servers


@pytest.fixture
def srv(embedding_server: EmbeddingServer) -> EmbeddingServer:
    return embedding_server


def _label(client: q.EmbeddingClient | q.AsyncEmbeddingClient) -> str:
    return balance.endpoint_for(client.config).replicas[0].label


def _assert_pinned(error: BaseException, index: int, label: str) -> None:
    assert isinstance(error, q.ServerError), error
    assert error.status == 500
    assert error.index == index
    assert error.replica == label
    assert error.attempts is not None
    assert error.attempts >= 1
    assert str(error).endswith(f" [input index {index} of this call]")
    assert str(error).count("input index") == 1


def test_a_poisonous_text_is_named_sync_and_async(srv: EmbeddingServer) -> None:
    srv.poison(TEXTS[13])
    client = q.EmbeddingClient(base_url=srv.base_url, batch_size=8, retry=FAST)
    with pytest.raises(q.ServerError) as info:
        client.embed_documents(TEXTS)
    _assert_pinned(info.value, 13, _label(client))
    aclient = q.AsyncEmbeddingClient(base_url=srv.base_url, batch_size=8, retry=FAST)
    with pytest.raises(q.ServerError) as ainfo:
        asyncio.run(aclient.embed_documents(TEXTS))
    _assert_pinned(ainfo.value, 13, _label(aclient))
    skipped = client.embed_documents(TEXTS, on_error="skip")
    assert list(skipped.errors) == [13]
    _assert_pinned(skipped.errors[13], 13, _label(client))


def test_langchain_names_the_poisonous_text_sync_and_async(srv: EmbeddingServer) -> None:
    srv.poison(TEXTS[13])
    emb = q.QwenPooledEmbeddings(base_url=srv.base_url, batch_size=8, max_retries=1)
    label = emb.config.endpoint
    with pytest.raises(q.ServerError) as info:
        emb.embed_documents(TEXTS)
    _assert_pinned(info.value, 13, label)
    with pytest.raises(q.ServerError) as ainfo:
        asyncio.run(emb.aembed_documents(TEXTS))
    _assert_pinned(ainfo.value, 13, label)


@pytest.mark.parametrize("mode", ["sync", "sync_window_1", "async"])
def test_llama_index_names_the_index_in_the_callers_list(srv: EmbeddingServer, mode: str) -> None:
    """The third LlamaIndex batch of 4 holds a text too long for the server, which names
    its position in that request (1): the error is built with the caller's index (9),
    and the server's own words keep the server's index."""
    srv.limit_input_tokens(50, name_index=True)
    texts = list(TEXTS[:14])
    texts[9] = "long " * 100
    model = q.QwenPooledEmbedding(
        base_url=srv.base_url,
        embed_batch_size=4,
        max_concurrency=1 if mode == "sync_window_1" else 2,
        max_retries=1,
    )

    def embed() -> object:
        if mode == "async":
            return asyncio.run(model.aget_text_embedding_batch(texts))
        return model.get_text_embedding_batch(texts)

    with pytest.raises(q.ContextLengthError) as info:
        embed()
    error = info.value
    assert error.index == 9
    assert error.replica == model.config.endpoint
    text = str(error)
    assert text.endswith(" [input index 9 of this call]"), text
    assert "the server's index 1 counts within the batch it was sent" in text
    assert "input index 1" in error.message  # the server's message, as it said it


def test_every_replica_failed_names_each_replicas_last_failure() -> None:
    with EmbeddingServer() as one, EmbeddingServer() as two:
        for server in (one, two):
            server.inject_overloaded(count=10_000)
        retry = q.RetryConfig(
            backoff_initial=0.01, backoff_max=0.05, deadline=1.0, query_deadline=1.0
        )
        client = q.EmbeddingClient(base_url=[one.base_url, two.base_url], retry=retry)
        with pytest.raises(q.OverloadedError) as info:
            client.embed_documents(["busy everywhere"])
    error = info.value
    labels = [r.label for r in balance.endpoint_for(client.config).replicas]
    assert error.replica in labels
    assert error.attempts is not None
    assert error.attempts >= 2
    assert error.index is None
    text = str(error)
    assert " (every replica failed; last failures: " in text
    for label in labels:
        assert f"{label}: HTTP 503 from {label}/embeddings" in text
    assert text.startswith(f"HTTP 503 from {error.replica}/embeddings: The request queue is full.")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_404_without_v1_says_to_try_v1(srv: EmbeddingServer, mode: str) -> None:
    root = srv.base_url.removesuffix("/v1")
    if mode == "sync":
        client: q.EmbeddingClient | q.AsyncEmbeddingClient = q.EmbeddingClient(base_url=root)
        with pytest.raises(q.NotFoundError) as info:
            client.embed_query("where")
    else:
        client = q.AsyncEmbeddingClient(base_url=root)
        with pytest.raises(q.NotFoundError) as info:
            asyncio.run(client.embed_query("where"))
    error = info.value
    assert error.status == 404
    assert (error.replica, error.attempts, error.index) == (root, 1, None)
    assert str(error).endswith(
        f" (OpenAI-compatible servers usually serve under /v1: try base_url='{root}/v1')"
    )
    assert "/v1" not in error.message  # the server's own message is kept apart
    clone = pickle.loads(pickle.dumps(error))
    assert (str(clone), clone.status, clone.replica) == (str(error), 404, root)
