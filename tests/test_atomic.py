"""kvchat.atomic: the one way kvchat writes a file."""

from __future__ import annotations

import hashlib
import os

import pytest

from kvchat.atomic import TMP_PREFIX, write_atomic


def test_a_write_replaces_a_symlink_and_never_writes_through_it(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    link = tmp_path / "config.toml"
    link.symlink_to(victim)
    sha = write_atomic(link, b"new = 1\n")
    assert victim.read_text() == "keep me"  # the file the link pointed at is untouched
    assert not link.is_symlink() and link.read_bytes() == b"new = 1\n"
    assert sha == hashlib.sha256(b"new = 1\n").hexdigest()
    assert oct(link.stat().st_mode & 0o777) == oct(0o600)


def test_without_replace_an_existing_name_stays_and_nothing_is_left(tmp_path):
    target = tmp_path / "export.md"
    target.write_text("mine")
    with pytest.raises(FileExistsError):
        write_atomic(target, b"theirs", replace=False)
    assert target.read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["export.md"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "history.json"
    target.write_text("old")

    def full_disk(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError):
        write_atomic(target, b"new")
    assert target.read_text() == "old"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(TMP_PREFIX)]
