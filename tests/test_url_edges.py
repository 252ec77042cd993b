"""The edges of the URL settings: a port outside 1..65535 (or not written as plain digits)
is a ``ConfigError`` naming the setting on every surface (core config, both adapters, the
CLI), never a bare ``ValueError`` or a silent default port; and only a loopback address
(127/8, ::1) or the name ``localhost`` itself is trusted as loopback."""

from __future__ import annotations

import logging
from pathlib import Path

import pydantic
import pytest

import qwen_embed_plugins as q
from qwen_embed_plugins import QwenPooledEmbedding, QwenPooledEmbeddings
from qwen_embed_plugins._endpoint import insecure_key_target, is_loopback
from tests.cli_support import run

pytestmark = pytest.mark.unit

BAD_PORTS = [
    ("http://gpu:0/v1", "0"),
    ("http://gpu:-1/v1", "-1"),
    ("http://gpu:65536/v1", "65536"),
    ("http://gpu:65616/v1", "65616"),
    ("http://gpu:99999/v1", "99999"),
    ("http://gpu:/v1", ""),  # a colon with no port: not the scheme's default
    ("http://gpu:abc/v1", "abc"),
    ("http://[::1]:0/v1", "0"),
    ("http://gpu:+80/v1", "+80"),
    ("http://gpu:00080/v1", "00080"),  # leading zeros: refused, not read as 80
    ("http://gpu:\uff18\uff10/v1", "\uff18\uff10"),  # full-width digits
    ("https://gpu:80:90/v1", "80:90"),
]


@pytest.mark.parametrize(("url", "port"), BAD_PORTS)
def test_a_port_outside_the_range_is_a_config_error_naming_base_url(url: str, port: str) -> None:
    with pytest.raises(q.ConfigError) as caught:
        q.EmbeddingConfig(base_url=url)
    message = str(caught.value)
    assert message.startswith("base_url:"), message
    assert f"got {port!r}" in message, message
    assert "1 to 65535" in message


def test_a_port_with_spaces_is_refused() -> None:
    with pytest.raises(q.ConfigError, match="base_url"):
        q.EmbeddingConfig(base_url="http://gpu: 80/v1")


@pytest.mark.parametrize(
    "value",
    [["http://a:8000/v1", "http://b:0/v1"], "http://a:8000/v1,http://b:0/v1"],
)
def test_a_replica_with_a_bad_port_is_named_by_its_index(value: object) -> None:
    with pytest.raises(q.ConfigError, match=r"^base_url\[1\]: the port of 'http://b:0/v1'"):
        q.EmbeddingConfig(base_url=value)


@pytest.mark.parametrize("url", ["http://gpu:1/v1", "http://gpu:65535/v1", "http://[::1]:8/v1"])
def test_a_valid_port_is_kept_in_the_config_and_its_repr(url: str) -> None:
    config = q.EmbeddingConfig(base_url=url)
    port = url.rsplit(":", 1)[1].split("/")[0]
    assert config.base_url == url
    assert f":{port}/v1" in repr(config)
    assert f":{port}/v1" in config.endpoint
    assert config.pool_key.base_url == url


@pytest.mark.parametrize(
    ("proxy", "port"),
    [
        ("http://proxy:0", "0"),
        ("http://proxy:99999", "99999"),
        ("http://user:pw-secret@proxy:70000", "70000"),
        ("http://proxy:abc", "abc"),
        ("http://[::1]:0", "0"),
    ],
)
def test_a_proxy_port_outside_the_range_is_a_config_error_naming_proxy(
    proxy: str, port: str
) -> None:
    with pytest.raises(q.ConfigError) as caught:
        q.EmbeddingConfig(base_url="http://gpu:8000/v1", proxy=proxy)
    message = str(caught.value)
    assert message.startswith("proxy:"), message
    assert f"got {port!r}" in message
    assert "pw-secret" not in message


def test_a_proxy_without_a_host_is_refused() -> None:
    with pytest.raises(q.ConfigError, match="proxy must be"):
        q.EmbeddingConfig(base_url="http://gpu:8000/v1", proxy="http://:8080")


def test_an_environment_proxy_with_a_bad_port_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://envproxy:0")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    config = q.EmbeddingConfig(base_url="http://gpu:8000/v1")
    with pytest.raises(q.ConfigError, match=r"^proxy \(from the environment's HTTP_PROXY"):
        _ = config.pool_key


def test_both_adapters_refuse_a_bad_port_naming_base_url() -> None:
    with pytest.raises(pydantic.ValidationError, match="base_url: the port of"):
        QwenPooledEmbeddings(base_url="http://gpu:0/v1")
    with pytest.raises(q.ConfigError, match=r"^base_url: the port of"):
        QwenPooledEmbedding(base_url="http://gpu:99999/v1")


@pytest.mark.parametrize("url", ["http://127.0.0.1:0/v1", "http://127.0.0.1:99999/v1"])
@pytest.mark.parametrize("command", ["check", "embed"])
def test_the_cli_refuses_a_bad_port_with_a_usage_error(
    url: str, command: str, tmp_path: Path
) -> None:
    src = tmp_path / "in.txt"
    src.write_text("a text\n")
    args = ["--timeout", "3"] if command == "check" else [str(src), str(tmp_path / "o.npy")]
    result = run(command, "--base-url", url, *args)
    assert result.exit_code == 2, result.output
    assert "base_url: the port of" in result.output


@pytest.mark.parametrize("url", ["http://127.0.0.1:0/v1", "http://127.0.0.1:99999/v1"])
def test_the_bench_command_refuses_a_bad_port_naming_base_url(url: str) -> None:
    result = run("bench", "--base-url", url, "--requests", "1")
    assert result.exit_code == 1, result.output
    assert "error: base_url: the port of" in result.output


# --------------------------------------------------------------------------- loopback


@pytest.mark.parametrize(
    ("url", "loopback"),
    [
        ("http://localhost:8000/v1", True),
        ("http://LOCALHOST.:8000/v1", True),
        ("http://127.0.0.1:8000/v1", True),
        ("http://127.9.8.7:8000/v1", True),
        ("http://[::1]:8000/v1", True),
        # a name under .localhost may resolve anywhere: never trusted by its spelling
        ("http://api.localhost:8000/v1", False),
        ("http://a.b.localhost.:8000/v1", False),
        ("http://localhost.example.com:8000/v1", False),
        ("http://localhostx:8000/v1", False),
        ("http://10.99.0.1:8000/v1", False),
        ("http://127.1:8000/v1", False),  # not an address Python reads: not trusted
        ("http://[::ffff:10.0.0.1]:8000/v1", False),
    ],
)
def test_only_loopback_addresses_and_localhost_are_loopback(url: str, loopback: bool) -> None:
    assert is_loopback(url) is loopback
    assert insecure_key_target(url) is (not loopback)


def test_a_localhost_subdomain_gets_the_plain_http_rules_and_the_proxy(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = "http://api.localhost:8000/v1"  # in the finding, it resolved to 10.99.0.1
    with pytest.raises(q.ConfigError, match="plain HTTP"):
        q.EmbeddingConfig(base_url=url, api_key="sk-abcdefgh", insecure_key="error")
    config = q.EmbeddingConfig(base_url=url, proxy="http://proxy.internal:3128")
    assert config.pool_key.proxy == "http://proxy.internal:3128"
    assert (
        q.EmbeddingConfig(base_url="http://localhost:8000/v1", proxy="http://p:1").pool_key.proxy
        is None
    )
    caplog.set_level(logging.WARNING, logger="qwen_embed_plugins")
    q.EmbeddingClient(base_url=url, api_key="sk-abcdefgh")._engine.new_call(query=True)
    warned = [r.getMessage() for r in caplog.records if "plain HTTP" in r.getMessage()]
    assert len(warned) == 1
    assert "api.localhost" in warned[0]
