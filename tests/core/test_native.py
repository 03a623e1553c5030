"""mp_callbacks.native: the run-time build (cached by a hash of source, compiler and flags; an unwritable cache
folder falls back to a private one; no compiler is a clear error) and the try-once loader (a failure warns once
and keeps None)."""

import ctypes
import os
import shutil
import warnings

import pytest

from mp_callbacks.native import SCAN, build_library, loaded_once

SOURCE = "#include <stdint.h>\nint32_t twice(int32_t x) { return 2 * x; }\n"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "mp_callbacks"


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_a_build_is_cached_by_source_and_flags(cache):
    path = build_library(SOURCE, "twice", ["-O2", "-shared", "-fPIC"])
    assert path.parent == cache and path.name.startswith("twice-") and ctypes.CDLL(str(path)).twice(21) == 42
    mtime = path.stat().st_mtime_ns
    assert build_library(SOURCE, "twice", ["-O2", "-shared", "-fPIC"]) == path and path.stat().st_mtime_ns == mtime
    assert build_library(SOURCE, "twice", ["-O1", "-shared", "-fPIC"]) != path  # other flags: another build
    assert [p.name for p in cache.iterdir() if p.is_dir()] == []  # no half-built leftovers


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_the_shared_scan_compiles_as_c_and_finds_the_exponent_all_ones(cache):
    source = ("#include <stdint.h>\n#define CLONES\n" + SCAN
              + "int32_t f32(const uint32_t *x, int64_t n) { return scan_f32(x, n); }\n")
    lib = ctypes.CDLL(str(build_library(source, "scan", ["-O2", "-shared", "-fPIC"])))
    lib.f32.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    for bits, want in ((0x3F800000, 0), (0x7F7FFFFF, 0), (0x7F800000, 1), (0xFF800000, 1), (0x7FC00000, 1)):
        values = (ctypes.c_uint32 * 5)(0, bits, 0x00000001, 0x80000000, 0x42000000)
        assert lib.f32(values, 5) == want


def test_no_compiler_is_a_clear_error(cache, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with pytest.raises(RuntimeError, match="no C compiler .*no-such-compiler-here"):
        build_library(SOURCE, "twice", ["-shared"])


@pytest.mark.skipif(shutil.which("cc") is None or os.geteuid() == 0, reason="no C compiler, or root writes anywhere")
def test_an_unwritable_cache_folder_builds_in_a_private_one(cache):
    cache.parent.chmod(0o500)
    try:
        path = build_library(SOURCE, "twice", ["-O2", "-shared", "-fPIC"])
        assert cache not in path.parents and ctypes.CDLL(str(path)).twice(2) == 4
    finally:
        cache.parent.chmod(0o700)


def test_loaded_once_tries_once_and_warns_once():
    calls = []

    def fail():
        calls.append(1)
        raise OSError("no library")

    slot = []
    with pytest.warns(RuntimeWarning, match="unavailable \\(no library\\); slower"):
        assert loaded_once(slot, fail, "unavailable ({err}); slower") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loaded_once(slot, fail, "unavailable ({err}); slower") is None
    assert calls == [1]
    ok = []
    assert loaded_once(ok, lambda: "lib", "{err}") == "lib" and loaded_once(ok, lambda: 1 / 0, "{err}") == "lib"
