"""A compile form's archive: every file out of it only after its bytes matched, and only inside the target."""

from __future__ import annotations

import msgspec
import pytest

from tensorizer_manifest.errors import IntegrityError
from tensorizer_manifest.format.generation import CompileFile
from tensorizer_manifest.storage.compile_archive import cache_files, check_archive, pack, unpack


def _cache(tmp_path):
    cache = tmp_path / "cache"
    (cache / "rank_0_0" / "backbone").mkdir(parents=True)
    (cache / "rank_0_0" / "backbone" / "vllm_compile_cache.py").write_text("{(1, 0, 'inductor'): 'fxkey'}\n")
    (cache / "rank_0_0" / "inductor_cache" / "ab").mkdir(parents=True)
    (cache / "rank_0_0" / "inductor_cache" / "ab" / "cabc.so").write_bytes(bytes(range(256)) * 4)
    (cache / "rank_0_0" / "inductor_cache" / "ab" / "cabc.lock").write_bytes(b"")  # not an artifact
    return cache


def test_a_packed_cache_unpacks_to_the_same_files_and_skips_locks(tmp_path):
    cache = _cache(tmp_path)
    archive, files = pack(cache, tmp_path / "compile.bin", "generations/g/compile.bin")
    assert [f.path for f in files] == [
        "rank_0_0/backbone/vllm_compile_cache.py",
        "rank_0_0/inductor_cache/ab/cabc.so",
    ]
    assert archive.size == sum(f.size for f in files) == (tmp_path / "compile.bin").stat().st_size
    target = tmp_path / "placed"
    target.mkdir()
    unpack((tmp_path / "compile.bin").read_bytes(), archive, files, target, "compile.bin")
    placed = sorted(p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file())
    assert placed == [f.path for f in files]
    for f in files:
        assert (target / f.path).read_bytes() == (cache / f.path).read_bytes()


def test_one_changed_byte_in_one_artifact_is_refused_before_anything_is_written(tmp_path):
    cache = _cache(tmp_path)
    archive, files = pack(cache, tmp_path / "compile.bin", "generations/g/compile.bin")
    data = bytearray((tmp_path / "compile.bin").read_bytes())
    data[files[1].offset + 7] ^= 1
    target = tmp_path / "placed"
    target.mkdir()
    with pytest.raises(IntegrityError, match="not the bytes the generation records"):
        unpack(bytes(data), archive, files, target, "compile.bin")
    assert not any(target.iterdir())
    # The archive's own hash right, one file's record wrong: that file is named.
    good = (tmp_path / "compile.bin").read_bytes()
    wrong = [files[0], msgspec.structs.replace(files[1], hash="blake3:" + "0" * 64)]
    with pytest.raises(IntegrityError, match="cabc.so"):
        check_archive(good, archive, wrong, "compile.bin")


def test_a_path_out_of_the_target_is_refused(tmp_path):
    cache = _cache(tmp_path)
    archive, files = pack(cache, tmp_path / "compile.bin", "generations/g/compile.bin")
    escaping = msgspec.structs.replace(files[0], path="../outside.py")  # as a forged, re-sealed generation could
    with pytest.raises(IntegrityError, match="outside.py"):
        check_archive((tmp_path / "compile.bin").read_bytes(), archive, [escaping, files[1]], "compile.bin")
    # Decoding a generation refuses such a path before it gets here.
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"path": "../x", "offset": 0, "size": 0, "hash": "blake3:" + "0" * 64}, CompileFile)


def test_a_cache_file_a_checkpoint_cannot_name_is_refused_not_left_out(tmp_path):
    cache = _cache(tmp_path)
    (cache / "rank_0_0" / ".hidden").write_text("x")
    with pytest.raises(IntegrityError, match="cannot hold"):
        list(cache_files(cache))
