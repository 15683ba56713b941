"""Replacing a file so that a crash mid-write (an exception, SIGKILL, a power cut) leaves the old
content or the new one, never a torn mix: the bytes go to a temp file beside the target (same
filesystem, so the rename cannot turn into a copy), reach the disk, and are renamed over the target
with one os.replace. Every file pagedserve persists goes through here. No torch: the CLI imports it.
"""
from __future__ import annotations

import os
import stat
import uuid
from pathlib import Path
from typing import BinaryIO

TEMP_SUFFIX = ".tmp"


def temp_path(target: Path) -> Path:
    """A hidden name beside `target`, unique per process and call, so two writers never share a temp
    file; it ends in `.tmp`, so a glob for the real files (`*.json`) never picks one up. The target's
    name is cut to 100 characters: a name near the filesystem's limit must still get a temp file."""
    return target.with_name(f".{target.name[:100]}.{os.getpid()}-{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}")


def temp_writer(tmp: Path) -> int | None:
    """The process id in a name `temp_path` gave (None for another name)."""
    pid = tmp.name.rpartition(".")[0].rpartition(".")[2].partition("-")[0]
    return int(pid) if pid.isdigit() else None


def write_atomic(path: str | Path, data: str | bytes, *, encoding: str = "utf-8") -> None:
    """Replace `path`'s content with `data` (text is encoded with `encoding`). A symlink keeps pointing
    at the file, which is the one replaced; an existing file keeps its permission bits (a config that
    holds an API key may be 0600)."""
    target = Path(os.path.realpath(path))
    payload = data.encode(encoding) if isinstance(data, str) else data
    tmp = temp_path(target)
    try:
        with open(tmp, "xb") as f:
            _fill(f, payload)
        _keep_mode(target, tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _fill(f: BinaryIO, payload: bytes) -> None:
    # fsync before the rename: otherwise a power cut can leave the new name on an empty file
    f.write(payload)
    f.flush()
    os.fsync(f.fileno())


def _keep_mode(target: Path, tmp: Path) -> None:
    try:
        mode = stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        return                  # a new file: the umask decides, as for any other new file
    os.chmod(tmp, mode)
