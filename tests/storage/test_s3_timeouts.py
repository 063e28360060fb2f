"""S3 timeouts (issue 20, defect 8): an endpoint that accepts connections and never answers took
~100 s, and ``?request_timeout=`` / ``?connect_timeout=`` were refused as unknown options.
`rolltool.storage.fs.locate` takes them from the URI (defaults `S3_TIMEOUTS`) and gives them to
pyarrow's `S3FileSystem`; the rest of the URI, options included, is pyarrow's as before."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from click.testing import Result
from s3_server import S3Store

from rolltool.errors import RolltoolError
from rolltool.storage.fs import S3_TIMEOUTS, locate

RunCli = Callable[..., Result]
EXAMPLE = Path(__file__).parents[2] / "examples" / "rollouts.parquet"
BASE = "s3://bkt/x.parquet?endpoint_override=127.0.0.1:9&scheme=http&region=us-east-1"


def _options(uri: str) -> dict[str, object]:
    fs = locate(uri).fs
    assert isinstance(fs, pafs.S3FileSystem)
    return fs.__reduce__()[1][0]  # type: ignore[no-any-return]


def test_timeouts_default_and_come_from_the_uri() -> None:
    """No network: the endpoint and the region are given."""
    assert S3_TIMEOUTS == {"connect_timeout": 5.0, "request_timeout": 10.0}
    got = _options(BASE)
    assert (got["connect_timeout"], got["request_timeout"]) == (5.0, 10.0)
    assert (got["endpoint_override"], got["scheme"], got["region"]) == (
        "127.0.0.1:9", "http", "us-east-1")  # fmt: skip
    got = _options(BASE + "&request_timeout=2.5&connect_timeout=1")
    assert (got["connect_timeout"], got["request_timeout"]) == (1.0, 2.5)
    loc = locate(BASE.replace("x.parquet?", "x.parquet?request_timeout=3&"))
    assert loc.path == "bkt/x.parquet" and "request_timeout=3" in loc.shown
    assert _options(BASE.replace("x.parquet?", "x.parquet?request_timeout=3&"))["region"] == (
        "us-east-1"
    )


@pytest.mark.parametrize("bad", ["request_timeout=abc", "connect_timeout=0", "request_timeout="])
def test_a_bad_timeout_is_refused_naming_the_uri(bad: str) -> None:
    with pytest.raises(RolltoolError, match="is not a number of seconds") as e:
        locate(f"{BASE}&{bad}")
    assert str(e.value).startswith(f"{BASE}&{bad}: ")


@pytest.fixture
def silent() -> Iterator[str]:
    """``127.0.0.1:PORT`` where connections are taken (the kernel's backlog) and never
    answered."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    try:
        yield f"127.0.0.1:{s.getsockname()[1]}"
    finally:
        s.close()


def test_a_silent_endpoint_fails_within_the_timeout_naming_it(
    silent: str, tmp_path: Path, run_cli: RunCli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1 s timeouts from the URI: pack fails in seconds (pyarrow's 3 attempts), one line naming
    the endpoint, nothing written."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    uri = (f"s3://bkt/in.parquet?endpoint_override={silent}&scheme=http&region=us-east-1"
           "&connect_timeout=1&request_timeout=1")  # fmt: skip
    start = time.monotonic()
    result = run_cli("pack", uri, "-o", tmp_path / "out", "--dp", 2)
    took = time.monotonic() - start
    assert result.exit_code == 1 and silent in result.stderr, result.output
    assert "Traceback" not in result.output and "amazonaws" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Timeout was reached" in errors[0], result.stderr
    assert "Hint: check the network and the endpoint" in result.stderr
    assert took < 20, took
    assert not (tmp_path / "out").exists()


def test_timeouts_in_the_uris_on_a_real_server(
    s3: S3Store, tmp_path: Path, run_cli: RunCli
) -> None:
    """The options travel with the URI everywhere it goes (input, output, stats): the same
    files as without them."""
    s3.put("in/rollouts.parquet", EXAMPLE.read_bytes())
    slow = "&connect_timeout=3&request_timeout=20"
    plain = run_cli("pack", s3.uri("in/rollouts.parquet"), "-o", s3.uri("a"), "--dp", 2)
    assert plain.exit_code == 0, plain.output
    timed = run_cli("pack", s3.uri("in/rollouts.parquet") + slow, "-o", s3.uri("b") + slow,
                    "--dp", 2)  # fmt: skip
    assert timed.exit_code == 0, timed.output
    a, b = s3.files("a"), s3.files("b")
    a.pop("manifest.json"), b.pop("manifest.json")
    assert a == b and a
    assert run_cli("stats", s3.uri("b") + slow).exit_code == 0
    assert run_cli("stats", s3.uri("in/rollouts.parquet") + slow).exit_code == 0
