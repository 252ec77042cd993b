"""Tooling of qwen-embed-plugins: the loopback fake servers and the benchmark machinery.

Its own distribution, ``qwen-embed-tooling`` (in ``tooling/`` of the library's repository,
released with the library, as LangChain ships ``langchain-tests``), so that the library's
wheel holds the library only. Packages:

- ``qwen_embed_tooling.testing``: ``EmbeddingServer`` (the OpenAI-compatible loopback
  server with faults, rules, dialects of the real servers, HTTP/2), ``HostileServer``,
  ``LoopbackProxy``; ``python -m qwen_embed_tooling.testing`` runs one in the foreground.
- ``qwen_embed_tooling.bench``: ``run_bench`` (the modes of ``qwen-embed bench`` side by
  side), ``local_target`` and the RTT relay (``bench.relay``).
- ``qwen_embed_tooling.ray_crash``: a Ray actor crashing once in the middle of a job
  (Ray's ``worker_process_setup_hook``), for tests of ``qwen_embed_plugins.ray``.
- ``qwen_embed_tooling.cli``: the ``qwen-embed bench`` and ``qwen-embed serve`` commands,
  registered in the entry-point group ``qwen_embed.commands`` that the library's
  ``qwen-embed`` reads.

Dependency direction: this package imports the library (``qwen_embed_plugins``), the
library never imports this package. It uses some of the library's private modules
(the CLI's options and rendering, the probes), so it pins the library's version.
This ``__init__`` imports nothing.
"""
