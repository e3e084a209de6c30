"""The admin token's file (launcher/secret_file.py): this user's alone, made anew."""

from __future__ import annotations

import pytest

from launcher.secret_file import write_secret


def test_the_file_is_readable_by_this_user_only_and_replaces_an_old_one(tmp_path) -> None:
    path = tmp_path / "admin-token"
    path.write_text("old\n")
    path.chmod(0o644)
    assert write_secret(path, "s3cret") == path
    assert path.read_text() == "s3cret\n"
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_link_planted_in_its_place_is_not_followed(tmp_path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("untouched\n")
    path = tmp_path / "admin-token"
    path.symlink_to(target)
    write_secret(path, "s3cret")  # the link goes; a new file takes its place
    assert target.read_text() == "untouched\n"
    assert not path.is_symlink() and path.read_text() == "s3cret\n"


def test_a_folder_it_cannot_write_to_is_an_error(tmp_path) -> None:
    with pytest.raises(OSError):
        write_secret(tmp_path / "missing" / "admin-token", "s3cret")
