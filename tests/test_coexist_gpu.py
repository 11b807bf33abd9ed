"""graphrt's graphs survive a torch.compile(mode="reduce-overhead") model that records new
shapes in the same process (cudagraph trees free every cuBLAS workspace before recording),
next to a hand-captured graph; replays stay bitwise equal to eager. Each run is its own
process (tests/coexist_driver.py), so a crash of the CUDA context fails one test only."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphrt_replays_stay_exact_beside_a_compiled_model(dtype):
    proc = subprocess.run([sys.executable, "-m", "tests.coexist_driver", "--dtype", dtype],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["graphrt_replays_checked"] == 25 and result["sentinels_corrupted"] == 0
