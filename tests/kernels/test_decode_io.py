"""The decode step's row unpacking and greedy sampling (CPU interpreter): ``greedy_sample``
equals ``torch.argmax`` index for index (ties: the first index; -inf, an all -inf row, NaN,
vocab not a multiple of the chunk), writes ``out_sampled[:bs]`` only; ``unpack_rows`` equals
its torch reference on padded and out-of-range rows; both refuse bad arguments and run as
``torch.ops.graphrt`` custom ops."""
from __future__ import annotations

import pytest
import torch

import graphrt.kernels.ops as gops
from graphrt.kernels.decode_io import (MAX_VOCAB_BLOCK, greedy_sample, greedy_sample_ref,
                                       unpack_rows, unpack_rows_ref)

NAN, INF = float("nan"), float("inf")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
OPS = torch.ops.graphrt


# -------------------------------------------------------------------------- greedy_sample
def _sample(logits, out_sampled=None):
    ids = torch.full((logits.shape[0],), -5, dtype=torch.int64)   # poisoned
    assert greedy_sample(logits, out_ids=ids, out_sampled=out_sampled) is ids
    return ids


def _logits(bs, vocab, dtype, seed):
    """Random logits, then per row a deliberate case: a tie for the maximum (the first index
    must win), ties in the same lane of different chunks, -inf masks, an all -inf row, NaN."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(bs, vocab, generator=g) * 4).to(dtype)
    for r in range(bs):
        case, a = r % 5, int(torch.randint(0, vocab // 2, (1,), generator=g))
        b = int(torch.randint(a + 1, vocab, (1,), generator=g))
        if case == 0:                                  # two equal maxima: a wins
            x[r, a] = x[r, b] = 100
        elif case == 1:                                # -inf mask, two equal survivors: b first
            x[r, :] = -INF
            x[r, b] = x[r, vocab - 1] = -3
        elif case == 2:                                # fully masked: index 0
            x[r, :] = -INF
        elif case == 3:                                # NaN after a larger value: the NaN wins
            x[r, a], x[r, b] = 1000, NAN
        else:                                          # two NaNs: the first wins
            x[r, a] = x[r, b] = NAN
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs", [1, 3, 8])
@pytest.mark.parametrize("vocab", [1000, 5003])        # not multiples of the chunk
def test_greedy_sample_equals_torch_argmax(dtype, bs, vocab):
    for seed in range(3):
        x = _logits(bs, vocab, dtype, seed + 10 * bs)
        assert torch.equal(_sample(x), greedy_sample_ref(x)), (seed, x.argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_sample_hand_cases(dtype):
    B = MAX_VOCAB_BLOCK
    vocab = B + 907
    rows = {                                           # row -> (values to place, expected id)
        "same lane, later chunk ties": ({5: 9, 5 + B: 9}, 5),
        "same lane, later chunk wins": ({5: 9, 5 + B: 10}, 5 + B),
        "other lanes tie": ({B + 3: 9, 7: 9, B + 1: 9}, 7),
        "-0.0 and +0.0 tie": ({11: -0.0, B + 2: 0.0, B + 11: 0.0}, 11),
        "+inf beats all": ({3: INF, B + 1: INF, 2: 1e4}, 3),
        "NaN beats +inf": ({3: INF, B + 9: NAN}, B + 9),
        "NaN in the last chunk's tail": ({vocab - 1: NAN}, vocab - 1),
        "max at the last index": ({vocab - 1: 77}, vocab - 1),
    }
    x = torch.full((len(rows), vocab), -INF, dtype=dtype)
    x[:, 1::2] = -2.0                                  # finite but low everywhere else
    want = []
    for r, (vals, idx) in enumerate(rows.values()):
        for i, v in vals.items():
            x[r, i] = v
        want.append(idx)
    got = _sample(x)
    assert got.tolist() == want == greedy_sample_ref(x).tolist(), dict(zip(rows, got.tolist()))


def test_greedy_sample_small_vocab_and_strided_rows():
    base = torch.randn(4, 70).to(torch.bfloat16)
    x = base[:, 3:53]                                  # row stride 70, vocab 50 (< one chunk)
    x[1, 10] = x[1, 40] = 9
    assert torch.equal(_sample(x), torch.argmax(x, dim=-1))
    one = torch.randn(3, 1)                            # vocab 1: always 0
    assert _sample(one).tolist() == [0, 0, 0]


def test_greedy_sample_writes_out_sampled_only_in_its_first_rows():
    x = _logits(3, 1000, torch.bfloat16, seed=7)
    sampled = torch.full((8,), -7, dtype=torch.int64)
    ids = _sample(x, out_sampled=sampled)
    assert torch.equal(ids, torch.argmax(x, dim=-1))
    assert torch.equal(sampled[:3], ids) and sampled[3:].tolist() == [-7] * 5
    empty = torch.empty(0, 1000)                       # bs 0: nothing launched, nothing written
    assert greedy_sample(empty, out_ids=torch.empty(0, dtype=torch.int64),
                         out_sampled=sampled).numel() == 0
    assert sampled[3:].tolist() == [-7] * 5


@pytest.mark.parametrize("call, err, match", [
    (lambda x, i: greedy_sample(x.double(), out_ids=i), ValueError, r"logits\.dtype"),
    (lambda x, i: greedy_sample(x[0], out_ids=i), ValueError, r"logits\.shape"),
    (lambda x, i: greedy_sample(x.t(), out_ids=i[:1].expand(16)), ValueError,
     r"logits\.stride\(1\)"),
    (lambda x, i: greedy_sample(x, out_ids=i[:3]), ValueError, r"out_ids\.shape: expected \(4,\)"),
    (lambda x, i: greedy_sample(x, out_ids=i.int()), ValueError, r"out_ids\.dtype"),
    (lambda x, i: greedy_sample(x, out_ids=i, out_sampled=i[:2]), ValueError,
     r"out_sampled\.numel\(\): expected >= bs = 4, got 2"),
    (lambda x, i: greedy_sample(x, out_ids=i, out_sampled=i.view(2, 2)), ValueError,
     r"out_sampled\.shape"),
    (lambda x, i: greedy_sample(x.tolist(), out_ids=i), TypeError,
     "logits: expected a torch.Tensor"),
])
def test_greedy_sample_validation(call, err, match):
    x, ids = torch.randn(4, 16), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(err, match=match):
        call(x, ids)


# ---------------------------------------------------------------------------- unpack_rows
KW = dict(vocab=100, max_ctx=64, scratch_slot=200, scratch_block=50)


def _outs(bs, max_blocks):
    """Poisoned output buffers, in the launcher's order."""
    return dict(out_tokens=torch.full((bs,), -9, dtype=torch.int64),
                out_positions=torch.full((bs,), -9, dtype=torch.int32),
                out_slots=torch.full((bs,), -9, dtype=torch.int64),
                out_block_table=torch.full((bs, max_blocks), -9, dtype=torch.int32),
                out_seq_lens=torch.full((bs,), -9, dtype=torch.int32))


def _unpack(rows, sampled, **kw):
    outs = _outs(rows.shape[0], rows.shape[1] - 5)
    got = unpack_rows(rows, sampled, **{**KW, **kw}, **outs)
    assert all(g is o for g, o in zip(got, outs.values()))
    return got


def test_unpack_rows_hand_case():
    rows = torch.tensor([[5, -1, 3, 10, 4, 1, 2, -1],          # host token, a -1 table entry
                         [-1] * 8,                              # a padded row
                         [9999, 2, 9999, 9999, 9999, 9999, -5, 3],  # src 2; all too large
                         [3, 0, -4, -4, -4, 0, 0, 0],           # src 0; negatives
                         [-3, 7, 0, 0, 0, 0, 0, 0],             # src past max_bs: clamped to 2
                         [-3, -1, 0, 0, 0, 0, 0, 0]], dtype=torch.int32)  # host token < 0
    sampled = torch.tensor([11, 22, 33], dtype=torch.int64)
    tokens, positions, slots, table, seq_lens = _unpack(rows, sampled)
    assert tokens.tolist() == [5, 0, 33, 11, 33, 0]
    assert positions.tolist() == [3, 0, 63, 0, 0, 0]
    assert slots.tolist() == [10, 200, 200, 200, 0, 0]
    assert table.tolist() == [[1, 2, 50], [50, 50, 50], [50, 50, 3]] + [[0, 0, 0]] * 3
    assert seq_lens.tolist() == [4, 0, 64, 0, 0, 0]
    ref = unpack_rows_ref(rows, sampled, **KW)
    for got, want in zip((tokens, positions, slots, table, seq_lens), ref):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("bs, max_blocks", [(1, 4), (3, 33), (8, 1500)])  # 1500: > one chunk
def test_unpack_rows_matches_ref_on_random_rows(bs, max_blocks):
    g = torch.Generator().manual_seed(bs)
    rows = torch.randint(-300, 300, (bs, 5 + max_blocks), generator=g, dtype=torch.int32)
    rows[:, 1] = torch.randint(-2, 6, (bs,), generator=g, dtype=torch.int32)   # src, some >= max_bs
    if bs > 1:
        rows[bs // 2:] = -1                                                 # padded rows
    rows[0, 5:] = torch.iinfo(torch.int32).max                              # clamped to scratch
    sampled = torch.randint(0, 100, (4,), generator=g)
    got = _unpack(rows, sampled)
    for name, a, b in zip(("tokens", "positions", "slots", "table", "seq_lens"), got,
                          unpack_rows_ref(rows, sampled, **KW)):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_unpack_rows_strided_rows_and_empty_batch():
    base = torch.randint(-5, 90, (3, 12), dtype=torch.int32)
    rows = base[:, 1:9]                                              # row stride 12
    sampled = torch.arange(3, dtype=torch.int64) + 40
    for a, b in zip(_unpack(rows, sampled), unpack_rows_ref(rows, sampled, **KW)):
        assert torch.equal(a, b)
    outs = _unpack(torch.empty(0, 8, dtype=torch.int32), sampled)  # bs 0: nothing launched
    assert all(o.shape[0] == 0 for o in outs)


def _unpack_args():
    rows = torch.full((4, 9), -1, dtype=torch.int32)
    return rows, torch.zeros(4, dtype=torch.int64), dict(KW), _outs(4, 4)


@pytest.mark.parametrize("edit, match", [
    (lambda a: a.__setitem__(0, a[0].long()), r"rows\.dtype"),
    (lambda a: a.__setitem__(0, a[0][:, :5]), r"rows\.shape\[1\]: expected 5 \+ max_blocks"),
    (lambda a: a.__setitem__(0, torch.full((9, 4), -1, dtype=torch.int32).t()),
     r"rows\.stride\(1\)"),
    (lambda a: a.__setitem__(1, a[1].int()), r"sampled\.dtype"),
    (lambda a: a.__setitem__(1, a[1][:0]), r"sampled\.numel\(\) \(max_bs\): expected >= 1"),
    (lambda a: a[2].update(vocab=0), "vocab: expected 1..2147483647, got 0"),
    (lambda a: a[2].update(max_ctx=0), "max_ctx"),
    (lambda a: a[2].update(scratch_slot=2**31), "scratch_slot"),
    (lambda a: a[2].update(scratch_block=-1), "scratch_block"),
    (lambda a: a[3].update(out_tokens=a[3]["out_tokens"].int()), r"out_tokens\.dtype"),
    (lambda a: a[3].update(out_positions=a[3]["out_positions"][:3]),
     r"out_positions\.shape: expected \(4,\), got \(3,\)"),
    (lambda a: a[3].update(out_slots=a[3]["out_slots"].int()), r"out_slots\.dtype"),
    (lambda a: a[3].update(out_block_table=a[3]["out_block_table"][:, :3]),
     r"out_block_table\.shape: expected \(4, 4\)"),
    (lambda a: a[3].update(out_seq_lens=a[3]["out_seq_lens"].long()), r"out_seq_lens\.dtype"),
])
def test_unpack_rows_validation(edit, match):
    args = list(_unpack_args())
    edit(args)
    rows, sampled, kw, outs = args
    with pytest.raises(ValueError, match=match):
        unpack_rows(rows, sampled, **kw, **outs)


# ------------------------------------------------------------------------- custom ops
def test_ops_match_launchers_and_pass_opcheck():
    x = _logits(5, 1000, torch.bfloat16, seed=3)
    ids, sampled = torch.zeros(5, dtype=torch.int64), torch.full((8,), -7, dtype=torch.int64)
    assert OPS.greedy_sample(x, ids, sampled) is None
    assert torch.equal(ids, torch.argmax(x, -1)) and torch.equal(sampled[:5], ids)
    assert sampled[5:].tolist() == [-7] * 3
    ids2 = torch.zeros(5, dtype=torch.int64)
    OPS.greedy_sample(x, ids2)                                     # out_sampled omitted
    assert torch.equal(ids2, ids)
    torch.library.opcheck(OPS.greedy_sample.default, (x, torch.zeros(5, dtype=torch.int64),
                                                      torch.zeros(8, dtype=torch.int64)))
    rows, smp, kw, outs = _unpack_args()
    rows[1] = torch.tensor([7, 2, 3, 4, 5, 6, 7, 8, 9], dtype=torch.int32)
    smp[2] = 42
    assert OPS.unpack_rows(rows, smp, *kw.values(), *outs.values()) is None
    for a, b in zip(outs.values(), unpack_rows_ref(rows, smp, **kw)):
        assert torch.equal(a, b)
    torch.library.opcheck(OPS.unpack_rows.default, (rows, smp, *kw.values(), *_outs(4, 4).values()))


def test_launchers_as_ops_route_decode_io():
    import graphrt.kernels.decode_io as dio
    x = _logits(3, 300, torch.float32, seed=4)
    rows, smp, kw, outs = _unpack_args()
    with gops.launchers_as_ops():
        assert dio.greedy_sample is not greedy_sample and dio.unpack_rows is not unpack_rows
        ids = torch.zeros(3, dtype=torch.int64)
        assert dio.greedy_sample(x, out_ids=ids) is ids
        got = dio.unpack_rows(rows, smp, **kw, **outs)
    assert dio.greedy_sample is greedy_sample and torch.equal(ids, torch.argmax(x, -1))
    assert all(a is b for a, b in zip(got, outs.values()))
    assert outs["out_slots"].tolist() == [200] * 4
