"""Ray Data: `qwen_embed_plugins.ray` against real loopback servers on a local Ray instance.

One local Ray instance (``num_cpus=2``, no dashboard, no usage stats) is started for the
whole session and shut down at the end; every job runs real Ray actors in worker
processes that import the package and talk to `EmbeddingServer` on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qwen_embed_plugins import ConfigError, EmbeddingConfig, InputError
from qwen_embed_tooling import ray_crash
from qwen_embed_tooling.testing import EmbeddingServer, expected_embedding

if os.environ.get("CI"):
    import ray  # CI installs the [ray] extra: a missing Ray must fail there, not skip
else:
    ray = pytest.importorskip("ray", reason="needs the [ray] extra")

import pyarrow as pa
import pyarrow.parquet as pq

from qwen_embed_plugins import ray as qray

pytestmark = [
    pytest.mark.ray,
    pytest.mark.xdist_group("ray"),  # one local Ray instance, in one xdist worker
    # Ray 2.60's DataContext.__setattr__ warns about its deprecated fields
    # (use_push_based_shuffle, use_polars, ...) on every assignment, including the ones
    # its own dataclass __init__ makes: constructing a DataContext always warns. Only
    # DeprecationWarnings raised in that module are ignored.
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context"),
]

ROWS = 5000


@pytest.fixture(scope="module", autouse=True)
def ray_local() -> Iterator[None]:
    """A local Ray instance for this module: 2 CPUs, no dashboard, nothing online; its
    workers can be made to crash once (``ray_crash``, armed per job)."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    if ray.is_initialized():  # pragma: no cover - a previous module left one running
        ray.shutdown()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"worker_process_setup_hook": ray_crash.SETUP_HOOK},
    )
    # Ray Data's progress bars would fill the pytest log; the jobs are what is tested.
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


def _texts(n: int, start: int = 0) -> list[str]:
    return [f"passage {i}: " + "lorem ipsum " * (1 + i % 7) for i in range(start, start + n)]


def _dataset(n: int, *, blocks: int = 10, ids: range | None = None) -> Any:
    texts = _texts(n)
    rows = [{"id": i, "text": texts[i]} for i in (ids if ids is not None else range(n))]
    return ray.data.from_items(rows, override_num_blocks=blocks)


def _collect(ds: Any) -> pa.Table:
    """The whole dataset as one Arrow table (the blocks exactly as the actors built them)."""
    tables = ray.get(ds.to_arrow_refs())
    return pa.concat_tables(tables)


def _blocks(ds: Any) -> list[pa.Table]:
    return list(ray.get(ds.to_arrow_refs()))


def _assert_exact(table: pa.Table, server: EmbeddingServer, ids: range) -> None:
    """Every row present once, and its embedding exactly the server's vector for its text."""
    got_ids = table.column("id").to_pylist()
    assert sorted(got_ids) == list(ids), "rows lost or duplicated"
    column = table.column("embedding").combine_chunks()
    assert column.type == pa.list_(pa.float32(), server.dim)
    assert column.null_count == 0
    vectors = column.values.to_numpy().reshape(-1, server.dim)
    expected = server.expected_embeddings(table.column("text").to_pylist())
    np.testing.assert_array_equal(vectors, expected)
    # aligned with the row: the text in the row is the one its id was made from
    by_id = _texts(len(ids))
    assert table.column("text").to_pylist() == [by_id[i] for i in got_ids]


def _replicas_supported(a: str, b: str) -> bool:
    """Whether the core takes a list of replicas as base_url yet (issue 15, item 1)."""
    try:
        EmbeddingConfig(base_url=[a, b])  # type: ignore[arg-type]
    except ConfigError:
        return False
    return True


# ---------------------------------------------------------------------------------- jobs


def test_5000_rows_exact_and_aligned_across_two_servers() -> None:
    with EmbeddingServer() as one, EmbeddingServer() as two:
        if _replicas_supported(one.base_url, two.base_url):
            out = qray.embed_dataset(
                _dataset(ROWS), base_url=[one.base_url, two.base_url], concurrency=2, batch_size=256
            )
        else:
            # Until replicas land in the client: one job per server, run as one Ray job.
            even = _dataset(ROWS, blocks=5, ids=range(0, ROWS, 2))
            odd = _dataset(ROWS, blocks=5, ids=range(1, ROWS, 2))
            out = qray.embed_dataset(
                even, base_url=one.base_url, concurrency=1, batch_size=256
            ).union(qray.embed_dataset(odd, base_url=two.base_url, concurrency=1, batch_size=256))
        blocks = _blocks(out)
        table = pa.concat_tables(blocks)
        _assert_exact(table, one, range(ROWS))
        # Rows keep their order within each block (the inputs' blocks were in id order).
        for block in blocks:
            ids = block.column("id").to_pylist()
            assert ids == sorted(ids)
        # Both servers served, and between them every text exactly once (all distinct).
        assert one.texts > 0
        assert two.texts > 0
        assert one.texts + two.texts == ROWS
        # One client per actor, one pool per replica in it: at most max_in_flight (4)
        # requests of an actor at once, so at most actors x max_in_flight at a server and
        # actors x replicas x max_in_flight connections in all (160 requests were sent).
        for server in (one, two):
            assert server.stats()["max_in_flight"] <= 2 * 4
        assert one.connections_opened + two.connections_opened <= 2 * 2 * 4


def test_actor_killed_mid_job_is_retried_exact_no_duplicates(tmp_path: Path) -> None:
    exit_file = tmp_path / "exit-once"
    exit_file.touch()
    with EmbeddingServer() as server:
        out = qray.embed_dataset(
            _dataset(ROWS, blocks=20),
            base_url=server.base_url,
            concurrency=2,
            batch_size=250,
            runtime_env=ray_crash.runtime_env(exit_file),
        )
        table = _collect(out)
        # The file is deleted only by the actor that then exits: the crash happened after
        # that actor had finished a batch, i.e. in the middle of the job.
        assert not exit_file.exists()
        _assert_exact(table, server, range(ROWS))
        assert table.num_rows == ROWS


def test_on_error_skip_marks_bad_rows_and_keeps_the_rest() -> None:
    good = _texts(40)
    long_text = "x" * 300  # accepted by the client, refused by this server (400, by index)
    texts: list[str | None] = [*good[:10], None, "", "   ", *good[10:30], long_text, *good[30:]]
    rows = [{"id": i, "text": t} for i, t in enumerate(texts)]
    with EmbeddingServer(max_input_chars=200) as server:
        out = qray.embed_dataset(
            ray.data.from_items(rows, override_num_blocks=2),
            base_url=server.base_url,
            batch_size=32,
            on_error="skip",
        )
        table = _collect(out).sort_by("id")
    assert table.num_rows == len(texts)
    errors = table.column(qray.DEFAULT_ERROR_COLUMN).to_pylist()
    column = table.column("embedding").combine_chunks()
    bad = {10: "is None; expected str", 11: "empty", 12: "whitespace", 33: "HTTP 400"}
    for i, message in enumerate(errors):
        if i in bad:
            assert message is not None, i
            assert bad[i] in message, (i, message)
            assert not column[i].is_valid
        else:
            assert message is None, (i, message)
            np.testing.assert_array_equal(
                np.asarray(column[i].as_py(), dtype=np.float32),
                expected_embedding(texts[i], server.dim),  # type: ignore[arg-type]
            )


def test_on_error_raise_fails_the_job_naming_the_problem() -> None:
    rows = [{"id": 0, "text": "fine"}, {"id": 1, "text": "  "}]
    with EmbeddingServer() as server:
        out = qray.embed_dataset(ray.data.from_items(rows), base_url=server.base_url)
        # Ray Data re-raises a UDF's exception as RayTaskError(UserCodeException), the
        # original's type and message kept in its text (the object itself is not kept).
        with pytest.raises(
            ray.exceptions.RayTaskError,
            match=r"InputError: column 'text': text at index 1 is empty or whitespace-only",
        ):
            _collect(out)
        assert server.requests == 0  # invalid input: nothing sent


def test_api_key_comes_from_the_workers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The key is never pickled: an actor whose environment lacks it fails at start naming
    the variable; given through runtime_env, requests carry it."""
    key = "sk-test-ray-workers"
    rows = [{"id": i, "text": t} for i, t in enumerate(_texts(50))]
    with EmbeddingServer(api_key=key) as server:
        monkeypatch.setenv("QWEN_EMBED_API_KEY", key)  # the driver's only: Ray already runs
        missing = qray.embed_dataset(ray.data.from_items(rows), base_url=server.base_url)
        with pytest.raises(ray.exceptions.RayError, match="QWEN_EMBED_API_KEY"):
            missing.materialize()
        assert server.requests == 0
        given = qray.embed_dataset(
            ray.data.from_items(rows),
            base_url=server.base_url,
            runtime_env={"env_vars": {"QWEN_EMBED_API_KEY": key}},
        )
        _assert_exact(_collect(given), server, range(50))


def test_explicit_api_key_reaches_the_workers_but_no_pickle_or_log(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``api_key=`` travels through Ray's object store: the server (which answers 401
    without ``Authorization: Bearer <key>``) embeds every row, while what Ray pickles for
    the actors, its repr, and the Ray session's log files hold no trace of the key."""
    import pickle

    key = "sk-test-ray-explicit-5e1f0c2a"
    monkeypatch.delenv("QWEN_EMBED_API_KEY", raising=False)  # nowhere in any environment
    rows = [{"id": i, "text": t} for i, t in enumerate(_texts(50))]
    with EmbeddingServer(api_key=key) as server:
        ds = qray.embed_dataset(ray.data.from_items(rows), base_url=server.base_url, api_key=key)
        _assert_exact(_collect(ds), server, range(50))
        assert server.requests > 0
    config, needs_key, shipped = qray._client_config(server.base_url, 4, None, {"api_key": key})
    assert shipped is not None
    assert not needs_key
    assert config.api_key is None
    for blob in (
        pickle.dumps((config, shipped)),
        ray.cloudpickle.dumps((config, shipped)),
        repr((config, shipped)).encode(),
    ):
        assert key.encode() not in blob
    assert shipped.get() == (key, {}, None)
    sockets = Path(ray.nodes()[0]["ObjectStoreSocketName"]).parent
    logs = sockets.parent / "logs"
    assert logs.is_dir()
    for path in logs.rglob("*"):
        if path.is_file():
            assert key.encode() not in path.read_bytes(), path


def test_secret_headers_reach_the_workers_but_no_pickle_or_log() -> None:
    """A credential-like ``headers=`` value (and ``extra_body`` field) is never pickled
    (an unpickled config asks for it again): it travels with the key through Ray's
    object store, so the actors send it (they failed with "pass headers= with its value
    again in this process"), while what Ray pickles for them, its repr and the session's
    logs hold no trace of it."""
    import pickle

    from recording_server import RecordingServer

    secret = "gw-test-ray-header-7d41c9"
    headers = {"X-Tenant": "acme", "X-Api-Key": secret}
    in_body = "body-test-ray-field-3e58a1"
    body = {"truncate_prompt_tokens": 8, "options": {"api_key": in_body}}
    rows = [{"id": i, "text": t} for i, t in enumerate(_texts(50))]
    with RecordingServer() as server:
        ds = qray.embed_dataset(
            ray.data.from_items(rows), base_url=server.base_url, headers=headers, extra_body=body
        )
        out = _collect(ds)
        seen = server.all()
    assert len(out) == 50
    assert seen
    assert {(r.headers.get("x-api-key"), r.headers.get("x-tenant")) for r in seen} == {
        (secret, "acme")
    }
    assert all(r.body["options"] == {"api_key": in_body} for r in seen)
    settings = {"headers": headers, "extra_body": body}
    config, needs_key, shipped = qray._client_config(server.base_url, 4, None, settings)
    assert shipped is not None
    assert not needs_key
    for blob in (
        pickle.dumps((config, shipped)),
        ray.cloudpickle.dumps((config, shipped)),
        repr((config, shipped)).encode(),
    ):
        assert secret.encode() not in blob
        assert in_body.encode() not in blob
    restored = shipped.restore(pickle.loads(pickle.dumps(config)))
    assert restored.headers == headers
    assert restored.extra_body == body
    logs = Path(ray.nodes()[0]["ObjectStoreSocketName"]).parent.parent / "logs"
    for path in logs.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
            assert in_body.encode() not in path.read_bytes(), path


def test_embed_files_parquet_in_parquet_out(tmp_path: Path) -> None:
    n = 600
    source = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"id": list(range(n)), "text": _texts(n)}), source)
    out_dir = tmp_path / "out"
    with EmbeddingServer() as server:
        result = qray.embed_files(
            source, out_dir, column="text", base_url=server.base_url, batch_size=200
        )
        assert result.rows == n
        assert result.failed_rows == 0
        assert result.output_dir == str(out_dir.resolve())
        table = pq.read_table(out_dir)  # plain pyarrow, no Ray
        assert table.schema.field("id").type == pa.int64()
        assert table.schema.field("text").type == pa.string()
        embedding = table.schema.field("embedding").type
        assert pa.types.is_fixed_size_list(embedding)
        assert embedding.list_size == server.dim
        assert embedding.value_type == pa.float32()
        _assert_exact(table, server, range(n))
        assert sorted(os.listdir(tmp_path)) == ["corpus.parquet", "out"]  # no staging left
        with pytest.raises(FileExistsError, match="overwrite"):
            qray.embed_files(source, out_dir, base_url=server.base_url)


def test_embed_files_jsonl_skip(tmp_path: Path) -> None:
    source = tmp_path / "corpus.jsonl"
    lines = [{"id": 0, "body": "alpha"}, {"id": 1, "body": ""}, {"id": 2, "body": "gamma"}]
    source.write_text("".join(json.dumps(r) + "\n" for r in lines))
    with EmbeddingServer() as server:
        result = qray.embed_files(
            source,
            tmp_path / "out",
            column="body",
            output_column="vec",
            base_url=server.base_url,
            on_error="skip",
            concurrency=(1, 2),  # an autoscaling actor pool
        )
    assert (result.rows, result.failed_rows) == (3, 1)
    table = pq.read_table(tmp_path / "out").sort_by("id")
    assert table.column("vec").null_count == 1
    assert not table.column("vec")[1].is_valid
    assert table.column(qray.DEFAULT_ERROR_COLUMN).to_pylist()[0] is None
    assert "empty" in table.column(qray.DEFAULT_ERROR_COLUMN).to_pylist()[1]
    np.testing.assert_array_equal(
        np.asarray(table.column("vec")[2].as_py(), dtype=np.float32),
        expected_embedding("gamma", server.dim),
    )


# ------------------------------------------------------------------------ no Ray job run


def test_skip_isolates_inputs_the_server_refuses_without_naming_them() -> None:
    """TEI answers 413 for a too-long input without saying which: the client's
    ``on_error="skip"`` bisects until the failing texts stand alone (no Ray job needed)."""
    from qwen_embed_plugins import EmbeddingClient

    texts: list[object] = _texts(16)
    texts[5] = "y" * 300
    texts[12] = "z" * 300
    with EmbeddingServer(dialect="tei", max_input_chars=200) as server:
        client = EmbeddingClient(base_url=server.base_url, server="tei")
        parts, errors = qray._embed_skipping(client, texts)
    assert [i for i, e in enumerate(errors) if e is not None] == [5, 12]
    assert all("HTTP 413" in str(errors[i]) for i in (5, 12))
    ((rows, vectors),) = parts  # one part: every row sent, failed rows NaN
    assert rows == list(range(16))
    good = [i for i in range(16) if i not in (5, 12)]
    np.testing.assert_array_equal(
        vectors[good], server.expected_embeddings([str(texts[i]) for i in good])
    )
    assert np.isnan(vectors[[5, 12]]).all()


def test_output_column_shares_the_decoded_arrays_memory() -> None:
    vectors = np.arange(12, dtype=np.float32).reshape(4, 3)
    column = qray._vectors_column(vectors, 3)
    assert column.type == pa.list_(pa.float32(), 3)
    assert column.values.buffers()[1].address == vectors.ctypes.data  # zero-copy


def test_settings_are_checked_in_the_driver() -> None:
    ds = ray.data.from_items([{"text": "a"}])
    url = "http://127.0.0.1:9/v1"
    with pytest.raises(ConfigError, match="QWEN_EMBED_PROXY") as info:
        qray.embed_dataset(ds, base_url=url, proxy="http://u:pr0xy-pw-not-shipped@proxy:3128")
    assert "pr0xy-pw-not-shipped" not in str(info.value)
    with pytest.raises(ConfigError, match="on_error"):
        qray.embed_dataset(ds, base_url=url, on_error="ignore")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="request_batch_size"):
        qray.embed_dataset(ds, base_url=url, max_concurrency=8)
    with pytest.raises(ConfigError, match="concurrency"):
        qray.embed_dataset(ds, base_url=url, concurrency=0)
    with pytest.raises(InputError, match="column 'body'"):
        qray.embed_dataset(ds, base_url=url, column="body")


# ------------------------------------------------------------------------ the docs' code

DOC = Path(__file__).resolve().parent.parent / "docs" / "scale-out.md"
RUN_HERE = "<!-- run-by: tests/test_ray.py -->"


def _ray_doc_blocks() -> list[tuple[int, str]]:
    """The ```python blocks of docs/scale-out.md marked to run here (they need Ray)."""
    lines = DOC.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == RUN_HERE and lines[i + 1].strip() == "```python":
            end = lines.index("```", i + 2)
            blocks.append((i + 2, "\n".join(lines[i + 2 : end]) + "\n"))
            i = end
        i += 1
    return blocks


def test_docs_have_ray_blocks() -> None:
    assert len(_ray_doc_blocks()) >= 2


@pytest.mark.parametrize(("line", "code"), _ray_doc_blocks(), ids=lambda v: str(v)[:12])
def test_docs_ray_block_runs(
    line: int, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each marked block runs against a loopback server (placeholder hosts rewritten, as
    tests/test_docs.py does for the other pages), in a scratch folder; every
    ``print(...)  # text`` comment must match a printed line, in order."""
    import contextlib
    import io
    import re

    monkeypatch.chdir(tmp_path)
    with EmbeddingServer() as server:
        monkeypatch.setenv("QWEN_EMBED_BASE_URL", server.base_url)
        source = re.sub(r"https?://[A-Za-z0-9.\-]+(?::\d+)?/v1\b", server.base_url, code)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(source, f"{DOC.name}:{line}", "exec"), {"__name__": "docs_snippet"})
        assert server.requests > 0
    printed = iter(s.strip() for s in out.getvalue().splitlines())
    for want in re.findall(r"^\s*print\(.*\)\s+#\s*(.+?)\s*$", code, re.M):
        assert any(s == want for s in printed), (want, out.getvalue())


def test_cli_embed_ray_writes_parquet(tmp_path: Path) -> None:
    """``qwen-embed embed --ray --input corpus.parquet --output out_dir/ --column body``:
    Parquet readable by plain pyarrow with the fixed-size float32 list column."""
    from click.testing import CliRunner

    from qwen_embed_plugins.cli._app import cli

    n = 300
    source = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"id": list(range(n)), "body": _texts(n)}), source)
    out_dir = tmp_path / "out"
    with EmbeddingServer() as server:
        result = CliRunner().invoke(
            cli,
            [
                "embed",
                "--ray",
                "--base-url",
                server.base_url,
                "--input",
                str(source),
                "--output",
                str(out_dir),
                "--column",
                "body",
                "--actors",
                "1",
            ],
        )
        assert result.exit_code == 0, result.output
        assert f"embedded {n} rows" in result.output
        table = pq.read_table(out_dir)
        embedding = table.schema.field("embedding").type
        assert pa.types.is_fixed_size_list(embedding)
        assert embedding.value_type == pa.float32()
        assert embedding.list_size == server.dim
        ids = table.column("id").to_pylist()
        rows = np.asarray(table.column("embedding").to_pylist(), dtype=np.float32)
        order = np.argsort(ids)
        np.testing.assert_array_equal(
            rows[order], server.expected_embeddings([_texts(n)[i] for i in sorted(ids)])
        )


def test_a_server_never_reached_fails_the_job_fast_naming_the_url() -> None:
    """The library's rule in the actors: a dead port fails the job after
    ``wait_for_server`` (not the 300 s deadline), naming the URL and ``qwen-embed check``."""
    import re
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    out = qray.embed_dataset(ray.data.from_items([{"id": 0, "text": "x"}]), base_url=url)
    with pytest.raises(
        ray.exceptions.RayTaskError,
        match=r"ConnectError: .*" + re.escape(f"qwen-embed check --base-url {url}"),
    ):
        _collect(out)
