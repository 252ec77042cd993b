"""Measurement and probing behind ``qwen-embed bench`` and ``qwen-embed check``.

Everything here returns result objects and prints nothing; ``qwen_embed_plugins.cli``
renders them. Modules:

- ``results``: the mode names and the result objects (``BenchResult``, ``ModeResult``,
  ``CheckReport``, ``CheckFinding``) and their JSON schemas. Imports only the standard
  library, so the CLI's ``--help`` can list the modes without loading the client.
- ``run``: ``run_bench`` (the modes side by side) and ``local_target`` (the loopback
  server behind the RTT relay).
- ``check``: ``check_server``, the server probe with per-server advice.
- ``probe``: the raw HTTP probes both use (models, HTTP/2, idle keep-alive timeout).
- ``corpus``: real input text (Python's own documentation).
- ``relay``: the TCP relay that emulates a network round trip on loopback.

Dependency direction: ``cli -> _bench -> client``; the core never imports this package.
This ``__init__`` imports nothing, so importing one submodule loads only what it needs.
"""
