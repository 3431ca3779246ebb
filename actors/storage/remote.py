"""A run directory's remote home: an object store (or any filesystem ``pyarrow.fs`` resolves).

:func:`open_remote` turns a URL into a :class:`Remote`: ``s3://bucket/prefix`` (AWS, or any
S3-compatible store: MinIO, Ceph, moto), ``gs://bucket/prefix``, ``hdfs://...``, ``file://...``,
through ``pyarrow.fs``, the library Ray uses for its own ``storage_path``.  Credentials come
from where each store's own tools read them: for S3 the standard ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION`` / ``AWS_DEFAULT_REGION`` and
``AWS_ENDPOINT_URL`` (an S3-compatible store), or the URL's own query
(``s3://bucket/p?endpoint_override=host:9000&scheme=http``).

Contracts:

- **Every call has a deadline.**  An S3 filesystem is built with a connect timeout of
  :data:`CONNECT_TIMEOUT_S` and a request timeout of :data:`REQUEST_TIMEOUT_S`; callers that
  wait on a store without such options (gs, hdfs) do so from a thread they bound
  themselves (:class:`~erlay.actors.storage.mirror.Mirror`).
- **Retries.**  :meth:`Remote.put` and :meth:`Remote.get` retry a failed transfer
  ``attempts`` times with exponential backoff; a missing object is not retried.
- **Atomic objects.**  An object appears whole or not at all (a PUT, or a multipart upload
  completed at close): a reader never sees half a file.  Ordering across objects is the
  writer's business (checkpoint manifests last: :mod:`~erlay.actors.storage.mirror`).
- **Bad settings are one line.**  :meth:`Remote.probe` writes and removes one small object;
  a missing bucket, bad credentials or an unreachable endpoint raise :class:`StorageError`
  with one line naming the URL and the cause, before a job starts anything.

May import: erlay.supervisor.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from erlay.supervisor.errors import ErlayError

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 60.0
# Local paths stay local: a "URL" is anything with a scheme other than file-like drive names.
_REMOTE_SCHEMES = ("s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss", "file", "mock")


class StorageError(ErlayError):
    """The remote store cannot be used; the message is one line: the URL and the cause."""


def is_remote(location: str | os.PathLike[str] | None) -> bool:
    """Whether ``location`` names remote storage (``scheme://...``), not a local path."""
    if location is None:
        return False
    scheme, sep, _ = str(location).partition("://")
    return bool(sep) and scheme.lower() in _REMOTE_SCHEMES


def check_url(url: str) -> str:
    """``url`` if it is a storage URL erlay can open, else ValueError saying why (for the
    config's validators: nothing is contacted)."""
    parsed = urllib.parse.urlparse(url)
    scheme = parsed.scheme.lower()
    if scheme not in _REMOTE_SCHEMES:
        raise ValueError(f"{url}: unknown storage scheme {parsed.scheme!r}; give a local "
                         f"path or one of {', '.join(s + '://' for s in _REMOTE_SCHEMES[:5])}")
    if scheme in ("s3", "gs", "gcs") and not parsed.netloc:
        raise ValueError(f"{url}: names no bucket ({scheme}://BUCKET/PREFIX)")
    return url


def join(url: str, *parts: str) -> str:
    """``url`` with ``parts`` appended as path segments (the query, if any, kept last)."""
    base, q, query = url.partition("?")
    path = "/".join([base.rstrip("/"), *(p.strip("/") for p in parts if p)])
    return path + (q + query if q else "")


def basename(url: str) -> str:
    """The last path segment of ``url``: a run's id."""
    return url.partition("?")[0].rstrip("/").rsplit("/", 1)[-1]


def _s3_filesystem(parsed: urllib.parse.ParseResult) -> Any:
    """An S3 filesystem with deadlines and retries, honouring the URL's query and the AWS
    environment (``AWS_ENDPOINT_URL`` included, which pyarrow's constructor ignores)."""
    import pyarrow.fs as pafs

    query = {k: v[-1] for k, v in urllib.parse.parse_qs(parsed.query).items()}
    endpoint = (query.pop("endpoint_override", None) or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL"))
    scheme = query.pop("scheme", None)
    if endpoint and "://" in endpoint:
        scheme, _, endpoint = endpoint.partition("://")
    region = (query.pop("region", None) or os.environ.get("AWS_REGION")
              or os.environ.get("AWS_DEFAULT_REGION"))
    kwargs: dict[str, Any] = {
        "connect_timeout": CONNECT_TIMEOUT_S, "request_timeout": REQUEST_TIMEOUT_S,
        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=3)}
    if endpoint:
        kwargs["endpoint_override"] = endpoint.rstrip("/")
    if scheme:
        kwargs["scheme"] = scheme
    if region:
        kwargs["region"] = region
    if query:
        raise StorageError(f"s3://{parsed.netloc}{parsed.path}: unknown URL option(s) "
                           f"{', '.join(sorted(query))}")
    return pafs.S3FileSystem(**kwargs)


@dataclass(frozen=True)
class Remote:
    """A directory in a remote store: ``fs`` (a ``pyarrow.fs.FileSystem``) and ``root``, the
    path in it.  ``url`` is what users see and type.  Paths given to the methods are
    relative to ``root``, with ``/`` separators."""

    url: str
    fs: Any
    root: str
    attempts: int = 4

    def child(self, name: str) -> Remote:
        return Remote(join(self.url, name), self.fs, f"{self.root}/{name}", self.attempts)

    def _path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def _retrying(self, what: str, fn: Any) -> Any:
        delay = 0.2
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except FileNotFoundError:
                raise
            except OSError as exc:
                if attempt == self.attempts:
                    raise StorageError(f"{what}: {one_line(exc)}") from exc
                log.warning("storage: %s failed (attempt %d of %d): %s", what, attempt,
                            self.attempts, one_line(exc))
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        raise AssertionError("unreachable")

    def put(self, local: Path, rel: str) -> int:
        """Upload the file ``local`` as ``rel``, whole; its bytes.  Streamed in 8 MiB pieces
        (a checkpoint is never held in memory) up to the size it had when the upload began,
        so a file that grows meanwhile is uploaded as it was then."""

        def write() -> int:
            with open(local, "rb") as src, self.fs.open_output_stream(self._path(rel)) as out:
                left = os.fstat(src.fileno()).st_size
                sent = 0
                while left > 0:
                    piece = src.read(min(left, 8 << 20))
                    if not piece:   # truncated meanwhile: what there was
                        break
                    out.write(piece)
                    sent += len(piece)
                    left -= len(piece)
                return sent
        return int(self._retrying(f"uploading {local} to {join(self.url, rel)}", write))

    def put_bytes(self, data: bytes, rel: str) -> None:
        def write() -> None:
            with self.fs.open_output_stream(self._path(rel)) as out:
                out.write(data)
        self._retrying(f"writing {join(self.url, rel)}", write)

    def get(self, rel: str, local: Path) -> int:
        """Download ``rel`` into ``local`` (a temporary name, then renamed: a reader never
        sees half of it); its bytes.  FileNotFoundError when ``rel`` does not exist."""

        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(local.name + ".part")

        def read() -> int:
            got = 0
            with self.fs.open_input_stream(self._path(rel)) as src, open(tmp, "wb") as out:
                while piece := src.read(8 << 20):
                    out.write(piece)
                    got += len(piece)
            return got
        size = int(self._retrying(f"downloading {join(self.url, rel)}", read))
        os.replace(tmp, local)
        return size

    def read_text(self, rel: str) -> str:
        def read() -> bytes:
            with self.fs.open_input_stream(self._path(rel)) as src:
                return bytes(src.read())
        return self._retrying(f"reading {join(self.url, rel)}", read).decode("utf-8")

    def exists(self, rel: str) -> bool:
        import pyarrow.fs as pafs
        info = self._retrying(f"looking up {join(self.url, rel)}",
                              lambda: self.fs.get_file_info(self._path(rel)))
        return bool(info.type != pafs.FileType.NotFound)

    def listing(self, rel: str = "") -> dict[str, int]:
        """Every file under ``rel`` (recursively): relative path -> size.  Empty when
        nothing is there."""
        import pyarrow.fs as pafs
        base = self._path(rel)
        selector = pafs.FileSelector(base, recursive=True, allow_not_found=True)
        infos = self._retrying(f"listing {join(self.url, rel)}",
                               lambda: self.fs.get_file_info(selector))
        prefix = self.root + "/"
        return {i.path[len(prefix):]: int(i.size) for i in infos
                if i.type == pafs.FileType.File and i.path.startswith(prefix)}

    def delete(self, rel: str) -> None:
        """Remove the file ``rel``; a missing one is not an error."""
        def remove() -> None:
            try:
                self.fs.delete_file(self._path(rel))
            except FileNotFoundError:
                pass
        self._retrying(f"deleting {join(self.url, rel)}", remove)

    def probe(self) -> None:
        """Write, read back and remove one small object under ``root``: StorageError (one
        line) when the bucket is missing, the credentials are refused or the store does not
        answer.  What a job does before it starts anything."""
        name = f".erlay-probe-{secrets.token_hex(4)}"
        try:
            def roundtrip() -> None:
                with self.fs.open_output_stream(self._path(name)) as out:
                    out.write(b"erlay")
                with self.fs.open_input_stream(self._path(name)) as src:
                    if src.read() != b"erlay":
                        raise OSError("read back something else than was written")
                self.fs.delete_file(self._path(name))
            roundtrip()
        except (OSError, ValueError) as exc:
            raise StorageError(f"{self.url} is not writable: {one_line(exc)}") from exc


def open_remote(url: str) -> Remote:
    """The :class:`Remote` that ``url`` names.  Nothing is contacted; StorageError for a URL
    pyarrow cannot resolve (an unknown scheme, a store whose library is missing)."""
    import pyarrow.fs as pafs

    check = url.rstrip("/") if "?" not in url else url
    try:
        check_url(check)
    except ValueError as exc:
        raise StorageError(str(exc)) from exc
    parsed = urllib.parse.urlparse(check)
    try:
        if parsed.scheme.lower() == "s3":
            fs = _s3_filesystem(parsed)
            root = f"{parsed.netloc}{parsed.path}".rstrip("/")
        else:
            fs, root = pafs.FileSystem.from_uri(check)
            root = root.rstrip("/")
    except (OSError, ValueError, TypeError) as exc:
        raise StorageError(f"{url}: {one_line(exc)}") from exc
    return Remote(check, fs, root)


def one_line(exc: BaseException) -> str:
    """``exc``'s message on one line, without AWS request ids: what a user acts on."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    cut = text.find(" (Request ID")
    return text[:cut] if cut > 0 else text
