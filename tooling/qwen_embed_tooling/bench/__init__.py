"""Measurement behind ``qwen-embed bench`` (and the scripts in the repository's ``bench/``).

Everything here returns result objects and prints nothing; ``qwen_embed_tooling.cli``
renders them. Modules:

- ``results``: the mode names and the result objects (``BenchResult``, ``ModeResult``)
  and their JSON schema. Imports only the standard library, so the CLI's ``--help`` can
  list the modes without loading the client.
- ``run``: ``run_bench`` (the modes side by side) and ``local_target`` (the loopback
  server behind the RTT relay).
- ``relay``: the TCP relay that emulates a network round trip on loopback.

The probes (models, HTTP/2) and the input corpus are the library's own (those of
``qwen-embed check``: ``qwen_embed_plugins.cli._probe``, ``qwen_embed_plugins._corpus``).
This ``__init__`` imports nothing, so importing one submodule loads only what it needs.
"""
