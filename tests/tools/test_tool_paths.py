"""Where the tools read and write: the URI/JOB forms the storage layer accepts, and outputs
that would land inside a checkpoint job (one process, a synthetic checkpoint)."""

from __future__ import annotations

import os

import pytest
from synth import write_step

from ckptd.cli import main
from ckptd.errors import ConfigError
from ckptd.storage import open_storage
from ckptd.tools.common import split_job_uri


def test_job_uris_take_the_forms_open_storage_takes(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert split_job_uri("file:/ckpt/job") == ("file:///ckpt", "job")  # RFC 8089 short form
    assert split_job_uri("~/ckpt/job") == (f"{tmp_path}/ckpt", "job")
    assert split_job_uri("./a:b/job") == (f"{tmp_path}/a:b", "job")
    for typo in ("s3:/bucket/job", "s3:bucket/job", "file:/"):
        with pytest.raises(ConfigError, match="looks like a URI with scheme"):
            split_job_uri(typo)
    with pytest.raises(ConfigError, match="names no bucket"):
        split_job_uri("s3://")
    with pytest.raises(ConfigError, match="has no job name"):
        split_job_uri("file:///")
    # a mistyped --out writes nothing into the working directory
    storage = open_storage(str(tmp_path / "ckpt"))
    write_step(storage, "job", 5, "att", world=2)
    assert main(["reshard", "~/ckpt/job", "--to-world-size", "3", "--out",
                 "s3:/bucket/out"]) == 2
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert main(["inspect", f"file:{tmp_path}/ckpt/job"]) == 0


def test_ls_of_the_filesystem_root_names_it(capsys):
    assert main(["ls", "/"]) in (0, 2)
    assert "got ''" not in capsys.readouterr().err


def test_outputs_inside_a_job_directory_are_refused(tmp_path, capsys):
    storage = open_storage(str(tmp_path))
    write_step(storage, "job", 5, "att", world=2)
    before = sorted(os.walk(tmp_path))
    step_dir = tmp_path / "job" / "000000000005"
    cases = [
        # gc would delete a file in a step directory as a leftover attempt
        (["export", f"{tmp_path}/job", "--format", "safetensors", "--out",
          str(step_dir / "model.safetensors")], "inside the checkpoint directory"),
        (["export", f"{tmp_path}/job", "--format", "safetensors", "--out",
          str(tmp_path / "job" / "model.safetensors")], "inside the checkpoint directory"),
        # a job inside another job: not listed by ls, deleted with the outer one
        (["reshard", f"{tmp_path}/job", "--to-world-size", "3", "--out",
          f"file://{tmp_path}/job/w3"], "are nested"),
        (["reshard", f"{tmp_path}/job", "--to-world-size", "3", "--out",
          f"{step_dir}/w3"], "are nested"),
    ]
    cases.append((["export", f"{tmp_path}/job", "--format", "torch", "--out",
                   str(tmp_path / "nosuch" / "model.pt")], "create it or choose another --out"))
    for argv, msg in cases:
        capsys.readouterr()
        assert main(argv) == 2, argv
        assert msg in capsys.readouterr().err, argv
    assert sorted(os.walk(tmp_path)) == before
    assert main(["reshard", f"{tmp_path}/job", "--to-world-size", "3", "--out",
                 f"{tmp_path}/job-w3"]) == 0
    assert main(["export", f"{tmp_path}/job-w3", "--format", "safetensors", "--out",
                 str(tmp_path / "job-w3.safetensors")]) == 0


def test_an_output_that_cannot_be_written_is_a_ckptd_error(tmp_path, capsys):
    storage = open_storage(str(tmp_path))
    write_step(storage, "job", 5, "att", world=2)
    out = tmp_path / ("x" * 250 + ".safetensors")  # longer than a file name may be
    capsys.readouterr()
    assert main(["export", f"{tmp_path}/job", "--format", "safetensors", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"writing {out} failed" in err and "choose another --out" in err
    assert sorted(os.listdir(tmp_path)) == ["job"]
