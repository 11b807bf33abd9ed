"""CPU tests of cross-rank agreement (two processes over gloo): the agreed batch is the
largest live batch, the debug check names both ranks' sizes on a mismatch, and a rank that
never arrives becomes a timeout error instead of a hang."""
import os
import tempfile

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from graphrt.testing.launch import free_port


def _worker(rank, world, port, out_dir, scenario):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from graphrt.coordinator import RankCoordinator, RankMismatch
    result = "ok"
    try:
        if scenario == "agree":
            co = RankCoordinator(uniform=True, debug_check=True, group=dist.group.WORLD)
            agreed = co.agree_batch([3, 17][rank])
            co.check_replay(24, "graph")                 # same size everywhere: fine
            result = f"agreed={agreed}"
        elif scenario == "mismatch":
            co = RankCoordinator(uniform=True, debug_check=True, group=dist.group.WORLD)
            try:
                co.check_replay([8, 16][rank], "graph")
            except RankMismatch as e:
                result = f"mismatch: {e}"
        elif scenario == "per-rank":
            co = RankCoordinator(uniform=False, debug_check=True, group=dist.group.WORLD)
            co.check_replay([8, 16][rank], "graph")      # DeepEP-style: sizes may differ
            result = f"agreed={co.agree_batch([3, 17][rank])}"
        elif scenario == "own-group":
            from graphrt.errors import GraphrtError
            try:
                RankCoordinator(uniform=True, timeout_s=2, group=dist.group.WORLD)
                result = "accepted timeout_s with group="
            except GraphrtError as e:
                result = f"refused: {e}"
            before = len(dist.distributed_c10d._world.pg_map)
            for _ in range(3):
                co = RankCoordinator(uniform=True)
                agreed = co.agree_batch(rank + 1)
                co.close()
                co.close()  # idempotent
            try:
                co.agree_batch(1)  # closed: not the default group instead
                result += " | closed coordinator ran"
            except GraphrtError as e:
                result += f" | {e}"
            passed_in = RankCoordinator(uniform=True, group=dist.group.WORLD)
            passed_in.close()  # not its group: left alone
            dist.barrier()
            result += f" | groups {before}->{len(dist.distributed_c10d._world.pg_map)} agreed={agreed}"
        elif scenario == "bad-timeout":
            from graphrt.errors import InputError
            try:
                RankCoordinator(uniform=True, timeout_s=-1)
                result = "accepted timeout_s=-1"
            except InputError as e:
                result = f"refused: {e}"
            co = RankCoordinator(uniform=True, timeout_s=30)   # the next good call works
            result += f" | agreed={co.agree_batch(rank + 1)}"
            co.close()
        elif scenario == "subgroup":  # EP groups {0} and {1}: each coordinator over its own
            from graphrt.errors import InputError
            groups = [dist.new_group([0], backend="gloo"), dist.new_group([1], backend="gloo")]
            co = RankCoordinator(uniform=True, debug_check=True, group=groups[rank])
            result = f"rank={co.rank} world={co.world} agreed={co.agree_batch(8 + rank)}"
            co.check_replay(8 + rank, "graph")           # alone in its group: nobody to wait for
            co.world += 1                                # a wrong tensor count: gloo refuses it
            try:
                co.check_replay(8, "graph")
                result += " | wrong count accepted"
            except RankMismatch as e:
                result += f" | an argument error reported as a missing rank: {e}"
            except RuntimeError as e:
                result += f" | argument error raised as is ({type(e).__name__})"
            try:
                RankCoordinator(uniform=True, group=groups[1 - rank])
                result += " | non-member group accepted"
            except InputError as e:
                result += f" | {e}"
        elif scenario == "late-rank":  # rank 1 loads its weights slower than timeout_s
            import time
            from datetime import timedelta

            import torch
            from torch.distributed import distributed_c10d
            if rank == 1:
                time.sleep(3)
            co = RankCoordinator(uniform=True, timeout_s=1)
            gloo = co.group._get_backend(torch.device("cpu"))
            result = f"agreed={co.agree_batch(rank + 1)} timeout={gloo.options._timeout}"
            co.close()
            setter = distributed_c10d._set_pg_timeout
            del distributed_c10d._set_pg_timeout    # a torch without it: the group's own
            try:
                co = RankCoordinator(uniform=True, timeout_s=20)
            finally:
                distributed_c10d._set_pg_timeout = setter
            timeout = co.group._get_backend(torch.device("cpu")).options._timeout
            result += f" | without _set_pg_timeout: {timeout == timedelta(seconds=20)}"
            co.close()
        elif scenario == "missing":
            co = RankCoordinator(uniform=True, debug_check=True, timeout_s=3)
            if rank == 0:
                try:
                    co.check_replay(8, "graph")          # rank 1 never arrives
                except RankMismatch as e:
                    result = f"timeout: {e}"
            else:
                import time
                time.sleep(8)
    finally:
        with open(os.path.join(out_dir, f"{rank}.txt"), "w") as f:
            f.write(result)
        if scenario != "missing":
            dist.barrier()  # nobody leaves while a peer still talks to it (gloo aborts then)
        dist.destroy_process_group()


def _run(scenario):
    out = tempfile.mkdtemp()
    mp.start_processes(_worker, args=(2, free_port(), out, scenario), nprocs=2, join=True,
                       start_method="spawn")
    return [open(os.path.join(out, f"{r}.txt")).read() for r in range(2)]


@pytest.mark.slow
def test_agree_batch_is_the_largest_live_batch():
    assert _run("agree") == ["agreed=17", "agreed=17"]


@pytest.mark.slow
def test_mismatch_names_both_ranks_sizes():
    r0, r1 = _run("mismatch")
    assert "rank 0 is about to run a graph step of batch 8 but rank 1 a graph step of batch 16" in r0
    assert "rank 1 is about to run a graph step of batch 16 but rank 0 a graph step of batch 8" in r1


@pytest.mark.slow
def test_per_rank_backends_need_no_agreement():
    assert _run("per-rank") == ["agreed=3", "agreed=17"]


@pytest.mark.slow
def test_a_subgroup_coordinator_takes_rank_and_world_from_its_group():
    """group=subgroup took rank/world from WORLD: check_replay gathered WORLD's count of
    tensors over the subgroup and gloo's argument error came back as "not every rank reached
    this step's replay check" (a RankMismatch). Now rank/world are the group's, a gloo
    argument error is raised as is, and a group without this rank is refused."""
    for rank, r in enumerate(_run("subgroup")):
        assert r.startswith(f"rank=0 world=1 agreed={8 + rank} | argument error raised as is "
                            "(RuntimeError) | RankCoordinator: this process (rank "
                            f"{rank} of WORLD) is not a member of the group="), r


@pytest.mark.slow
def test_missing_rank_is_a_timeout_not_a_hang():
    r0, _ = _run("missing")
    assert r0.startswith("timeout: rank 0: not every rank reached")


@pytest.mark.slow
def test_a_rank_reaching_the_constructor_late_is_waited_for():
    """``timeout_s`` was also the group creation's timeout: a rank reaching the constructor
    more than ``timeout_s`` after its peer (slower weight loading) failed it on both ranks
    (DistStoreError, Broken pipe). Creation now waits long; collectives wait ``timeout_s``."""
    for r in _run("late-rank"):
        assert r == "agreed=2 timeout=0:00:01 | without _set_pg_timeout: True", r


@pytest.mark.slow
def test_timeout_with_a_passed_group_is_refused_and_close_frees_the_group():
    """``timeout_s`` was silently ignored with ``group=``; each coordinator's own gloo group
    stayed until the process ended (no ``close()``)."""
    for r in _run("own-group"):
        assert r.startswith("refused: RankCoordinator: timeout_s applies"), r
        assert "| RankCoordinator is closed: make a new one |" in r, r
        assert r.endswith("groups 1->1 agreed=2"), r


@pytest.mark.slow
def test_a_timeout_that_is_not_positive_is_an_input_error_before_any_collective():
    """``timeout_s=-1`` reached gloo, which raised a bare ``RuntimeError``."""
    for r in _run("bad-timeout"):
        assert r.startswith("refused: RankCoordinator timeout_s: expected a finite number"), r
        assert r.endswith("| agreed=2"), r


@pytest.mark.parametrize("timeout_s", [-1, 0, float("nan"), float("inf"), "5", True])
def test_a_bad_timeout_is_refused_as_an_argument(timeout_s):
    from graphrt.coordinator import RankCoordinator
    from graphrt.errors import InputError
    with pytest.raises(InputError, match="timeout_s: expected a finite number of seconds > 0"):
        RankCoordinator(uniform=True, timeout_s=timeout_s)   # no process group needed


@pytest.mark.parametrize("timeout_s", [0.0004, 1e10, 1e14])
def test_a_timeout_gloo_cannot_hold_is_refused_as_an_argument(timeout_s):
    """Below 1 ms gloo's timeout became 0 ms (every collective failed at once, the
    constructor too); 1e10 s overflowed gloo's deadline (an immediate timeout); 1e14 s
    raised OverflowError from timedelta."""
    from graphrt.coordinator import RankCoordinator
    from graphrt.errors import InputError
    with pytest.raises(InputError, match=r"timeout_s: expected 0.001 to 604800 seconds .*got "):
        RankCoordinator(uniform=True, timeout_s=timeout_s)   # no process group needed
