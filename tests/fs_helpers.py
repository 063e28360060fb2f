"""A filesystem without rename, for tests of outputs on object storage without network.

``norename:///abs/folder`` (registered in `rolltool.storage.fs.SCHEMES` by `register`) is a folder of
this machine seen through `pyarrow.fs.PyFileSystem` with a handler that refuses ``move`` (as
object stores have no directory rename) and counts the calls it refuses; everything else goes
to `pyarrow.fs.LocalFileSystem`. Its files can be compared byte for byte with a local output's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from rolltool.storage import fs as rfs

SCHEME = "norename"
refused: list[tuple[str, str]] = []
"""The moves the filesystem refused (src, dest)."""


class NoRename(pafs.FileSystemHandler):
    """LocalFileSystem without move (and with no other way to rename)."""

    def __init__(self) -> None:
        self.local = pafs.LocalFileSystem()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NoRename)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def get_type_name(self) -> str:
        return "norename"

    def normalize_path(self, path: str) -> str:
        return self.local.normalize_path(path)

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return self.local.get_file_info(paths)

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        return self.local.get_file_info(selector)

    def create_dir(self, path: str, recursive: bool) -> None:
        self.local.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self.local.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self.local.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        raise OSError("refusing to empty the root")

    def delete_file(self, path: str) -> None:
        self.local.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        refused.append((src, dest))
        raise OSError(f"no rename on this filesystem ({src} -> {dest})")

    def copy_file(self, src: str, dest: str) -> None:
        self.local.copy_file(src, dest)

    def open_input_stream(self, path: str) -> Any:
        return self.local.open_input_stream(path)

    def open_input_file(self, path: str) -> Any:
        return self.local.open_input_file(path)

    def open_output_stream(self, path: str, metadata: Any = None) -> Any:
        # object stores create "folders" implicitly
        parent = path.rsplit("/", 1)[0]
        if parent:
            self.local.create_dir(parent, recursive=True)
        return self.local.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path: str, metadata: Any = None) -> Any:
        raise OSError("no append on this filesystem")


def _open(uri: str) -> tuple[pafs.FileSystem, str]:
    return pafs.PyFileSystem(NoRename()), uri[len(SCHEME) + 3 :]


def register() -> None:
    """Make ``norename:///path`` URIs resolve (in this process)."""
    rfs.SCHEMES[SCHEME] = _open


def uri(path: object) -> str:
    return f"{SCHEME}://{path}"


class Folder:
    """A ``norename://`` prefix over a local folder, with `s3_server.S3Store`'s methods (so a
    test runs against either)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def uri(self, rel: str = "") -> str:
        return uri(f"{self.root}/{rel}".rstrip("/"))

    def files(self, rel: str = "") -> dict[str, bytes]:
        """Every file under `rel` (folders left empty by deletes do not count)."""
        base = self.root / rel
        found = {str(p.relative_to(base)): p.read_bytes() for p in base.rglob("*") if p.is_file()}
        return dict(sorted(found.items()))

    def put(self, rel: str, data: bytes) -> None:
        (self.root / rel).parent.mkdir(parents=True, exist_ok=True)
        (self.root / rel).write_bytes(data)

    def delete(self, rel: str) -> None:
        (self.root / rel).unlink()
