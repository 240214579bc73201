"""The GPU tests' input builder (``gpu_cases.make_dense_case``), checked on the CPU: the same code
draws the values on whatever device it is given."""

import math

import torch

from gpu_cases import SENTINEL_BLOCK, make_dense_case


def test_dense_case_poison_and_values():
    lens = [0, 1, 64, 65, 130]
    case = make_dense_case(5, 2, 0, 8, 2, lengths=lens, page=64, device="cpu", gen=torch.Generator().manual_seed(3))
    q, cache, table = case["q"], case["k_cache"], case["block_table"]
    assert q.shape == (5, 2, 8, 576) and q.dtype == torch.bfloat16 and cache.shape[1:] == (64, 2, 576)
    assert case["cache_seqlens"].tolist() == lens and case["cache_seqlens"].dtype == torch.int32
    assert torch.isfinite(q).all() and q.abs().max() <= 1
    written = torch.zeros(cache.shape[0] * 64, dtype=torch.bool)
    used = []
    for i, n in enumerate(lens):
        blocks = math.ceil(n / 64)
        assert (table[i, blocks:] == SENTINEL_BLOCK).all()
        used += table[i, :blocks].tolist()
        for t in range(n):
            written[int(table[i, t // 64]) * 64 + t % 64] = True
    assert len(set(used)) == len(used)  # no two requests share a block
    rows = cache.view(-1, 2, 576)
    assert torch.isfinite(rows[written]).all() and rows[written].abs().max() <= 1
    assert rows[~written].isnan().all()  # every row past a length is NaN, as FlashMLA's tests poison it


def test_dense_case_is_seeded_by_gen():
    def make(seed):
        return make_dense_case(3, 1, 100, 4, 1, varlen=True, device="cpu", gen=torch.Generator().manual_seed(seed))

    a, b, c = make(7), make(7), make(8)
    for key in a:
        assert torch.equal(a[key].nan_to_num(), b[key].nan_to_num()), key
    assert not torch.equal(a["q"], c["q"])
