"""What a call returns, assembled from its batches as they finish: no I/O, shared by the
sync and async clients.

``Inputs`` is a call's texts after the checks before sending (the rejected ones set
aside, each with its error); ``Sink`` receives each batch's ``Part`` as it finishes
(into one array, or lists); ``finish_list`` / ``finish_array`` put the result in the
caller's order, with ``EmbeddingList`` / ``EmbeddingResult`` for ``on_error="skip"``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ._batching import BatchPlan
from ._config import OnError
from ._protocol import FloatArray
from .errors import InputError, QwenEmbedError

if TYPE_CHECKING:
    from ._run import Part

__all__ = [
    "EmbeddingList",
    "EmbeddingResult",
    "Inputs",
    "Sink",
    "batch_counts",
    "caller_indices",
    "finish_array",
    "finish_list",
]


class EmbeddingList(list):  # type: ignore[type-arg]
    """The vectors of an ``on_error="skip"`` call: ``n`` items, each ``dim`` floats or
    ``None`` for an input that could not be embedded.

    Attributes:
        errors: the caller's input index -> the error that input met.
    """

    errors: dict[int, QwenEmbedError]

    def __init__(self, rows: Iterable[Any] = (), errors: dict[int, QwenEmbedError] | None = None):
        super().__init__(rows)
        self.errors = dict(errors or {})


@dataclass
class EmbeddingResult:
    """The result of an ``on_error="skip"`` array call.

    Attributes:
        vectors: float32, ``n x dim``; rows of failed inputs are NaN.
        errors: the caller's input index -> the error that input met.
    """

    vectors: FloatArray
    errors: dict[int, QwenEmbedError] = field(default_factory=dict)

    @property
    def ok(self) -> np.ndarray[Any, np.dtype[np.bool_]]:
        """Boolean mask, ``n``: ``True`` where the input was embedded."""
        mask = np.ones(len(self.vectors), dtype=bool)
        if self.errors:
            mask[list(self.errors)] = False
        return mask


class Sink:
    """Where decoded batches go as they finish, so no second full copy is kept: an
    array allocated at the first batch (``n_unique x dim``), or plain lists per batch."""

    def __init__(self, plan: BatchPlan, *, lists: bool) -> None:
        self.plan = plan
        self.lists = lists
        self.array: FloatArray | None = None
        self.rows: list[Any] | None = [None] * len(plan.unique) if lists else None
        self.failed: dict[int, QwenEmbedError] = {}  # unique row -> error
        self._lock = threading.Lock()  # batches finish on several threads

    def _allocate(self, dim: int) -> FloatArray:
        with self._lock:
            if self.array is None:
                array = np.empty((len(self.plan.unique), dim), np.float32)
                array.fill(np.nan)
                self.array = array
            return self.array

    def put(self, b: int, part: Part) -> None:
        start = self.plan.batches[b][0]
        for offset, rows in part.pieces:
            at = start + offset
            if self.rows is not None:
                self.rows[at : at + len(rows)] = rows.tolist()
            else:
                array = self.array if self.array is not None else self._allocate(rows.shape[1])
                array[at : at + len(rows)] = rows
        for offset, error in part.failed.items():
            self.failed[start + offset] = error
            if self.rows is not None:
                self.rows[start + offset] = None

    def _errors(self) -> dict[int, QwenEmbedError]:
        plan = self.plan
        if not self.failed:
            return {}
        if plan.positions is None:
            return {plan.first_index[row]: e for row, e in self.failed.items()}
        return {
            i: self.failed[int(row)]
            for i, row in enumerate(plan.positions)
            if int(row) in self.failed
        }

    def array_result(self, dim: int) -> tuple[FloatArray, dict[int, QwenEmbedError]]:
        """The rows (``n_inputs x d``) and errors; ``d`` is ``dim`` when every input
        failed (no answer said the size)."""
        plan = self.plan
        arr = self.array
        if arr is None:  # every input failed
            arr = np.full((len(plan.unique), dim), np.nan, dtype=np.float32)
        if plan.positions is not None:
            arr = arr[plan.positions]
        return arr, self._errors()

    def list_result(self) -> tuple[list[Any], dict[int, QwenEmbedError]]:
        plan = self.plan
        rows = self.rows
        if rows is None:  # cannot happen
            raise RuntimeError("internal error: rows is None")
        if plan.positions is not None:
            seen: set[int] = set()
            out: list[Any] = []
            for row in plan.positions.tolist():
                value = rows[row]
                if row in seen and value is not None:
                    value = list(value)  # duplicates get their own list
                seen.add(row)
                out.append(value)
            rows = out
        return rows, self._errors()


@dataclass
class Inputs:
    """A call's texts after the checks before sending.

    Attributes:
        texts: the texts to send (the rejected ones left out).
        size: the number of inputs of the call (``n``), rejected ones included.
        kept: the caller's index of each text in ``texts``; ``None``: all were kept.
        rejected: the caller's index -> why that text cannot be sent.
        first: the caller's index of ``texts[0]`` when they are a slice of the caller's
            list (every error names the index in that list).
    """

    texts: list[str]
    size: int
    kept: list[int] | None
    rejected: dict[int, InputError]
    first: int = 0

    def errors(self, found: dict[int, QwenEmbedError]) -> dict[int, QwenEmbedError]:
        """Every input's error by the caller's index, in index order: ``found`` (keyed
        by position in ``texts``) and the rejected inputs."""
        if self.kept is None:
            return found
        kept = self.kept
        merged: dict[int, QwenEmbedError] = {kept[j]: e for j, e in found.items()}
        merged.update(self.rejected)
        return dict(sorted(merged.items()))


def caller_indices(plan: BatchPlan, inputs: Inputs) -> list[int]:
    """For each unique text of ``plan``, the caller's index of its first occurrence
    (errors name it), counting the inputs set aside before sending."""
    if inputs.kept is None:
        first = inputs.first
        return [first + i for i in plan.first_index] if first else plan.first_index
    kept = inputs.kept
    return [kept[i] for i in plan.first_index]


def finish_list(
    sink: Sink | None, inputs: Inputs, on_error: OnError
) -> list[list[float]] | EmbeddingList:
    rows, errors = sink.list_result() if sink is not None else ([], {})
    if inputs.kept is not None:
        full: list[Any] = [None] * inputs.size
        for j, i in enumerate(inputs.kept):
            full[i] = rows[j]
        rows = full
    if on_error == "skip":
        return EmbeddingList(rows, inputs.errors(errors))
    return rows


def finish_array(
    sink: Sink | None, inputs: Inputs, on_error: OnError, dim: int
) -> FloatArray | EmbeddingResult:
    if sink is not None:
        arr, errors = sink.array_result(dim)
    else:
        arr, errors = np.empty((0, dim), dtype=np.float32), {}
    if inputs.kept is not None:
        full = np.full((inputs.size, arr.shape[1] or dim), np.nan, dtype=np.float32)
        if len(arr):
            full[inputs.kept] = arr
        arr = full
    if on_error == "skip":
        return EmbeddingResult(arr, inputs.errors(errors))
    return arr


def batch_counts(plan: BatchPlan) -> Callable[[int], int]:
    """Input texts covered by batch ``b`` (duplicates included), for progress."""
    if plan.positions is None:
        return lambda b: plan.batches[b][1] - plan.batches[b][0]
    per_row = np.bincount(plan.positions, minlength=len(plan.unique))
    return lambda b: int(per_row[plan.batches[b][0] : plan.batches[b][1]].sum())
