"""The embedding lookup kernel (``kernels/embedding.py``): bitwise equal to ``index_select``
for in-range ids, zero rows for ids out of range, on the CPU interpreter and on the GPU
(eagerly and replayed from a captured graph with new ids)."""
from __future__ import annotations

import pytest
import torch

from graphrt.kernels.embedding import embedding_rows, embedding_rows_ref


def _table(vocab, hidden, dtype=torch.bfloat16, device="cpu"):
    g = torch.Generator(device=device).manual_seed(vocab + hidden)
    return torch.randn(vocab, hidden, generator=g, device=device).to(dtype)


@pytest.mark.parametrize("hidden", [64, 200, 2500])     # one chunk, ragged, three chunks
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_rows_equal_index_select(hidden, id_dtype):
    table = _table(50, hidden)
    ids = torch.tensor([3, 0, 49, 3, 17], dtype=id_dtype)
    out = torch.full((5, hidden), float("nan"), dtype=table.dtype)
    assert embedding_rows(table, ids, out=out) is out
    assert torch.equal(out, table.index_select(0, ids))


def test_out_of_range_ids_give_zero_rows_and_read_nothing():
    table = _table(10, 96, dtype=torch.float32)
    ids = torch.tensor([-1, 10, 2, 1 << 40])
    out = torch.full((4, 96), float("nan"))
    embedding_rows(table, ids, out=out)
    assert torch.equal(out, embedding_rows_ref(table, ids))
    assert torch.equal(out[2], table[2]) and not out[[0, 1, 3]].any()


def test_strided_table_and_out_rows():
    table = _table(20, 256)[:, :128]                   # row stride 256, last dim contiguous
    ids = torch.tensor([5, 19])
    out = torch.zeros(2, 300, dtype=table.dtype)[:, :128]
    embedding_rows(table, ids, out=out)
    assert torch.equal(out, table[ids])


def test_errors_say_what_came():
    table = _table(8, 32)
    with pytest.raises(ValueError, match="ids.dtype"):
        embedding_rows(table, torch.zeros(2), out=torch.empty(2, 32, dtype=table.dtype))
    with pytest.raises(ValueError, match="out.shape"):
        embedding_rows(table, torch.zeros(2, dtype=torch.long), out=torch.empty(3, 32, dtype=table.dtype))
    with pytest.raises(ValueError, match="out.dtype"):
        embedding_rows(table, torch.zeros(2, dtype=torch.long), out=torch.empty(2, 32))
    empty = torch.empty(0, 32, dtype=table.dtype)
    assert embedding_rows(table, torch.zeros(0, dtype=torch.long), out=empty) is empty


@pytest.mark.gpu
@pytest.mark.parametrize("rows, hidden", [(1, 2048), (16, 2048), (8, 7168)])
def test_gpu_graph_replay_follows_new_ids(cuda_device, rows, hidden):
    dev = cuda_device
    table = _table(32768, hidden, device=dev)
    ids = torch.zeros(rows, dtype=torch.long, device=dev)
    out = torch.full((rows, hidden), float("nan"), dtype=table.dtype, device=dev)
    g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        embedding_rows(table, ids, out=out)
    torch.cuda.current_stream(dev).wait_stream(s)
    gen = torch.Generator(device=dev).manual_seed(rows)
    for _ in range(3):
        new = torch.randint(0, 32768, (rows,), generator=gen, device=dev)
        new[0] = -5                                       # one out-of-range id
        ids.copy_(new)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize(dev)
        assert torch.equal(out, embedding_rows_ref(table, new))


def test_the_reference_model_step_is_the_same_with_the_kernel(monkeypatch):
    """``MoEModel.embed_kernel``: the step's logits bitwise equal to index_select's."""
    from graphrt.moe import make_step, model as model_mod, preset
    logits = []
    for on in (False, True):
        monkeypatch.setattr(model_mod.MoEModel, "embed_kernel", on)
        spec, model = make_step(preset("tiny"), "cpu", max_batch_size=4, backend="triton")
        x = model.example_inputs(3, "cpu", torch.Generator().manual_seed(3))
        logits.append(spec.call(x)["logits"])
    assert torch.equal(logits[0], logits[1])
