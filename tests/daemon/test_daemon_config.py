"""`ckptd serve` settings: flags, CKPTD_* variables, sizes, and refusals."""

from __future__ import annotations

import argparse
import os

import pytest

from ckptd.daemon.config import (
    DEFAULT_SOCKET,
    add_serve_arguments,
    check_staging_fits,
    default_staging_bytes,
    from_args,
    memory_limit,
    parse_size,
)
from ckptd.errors import ConfigError


def parse(argv, env=None):
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return from_args(p.parse_args(argv), env or {})


def test_sizes():
    assert parse_size("16GiB") == 16 << 30
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("8GB") == 8 * 10**9
    assert parse_size("4096") == 4096
    assert parse_size("1.5GiB") == 3 << 29
    for bad in ("", "GiB", "12 parsecs", "-1"):
        with pytest.raises(ConfigError):
            parse_size(bad)


def test_defaults_env_and_flag_precedence():
    cfg = parse(["--storage", "file:///x"])
    assert cfg.socket == DEFAULT_SOCKET
    assert cfg.staging_bytes == default_staging_bytes(memory_limit())
    assert cfg.write_concurrency == 8 and cfg.metrics_port == 9400 and cfg.drain_timeout == 600
    env = {"CKPTD_STORAGE": "s3://b/p", "CKPTD_STAGING_BYTES": "16GiB",
           "CKPTD_WRITE_CONCURRENCY": "3", "CKPTD_KEEP_LAST": "5", "CKPTD_LOG_FORMAT": "json",
           "CKPTD_SOCKET": "/run/x/y.sock", "CKPTD_METRICS_PORT": "0"}
    cfg = parse([], env)
    assert (cfg.storage, cfg.staging_bytes, cfg.write_concurrency, cfg.keep_last,
            cfg.log_format, cfg.socket, cfg.metrics_port) == (
        "s3://b/p", 16 << 30, 3, 5, "json", "/run/x/y.sock", 0)
    cfg = parse(["--staging-bytes", "1GiB", "--write-concurrency", "2"], env)
    assert cfg.staging_bytes == 1 << 30 and cfg.write_concurrency == 2
    assert cfg.test_write_delay == 0 and cfg.test_write_gate is None
    cfg = parse([], dict(env, CKPTD_TEST_WRITE_DELAY="1.5", CKPTD_TEST_WRITE_GATE="/tmp/g"))
    assert cfg.test_write_delay == 1.5 and cfg.test_write_gate == "/tmp/g"


@pytest.mark.parametrize("argv,match", [
    ([], "storage"),
    (["--storage", "file:///x", "--listen", "0.0.0.0:7000"], "TLS"),
    (["--storage", "file:///x", "--listen", "nope", "--tls-cert", "c", "--tls-key", "k",
      "--token-file", "t"], "HOST:PORT"),
    (["--storage", "file:///x", "--socket", "relative.sock"], "absolute"),
    (["--storage", "file:///x", "--socket", "/" + "x" * 120], "too long"),
    (["--storage", "file:///x", "--staging-bytes", "1000"], "too small"),
    (["--storage", "file:///x", "--write-concurrency", "0"], "write-concurrency"),
    (["--storage", "file:///x", "--keep-last", "0"], "keep-last"),
])
def test_refusals(argv, match):
    with pytest.raises(ConfigError, match=match):
        parse(argv)


def test_bad_env_value_names_the_variable():
    with pytest.raises(ConfigError, match="CKPTD_WRITE_CONCURRENCY"):
        parse([], {"CKPTD_STORAGE": "file:///x", "CKPTD_WRITE_CONCURRENCY": "many"})


def test_bad_values_say_what_was_expected(capsys):
    """argparse shows the converter's message (not "invalid parse_size value"); nan/inf
    seconds and sizes are refused, from flags and from CKPTD_* variables alike."""
    for argv, want in ((["--staging-bytes", "-5"], "16GiB, 512MiB"),
                       (["--staging-bytes", "1e400"], "16GiB, 512MiB"),
                       (["--write-concurrency", "x"], "expected an integer, got 'x'"),
                       (["--drain-timeout", "nan"], "finite number of seconds"),
                       (["--storage-retry-s", "inf"], "finite number of seconds")):
        with pytest.raises(SystemExit):
            parse(["--storage", "file:///x", *argv])
        err = capsys.readouterr().err
        assert want in err, err
    with pytest.raises(ConfigError, match="CKPTD_DRAIN_TIMEOUT.*finite number of seconds"):
        parse([], {"CKPTD_STORAGE": "file:///x", "CKPTD_DRAIN_TIMEOUT": "nan"})


def test_default_budget_fits_small_nodes_and_explicit_budget_is_kept():
    # 8 GiB where memory allows it; half the memory on a smaller node or container, so
    # `ckptd serve` with its defaults starts there instead of refusing its own default
    assert default_staging_bytes(None) == 8 << 30
    assert default_staging_bytes(64 << 30) == 8 << 30
    assert default_staging_bytes(16 << 30) == 8 << 30
    assert default_staging_bytes(6 << 30) == 3 << 30
    limit = memory_limit()
    assert limit is not None
    cfg = parse(["--storage", "file:///x"])
    assert cfg.staging_bytes == min(8 << 30, limit // 2)
    check_staging_fits(cfg.staging_bytes)  # the default always passes the start-up check
    # a budget given on purpose is kept as given (and refused at start-up if too large)
    assert parse(["--storage", "file:///x", "--staging-bytes", "8GiB"]).staging_bytes == 8 << 30
    assert parse(["--storage", "file:///x"], {"CKPTD_STAGING_BYTES": "2GiB"}).staging_bytes \
        == 2 << 30


def test_staging_budget_beyond_memory_is_refused_at_startup(tmp_path):
    import subprocess
    import sys

    limit = memory_limit()
    assert limit is not None and limit > 0
    check_staging_fits(1 << 30, limit=2 << 30)
    with pytest.raises(ConfigError, match="more than the memory"):
        check_staging_fits(3 << 30, limit=2 << 30)
    out = subprocess.run(
        [sys.executable, "-m", "ckptd.cli", "serve", "--storage", f"file://{tmp_path}/s",
         "--socket", f"{tmp_path}/run/x.sock", "--metrics-port", "0",
         "--staging-bytes", str(limit + (1 << 30))], capture_output=True, text=True,
        timeout=60, check=False)
    assert out.returncode == 2 and "more than the memory" in out.stderr, out.stderr
    assert not os.path.exists(f"{tmp_path}/run/x.sock")


def test_local_storage_the_daemon_cannot_write_is_refused_at_startup(tmp_path):
    import subprocess
    import sys

    (tmp_path / "afile").write_text("not a directory")
    for storage, why in ((f"file://{tmp_path}/afile/ckpt", "Not a directory"),
                         ("file:///proc/ckptd-storage", "No such file or directory")):
        out = subprocess.run(
            [sys.executable, "-m", "ckptd.cli", "serve", "--storage", storage,
             "--socket", f"{tmp_path}/run/x.sock", "--metrics-port", "0"],
            capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 2, out.stderr
        assert f"--storage {storage}: the daemon cannot write there ({why})" in out.stderr
        assert "Traceback" not in out.stderr
        assert not (tmp_path / "run" / "x.sock").exists()
    # a missing directory is created, and nothing of the probe is left in it
    from ckptd.daemon.testing import start_daemon

    with start_daemon(f"file://{tmp_path}/new/ckpt", str(tmp_path / "run2" / "d.sock")):
        assert os.listdir(tmp_path / "new" / "ckpt") == []


def test_a_socket_in_a_shared_directory_is_refused_and_the_directory_left_alone(tmp_path):
    """`ckptd serve --socket /tmp/ckptd.sock`: the directory is /tmp, which the daemon (as its
    owner, e.g. root) tightened to 1750, locking every other user out of /tmp."""
    from ckptd.daemon.server import prepare_socket_dir

    shared = tmp_path / "tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    with pytest.raises(ConfigError, match=r"shared directory \(mode 1777.*own, e.g. --socket "
                                          rf"{shared}/ckptd/ckptd.sock"):
        prepare_socket_dir(str(shared / "ckptd.sock"), None)
    assert os.stat(shared).st_mode & 0o7777 == 0o1777
    prepare_socket_dir(str(shared / "ckptd" / "ckptd.sock"), None)  # what the error suggests
    assert os.stat(shared / "ckptd").st_mode & 0o7777 == 0o750
