"""``graphrt.testing.launch.spawn`` on CPU processes (its ``setup`` replaced: no GPU, no NCCL):
results in rank order, a rank that raises reported with its own error while a peer that
waits for it is killed after the grace period (not after the whole timeout), and a rank
that dies without reporting named with its exit code. Marked ``slow``: each case starts
processes that import torch."""
import glob
import tempfile
import time

import pytest

from graphrt.errors import GraphrtError
from graphrt.testing.launch import first_failure, spawn
from tests.fakes import ranks

pytestmark = pytest.mark.slow


def _leftover():
    return set(glob.glob(f"{tempfile.gettempdir()}/graphrt-ranks-*"))


def test_every_rank_reports_in_rank_order():
    before = _leftover()
    res = spawn(ranks.fine, 2, setup=ranks.no_setup, timeout_s=120)
    assert [(r["rank"], r["ok"], r["value"]) for r in res] == [(0, True, 0), (1, True, 10)]
    assert first_failure(res) is None and _leftover() <= before


def test_a_rank_that_raises_is_reported_and_its_waiting_peer_killed():
    t0 = time.monotonic()
    res = spawn(ranks.raises_and_peer_waits, 2, setup=ranks.no_setup, timeout_s=120, grace_s=2)
    assert time.monotonic() - t0 < 50                       # not the peer's 60-s wait
    assert res[1]["ok"] is False and res[1]["error"] == "RuntimeError: the real error on rank 1"
    assert "Traceback" in res[1]["traceback"]
    assert res[0]["ok"] is False and res[0]["killed"] is True
    assert first_failure(res) is res[1]                     # the cause, not the killed peer


def test_a_rank_that_dies_without_reporting_is_named():
    t0 = time.monotonic()
    res = spawn(ranks.dies, 2, setup=ranks.no_setup, timeout_s=120)
    assert time.monotonic() - t0 < 50
    assert res[1]["ok"] is False and "exit code 3" in res[1]["error"]
    assert res[0]["ok"] is False and res[0].get("killed")
    assert first_failure(res) is res[1]


def test_a_rank_that_exits_with_status_0_without_reporting_is_named():
    """os._exit(0) on one rank stalled spawn until timeout_s, then RanksTimeout said no rank
    failed (only a non-zero exit counted as a death)."""
    t0 = time.monotonic()
    res = spawn(ranks.exits_zero, 2, setup=ranks.no_setup, timeout_s=30, grace_s=2)
    assert time.monotonic() - t0 < 20                       # grace_s after it, not timeout_s
    assert res[1]["ok"] is False
    assert res[1]["error"].startswith("the rank died without reporting (exit code 0)")
    assert res[0]["ok"] is False and res[0]["killed"] is True
    assert first_failure(res) is res[1]


def test_a_result_json_cannot_encode_is_a_failure_of_that_rank_alone():
    """json.dump raised TypeError inside _entry's finally (tuple keys): torch's spawn error
    replaced every rank's result."""
    res = spawn(ranks.unencodable, 2, setup=ranks.no_setup, timeout_s=120)
    assert (res[0]["rank"], res[0]["ok"], res[0]["value"]) == (0, True, 0)
    assert res[1]["rank"] == 1 and res[1]["ok"] is False
    assert res[1]["error"].startswith("result not JSON-encodable (TypeError: keys must be"), res[1]
    assert first_failure(res) is res[1]


def test_ranks_killed_at_the_timeout_are_reaped(tmp_path, monkeypatch):
    """Killed ranks were never joined and stayed zombies of the caller."""
    monkeypatch.setenv("GRAPHRT_TEST_PID_DIR", str(tmp_path))
    with pytest.raises(TimeoutError, match="did not finish within 25 s") as info:
        spawn(ranks.hangs_after_pid, 2, setup=ranks.no_setup, timeout_s=25)
    assert isinstance(info.value, GraphrtError)  # a graphrt error, as every deliberate one
    pids = [int((tmp_path / str(r)).read_text()) for r in range(2)]

    def state(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split()[2]
        except OSError:
            return "gone"
    assert {state(p) for p in pids} == {"gone"}, {p: state(p) for p in pids}


@pytest.mark.parametrize("world,err", [(0, "InputError"), (-2, "InputError"),
                                       (2.0, "InputTypeError")])
def test_spawn_of_no_ranks_is_refused(world, err):
    """spawn(fn, 0) returned [] (no rank failed: it read as success)."""
    from graphrt import errors
    before = _leftover()
    with pytest.raises(getattr(errors, err), match="spawn: world must be an int >= 1"):
        spawn(ranks.fine, world, setup=ranks.no_setup, timeout_s=30)
    assert _leftover() <= before                            # nothing started, nothing left


def test_make_comm_forwards_or_refuses_keywords_and_num_experts():
    """local/nccl dropped **kw silently (make_comm('local', ..., fp8=True) built a bf16
    comm) and num_experts=0 became cfg.num_experts."""
    from types import SimpleNamespace

    from graphrt.errors import InputError, InputTypeError
    from graphrt.testing.launch import make_comm
    cfg = SimpleNamespace(num_experts=8, hidden=64, num_topk=2)
    comm = make_comm("local", cfg, "cpu", 16, cap_align=16)
    assert (comm.num_experts, comm.cap_align, comm.max_tokens) == (8, 16, 16)
    assert make_comm("local", cfg, "cpu", 16, num_experts=12).num_experts == 12
    with pytest.raises(InputTypeError, match=r"make_comm\('local'\): LocalComm takes no keyword 'fp8'"):
        make_comm("local", cfg, "cpu", 16, fp8=True)
    with pytest.raises(InputTypeError, match=r"NCCLComm takes no keyword 'cap_align'"):
        make_comm("nccl", cfg, "cpu", 16, cap_align=16)      # refused before any collective
    with pytest.raises(InputError, match="num_experts must be an int >= 1 .*got 0"):
        make_comm("local", cfg, "cpu", 16, num_experts=0)
    for name in ("x", "deepep_event", "deepepevent", "deepep-"):   # the last three built
        with pytest.raises(InputError, match=f"unknown comm '{name}'"):  # hook mode or mode ''
            make_comm(name, cfg, "cpu", 16)
