"""FSDP2 through real daemons: save at world 2 (one daemon; two daemons with the ranks split),
load at world 3 through a daemon and from storage directly -- bit-exact; backpressure
(skip/error) decided by all ranks together."""

from __future__ import annotations

import pytest
from daemon_helpers import backpressure_ranks_rank, load_rank, save_rank
from distributed import run_world


@pytest.mark.slow
def test_fsdp2_save_2_load_3_one_and_two_daemons(tmp_path, daemons):
    root = str(tmp_path)
    a = daemons.start()
    b = daemons.start()
    run_world(save_rank, 2, root, "one-daemon", [a.address], 3)
    run_world(save_rank, 2, root, "two-daemons", [a.address, b.address], 3)
    assert "committed" in a.log() and "committed" in b.log()
    run_world(load_rank, 3, root, ["one-daemon", "two-daemons"],
              [b.address, f"file://{root}/store"])
    # every daemon is still healthy after all of that
    assert a.alive() and b.alive()


@pytest.mark.slow
def test_backpressure_skip_and_error_are_decided_by_all_ranks(tmp_path, daemons):
    """One rank without free staging makes every rank skip (or raise): a step handed over
    by some ranks only would wait commit_timeout for the others and never commit."""
    d = daemons.start()
    run_world(backpressure_ranks_rank, 2, str(tmp_path), d.address)
