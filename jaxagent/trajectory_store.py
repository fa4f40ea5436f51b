"""Trajectory storage: ArrayRecord shards of msgpack records under a run directory, readable by grain.

Layout: `<dir>/trajectories-00000.array_record`, `-00001`, … Each record is one `Trajectory.to_dict()` packed
with msgpack (arrays as raw little-endian bytes, so float32 behavior log-probs round-trip exactly).

Crash safety: a shard is written as `<name>.array_record.partial` and renamed only after `close()` has written
ArrayRecord's footer and the bytes are fsynced. A crash loses at most the open shard (the trajectories written
since the last `flush()`); finished shards are never reopened. ArrayRecord/Riegeli chunks carry hashes and
shards are written with `group_size:1` (one record per chunk), so a corrupted byte range damages only the
records whose chunks it touches: the reader reports those with file and index and reads the rest.

Offline training reads the same files with grain:
    source = trajectory_store.data_source(run_dir / "trajectories")   # grain.sources.ArrayRecordDataSource
    trajectory = trajectory_store.decode(source[i])
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterator

import msgpack

from jaxagent.trajectory import Trajectory, TrajectoryFormatError

SUFFIX = ".array_record"
PARTIAL = ".partial"
# One record per Riegeli chunk: corruption stays local to a record; random access needs no decompression of
# neighbours.
WRITER_OPTIONS = "group_size:1"


class TrajectoryReadError(ValueError):
  """A stored record (or a whole file) cannot be read; names the file and, when known, the record index."""

  def __init__(self, path: str | os.PathLike, index: int | None, reason: str):
    self.path, self.index, self.reason = str(path), index, reason
    where = f"{self.path}: record {index}" if index is not None else f"{self.path}"
    super().__init__(f"{where}: {reason}")


def encode(trajectory: Trajectory) -> bytes:
  return msgpack.packb(trajectory.to_dict(arrays_as="bytes"), use_bin_type=True)


def decode(data: bytes) -> Trajectory:
  """bytes -> `Trajectory`; raises `TrajectoryFormatError` on undecodable or schema-invalid records."""
  try:
    obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
  except (msgpack.UnpackException, ValueError, TypeError) as e:
    raise TrajectoryFormatError(f"not a msgpack record: {type(e).__name__}: {e}") from None
  return Trajectory.from_dict(obj)


class TrajectoryWriter:
  """Appends trajectories to numbered ArrayRecord shards in `directory` (created if needed).

  Use as a context manager, or call `close()`. `flush()` finishes the open shard so everything written so
  far survives a crash; a new shard starts on the next `write`. Resuming into a directory continues the
  numbering after the existing shards and never touches them.
  """

  def __init__(self, directory: str | os.PathLike, *, records_per_shard: int = 1024,
               prefix: str = "trajectories"):
    from array_record.python.array_record_module import ArrayRecordWriter

    if records_per_shard < 1:
      raise ValueError(f"records_per_shard={records_per_shard}: must be >= 1")
    self._writer_cls = ArrayRecordWriter
    self.directory = Path(directory)
    self.directory.mkdir(parents=True, exist_ok=True)
    self.records_per_shard = records_per_shard
    self.prefix = prefix
    pattern = shard_pattern(prefix)
    taken = [int(m.group(1)) for p in self.directory.iterdir() if (m := pattern.match(p.name))]
    self._next_index = max(taken, default=-1) + 1
    self._writer = None
    self._path: Path | None = None
    self._count = 0
    self.finished: list[Path] = []

  @property
  def next_index(self) -> int:
    """Index of the next shard this writer will create (every lower index is finished or open)."""
    return self._next_index

  def write(self, trajectory: Trajectory) -> None:
    if not isinstance(trajectory, Trajectory):
      raise TypeError(f"expected a Trajectory, got {type(trajectory).__name__}")
    data = encode(trajectory)
    if self._writer is None:
      self._path = self.directory / f"{self.prefix}-{self._next_index:05d}{SUFFIX}"
      self._next_index += 1
      self._writer = self._writer_cls(str(self._path) + PARTIAL, WRITER_OPTIONS)
      self._count = 0
    self._writer.write(data)
    self._count += 1
    if self._count >= self.records_per_shard:
      self.flush()

  def flush(self) -> Path | None:
    """Finishes the open shard (footer, fsync, rename); returns its path, or None when none was open."""
    if self._writer is None:
      return None
    self._writer.close()
    partial = Path(str(self._path) + PARTIAL)
    with open(partial, "rb") as f:
      os.fsync(f.fileno())
    os.replace(partial, self._path)
    dir_fd = os.open(self.directory, os.O_RDONLY)
    try:
      os.fsync(dir_fd)
    finally:
      os.close(dir_fd)
    path, self._writer, self._path = self._path, None, None
    self.finished.append(path)
    return path

  def close(self) -> None:
    self.flush()

  def __enter__(self) -> "TrajectoryWriter":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def discard_from(directory: str | os.PathLike, index: int, *, prefix: str = "trajectories") -> list[Path]:
  """Moves shards numbered >= `index` (and unfinished ones) into `directory/discarded/`; returns their new paths.

  Used on resume: trajectories of iterations after the restored checkpoint belong to a timeline that is
  replayed, so they are set aside (not deleted) and the replayed ones are not stored twice.
  """
  directory = Path(directory)
  if not directory.is_dir():
    return []
  pattern = shard_pattern(prefix)
  moved = []
  for path in sorted(directory.iterdir()):
    m = pattern.match(path.name)
    if m and (int(m.group(1)) >= index or m.group(2)):
      target = directory / "discarded" / path.name
      target.parent.mkdir(exist_ok=True)
      os.replace(path, target)
      moved.append(target)
  return moved


def shard_prefix(process: int, process_count: int) -> str:
  """The shard-name prefix process `process` of `process_count` writes a run's trajectories under (one writer per
  process: `trajectories` alone, `trajectories-p<i>` in a multi-process run)."""
  return "trajectories" if process_count == 1 else f"trajectories-p{process}"


def shard_pattern(prefix: str = "trajectories") -> re.Pattern:
  """The names of a writer's shards: `<prefix>-<index>.array_record`, group 1 the index, group 2 `.partial`."""
  return re.compile(re.escape(prefix) + r"-(\d+)" + re.escape(SUFFIX) + r"(\.partial)?$")


def list_files(path: str | os.PathLike) -> list[Path]:
  """A shard file, or the finished shards (`*.array_record`, sorted) of a directory."""
  path = Path(path)
  if path.is_dir():
    return sorted(p for p in path.iterdir() if p.name.endswith(SUFFIX) and p.is_file())
  if path.is_file():
    return [path]
  raise FileNotFoundError(f"{path}: no such trajectory file or directory")


def _reader(path: Path):
  from array_record.python.array_record_module import ArrayRecordReader
  try:
    reader = ArrayRecordReader(str(path), "readahead_buffer_size:0")
    if not reader.ok():
      raise RuntimeError(reader.status() if hasattr(reader, "status") else "reader not ok")
    return reader, reader.num_records()
  except (RuntimeError, ValueError, OSError) as e:
    raise TrajectoryReadError(path, None, f"not a readable ArrayRecord file: {_short(e)}") from None


def _short(e: BaseException) -> str:
  text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
  return text[:300]


def read_file(path: str | os.PathLike, errors: list[TrajectoryReadError] | None = None
              ) -> Iterator[Trajectory]:
  """Yields the trajectories of one shard in order.

  Args:
    path: an ArrayRecord shard.
    errors: None: the first bad record raises `TrajectoryReadError`. A list: bad records (and an unreadable
      file) are appended to it and reading goes on with the next record.
  """
  path = Path(path)
  try:
    reader, num_records = _reader(path)
  except TrajectoryReadError as e:
    if errors is None:
      raise
    errors.append(e)
    return
  try:
    for i in range(num_records):
      try:
        data = reader.read([i])[0]
      except RuntimeError as e:   # Riegeli: chunk hash mismatch, truncated chunk, …
        err = TrajectoryReadError(path, i, f"corrupt record: {_short(e)}")
      else:
        try:
          yield decode(data)
          continue
        except TrajectoryFormatError as e:
          err = TrajectoryReadError(path, i, str(e))
      if errors is None:
        raise err
      errors.append(err)
  finally:
    try:
      reader.close()
    except RuntimeError:
      pass   # a damaged file may also fail to close; its errors were reported per record


def read(path: str | os.PathLike, errors: list[TrajectoryReadError] | None = None) -> Iterator[Trajectory]:
  """Yields the trajectories of a shard or of every finished shard in a directory (see `read_file`)."""
  for p in list_files(path):
    yield from read_file(p, errors)


def data_source(path: str | os.PathLike):
  """A `grain.sources.ArrayRecordDataSource` over the finished shards; map `decode` over its records."""
  import grain
  return grain.sources.ArrayRecordDataSource([str(p) for p in list_files(path)])
