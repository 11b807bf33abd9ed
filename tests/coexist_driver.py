"""Driver of the torch.compile coexistence test (tests/test_coexist_gpu.py): graphrt's
graphs, a hand-captured CUDA graph and a ``torch.compile(mode="reduce-overhead")`` model
(cudagraph trees) in one process; the compiled model records graphs for new shapes after
graphrt captured. Every graphrt replay and every hand-graph replay is compared bitwise with
eager on the same padded inputs after each new compiled shape.

    python -m tests.coexist_driver [--variant shipped|old|stream-only|clear-only] [--dtype float32|bfloat16]

``old`` reproduces the capture that crashed (analysis and warm-up on the capture stream,
cuBLAS workspaces kept); ``stream-only`` and ``clear-only`` apply one half of the fix.
Prints one JSON line; a crash surfaces as a non-zero exit of this process.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

import graphrt


def _step(dtype, device, hidden=1024, inter=4096):
    g = torch.Generator(device="cpu").manual_seed(0)
    w1 = (torch.randn(inter, hidden, generator=g) / hidden ** 0.5).to(device, dtype)
    b1 = torch.randn(inter, generator=g).to(device, dtype)
    w2 = (torch.randn(hidden, inter, generator=g) / inter ** 0.5).to(device, dtype)
    b2 = torch.randn(hidden, generator=g).to(device, dtype)
    ws = (torch.randn(hidden, hidden, generator=g) / hidden ** 0.5).to(device, dtype)
    side = torch.cuda.Stream(device)

    def step(x, n):
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):                      # a side-stream GEMM, joined below
            s = x @ ws
        h = torch.nn.functional.gelu(torch.nn.functional.linear(x, w1, b1))   # cuBLASLt (bias)
        y = torch.nn.functional.linear(h, w2, b2)
        main.wait_stream(side)
        return {"y": y + s}

    return graphrt.StepSpec(step, {"x": graphrt.Input((None, hidden), dtype)}, 128, live_count="n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default="shipped", choices=("shipped", "old", "stream-only", "clear-only"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda", 0)
    from graphrt.capture import manager
    if args.variant in ("old", "stream-only"):
        manager._clear_cublas_workspaces = lambda: None   # keep warm-up workspaces (graphrt only)
    kw = {}
    if args.variant in ("old", "clear-only"):
        s = torch.cuda.Stream(device)
        kw = dict(capture_stream=s)
        orig = manager.CaptureManager.__init__

        def init(self, *a, **k):
            orig(self, *a, **k)
            self.warmup_stream = s
        manager.CaptureManager.__init__ = init
    spec = _step(dtype, device)
    rt = graphrt.GraphRuntime(spec, progress=False, **kw).capture()
    rt.check_replay(trials=1)

    # A hand-captured graph (the PyTorch recipe: warm up on a side stream, capture on the
    # default capture stream of torch.cuda.graph).
    mlp = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).to(device, dtype)
    hx = torch.randn(32, 512, device=device, dtype=dtype)
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        for _ in range(3):
            mlp(hx)
    torch.cuda.current_stream().wait_stream(s)
    hand = torch.cuda.CUDAGraph()
    with torch.cuda.graph(hand), torch.no_grad():
        hy = mlp(hx)

    compiled_model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                         torch.nn.Linear(4096, 1024)).to(device, dtype)
    compiled = torch.compile(compiled_model, mode="reduce-overhead")
    gen = torch.Generator().manual_seed(7)
    checked = 0
    corrupted = 0
    for rows in (1, 13, 32, 5, 77):
        with torch.no_grad():
            for _ in range(3):                              # record (and replay) a new shape
                compiled(torch.randn(rows, 1024, device=device, dtype=dtype))
        torch.cuda.synchronize()
        # Whatever the recording freed (cuBLAS workspaces among it) is handed out again:
        # sentinels of the usual workspace sizes take it, and must survive graphrt's replays.
        sentinels = [torch.full((mib << 20,), 0x5A, dtype=torch.uint8, device=device)
                     for mib in (1, 2, 4, 8, 9, 16, 32, 64) for _ in range(4)]
        for n in (1, 3, 13, 50, 128):
            x = graphrt.Input((None, 1024), dtype).random(n, device, gen)
            out = rt.run(x=x)["y"]
            want = spec.call_padded({"x": x}, rt.table.pick(n))["y"]
            if not torch.equal(out, want):
                print(json.dumps({"variant": args.variant, "ok": False, "rows": rows, "n": n,
                                  "max_abs": float((out.float() - want.float()).abs().max())}))
                return 1
            checked += 1
        torch.cuda.synchronize()
        corrupted += sum(int((t != 0x5A).any()) for t in sentinels)
        del sentinels
        torch.cuda.empty_cache()                            # and what is free goes back to the driver
        hx.copy_(torch.randn(32, 512, device=device, dtype=dtype))
        hand.replay()
        with torch.no_grad():
            if not torch.equal(hy, mlp(hx)):
                print(json.dumps({"variant": args.variant, "ok": False, "hand_graph": rows}))
                return 1
    torch.cuda.synchronize()
    print(json.dumps({"variant": args.variant, "dtype": args.dtype, "ok": corrupted == 0,
                      "graphrt_replays_checked": checked, "compiled_shapes": 5,
                      "sentinels_corrupted": corrupted}))
    return 0 if corrupted == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
