"""``qwen-embed check``'s advice matches the server that answers, and a base URL that
misses the API's path is diagnosed as such (each server a loopback server speaking its
dialect)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from cli_support import run

from qwen_embed_tooling.testing import EmbeddingServer


def check(base_url: str, *args: str) -> dict[str, Any]:
    result = run("check", "--base-url", base_url, "--max-idle", "0.5", "--json", *args)
    assert result.exit_code in (0, 1), result.output
    data: dict[str, Any] = orjson.loads(result.stdout)
    assert data["ok"] is (result.exit_code == 0)
    return data


def findings(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f["name"]: f for f in data["findings"]}


# The dimensions advice each server gets, and words it must not contain (another
# server's settings).
_DIMENSIONS = {
    "sglang": ("--json-model-override-args", "--hf-overrides"),
    "vllm": ("--hf-overrides", "--json-model-override-args"),
    "tei": ("Text Embeddings Inference's OpenAI route has no `dimensions`", "is_matryoshka"),
    "llamacpp": ("llama.cpp does not read `dimensions`", "is_matryoshka"),
}


@pytest.mark.parametrize("dialect", sorted(_DIMENSIONS))
def test_dimensions_advice_names_the_servers_own_setting(dialect: str) -> None:
    with EmbeddingServer(dialect=dialect) as srv:
        data = check(srv.base_url)
    assert data["server"]["name"] == dialect
    found = findings(data)
    assert found["dimensions"]["status"] == "warn"  # refused or ignored
    wanted, foreign = _DIMENSIONS[dialect]
    assert wanted in found["dimensions"]["advice"]
    assert foreign not in found["dimensions"]["advice"]
    everything = orjson.dumps(data).decode()
    others = {"sglang": "SGLang", "vllm": "vLLM"}
    for name, word in others.items():
        if name != dialect:
            assert word not in everything, (dialect, word)


def test_tei_without_models_route_gets_tei_advice() -> None:
    with EmbeddingServer(dialect="tei") as srv:
        data = check(srv.base_url)
    models = findings(data)["models"]
    assert models["summary"] == "GET /models: HTTP 404"
    assert "Text Embeddings Inference has no /models" in models["advice"]
    assert findings(data)["batch_limit"]["value"] == 32
    assert "--max-client-batch-size" not in findings(data)["batch_limit"]["advice"]  # 32 fits


def test_tei_batch_limit_below_the_default_names_tei_setting() -> None:
    with EmbeddingServer(dialect="tei", max_batch=16) as srv:
        data = check(srv.base_url)
    batch = findings(data)["batch_limit"]
    assert batch["value"] == 16
    assert "set batch_size=16" in batch["advice"]
    assert "--max-client-batch-size" in batch["advice"]


@pytest.mark.parametrize("dialect", ["sglang", "vllm"])
def test_missing_v1_is_diagnosed_as_such(dialect: str) -> None:
    with EmbeddingServer(dialect=dialect) as srv:
        root = srv.base_url.removesuffix("/v1")
        assert root != srv.base_url
        data = check(root)
    found = findings(data)
    assert data["ok"] is False
    embedding = found["embedding"]
    assert embedding["status"] == "fail"
    assert embedding["value"] == 404
    assert embedding["advice"] == (
        f"the OpenAI API of this server is under {root}/v1, not {root}: pass --base-url {root}/v1"
    )
    assert "--model" not in embedding["advice"]
    assert "--api-key" not in embedding["advice"]


def test_a_missing_key_is_not_a_path_problem() -> None:
    with EmbeddingServer(dialect="vllm", api_key="sk-right") as srv:
        data = check(srv.base_url, "--api-key", "sk-wrong")
    embedding = findings(data)["embedding"]
    assert embedding["status"] == "fail"
    assert embedding["value"] == 401
    assert embedding["advice"] == "check --api-key (or QWEN_EMBED_API_KEY)"
    assert "sk-wrong" not in orjson.dumps(data).decode()


def test_ollama_serves_dimensions_itself() -> None:
    with EmbeddingServer(dialect="ollama") as srv:
        data = check(srv.base_url)
    assert data["server"]["name"] == "ollama"
    assert findings(data)["dimensions"]["status"] == "ok"


def test_infinity_served_at_the_root_behind_a_v1_url() -> None:
    with EmbeddingServer(dialect="infinity") as srv:
        assert not srv.base_url.endswith("/v1")  # Infinity without --url-prefix
        data = check(srv.base_url + "/v1")
    assert data["server"]["name"] == "infinity"
    embedding = findings(data)["embedding"]
    assert embedding["status"] == "warn"
    assert f"pass --base-url {srv.base_url}" in embedding["advice"]
    assert findings(data)["dimensions"]["status"] in ("ok", "warn")  # probed at the root
    assert findings(data)["latency"]["status"] == "ok"


def test_table_names_the_detected_server() -> None:
    with EmbeddingServer(dialect="vllm") as srv:
        result = run("check", "--base-url", srv.base_url, "--max-idle", "0.5")
    assert result.exit_code == 0, result.output
    assert "server: vLLM (GET /models: owned_by 'vllm')" in result.stdout


def test_check_reports_silent_truncation_and_a_missing_eos() -> None:
    """issue 13: `qwen-embed check` says when the server truncates long inputs (from its
    usage) and, on llama.cpp, when it does not append <|endoftext|>."""
    from qwen_embed_plugins.cli._check import check_server
    from qwen_embed_tooling.testing import EmbeddingServer

    with EmbeddingServer() as srv:
        srv.truncate_inputs(2048)
        report = check_server(srv.base_url, max_idle=0.5, samples=2)
        assert report.finding("truncation").status == "warn"
    with EmbeddingServer(dialect="llamacpp", append_eos=False) as llama:
        report = check_server(llama.base_url, max_idle=0.5, samples=2)
        assert report.finding("eos").status == "warn"
        assert "append_eos=True" in (report.finding("eos").advice or "")
    with EmbeddingServer() as plain:
        report = check_server(plain.base_url, max_idle=0.5, samples=2)
        assert report.finding("truncation").status == "ok"


def test_the_library_warnings_are_in_the_report_not_above_it() -> None:
    """issue 32: the client's own WARNING during the check (the truncation probe's
    long input) is a note of the report, under the table and in --json, and is not
    printed on stderr above the table."""
    with EmbeddingServer() as srv:
        srv.truncate_inputs(2048)
        table = run("check", "--base-url", srv.base_url, "--max-idle", "0.5")
        data = check(srv.base_url)
    assert table.exit_code == 0, table.output
    assert "probably truncated" not in table.stderr, table.stderr
    assert "qwen-embed:" not in table.stderr, table.stderr
    notes_at = table.stdout.index("client log during the check:")
    assert notes_at > table.stdout.index("truncation")  # under the table
    assert "probably truncated input index 0" in " ".join(table.stdout[notes_at:].split())
    assert findings(data)["truncation"]["status"] == "warn"
    assert len(data["notes"]) == 1, data["notes"]
    assert "probably truncated input index 0" in data["notes"][0]
    with EmbeddingServer() as plain:
        quiet = check(plain.base_url)
    assert quiet["notes"] == []


# --------------------------------------------------------------------------- speed
# (`check` took 38 s against Infinity + MiniLM: an ascending series of batches of long
# passages, then an idle wait for the keep-alive probe after every other probe.)


def test_the_batch_probe_sends_two_batches_of_short_texts_when_the_server_takes_them() -> None:
    with EmbeddingServer(received_limit=100) as srv:
        data = check(srv.base_url, "--batch-probe-max", "256")
        batches = [inputs for inputs in srv.received if len(inputs) > 1]
    assert findings(data)["batch_limit"]["value"] == 256
    assert [len(b) for b in batches] == [32, 256, 2]  # the batch probe's; the truncation one
    assert max(len(text.split()) for batch in batches[:2] for text in batch) <= 6


def test_the_batch_probe_steps_down_to_a_size_the_server_takes() -> None:
    # a limit the server does not state: batches over 128 texts are dropped
    with EmbeddingServer(received_limit=100) as srv:
        srv.add_rule("drop_over", max_texts=128, action="close")
        data = check(srv.base_url, "--batch-probe-max", "512")
    batch = findings(data)["batch_limit"]
    assert batch["value"] == 128
    assert batch["summary"].startswith("batch of 256 texts failed: ")
    assert batch["advice"] == "use batch_size <= 128"


def test_the_keepalive_probe_waits_beside_the_other_probes() -> None:
    """The keep-alive probe's connection is open while the batch probe runs (it used to
    start only after every other probe, adding its idle wait to the total)."""
    from cli_support import wait_until

    from qwen_embed_plugins.cli._check import check_server

    with EmbeddingServer(keep_alive_timeout=1.0) as srv:

        def step(name: str) -> None:
            if name == "batch_limit":  # the probes' own client holds one connection
                wait_until(lambda: srv.connections_opened >= 2, "the keep-alive probe")

        report = check_server(srv.base_url, max_idle=4.0, samples=2, step=step)
    idle = report.finding("keepalive").value
    assert isinstance(idle, float)
    assert 0.8 <= idle <= 2.0


def test_the_whole_check_ends_within_its_timeout() -> None:
    """``--timeout`` bounds the whole check, not each probe: a server keeping idle
    connections for 30 s, a keep-alive wait of up to 60 s, a 4 s timeout. The wait is
    cut at the deadline; the check exits 1 and the finding it cut says so (before,
    the keep-alive probe alone waited 60 s)."""
    import time

    from cli_support import GUARD

    with EmbeddingServer(keep_alive_timeout=30.0) as srv:
        started = time.monotonic()
        result = run(
            "check", "--base-url", srv.base_url, "--max-idle", "60", "--timeout", "4", "--json"
        )
        took = time.monotonic() - started
    assert took < GUARD
    assert result.exit_code == 1, result.output
    data = orjson.loads(result.stdout)
    cut = [f for f in data["findings"] if "--timeout" in f["summary"]]
    assert cut, data["findings"]
    assert all(f["status"] != "ok" for f in cut), cut
    assert "--timeout" in run("check", "--help").output
