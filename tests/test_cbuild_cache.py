"""flowlane's compiled-kernel cache loads only a library this user built: a .so or cache folder that someone else
owns or could have replaced is refused with a message saying why, and the caller falls back to Python (issue 33,
item 8: on a shared host the cache loaded any existing .so)."""

import os
import shutil
from pathlib import Path

import pytest

from flowlane import _cbuild

SRC = "int flowlane_cbuild_probe(void) { return 42; }\n"
FLAGS = ("-O1", "-shared", "-fPIC")

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWLANE_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "probe.c"
    src.write_text(SRC)
    return tmp_path / "cache", src


def _built(cache_dir: Path) -> Path:
    (so,) = cache_dir.glob("probe_*.so")
    return so


def test_a_fresh_cache_is_private_and_its_kernel_loads(cache):
    cache_dir, src = cache
    assert _cbuild.build_and_load(src, "probe", FLAGS).flowlane_cbuild_probe() == 42
    assert cache_dir.stat().st_mode & 0o777 == 0o700
    assert _built(cache_dir).stat().st_mode & 0o022 == 0
    assert _cbuild.build_and_load(src, "probe", FLAGS).flowlane_cbuild_probe() == 42  # the cached one


def test_a_cached_library_others_can_write_is_refused(cache):
    cache_dir, src = cache
    _cbuild.build_and_load(src, "probe", FLAGS)
    _built(cache_dir).chmod(0o777)
    with pytest.raises(
        OSError, match=r"refusing to load .*probe_\w+\.so: writable by group or others \(mode 0o777\)"
    ):
        _cbuild.build_and_load(src, "probe", FLAGS)


def test_a_cache_folder_others_can_write_is_refused(cache):
    cache_dir, src = cache
    _cbuild.build_and_load(src, "probe", FLAGS)
    cache_dir.chmod(0o777)
    with pytest.raises(
        OSError, match=r"refusing to load .*cache: writable by group or others \(mode 0o777\)"
    ):
        _cbuild.build_and_load(src, "probe", FLAGS)


def test_a_cached_library_another_user_owns_is_refused(cache, monkeypatch):
    cache_dir, src = cache
    _cbuild.build_and_load(src, "probe", FLAGS)
    me = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: me + 4242)  # as seen by another user of the same cache
    with pytest.raises(
        OSError, match=rf"refusing to load .*: owned by uid {me}, not by this user \(uid {me + 4242}\)"
    ):
        _cbuild.build_and_load(src, "probe", FLAGS)


def test_a_symlink_in_place_of_the_library_is_refused(cache, tmp_path):
    cache_dir, src = cache
    _cbuild.build_and_load(src, "probe", FLAGS)
    so = _built(cache_dir)
    so.rename(tmp_path / "elsewhere.so")
    so.symlink_to(tmp_path / "elsewhere.so")
    with pytest.raises(OSError, match=r"refusing to load .*probe_\w+\.so: not a regular file"):
        _cbuild.build_and_load(src, "probe", FLAGS)


def test_a_refused_kernel_warns_and_the_caller_falls_back(cache):
    cache_dir, src = cache
    _cbuild.build_and_load(src, "probe", FLAGS)
    _built(cache_dir).chmod(0o666)
    k = _cbuild.CKernel(src, "probe", FLAGS, lambda lib: None, "probe kernel", "using Python")
    with pytest.warns(UserWarning, match=r"probe kernel unavailable \(refusing to load .*\); using Python"):
        assert k.load() is None
