"""``qwen-embed serve``: a busy port is named, ``--model-names`` answers unknown model
names with vLLM's 404 (in-process where the command ends by itself, else as a real
process stopped by Ctrl-C once it printed its URL)."""

from __future__ import annotations

import re
import signal
import socket
import urllib.error
import urllib.request
from typing import Any

import orjson
import pytest
from cli_support import CliProcess, run

from qwen_embed_plugins import EmbeddingClient, NotFoundError
from qwen_embed_tooling.testing import EmbeddingServer

VLLM_404 = (
    b'{"object":"error","message":"The model `x` does not exist.",'
    b'"type":"NotFoundError","param":null,"code":404}'
)


def post(base_url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    request = urllib.request.Request(
        base_url + "/embeddings",
        data=orjson.dumps(body),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_a_busy_port_is_named() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run("serve", "--port", str(port), "--duration", "0.01")
    assert result.exit_code == 1
    assert f"port {port} on 127.0.0.1 is already in use" in result.stderr
    assert "--port" in result.stderr


def test_model_names_refuse_an_unknown_model_with_vllms_404() -> None:
    proc = CliProcess(["serve", "--port", "0", "--model-names", "a,b"])
    try:
        line = proc.wait_for_line("Serving")
        match = re.search(r"Serving a \(1024-dim\) at (http://127\.0\.0\.1:\d+/v1)", line)
        assert match, line
        base_url = match.group(1)
        for name in ("a", "b"):
            status, body = post(base_url, {"input": ["hi"], "model": name})
            assert status == 200, body
            assert len(orjson.loads(body)["data"][0]["embedding"]) == 1024
        status, _ = post(base_url, {"input": ["hi"]})  # no model: the first name
        assert status == 200
        assert post(base_url, {"input": ["hi"], "model": "x"}) == (404, VLLM_404)
        with urllib.request.urlopen(base_url + "/models", timeout=60) as response:
            listed = [card["id"] for card in orjson.loads(response.read())["data"]]
        assert listed == ["a", "b"]
    finally:
        proc.signal(signal.SIGINT)
        status, _, stderr = proc.finish()
    assert status == 130, stderr


@pytest.mark.parametrize("process", [False, True], ids=["thread", "child process"])
def test_the_client_names_the_unknown_model(process: bool) -> None:
    with EmbeddingServer(model="a", model_names=["b"], process=process) as server:
        assert EmbeddingClient(base_url=server.base_url, model="b").embed_query("q")
        with pytest.raises(NotFoundError, match="The model `x` does not exist") as info:
            EmbeddingClient(base_url=server.base_url, model="x").embed_query("q")
        assert info.value.status == 404
        assert server.requests == 2


@pytest.mark.parametrize(
    "args",
    [
        ("--model", "minilm"),
        ("--model", "all-MiniLM-L6-v2"),
        ("--model-names", "x,sentence-transformers/all-MiniLM-L6-v2"),
    ],
)
def test_the_real_model_names_point_to_the_real_model_route(args: tuple[str, str]) -> None:
    """``serve --model minilm`` would rename deterministic vectors: it names the command
    that serves the real all-MiniLM-L6-v2 instead, and serves nothing."""
    result = run("serve", "--port", "0", "--duration", "0.01", *args)
    assert result.exit_code == 1
    text = " ".join(result.stderr.split())
    assert "deterministic test vectors, not a real model" in text
    assert "python3 scripts/realserver.py start" in text
    assert "Serving" not in result.stdout


def test_any_model_name_is_answered_by_default() -> None:
    with EmbeddingServer() as server:
        assert EmbeddingClient(base_url=server.base_url, model="x").embed_query("q")


@pytest.mark.unit
def test_model_names_are_checked() -> None:
    with pytest.raises(ValueError, match="model_names must be a sequence of non-empty str"):
        EmbeddingServer(model_names="a,b")
