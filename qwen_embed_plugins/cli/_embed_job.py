"""The ``qwen-embed embed`` job: INPUT through the client into OUTPUT, safely and resumably.

How it runs:

1. **Scan.** One pass over INPUT before anything is sent: every record is checked
   (a bad one is named by file and line), counted, and the bytes hashed (BLAKE2b).
2. **Batches.** Records are cut into batches of ``batch_size`` in input order; up to
   ``window`` batches are in flight at once (one request each), and each answer is
   written at its place in the *part file* ``.OUTPUT.part`` beside OUTPUT: a ``.npy``
   of ``total x dim`` float32 whose rows land at fixed offsets, so batches may finish
   in any order. Memory holds only the batches in flight.
3. **Finish.** INPUT must be unchanged (same device, inode, size and mtime, and the
   bytes read hash to the scan's hash); then the part file becomes OUTPUT (``.npy``:
   renamed; ``.jsonl``: converted to JSON lines in ``.OUTPUT.tmp``, then renamed) with
   ``os.replace``, which is atomic: OUTPUT is the old file or the complete new one.

Without ``resume``, any failure or signal removes the part file and OUTPUT stays as it
was. With ``resume``, the job also keeps a *journal* ``.OUTPUT.resume``: a JSON header
line (schema, INPUT's size and hash, the settings that decide OUTPUT's bytes, the
number of texts and batches) and then one line ``<batch> <crc32>`` appended after each
batch's rows are written. A failed, interrupted or killed job leaves both files; the
same command with ``resume`` verifies each journaled batch against its CRC-32 in the
part file (so a torn write or a lost page after a power cut only costs that batch),
re-sends nothing else, and ends with the same bytes as an uninterrupted run. It
refuses to resume when INPUT's content or those settings differ. The part file and the
journal are ``fsync``-ed every ``_SYNC_EVERY`` seconds and on every exit path; a lock
(``flock``) on the part file keeps two jobs off the same OUTPUT.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import orjson

from .._corpus import Fingerprint, Record, iter_records, new_digest
from .._protocol import validate_text
from ..errors import InputError

__all__ = [
    "JOURNAL_SCHEMA",
    "JobError",
    "Outcome",
    "Scan",
    "Settings",
    "StatePaths",
    "UsageProblem",
    "run_job",
    "scan_input",
]

JOURNAL_SCHEMA: Final = "qwen-embed-resume/1"
_SYNC_EVERY: Final = 2.0  # seconds between fsyncs of the part file and the journal
_CONVERT_ROWS: Final = 1024  # rows per read when converting the part file to JSONL
_DTYPE: Final = np.dtype("<f4")


class JobError(Exception):
    """The job cannot go on (the message says why and names the file and line)."""


class UsageProblem(JobError):
    """The command asks for something unsafe or impossible (exit status 2)."""


@dataclass(frozen=True)
class Settings:
    """What decides the bytes of OUTPUT: a resumed job must use the same.

    Attributes:
        endpoint: the server's API root (no credentials).
        model: the model name sent.
        dimensions: MRL size asked for, or ``None``.
        query_instruction: the task of the Qwen3 query instruction (``--query``), else
            ``None``.
        batch_size: texts per request (batch shapes can change a GPU server's floats).
        output_format: ``"npy"`` or ``"jsonl"``.
    """

    endpoint: str
    model: str
    dimensions: int | None
    query_instruction: str | None
    batch_size: int
    output_format: str

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return asdict(self)


@dataclass
class Scan:
    """The first pass over INPUT.

    Attributes:
        total: non-blank records (texts to embed).
        blanks: blank records skipped.
        blank_lines: the first few of their 1-based line numbers.
        digest: hex BLAKE2b-128 of INPUT's bytes.
        fingerprint: INPUT's device, inode, size and mtime when the scan began.
    """

    total: int
    blanks: int
    blank_lines: list[int]
    digest: str
    fingerprint: Fingerprint


@dataclass
class Outcome:
    """What a finished job did: ``total`` texts of ``dim`` floats; ``sent`` of them
    embedded by this run (the rest came from the resumed part file)."""

    total: int
    dim: int
    sent: int
    resumed: int


class StatePaths:
    """OUTPUT and the job's files beside it (hidden, named after OUTPUT)."""

    def __init__(self, output: str | Path) -> None:
        self.output = Path(output)
        name = self.output.name
        self.part = self.output.with_name(f".{name}.part")
        self.journal = self.output.with_name(f".{name}.resume")
        self.tmp = self.output.with_name(f".{name}.tmp")

    def all(self) -> tuple[Path, ...]:
        """Every path the job writes."""
        return (self.output, self.part, self.journal, self.tmp)


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def check_paths(input_path: str, paths: StatePaths) -> None:
    """Refuse to write over INPUT (the same file under any name: links, symlinks).

    Raises:
        UsageProblem: OUTPUT (or one of the job's files) is INPUT, or OUTPUT's
            directory does not exist.
    """
    source = os.stat(input_path)
    for path in paths.all():
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        if _same_file(source, st):
            which = "OUTPUT" if path == paths.output else f"the job file {path}"
            raise UsageProblem(
                f"{which} is the input file {input_path} (same device and inode): "
                "refusing to overwrite the input"
            )
    if not paths.output.parent.is_dir():
        raise UsageProblem(f"the directory of OUTPUT does not exist: {paths.output.parent}")


def scan_input(
    input_path: str,
    prepare: Callable[[str], str],
    max_chars: int | None,
    *,
    blank_lines_kept: int = 5,
) -> Scan:
    """Check, count and hash every record of INPUT before anything is sent.

    Raises:
        JobError: a record cannot be sent (too long: the client's ``InputError``,
            named by file and line), or INPUT changed while read.
        ValueError: INPUT is not UTF-8 / not valid JSONL (names the line).
        OSError: INPUT cannot be read.
    """
    blank_lines: list[int] = []
    blanks = 0

    def skipped(line: int) -> None:
        nonlocal blanks
        blanks += 1
        if len(blank_lines) < blank_lines_kept:
            blank_lines.append(line)

    before = Fingerprint.of(os.stat(input_path))
    digest = new_digest()
    total = 0
    for rec in iter_records(input_path, on_blank=skipped, digest=digest):
        try:  # the client's own check, before anything is sent
            validate_text(prepare(rec.text), None, max_chars=max_chars)
        except InputError as exc:
            raise JobError(f"{input_path}:{rec.line}: {exc}") from None
        total += 1
    change = before.change(Fingerprint.of(os.stat(input_path)))
    if change is not None:
        raise JobError(f"{input_path} changed while it was being read: {change}")
    return Scan(total, blanks, blank_lines, digest.hexdigest(), before)


# --------------------------------------------------------------------------- part file


def _npy_header(total: int, dim: int) -> bytes:
    buf = io.BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(_DTYPE), "fortran_order": False}
    np.lib.format.write_array_header_1_0(buf, {**header, "shape": (total, dim)})
    return buf.getvalue()


def _read_npy_header(fd: int) -> tuple[tuple[int, ...], int] | None:
    """``(shape, header length)`` of the ``.npy`` header at the start of ``fd``, or
    ``None`` when there is no complete float32 C-order header."""
    head = os.pread(fd, 4096, 0)
    buf = io.BytesIO(head)
    try:
        version = np.lib.format.read_magic(buf)
        if version != (1, 0):
            return None
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(buf)
    except (ValueError, OSError, SyntaxError):
        return None
    if fortran or dtype != _DTYPE:
        return None
    return tuple(int(n) for n in shape), buf.tell()


def _pwrite(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data = data[written:]
        offset += written


def _lock(fd: int, paths: StatePaths) -> None:
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no lock
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise JobError(
            f"another qwen-embed embed is writing {paths.output} (it holds the lock on "
            f"{paths.part})"
        ) from None


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform/filesystem allows it
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------- the job


@dataclass
class _State:
    """The part file (and journal) of a running job."""

    part_fd: int
    journal_fd: int | None
    total: int
    batch_size: int
    batches: int
    done: set[int] = field(default_factory=set)
    dim: int | None = None
    header_len: int = 0
    last_sync: float = field(default_factory=time.monotonic)

    def rows(self, batch: int) -> tuple[int, int]:
        start = batch * self.batch_size
        return start, min(start + self.batch_size, self.total)

    def texts_done(self) -> int:
        return sum(stop - start for start, stop in map(self.rows, self.done))

    def sync(self) -> None:
        os.fsync(self.part_fd)
        if self.journal_fd is not None:
            os.fsync(self.journal_fd)
        self.last_sync = time.monotonic()

    def write(self, batch: int, vectors: Any, where: str) -> None:
        """Put ``vectors`` (rows of ``batch``) at their place; journal them."""
        start, stop = self.rows(batch)
        if vectors.ndim != 2 or vectors.shape[0] != stop - start:
            raise JobError(f"{where}: the client returned {vectors.shape} for {stop - start} texts")
        dim = int(vectors.shape[1])
        if self.dim is None:
            header = _npy_header(self.total, dim)
            _pwrite(self.part_fd, memoryview(header), 0)
            self.dim, self.header_len = dim, len(header)
        elif dim != self.dim:
            raise JobError(
                f"{where}: the server answered {dim}-dim vectors after {self.dim}-dim ones"
            )
        data = np.ascontiguousarray(vectors, dtype=_DTYPE)
        view = memoryview(data.data).cast("B")
        _pwrite(self.part_fd, view, self.header_len + start * dim * _DTYPE.itemsize)
        if self.journal_fd is not None:
            os.write(self.journal_fd, f"{batch} {zlib.crc32(view):08x}\n".encode())
        self.done.add(batch)
        if time.monotonic() - self.last_sync >= _SYNC_EVERY:
            self.sync()


def _journal_header(scan: Scan, settings: Settings, batches: int) -> bytes:
    header = {
        "schema": JOURNAL_SCHEMA,
        "input": {"size": scan.fingerprint.size, "blake2b": scan.digest},
        "settings": settings.to_dict(),
        "texts": scan.total,
        "batches": batches,
    }
    return orjson.dumps(header) + b"\n"


def _settings_change(old: dict[str, Any], new: dict[str, Any]) -> str:
    keys = sorted(set(old) | set(new))
    return ", ".join(
        f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)
    )


def _load_done(state: _State, lines: list[bytes]) -> None:
    """The journaled batches whose rows in the part file still match their CRC-32."""
    found = _read_npy_header(state.part_fd)
    if found is None:
        return  # killed before the first batch was written
    shape, header_len = found
    if len(shape) != 2 or shape[0] != state.total:
        return
    state.dim, state.header_len = shape[1], header_len
    row_bytes = shape[1] * _DTYPE.itemsize
    for line in lines:
        parts = line.split()
        if len(parts) != 2:
            continue  # a torn last line
        try:
            batch, crc = int(parts[0]), int(parts[1], 16)
        except ValueError:
            continue
        if not 0 <= batch < state.batches or batch in state.done:
            continue
        start, stop = state.rows(batch)
        size = (stop - start) * row_bytes
        data = os.pread(state.part_fd, size, header_len + start * row_bytes)
        if len(data) == size and zlib.crc32(data) == crc:
            state.done.add(batch)


def _open_state(paths: StatePaths, scan: Scan, settings: Settings, resume: bool) -> _State:
    batches = math.ceil(scan.total / settings.batch_size)
    existing = paths.journal.exists()
    if existing and not resume:
        raise UsageProblem(
            f"{paths.output} has an interrupted resumable run ({paths.journal}): pass "
            f"--resume to continue it, or delete {paths.journal} and {paths.part} to "
            "start over"
        )
    part_fd = os.open(paths.part, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _lock(part_fd, paths)
        state = _State(part_fd, None, scan.total, settings.batch_size, batches)
        if resume and existing:
            lines = paths.journal.read_bytes().split(b"\n")
            _check_journal(lines[0], paths, scan, settings)
            _load_done(state, lines[1:])
            state.journal_fd = os.open(paths.journal, os.O_WRONLY | os.O_APPEND)
            if lines[-1]:  # a torn last entry: end it, so the next one stands alone
                os.write(state.journal_fd, b"\n")
            return state
        os.ftruncate(part_fd, 0)
        if resume:
            tmp = paths.journal.with_name(paths.journal.name + ".new")
            with open(tmp, "wb") as fh:
                fh.write(_journal_header(scan, settings, batches))
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, paths.journal)
            _fsync_dir(paths.journal.parent)
            state.journal_fd = os.open(paths.journal, os.O_WRONLY | os.O_APPEND)
        return state
    except BaseException:
        os.close(part_fd)
        raise


def _check_journal(first: bytes, paths: StatePaths, scan: Scan, settings: Settings) -> None:
    start_over = f"delete {paths.journal} and {paths.part} to start over"
    try:
        header = orjson.loads(first)
        old_input, old_settings = header["input"], header["settings"]
        if header["schema"] != JOURNAL_SCHEMA:
            raise KeyError("schema")
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise UsageProblem(
            f"cannot resume: {paths.journal} is not a journal of this version ({exc}); {start_over}"
        ) from None
    if old_input != {"size": scan.fingerprint.size, "blake2b": scan.digest}:
        raise UsageProblem(
            "cannot resume: the input's content changed since the interrupted run "
            f"(size {old_input.get('size')} -> {scan.fingerprint.size} bytes, or its hash); "
            + start_over
        )
    if old_settings != settings.to_dict():
        raise UsageProblem(
            "cannot resume: the settings differ from the interrupted run's ("
            f"{_settings_change(old_settings, settings.to_dict())}); use the same ones, or "
            + start_over
        )


@dataclass
class _Batch:
    index: int
    lines: list[int]
    texts: list[str]


def _batches(
    records: Iterator[Record], batch_size: int, prepare: Callable[[str], str]
) -> Iterator[_Batch]:
    index = 0
    while True:
        lines: list[int] = []
        texts: list[str] = []
        for rec in records:
            lines.append(rec.line)
            texts.append(prepare(rec.text))
            if len(texts) == batch_size:
                break
        if not texts:
            return
        yield _Batch(index, lines, texts)
        index += 1


def run_job(
    client: Any,
    input_path: str,
    paths: StatePaths,
    scan: Scan,
    settings: Settings,
    prepare: Callable[[str], str],
    *,
    resume: bool,
    window: int,
    progress: Callable[[int], None],
    on_state: Callable[[_State], None] | None = None,
) -> Outcome:
    """Embed the scanned INPUT into OUTPUT (see the module docstring).

    Args:
        client: an ``EmbeddingClient``; each batch is one ``embed_documents_array`` call.
        input_path: INPUT.
        paths: OUTPUT and the job's files.
        scan: ``scan_input``'s result for INPUT.
        settings: what decides OUTPUT's bytes (the journal keeps them).
        prepare: the text sent for a record's text (the query instruction, or as is).
        resume: keep a journal; continue the interrupted run it records.
        window: batches in flight at once (>= 1).
        progress: called with the number of texts of each batch done (resumed ones too).
        on_state: called once with the job's state (tests, and the interrupt message).

    Returns:
        an ``Outcome``.

    Raises:
        UsageProblem: unsafe paths, or a journal that does not match (exit status 2).
        JobError: INPUT changed while it ran, another job holds the lock, or the
            server's vectors do not fit.
        QwenEmbedError: the client failed (an ``InputError`` names the input line).
        OSError: a file could not be read or written.
    """
    state = _open_state(paths, scan, settings, resume)
    if on_state is not None:
        on_state(state)
    resumed = state.texts_done()
    try:
        _embed_missing(client, input_path, state, scan, prepare, window, progress)
        if len(state.done) != state.batches or state.dim is None:  # pragma: no cover
            raise JobError(f"{len(state.done)} of {state.batches} batches done")
        os.ftruncate(state.part_fd, state.header_len + state.total * state.dim * _DTYPE.itemsize)
        state.sync()
        _finish(input_path, paths, scan, state, settings.output_format)
    except BaseException:
        if resume:
            with contextlib.suppress(OSError):
                state.sync()
        else:
            paths.part.unlink(missing_ok=True)
        paths.tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(state.part_fd)
        if state.journal_fd is not None:
            os.close(state.journal_fd)
    return Outcome(scan.total, state.dim, scan.total - resumed, resumed)


def _changed(input_path: str, scan: Scan) -> str | None:
    try:
        return scan.fingerprint.change(Fingerprint.of(os.stat(input_path)))
    except FileNotFoundError:
        return "the file was removed"


def _embed_missing(
    client: Any,
    input_path: str,
    state: _State,
    scan: Scan,
    prepare: Callable[[str], str],
    window: int,
    progress: Callable[[int], None],
) -> None:
    digest = new_digest()
    batches = _batches(iter_records(input_path, digest=digest), state.batch_size, prepare)
    pending: dict[Future[Any], _Batch] = {}
    executor = ThreadPoolExecutor(max_workers=window, thread_name_prefix="qwen-embed-job")
    try:
        exhausted = False
        while True:
            while not exhausted and len(pending) < window:
                batch = next(batches, None)
                if batch is None:
                    exhausted = True
                    break
                if (change := _changed(input_path, scan)) is not None:
                    raise JobError(f"{input_path} changed while it was being embedded: {change}")
                if batch.index in state.done:
                    progress(len(batch.texts))
                    continue
                pending[executor.submit(client.embed_documents_array, batch.texts)] = batch
            if not pending:
                break
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                batch = pending.pop(future)
                where = f"{input_path}:{batch.lines[0]}"
                try:
                    vectors = future.result()
                except InputError as exc:
                    if exc.index is not None and 0 <= exc.index < len(batch.lines):
                        where = f"{input_path}:{batch.lines[exc.index]}"
                    raise JobError(f"{where}: {exc}") from exc
                state.write(batch.index, vectors, where)
                progress(len(batch.texts))
    finally:
        for future in pending:
            future.cancel()
        executor.shutdown(wait=False, cancel_futures=True)
    _verify_unchanged(input_path, scan, digest)


def _verify_unchanged(input_path: str, scan: Scan, digest: Any) -> None:
    """Raise ``JobError`` unless INPUT still has the scan's fingerprint and ``digest``
    (of the bytes just read) equals the scan's hash."""
    change = _changed(input_path, scan)
    if change is None and digest.hexdigest() != scan.digest:
        change = "its content changed (its bytes no longer hash as in the first pass)"
    if change is not None:
        raise JobError(f"{input_path} changed while it was being embedded: {change}")


def _rehash(input_path: str) -> Any:
    digest = new_digest()
    with open(input_path, "rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest


def _finish(input_path: str, paths: StatePaths, scan: Scan, state: _State, fmt: str) -> None:
    if fmt == "npy":
        # the last look at INPUT: read again, so an edit that kept size and mtime (or
        # came after the last batch was read) is caught too
        _verify_unchanged(input_path, scan, _rehash(input_path))
        os.replace(paths.part, paths.output)
    else:
        _convert_to_jsonl(input_path, paths, scan, state)
        os.replace(paths.tmp, paths.output)
        paths.part.unlink(missing_ok=True)
    paths.journal.unlink(missing_ok=True)
    _fsync_dir(paths.output.parent)


def _convert_to_jsonl(input_path: str, paths: StatePaths, scan: Scan, state: _State) -> None:
    """Write ``{"index": line - 1, "id": ..., "embedding": [...]}`` per record."""
    if state.dim is None:  # cannot happen
        raise RuntimeError("internal error: state.dim is None")
    dim = state.dim
    row_bytes = dim * _DTYPE.itemsize
    digest = new_digest()
    with open(paths.tmp, "wb") as out:
        offset = state.header_len
        block: Any = np.empty((0, dim), dtype=_DTYPE)
        at = 0
        for rec in iter_records(input_path, digest=digest):
            if at == len(block):
                rows = min(_CONVERT_ROWS, state.total - (offset - state.header_len) // row_bytes)
                data = os.pread(state.part_fd, rows * row_bytes, offset)
                if len(data) != rows * row_bytes:
                    raise JobError(f"{paths.part} is shorter than {state.total} rows")
                block = np.frombuffer(data, dtype=_DTYPE).reshape(rows, dim)
                offset += len(data)
                at = 0
            item: dict[str, Any] = {"index": rec.line - 1}
            if rec.id is not None:
                item["id"] = rec.id
            item["embedding"] = block[at]
            at += 1
            out.write(orjson.dumps(item, option=orjson.OPT_SERIALIZE_NUMPY))
            out.write(b"\n")
        out.flush()
        os.fsync(out.fileno())
    _verify_unchanged(input_path, scan, digest)
