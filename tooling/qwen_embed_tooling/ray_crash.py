"""Kill a Ray actor in the middle of a ``qwen_embed_plugins.ray`` job, deterministically.

A crashed or preempted worker, for tests of Ray's retries, through Ray's public
``worker_process_setup_hook`` (a job-level setting):

1. start Ray with ``ray.init(..., runtime_env={"worker_process_setup_hook": SETUP_HOOK})``:
   every worker process wraps ``EmbeddingClient.embed_documents_array`` at start (a no-op
   wrapper unless the next step arms it);
2. pass ``runtime_env(path)`` (``path`` an existing file) to the job
   (``embed_dataset(..., runtime_env=...)``): in an actor that has already finished one
   ``embed_documents_array`` call (one batch), the next call deletes the file and, if it
   was the one that deleted it, exits at once (``os._exit``).

Exactly one actor crashes, after a batch of its own: the job is then in the middle, and
the file's absence afterwards proves the crash. The library knows nothing of this.
"""

from __future__ import annotations

import os
from typing import Any, Final

__all__ = ["CRASH_FILE_ENV", "SETUP_HOOK", "crash_after_first_batch", "runtime_env"]

CRASH_FILE_ENV: Final = "QWEN_EMBED_TEST_RAY_CRASH_FILE"
"""The environment variable naming the file whose deletion is the crash."""
SETUP_HOOK: Final = f"{__name__}.crash_after_first_batch"
"""``worker_process_setup_hook`` of ``ray.init(runtime_env=...)``."""


def runtime_env(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The job's Ray ``runtime_env`` that makes one of its actors crash once."""
    return {"env_vars": {CRASH_FILE_ENV: os.fspath(path)}}


def crash_after_first_batch() -> None:
    """Ray's worker set-up hook: wrap ``EmbeddingClient.embed_documents_array`` in this
    worker process (it crashes only where ``CRASH_FILE_ENV`` names a file)."""
    from qwen_embed_plugins import EmbeddingClient

    original = EmbeddingClient.embed_documents_array
    finished = [0]

    def embed_documents_array(self: EmbeddingClient, *args: Any, **kwargs: Any) -> Any:
        path = os.environ.get(CRASH_FILE_ENV)
        if path and finished[0]:
            try:
                os.unlink(path)  # exactly one process succeeds
            except FileNotFoundError:
                pass
            else:
                os._exit(1)
        result = original(self, *args, **kwargs)
        finished[0] += 1
        return result

    EmbeddingClient.embed_documents_array = embed_documents_array  # type: ignore[method-assign]
