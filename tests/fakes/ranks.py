"""Rank functions for ``graphrt.testing.launch.spawn`` on CPU (``tests/test_launch.py``):
module-level so spawned processes unpickle them by reference. ``no_setup`` stands in for
``launch.init`` (no GPU, no NCCL here)."""
import os
import time


def no_setup(rank, world, port):
    pass


def fine(rank, world):
    return {"value": rank * 10}


def dies(rank, world):
    """Rank 1 dies without reporting (as a segfault or an OOM kill would)."""
    if rank == 1:
        os._exit(3)
    time.sleep(60)                      # rank 0 would wait for it in a collective
    return {"value": 0}


def exits_zero(rank, world):
    """Rank 1 leaves with status 0 without reporting (``os._exit(0)``, as a library's exit
    path may); rank 0 waits for it as in a collective."""
    if rank == 1:
        os._exit(0)
    time.sleep(60)
    return {"value": 0}


def unencodable(rank, world):
    """Rank 1 returns what json cannot encode (a dict keyed by ``(size, n)`` tuples)."""
    return {"per_size": {(8, 3): 1.5}} if rank == 1 else {"value": rank}


def raises_and_peer_waits(rank, world):
    """Rank 1 raises; rank 0 blocks as it would in a collective with rank 1."""
    if rank == 1:
        raise RuntimeError("the real error on rank 1")
    time.sleep(60)
    return {"value": 0}


def hangs_after_pid(rank, world):
    """Writes its pid to ``$GRAPHRT_TEST_PID_DIR/<rank>``, then hangs past any timeout."""
    with open(os.path.join(os.environ["GRAPHRT_TEST_PID_DIR"], str(rank)), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)
