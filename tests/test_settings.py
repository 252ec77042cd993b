"""One declaration per setting (``qwen_embed_plugins._settings.SETTINGS``): every surface
exposes exactly the declared settings, with the declared name, default, environment
variable and flag. The surfaces: the core clients' keywords, the LangChain and
LlamaIndex fields, the ``qwen-embed`` options, Ray's ``embed_dataset`` and the docs'
parameter tables.

A new setting is one declaration plus its line in ``SAMPLES`` below (a value that is not
its default), and its annotation in ``FlatSettings`` (what type checkers read; checked
here); ``python -m qwen_embed_tooling.settings_docs`` then rewrites the docs' tables.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import click
import pytest
from llama_index.core.base.embeddings.base import BaseEmbedding

import qwen_embed_plugins as q
from qwen_embed_plugins._flat import CONFIG_FIELDS, flat_value
from qwen_embed_plugins._settings import SETTING, SETTINGS
from qwen_embed_plugins.cli._check_command import check
from qwen_embed_plugins.cli._embed_command import embed
from qwen_embed_plugins.integrations._common import FlatSettings, describe
from qwen_embed_plugins.integrations.langchain import QwenPooledEmbeddings
from qwen_embed_plugins.integrations.llama_index import QwenPooledEmbedding
from qwen_embed_tooling import settings_docs
from qwen_embed_tooling.cli.bench import bench
from qwen_embed_tooling.cli.serve import serve

URL = "http://127.0.0.1:9/v1"
DOCS = Path(__file__).resolve().parents[1] / "docs"

# A value of every declared setting that is not its default (what the surfaces are
# driven with): a setting missing here fails test_every_setting_has_a_sample.
SAMPLES: dict[str, Any] = {
    "base_url": "http://127.0.0.1:8/v1",
    "api_key": "sk-settings-0123",
    "model": "Qwen/Qwen3-Embedding-4B",
    "dimensions": 256,
    "query_instruction": "Given a question, find code",
    "batch_size": 7,
    "max_batch_tokens": 5000,
    "max_concurrency": 3,
    "encoding_format": "float",
    "normalize": False,
    "max_text_chars": 9000,
    "append_eos": False,
    "connect_timeout": 1.5,
    "read_timeout": 7.0,
    "write_timeout": 3.0,
    "pool_timeout": 4.0,
    "total_timeout": 9.0,
    "max_retries": 1,
    "deadline": 50.0,
    "query_deadline": 5.0,
    "max_connections": 6,
    "max_keepalive_connections": 2,
    "keepalive_expiry": 1.5,
    "max_connections_per_process": 9,
    "http2": True,
    "verify": False,
    "proxy": "http://proxy.example:3128",
    "trust_env": False,
    "insecure_key": "allow",
    "hedge": True,
    "server": "vllm",
    "headers": {"X-Tenant": "acme"},
    "extra_body": {"truncate": True},
}

# The three settings each adapter declares its own way (not in FlatSettings).
OWN = {"api_key", "model", "batch_size"}
LLAMA_INDEX_NAMES = {"model": "model_name", "batch_size": "embed_batch_size"}


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for setting in SETTINGS:
        if setting.env:
            monkeypatch.delenv(setting.env, raising=False)


def _held(config: q.EmbeddingConfig, name: str) -> Any:
    """Setting ``name`` as ``config`` holds it, in the form its sample is written."""
    if name == "api_key":
        return config.api_key_value()
    value = flat_value(config, name)
    if name in ("headers", "extra_body") and value is not None:
        return dict(value)
    return value


@pytest.mark.unit
def test_every_setting_has_a_sample_and_one_declaration() -> None:
    names = [setting.name for setting in SETTINGS]
    assert len(names) == len(set(names))
    assert set(SAMPLES) == set(names)
    for setting in SETTINGS:
        assert SAMPLES[setting.name] != setting.default, setting.name
        assert setting.doc.strip(), setting.name
        assert setting.part in (None, "timeout", "limits", "retry"), setting.name
        assert (setting.part or setting.name) in CONFIG_FIELDS, setting.name


# --------------------------------------------------------------------------- the core


@pytest.mark.unit
@pytest.mark.parametrize("client", [q.EmbeddingClient, q.AsyncEmbeddingClient])
def test_the_core_clients_take_every_declared_setting(client: type[Any]) -> None:
    for name, value in SAMPLES.items():
        settings = {"base_url": URL, "insecure_key": "allow", name: value}
        config = client(**settings).config
        assert _held(config, name) == value, name


@pytest.mark.unit
def test_the_defaults_of_the_core_config_are_the_declared_ones() -> None:
    config = q.EmbeddingConfig(base_url=URL)
    for setting in SETTINGS:
        if setting.name in ("base_url", "proxy"):  # required; "from the environment"
            continue
        assert _held(config, setting.name) == setting.default, setting.name


@pytest.mark.unit
def test_the_environment_variables_are_the_declared_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from_env = {"dimensions": "128", "batch_size": "9", "max_batch_tokens": "4000"}
    from_env |= {"max_concurrency": "5", "http2": "1", "server": "tei"}
    from_env |= {"model": "m-env", "api_key": "sk-env", "base_url": URL}
    declared = {setting.name for setting in SETTINGS if setting.env}
    assert declared == {*from_env, "proxy"}
    for name, raw in from_env.items():
        monkeypatch.setenv(str(SETTING[name].env), raw)
    monkeypatch.setenv(str(SETTING["proxy"].env), "http://proxy.example:3128")
    config = q.EmbeddingConfig()
    assert config.proxy == "http://proxy.example:3128"
    for name, raw in from_env.items():
        parse = SETTING[name].parse or str
        assert _held(config, name) == parse(raw), name


@pytest.mark.unit
@pytest.mark.parametrize(
    ("given", "meant"),
    [
        ("max_retry", "max_retries"),
        ("api_base", "base_url"),
        ("extra_headers", "headers"),
        ("user", "extra_body"),
        ("read_timout", "read_timeout"),
    ],
)
def test_an_unknown_name_is_refused_naming_the_closest_setting(given: str, meant: str) -> None:
    for client in (q.EmbeddingClient, q.AsyncEmbeddingClient):
        with pytest.raises(q.ConfigError, match=f"'{given}'; did you mean '{meant}'") as info:
            client(base_url=URL, **{given: 1})
        assert client.__name__ in str(info.value)


@pytest.mark.unit
def test_a_flat_name_changes_only_its_attribute_of_a_part_given_with_it() -> None:
    timeouts = q.Timeouts(connect=1.0, read=2.0, write=3.0, pool=4.0, total=5.0)
    client = q.EmbeddingClient(base_url=URL, timeout=timeouts, read_timeout=9.0, max_retries=0)
    assert client.config.timeouts == timeouts.replace(read=9.0)
    assert client.config.retry.max_retries == 0
    base = q.EmbeddingConfig(base_url=URL, limits=q.Limits(max_connections=3))
    other = q.EmbeddingClient(base, keepalive_expiry=1.0).config
    assert other.limits == q.Limits(max_connections=3, keepalive_expiry=1.0)
    with pytest.raises(q.ConfigError, match=r"max_retries must be an integer in \[0, 99\]"):
        q.EmbeddingClient(base_url=URL, max_retries=-1)


# --------------------------------------------------------------------------- the adapters


@pytest.mark.unit
def test_the_adapters_fields_are_exactly_the_declared_settings() -> None:
    flat = set(FlatSettings.model_fields)
    assert flat == set(SETTING) - OWN
    assert set(QwenPooledEmbeddings.model_fields) == set(SETTING) | {"show_progress", "on_error"}
    base = set(BaseEmbedding.model_fields) - set(LLAMA_INDEX_NAMES.values())
    llama = set(QwenPooledEmbedding.model_fields) - base
    assert llama == {LLAMA_INDEX_NAMES.get(name, name) for name in SETTING} | {"on_error"}
    for name, info in FlatSettings.model_fields.items():
        assert info.description == describe(name), name
        if name != "proxy":  # held as a ProxyURL when it has credentials
            assert info.annotation == SETTING[name].type, name


@pytest.mark.unit
@pytest.mark.parametrize("adapter", [QwenPooledEmbeddings, QwenPooledEmbedding])
def test_the_adapters_take_every_declared_setting(adapter: type[Any]) -> None:
    for name, value in SAMPLES.items():
        emb = adapter(**{"base_url": URL, "insecure_key": "allow", name: value})
        assert _held(emb.config, name) == value, name
    emb = adapter(base_url=URL)
    for name in set(SETTING) - OWN - {"base_url"}:
        assert getattr(emb, name) == SETTING[name].default, name


@pytest.mark.unit
def test_the_langchain_docstring_init_args_are_declared_settings() -> None:
    # the "Key init args" sections: "        name: type" lines, each a declared setting
    doc = QwenPooledEmbeddings.__doc__ or ""
    named = []
    for line in doc.splitlines():
        if line.startswith(" " * 8) and not line.startswith(" " * 9) and ": " in line:
            name = line.strip().split(":")[0]
            if name.isidentifier() and name.islower():
                named.append(name)
    assert len(named) >= 10
    assert set(named) <= set(SETTING)


# --------------------------------------------------------------------------- the CLI


def _options(command: click.Command) -> list[click.Option]:
    return [param for param in command.params if isinstance(param, click.Option)]


@pytest.mark.unit
def test_the_cli_options_are_the_declared_flags() -> None:
    flags = {setting.name: setting.cli for setting in SETTINGS if setting.cli}
    on_embed = {option.name: option for option in _options(embed) if option.name in SETTING}
    assert set(on_embed) == set(flags)
    by_flag = {flag: name for name, flag in flags.items()}
    for command in (embed, check, bench, serve):
        for option in _options(command):
            named = option.name in SETTING
            if named:
                assert option.opts == [SETTING[str(option.name)].cli], option.name
                assert option.envvar in (None, SETTING[str(option.name)].env), option.name
            if any(flag in by_flag for flag in option.opts):
                assert named, option.opts
    assert on_embed["deadline"].default == SETTING["deadline"].default


# --------------------------------------------------------------------------- Ray


@pytest.mark.unit
def test_ray_takes_every_declared_setting() -> None:
    from qwen_embed_plugins.ray import _client_config

    refused = {"batch_size", "max_concurrency"}  # request_batch_size=, max_in_flight=
    for name, value in SAMPLES.items():
        if name in refused or name in ("base_url", "api_key", "proxy"):
            continue
        config, _, _ = _client_config(URL, 4, None, {"insecure_key": "allow", name: value})
        assert _held(config, name) == value, name
    for name in refused:
        with pytest.raises(q.ConfigError, match="max_in_flight"):
            _client_config(URL, 4, None, {name: SAMPLES[name]})
    with pytest.raises(q.ConfigError, match="did you mean 'max_retries'"):
        _client_config(URL, 4, None, {"max_retry": 2})


# --------------------------------------------------------------------------- the docs


@pytest.mark.unit
@pytest.mark.parametrize("page", settings_docs.PAGES)
def test_the_docs_tables_are_the_declaration(page: str) -> None:
    found = settings_docs.tables((DOCS / page).read_text())
    assert found, f"docs/{page} has no settings table"
    for surface, table in found.items():
        assert table == settings_docs.render(surface), (
            f"docs/{page}: the {surface} settings table is stale; run "
            "python -m qwen_embed_tooling.settings_docs"
        )
        rows = [line.split("|")[1].strip().strip("`") for line in table.splitlines()[2:]]
        names = {LLAMA_INDEX_NAMES.get(s, s) if surface == "llamaindex" else s for s in SETTING}
        assert set(rows) == names


@pytest.mark.unit
def test_the_readme_summary_names_declared_settings() -> None:
    readme = (DOCS.parent / "README.md").read_text()
    start = readme.index("| setting | default | meaning |")
    rows = readme[start:].split("\n\n")[0].splitlines()[2:]
    named = {name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert len(named) >= 15
    assert named <= set(SETTING)
