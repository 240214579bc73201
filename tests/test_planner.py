"""The split-KV planner: every KV block planned exactly once, in order, with balanced parts.

``check_plan`` re-derives every property from the records alone, so it also serves as
the oracle for the GPU scheduler kernel, which must produce identical records.
"""

import math
import random

import pytest
import torch

from mla_cute.schedules import RECORD_FIELDS, num_sm_parts_for, plan_splits

BLOCK_N = 64


def check_plan(lens, num_parts, fixed_cost, records, num_splits, capacity=None):
    """Assert every documented property of (records, num_splits) for `lens`; ``capacity``: the most a
    part may cost, or a list of it per part (default: FlashMLA's payload)."""
    b = len(lens)
    assert records.dtype == torch.int32 and records.shape == (num_parts, len(RECORD_FIELDS))
    assert num_splits.dtype == torch.int32 and num_splits.shape == (b + 1,)
    # A length-0 request still costs one block: its part writes the empty result.
    nblocks = [max(math.ceil(n / BLOCK_N), 1) for n in lens]
    total = sum(nb + fixed_cost for nb in nblocks)
    payload = -(-total // num_parts) + fixed_cost if capacity is None else capacity

    covered = [[] for _ in range(b)]  # (begin, end) pieces of each request, in part order
    prev_end = (0, 0)  # (req, block) just past the previous part's work
    for p, rec in enumerate(records.tolist()):
        f = dict(zip(RECORD_FIELDS, rec))
        br, er, bb, eb = f["begin_req"], f["end_req"], f["begin_block"], f["end_block"]
        assert f["pad"] == 0
        if br > er:  # idle part: only after all work is handed out
            assert prev_end == (b, 0), f"part {p} idle while work remains"
            assert f["is_first_req_split"] == 0 and f["is_last_req_split"] == 0
            continue
        assert 0 <= br <= er < b
        assert (br, bb) == prev_end, f"part {p} starts at {(br, bb)}, expected {prev_end}"
        cost = 0
        for r in range(br, er + 1):
            start = bb if r == br else 0
            if r == er:
                # The end block of a length-0 request is written 0 (its one block is [0, 1)).
                if lens[r] == 0:
                    assert eb == 0, f"part {p}: empty request {r} must end at block 0"
                    end = 1
                else:
                    end = eb
            else:
                end = nblocks[r]
            assert 0 <= start < end <= nblocks[r], f"part {p} request {r}: bad piece [{start}, {end})"
            covered[r].append((start, end))
            cost += end - start + fixed_cost
        most = payload[p] if isinstance(payload, list) else payload
        assert cost <= most, f"part {p} costs {cost} > {most}"
        assert f["begin_split_idx"] == len(covered[br]) - 1
        end_whole = (lens[er] == 0) or eb == nblocks[er]
        prev_end = (er + 1, 0) if end_whole else (er, eb)
    assert prev_end == (b, 0), "not every block was planned"

    for r in range(b):
        pieces = covered[r]
        # Contiguous, in order, exactly once: the pieces tile [0, nblocks).
        assert pieces[0][0] == 0 and pieces[-1][1] == nblocks[r]
        assert all(a[1] == c[0] for a, c in zip(pieces, pieces[1:]))
        if lens[r] == 0:
            assert len(pieces) == 1

    splits = [len(c) for c in covered]
    assert num_splits.tolist() == [0] + list(_prefix(splits))
    # Flags: a piece is part of a split iff its request is cut across several parts.
    for rec in records.tolist():
        f = dict(zip(RECORD_FIELDS, rec))
        if f["begin_req"] > f["end_req"]:
            continue
        first = splits[f["begin_req"]] > 1
        last = splits[f["end_req"]] > 1
        if f["begin_req"] == f["end_req"]:
            assert f["is_first_req_split"] == f["is_last_req_split"] == int(first)
        else:
            assert f["is_first_req_split"] == int(first)
            assert f["is_last_req_split"] == int(last)
    return splits


def _prefix(xs):
    acc = 0
    for x in xs:
        acc += x
        yield acc


def plan_and_check(lens, num_parts, fixed_cost=5):
    records, num_splits = plan_splits(torch.tensor(lens, dtype=torch.int32), num_parts, BLOCK_N, fixed_cost)
    return check_plan(lens, num_parts, fixed_cost, records, num_splits)


# ----------------------------------------------------------------------------- cases


@pytest.mark.parametrize("seed", range(8))
def test_random_lengths(seed):
    rng = random.Random(seed)
    for _ in range(40):
        b = rng.randint(1, 80)
        max_len = rng.choice([1, 64, 200, 4096, 20000])
        lens = [rng.randint(0, max_len) for _ in range(b)]
        num_parts = rng.choice([1, 2, 7, 33, 66, 132])
        fixed_cost = rng.choice([0, 1, 5, 11])
        plan_and_check(lens, num_parts, fixed_cost)


@pytest.mark.parametrize("seed", range(4))
def test_plan_has_split_reads_the_split_counts(seed):
    """The runtime leaves out the combine on ``plan_has_split``'s word: it must be the plan's own."""
    from mla_cute.schedules import plan_has_split

    rng = random.Random(100 + seed)
    seen = set()
    for _ in range(60):
        lens = torch.tensor([rng.randint(0, rng.choice([64, 4096, 20000])) for _ in range(rng.randint(1, 80))])
        num_parts, fixed_cost = rng.choice([1, 7, 33, 66, 132]), rng.choice([0, 5])
        _, num_splits = plan_splits(lens, num_parts, BLOCK_N, fixed_cost)
        split = bool((num_splits.diff() > 1).any())
        assert plan_has_split(lens, num_parts, BLOCK_N, fixed_cost) == split
        seen.add(split)
    assert seen == {False, True}


@pytest.mark.parametrize("seed", range(4))
def test_plan_facts_read_the_records(seed):
    """``plan_facts``: whether the plan splits, and the most blocks one part reads (empty requests count one)."""
    from mla_cute.schedules import plan_facts

    rng = random.Random(200 + seed)
    for _ in range(40):
        lens = [rng.choice([0, rng.randint(1, 64), rng.randint(1, 20000)]) for _ in range(rng.randint(1, 60))]
        num_parts, fixed_cost, slack = rng.choice([1, 7, 33, 66, 132]), rng.choice([0, 5]), rng.choice([0, 8])
        records, num_splits = plan_splits(torch.tensor(lens), num_parts, BLOCK_N, fixed_cost, slack)
        nblocks = [max(math.ceil(n / BLOCK_N), 1) for n in lens]
        busiest = 0
        for rec in records.tolist():
            f = dict(zip(RECORD_FIELDS, rec))
            blocks = 0
            for r in range(f["begin_req"], f["end_req"] + 1):
                start = f["begin_block"] if r == f["begin_req"] else 0
                end = f["end_block"] if r == f["end_req"] and lens[r] else nblocks[r]
                blocks += end - start
            busiest = max(busiest, blocks)
        split = bool((num_splits.diff() > 1).any())
        assert plan_facts(torch.tensor(lens), num_parts, BLOCK_N, fixed_cost, slack) == (split, busiest)
    assert plan_facts(torch.tensor([131072]), 66)[1] == 32
    assert plan_facts(torch.tensor([4096] * 128), 66) == (False, 128)


@pytest.mark.parametrize("num_parts", [1, 3, 132])
def test_some_zero_lengths(num_parts):
    rng = random.Random(num_parts)
    lens = [0 if i % 2 else rng.randint(1, 4096) for i in range(64)]
    plan_and_check(lens, num_parts)


@pytest.mark.parametrize("b,num_parts", [(1, 1), (1, 132), (5, 3), (128, 132), (300, 16)])
def test_all_zero_lengths(b, num_parts):
    splits = plan_and_check([0] * b, num_parts)
    assert splits == [1] * b


def test_zero_length_at_the_end_of_a_part():
    # Part 0 ends on request 1 (empty): its end_block is 0, not 1.
    # Costs 15 + 6 + 15 over 2 parts: payload 23, so part 0 stops right after request 1.
    records, num_splits = plan_splits(torch.tensor([640, 0, 640], dtype=torch.int32), 2, BLOCK_N, 5)
    assert records.tolist() == [[0, 1, 0, 0, 0, 0, 0, 0], [2, 2, 0, 10, 0, 0, 0, 0]]
    check_plan([640, 0, 640], 2, 5, records, num_splits)


@pytest.mark.parametrize("fixed_cost", [0, 5])
def test_single_long_request(fixed_cost):
    lens, num_parts = [131072], 132
    splits = plan_and_check(lens, num_parts, fixed_cost)
    # 2048 blocks, each part takes ceil((2048 + fixed_cost) / 132) = 16: 128 busy parts, 4 idle.
    assert splits == [128]
    records, _ = plan_splits(torch.tensor(lens, dtype=torch.int32), num_parts, BLOCK_N, fixed_cost)
    busy = records[:128]
    assert busy[:, RECORD_FIELDS.index("begin_split_idx")].tolist() == list(range(128))
    assert busy[:, RECORD_FIELDS.index("begin_block")].tolist() == list(range(0, 2048, 16))
    assert torch.all(busy[:, RECORD_FIELDS.index("is_first_req_split")] == 1)
    assert torch.all(records[128:, 0] > records[128:, 1])


def test_more_requests_than_parts():
    rng = random.Random(7)
    lens = [rng.randint(1, 300) for _ in range(500)]
    plan_and_check(lens, 17)


@pytest.mark.parametrize("lens", [[1], [0], [64, 65, 0, 4096], [5] * 40])
def test_one_part_takes_everything(lens):
    records, num_splits = plan_splits(torch.tensor(lens, dtype=torch.int32), 1, BLOCK_N, 5)
    check_plan(lens, 1, 5, records, num_splits)
    rec = dict(zip(RECORD_FIELDS, records[0].tolist()))
    assert (rec["begin_req"], rec["end_req"], rec["begin_block"]) == (0, len(lens) - 1, 0)
    assert num_splits.tolist() == list(range(len(lens) + 1))


def test_fixed_cost_zero_balances_blocks_exactly():
    # 10 requests of 3 blocks over 6 parts: 30 blocks, 5 per part, no slack.
    records, num_splits = plan_splits(torch.full((10,), 192, dtype=torch.int32), 6, BLOCK_N, 0)
    check_plan([192] * 10, 6, 0, records, num_splits)
    blocks = []
    for rec in records.tolist():
        f = dict(zip(RECORD_FIELDS, rec))
        n = 0
        for r in range(f["begin_req"], f["end_req"] + 1):
            start = f["begin_block"] if r == f["begin_req"] else 0
            end = f["end_block"] if r == f["end_req"] else 3
            n += end - start
        blocks.append(n)
    assert blocks == [5] * 6


def test_more_parts_than_work_leaves_idle_parts():
    records, num_splits = plan_splits(torch.tensor([10, 20], dtype=torch.int32), 132, BLOCK_N, 5)
    check_plan([10, 20], 132, 5, records, num_splits)
    idle = records[:, 0] > records[:, 1]
    assert idle.sum() >= 100


def test_accepts_other_int_dtypes():
    lens = [100, 0, 3000]
    a = plan_splits(torch.tensor(lens, dtype=torch.int32), 9)
    b = plan_splits(torch.tensor(lens, dtype=torch.int64), 9)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize(
    "lens,num_parts,block_n,fixed_cost,slack,even",
    [([1], 0, 64, 5, 0, 0), ([1], 1, 0, 5, 0, 0), ([1], 1, 64, -1, 0, 0), ([], 4, 64, 5, 0, 0),
     ([3, -1], 4, 64, 5, 0, 0), ([1], 1, 64, 5, -1, 0), ([1], 1, 64, 5, 0, -1)],
)
def test_rejects_bad_arguments(lens, num_parts, block_n, fixed_cost, slack, even):
    with pytest.raises(ValueError):
        plan_splits(torch.tensor(lens, dtype=torch.int32), num_parts, block_n, fixed_cost, slack, even)


# ----------------------------------------------------------------------------- fill parts


@pytest.mark.parametrize("seed", range(4))
def test_fill_parts_take_their_share(seed):
    """The last ``fill_parts`` parts cost at most ``fill_share`` sixteenths of another part's blocks (plus
    the fixed cost), the others at most the weighted payload; both slacks are ignored; share 16 is FlashMLA's
    plan."""
    rng = random.Random(300 + seed)
    for _ in range(40):
        lens = [rng.randint(0, rng.choice([64, 4096, 20000])) for _ in range(rng.randint(1, 150))]
        if rng.random() < 0.3:
            lens = [rng.choice([4096, 8192, 16384])] * rng.randint(1, 150)
        num_parts = rng.choice([2, 7, 33, 66])
        fill, share = rng.randint(1, min(num_parts - 1, 6)), rng.randint(1, 16)
        fixed_cost, slack = rng.choice([0, 5]), rng.choice([0, 16])
        records, num_splits = plan_splits(torch.tensor(lens), num_parts, BLOCK_N, fixed_cost, slack, slack,
                                          fill_parts=fill, fill_share=share)
        total = sum(max(math.ceil(n / BLOCK_N), 1) + fixed_cost for n in lens)
        blocks = -(-16 * total // (16 * (num_parts - fill) + share * fill))
        capacity = [blocks + fixed_cost] * (num_parts - fill) + [-(-blocks * share // 16) + fixed_cost] * fill
        check_plan(lens, num_parts, fixed_cost, records, num_splits, capacity)
        flash = plan_splits(torch.tensor(lens), num_parts, BLOCK_N, fixed_cost)
        equal = plan_splits(torch.tensor(lens), num_parts, BLOCK_N, fixed_cost, slack, slack, fill, 16)
        assert all(torch.equal(a, c) for a, c in zip(flash, equal))


def test_fill_parts_on_the_benchmark_row():
    """b = 128, s_q = 2, 8K over 30 4-CTA clusters and 3 fill parts at share 11: four whole requests (512 tiles)
    a cluster, the last eight requests over the fill parts (at most 366 tiles each)."""
    from mla_cute.schedules import plan_facts

    lens = torch.full((128,), 8192)
    records, _ = plan_splits(lens, 33, BLOCK_N, 5, 16, 16, 3, 11)
    reads = [sum((e if r == rec[1] else 128) - (b if r == rec[0] else 0) for r in range(rec[0], rec[1] + 1))
             for rec in records.tolist() for b, e in [(rec[2], rec[3])]]
    assert reads[:30] == [512] * 30
    assert all(300 <= n <= 366 for n in reads[30:]), reads[30:]
    assert sum(reads) == 128 * 128
    assert plan_facts(lens, 33, BLOCK_N, 5, 16, 16, 3, 11) == (True, max(reads))


@pytest.mark.parametrize("fill,share", [(-1, 16), (33, 16), (1.0, 16), (1, 0), (1, 17), (1, 8.0)])
def test_rejects_bad_fill(fill, share):
    with pytest.raises(ValueError, match="fill_parts|fill_share"):
        plan_splits(torch.full((4,), 100), 33, BLOCK_N, 5, 0, 0, fill, share)


# ----------------------------------------------------------------------------- whole requests


def _best_whole_capacity(costs, num_parts):
    """The smallest largest-part cost over every way to cut ``costs`` in order into at most ``num_parts``
    contiguous parts (exhaustive dynamic programme, the oracle of the planner's bisection)."""
    b = len(costs)
    prefix = [0] + list(_prefix(costs))
    inf = float("inf")
    best = [[inf] * (b + 1) for _ in range(num_parts + 1)]  # best[k][i]: first i requests in k parts
    best[0][0] = 0
    for k in range(1, num_parts + 1):
        for i in range(b + 1):
            best[k][i] = min(max(best[k - 1][j], prefix[i] - prefix[j]) for j in range(i + 1))
    return best[num_parts][b]


@pytest.mark.parametrize("seed", range(6))
def test_unsplit_slack_keeps_requests_whole_when_cheap(seed):
    """With a slack the plan splits nothing whenever a whole packing costs at most payload + slack, and
    then its largest part is the smallest possible; otherwise it is FlashMLA's plan unchanged."""
    from mla_cute.schedules import plan_has_split

    rng = random.Random(500 + seed)
    outcomes = set()
    for _ in range(40):
        b = rng.randint(1, 24)
        lens = [rng.randint(0, rng.choice([64, 640, 4096])) for _ in range(b)]
        if rng.random() < 0.3:
            lens = [lens[0]] * b  # uniform lengths, as in the benchmark rows
        num_parts = rng.choice([1, 2, 3, 5, 8, 13])
        fixed_cost, slack = rng.choice([0, 5]), rng.choice([1, 3, 12, 40])
        costs = [max(math.ceil(n / BLOCK_N), 1) + fixed_cost for n in lens]
        payload = -(-sum(costs) // num_parts) + fixed_cost
        best = _best_whole_capacity(costs, num_parts)
        records, num_splits = plan_splits(torch.tensor(lens), num_parts, BLOCK_N, fixed_cost, slack)
        flash = plan_splits(torch.tensor(lens), num_parts, BLOCK_N, fixed_cost)
        if best <= payload + slack:
            splits = check_plan(lens, num_parts, fixed_cost, records, num_splits, capacity=best)
            assert splits == [1] * b
            assert not plan_has_split(torch.tensor(lens), num_parts, BLOCK_N, fixed_cost, slack)
            outcomes.add("whole")
        else:
            assert torch.equal(records, flash[0]) and torch.equal(num_splits, flash[1])
            outcomes.add("flashmla")
    assert outcomes == {"whole", "flashmla"}


@pytest.mark.parametrize("s_k,slack,whole", [(4096, 12, True), (4096, 0, False), (8192, 12, True), (8192, 8, False),
                                             (16384, 12, False)])
def test_unsplit_slack_on_the_s_q_2_benchmark_rows(s_k, slack, whole):
    """b = 128, s_q = 2, h_q = 128 (33 parts): four whole requests a part cost 3 (4K) and 11 (8K) blocks
    more than FlashMLA's payload, 26 at 16K."""
    lens = [s_k] * 128
    records, num_splits = plan_splits(torch.tensor(lens), 33, BLOCK_N, 5, slack)
    splits = check_plan(lens, 33, 5, records, num_splits, capacity=4 * (s_k // 64 + 5) if whole else None)
    assert (splits == [1] * 128) == whole
    if whole:
        busy = records[records[:, 0] <= records[:, 1]]
        assert len(busy) == 32 and torch.all(busy[:, 1] - busy[:, 0] == 3)


def _even_parts(nblocks, capacity, fixed_cost):
    """The parts of the even plan at ``capacity``, built directly: each part a list of (request, blocks)."""
    parts, cur = [], []
    for r, nb in enumerate(nblocks):
        if nb + fixed_cost <= capacity:
            if sum(n + fixed_cost for _, n in cur) + nb + fixed_cost > capacity:
                parts.append(cur)
                cur = []
            cur.append((r, nb))
        else:
            if cur:
                parts.append(cur)
                cur = []
            k = math.ceil(nb / (capacity - fixed_cost))
            parts += [[(r, (i + 1) * nb // k - i * nb // k)] for i in range(k)]
    return parts + ([cur] if cur else [])


@pytest.mark.parametrize("seed", range(6))
def test_even_split_slack_cuts_equal_pieces(seed):
    """With ``even_split_slack`` (and no whole plan taken) the plan is, at the smallest capacity from
    FlashMLA's payload up to payload + slack that fits: whole requests packed in order, and every request
    too long for a part cut into equal pieces, each alone on its part; with no such capacity, FlashMLA's."""
    rng = random.Random(900 + seed)
    outcomes = set()
    for _ in range(40):
        b = rng.randint(1, 24)
        lens = [rng.randint(0, rng.choice([64, 640, 4096, 30000])) for _ in range(b)]
        if rng.random() < 0.4:
            lens = [lens[0]] * b
        num_parts = rng.choice([1, 2, 3, 5, 8, 13, 33])
        fixed_cost, even = rng.choice([0, 5]), rng.choice([1, 3, 8, 40])
        nblocks = [max(math.ceil(n / BLOCK_N), 1) for n in lens]
        payload = -(-sum(nb + fixed_cost for nb in nblocks) // num_parts) + fixed_cost
        fits = [c for c in range(payload, payload + even + 1)
                if len(_even_parts(nblocks, c, fixed_cost)) <= num_parts]
        records, num_splits = plan_splits(torch.tensor(lens), num_parts, BLOCK_N, fixed_cost, 0, even)
        if not fits:
            flash = plan_splits(torch.tensor(lens), num_parts, BLOCK_N, fixed_cost)
            assert torch.equal(records, flash[0]) and torch.equal(num_splits, flash[1])
            outcomes.add("flashmla")
            continue
        capacity = fits[0]
        splits = check_plan(lens, num_parts, fixed_cost, records, num_splits, capacity=capacity)
        want = _even_parts(nblocks, capacity, fixed_cost)
        got = []
        for rec in records.tolist():
            f = dict(zip(RECORD_FIELDS, rec))
            if f["begin_req"] > f["end_req"]:
                continue
            part = []
            for r in range(f["begin_req"], f["end_req"] + 1):
                start = f["begin_block"] if r == f["begin_req"] else 0
                end = (f["end_block"] or 1) if r == f["end_req"] else nblocks[r]
                part.append((r, end - start))
            got.append(part)
        assert got == want
        for part in got:  # a piece of a split request is alone on its part
            assert len(part) == 1 or all(splits[r] == 1 for r, _ in part)
        outcomes.add("even" if any(s > 1 for s in splits) else "whole")
    assert outcomes == {"even", "whole", "flashmla"}


@pytest.mark.parametrize("lens,parts,pieces,tiles", [
    ([16384] * 64, 132, 2, 128),  # dense b = 64, 16K, h_q = 16: FlashMLA's plan cuts 3-4 pieces of up to 127
    ([32768] * 32, 132, 4, 128),
    ([65536] * 8, 66, 8, 128),  # b = 8, 64K, h_q = 128 (2 M tiles: slack 8)
])
def test_even_split_slack_on_the_benchmark_rows(lens, parts, pieces, tiles):
    """The default schedule's even pieces on the uniform rows where FlashMLA's plan puts request boundaries
    inside parts; the whole plan, where one is taken, comes first (the 8K rows keep two whole requests)."""
    from mla_cute.schedules import DEFAULT_DENSE_SCHEDULE, plan_facts

    policy = DEFAULT_DENSE_SCHEDULE.plan_policy(128 if parts == 66 else 16)
    records, num_splits = plan_splits(torch.tensor(lens), parts, BLOCK_N, *policy)
    splits = check_plan(lens, parts, 5, records, num_splits, capacity=tiles + 5)
    assert splits == [pieces] * len(lens)
    busy = records[records[:, 0] <= records[:, 1]]
    assert len(busy) == pieces * len(lens) and torch.all(busy[:, 0] == busy[:, 1])
    assert plan_facts(torch.tensor(lens), parts, BLOCK_N, *policy) == (True, tiles)
    whole = plan_splits(torch.tensor([8192] * 128), 66, BLOCK_N, *DEFAULT_DENSE_SCHEDULE.plan_policy(128))[1]
    assert whole.tolist() == list(range(129))


# ----------------------------------------------------------------------------- part count


def _parts_formula(num_sms, s_q, h_q, h_kv):
    return max(num_sms // h_kv // math.ceil(s_q * h_q / h_kv / 64), 1)


@pytest.mark.parametrize(
    "args,expected",
    [
        ((132, 1, 128, 1), 66),
        ((132, 1, 64, 1), 132),
        ((132, 2, 16, 1), 132),
        ((132, 2, 128, 1), 33),
        ((132, 4, 128, 1), 16),
        ((132, 1, 128, 2), 66),
        ((132, 1, 3, 3), 44),
        ((132, 2, 63, 3), 44),
        ((78, 1, 128, 8), 9),
        ((1, 4, 128, 8), 1),
    ],
)
def test_num_sm_parts_examples(args, expected):
    assert num_sm_parts_for(*args) == expected == _parts_formula(*args)


def test_num_sm_parts_matches_formula_on_grid():
    for num_sms in (1, 78, 114, 132):
        for s_q in (1, 2, 4):
            for h_kv in (1, 2, 3, 8):
                for h_q in (h_kv * g for g in (1, 3, 21, 32, 64, 126)):
                    assert num_sm_parts_for(num_sms, s_q, h_q, h_kv) == _parts_formula(num_sms, s_q, h_q, h_kv)


def test_sparse_part_count_and_lengths():
    from mla_cute.schedules import sparse_lengths, sparse_num_sm_parts_for

    assert sparse_num_sm_parts_for(132, 2, 128) == 33
    assert sparse_num_sm_parts_for(132, 1, 64) == 132
    assert sparse_num_sm_parts_for(132, 1, 16) == 132  # fewer than 64 heads still take one tile
    assert sparse_num_sm_parts_for(132, 200, 128) == 1
    assert sparse_lengths(2048, None, 3).tolist() == [2048, 2048, 2048]
    assert sparse_lengths(128, torch.tensor([0, 5, 128], dtype=torch.int32), 3).tolist() == [1, 5, 128]


def test_sparse_reference_call_fills_the_metadata():
    import mla_cute

    cache = mla_cute.quantize_kv_cache(torch.randn(2, 64, 1, 576).to(torch.bfloat16))
    meta, _ = mla_cute.get_mla_metadata()
    q = torch.randn(3, 2, 64, 576).to(torch.bfloat16)
    indices = torch.randint(0, 128, (3, 2, 128), dtype=torch.int32)
    topk_length = torch.tensor([0, 70, 128], dtype=torch.int32)
    mla_cute.flash_mla_with_kvcache(q, cache, None, None, 512, meta, is_fp8_kvcache=True, indices=indices,
                                    topk_length=topk_length, backend="reference")
    assert meta.tile_scheduler_metadata.shape == (66, 8) and meta.tile_scheduler_metadata.dtype == torch.int32
    assert meta.num_splits.tolist()[0] == 0 and len(meta.num_splits) == 4


@pytest.mark.parametrize("num_tokens,num_parts", [(1, 1), (7, 3), (3, 5), (4096, 66), (70000, 132), (131, 132)])
def test_whole_token_plan_serves_every_token_once_whole(num_tokens, num_parts):
    """Prefill from the FP8 cache: each part a contiguous, even share of the tokens (sizes differ by at most
    one), each token one split from one part, never cut (end block past any token's tiles)."""
    from mla_cute.schedules import whole_token_plan
    from mla_cute.schedules.planner import WHOLE_REQUEST_END

    records, num_splits = whole_token_plan(num_tokens, num_parts)
    assert records.dtype == num_splits.dtype == torch.int32 and records.shape == (num_parts, len(RECORD_FIELDS))
    assert num_splits.tolist() == list(range(num_tokens + 1))
    served, sizes = [], []
    for rec in records.tolist():
        f = dict(zip(RECORD_FIELDS, rec))
        assert f["begin_block"] == 0 and f["begin_split_idx"] == 0 and f["pad"] == 0
        assert f["is_first_req_split"] == f["is_last_req_split"] == 0
        if f["begin_req"] <= f["end_req"]:
            assert f["end_block"] == WHOLE_REQUEST_END
        served += range(f["begin_req"], f["end_req"] + 1)
        sizes.append(max(f["end_req"] - f["begin_req"] + 1, 0))
    assert served == list(range(num_tokens))
    assert max(sizes) - min(sizes) <= 1


def test_whole_token_plan_rejects_empty_shapes():
    from mla_cute.schedules import whole_token_plan

    with pytest.raises(ValueError, match="num_tokens and num_parts"):
        whole_token_plan(0, 4)
    with pytest.raises(ValueError, match="num_tokens and num_parts"):
        whole_token_plan(4, 0)
