"""The CPU paged-attention kernel against a float64 softmax reference."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixserve.model import native

pytestmark = pytest.mark.skipif(
    not native.load(), reason="the CPU kernel did not build here (see the log)"
)


def _reference(
    q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, pages: list[int], n: int, scale: float
) -> torch.Tensor:
    """Causal attention of the last ``len(q)`` of ``n`` positions (``q`` [rows, Hq, D]) over
    the first ``n`` tokens of ``pages``, in float64."""
    rows, hq, d = q.shape
    hkv = kp.shape[2]
    k = kp[pages].reshape(-1, hkv, d)[:n].double().repeat_interleave(hq // hkv, dim=1)  # [n, Hq, D]
    v = vp[pages].reshape(-1, hkv, d)[:n].double().repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("rhd,nhd->rhn", q.double(), k) * scale
    pos = torch.arange(n - rows, n)
    s = s.masked_fill((torch.arange(n)[None, :] > pos[:, None])[:, None, :], float("-inf"))
    return torch.einsum("rhn,nhd->rhd", torch.softmax(s, dim=-1), v)


def _case(
    rng: random.Random,
    groups: list[tuple[list[int], int]],
    page_size: int,
    hq: int,
    hkv: int,
    d: int,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
) -> float:
    """Random pages for ``groups`` (each member's new-token count, shared pages) and the
    kernel's largest error; members' rows are interleaved in q, with two rows in no plan."""
    members = [n for ns, _ in groups for n in ns]
    num_pages = (
        4
        + sum(s for _, s in groups)
        + sum(-(-(n + 3 * page_size + 1) // page_size) for n in members)
    )
    kp = torch.randn(num_pages, page_size, hkv, d).to(kv_dtype)
    vp = torch.randn(num_pages, page_size, hkv, d).to(kv_dtype)
    free = list(range(num_pages))
    rng.shuffle(free)
    # Member i's rows are the i-th run of q; the runs are laid out in a shuffled order.
    order = list(range(len(members)))
    rng.shuffle(order)
    starts, row = [0] * len(members), 1  # row 0 and the last row belong to nobody
    for i in order:
        starts[i] = row
        row += members[i]
    t_rows = row + 1
    # q a view of a fused qkv projection, as the model passes it.
    q = torch.randn(t_rows, (hq + 2 * hkv) * d).to(q_dtype)[:, : hq * d].view(-1, hq, d)
    plan_groups, full = [], []
    i = 0
    for ns, s in groups:
        shared = [free.pop() for _ in range(s)]
        ms = []
        for n in ns:
            own_len = n + rng.randint(
                0, 2 * page_size + 1
            )  # keys before the new ones, after the shared part
            pages = [free.pop() for _ in range(-(-own_len // page_size))]
            ms.append(native.Member(starts[i], n, pages, own_len))
            full.append((starts[i], n, shared + pages, s * page_size + own_len))
            i += 1
        plan_groups.append((ms, shared))
    out = torch.full_like(q, 7.0)
    scale = 1 / math.sqrt(d)
    native.paged_attention(q, kp, vp, out, native.AttentionPlan.build(plan_groups), scale)
    err = 0.0
    for start, n, pages, total in full:
        ref = _reference(q[start : start + n], kp, vp, pages, total, scale)
        err = max(err, (out[start : start + n].double() - ref).abs().max().item())
    assert torch.all(out[0] == 7.0) and torch.all(out[-1] == 7.0)  # rows in no plan: untouched
    return err


@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("page_size", [1, 16, 5])
def test_decodes_match_reference(heads: tuple[int, int], page_size: int) -> None:
    rng = random.Random(page_size * 100 + heads[0])
    # A big group, a pair, singletons without shared pages; shared parts longer than a block.
    groups = [([1] * 5, 90 // page_size + 1), ([1, 1], 3), ([1], 0), ([1], 0)]
    assert _case(rng, groups, page_size, *heads, 64, torch.float32, torch.float32) < 2e-5


@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("page_size", [1, 16, 5])
def test_extends_and_decodes_match_reference(heads: tuple[int, int], page_size: int) -> None:
    """Causal new rows over a prefix: a long prefill (many row blocks, rows near the diagonal
    masked), short extends sharing a trunk with decodes, so row blocks span members."""
    rng = random.Random(page_size * 7 + heads[1])
    groups = [([150], 0), ([7, 1, 3, 1, 30], 40 // page_size + 1), ([2], 0), ([1, 5], 2)]
    assert _case(rng, groups, page_size, *heads, 64, torch.float32, torch.float32) < 2e-5


@pytest.mark.parametrize(
    ("q_dtype", "kv_dtype", "tol"),
    [
        (torch.bfloat16, torch.bfloat16, 2e-2),
        (torch.float16, torch.float16, 2e-3),
        (torch.float32, torch.bfloat16, 2e-5),
    ],
    ids=["bfloat16", "float16", "float32-over-bfloat16"],
)
def test_half_precisions_match_reference(
    q_dtype: torch.dtype, kv_dtype: torch.dtype, tol: float
) -> None:
    """Error is that of rounding the output (and for bf16 the query), not of the kernel."""
    assert (
        _case(random.Random(3), [([1, 1, 9], 7), ([20], 0)], 16, 9, 3, 64, q_dtype, kv_dtype) < tol
    )


@pytest.mark.parametrize("d", [16, 32, 80, 128, 256])
def test_other_head_dims(d: int) -> None:
    assert (
        _case(random.Random(d), [([1, 4], 5), ([1], 1)], 16, 6, 2, d, torch.float32, torch.float32)
        < 2e-5
    )


def test_large_scores_do_not_overflow() -> None:
    """Scores far from 0 (a sharp softmax) stay finite: the running max is subtracted first."""
    kp = torch.zeros(2, 4, 1, 32)
    vp = torch.arange(256, dtype=torch.float32).view(2, 4, 1, 32)
    kp[1, 2, 0, 0] = 1.0
    q = torch.zeros(1, 1, 32)
    q[0, 0, 0] = 1e4
    out = torch.empty_like(q)
    plan = native.AttentionPlan.build([([native.Member(0, 1, [1], 4)], [0])])
    native.paged_attention(q, kp, vp, out, plan, 1.0)
    torch.testing.assert_close(out[0, 0], vp[1, 2, 0])


def test_bad_arguments_raise() -> None:
    q = torch.randn(2, 9, 64)
    kp = torch.randn(4, 16, 3, 64)

    def plan(*members: native.Member) -> native.AttentionPlan:
        return native.AttentionPlan.build([(list(members), [])])

    ok = plan(native.Member(0, 1, [1], 3))
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        native.paged_attention(torch.randn(2, 8, 64), kp, kp, torch.empty(2, 8, 64), ok, 1.0)
    with pytest.raises(RuntimeError, match="head_dim of q"):
        native.paged_attention(
            q, kp[..., :32].contiguous(), kp[..., :32].contiguous(), q.clone(), ok, 1.0
        )
    q40, kp40 = torch.randn(2, 9, 40), torch.randn(4, 16, 3, 40)
    with pytest.raises(RuntimeError, match="head_dim must be one of"):
        native.paged_attention(q40, kp40, kp40, q40.clone(), ok, 1.0)
    assert not native.supported(torch.float32, torch.float32, torch.device("cpu"), head_dim=40)
    bad = plan(native.Member(0, 1, [1], 3))
    bad.own_len = bad.own_len.int()
    with pytest.raises(RuntimeError, match="own_len"):
        native.paged_attention(q, kp, kp, q.clone(), bad, 1.0)
    with pytest.raises(RuntimeError, match="out of range"):
        native.paged_attention(q, kp, kp, q.clone(), plan(native.Member(0, 1, [4], 3)), 1.0)
    with pytest.raises(RuntimeError, match="must lie in q"):
        native.paged_attention(
            q, kp, kp, q.clone(), plan(native.Member(1, 2, [1], 3)), 1.0
        )  # rows 1..2 of 2
    with pytest.raises(RuntimeError, match="must lie in q"):
        native.paged_attention(
            q, kp, kp, q.clone(), plan(native.Member(0, 1, [1], 17)), 1.0
        )  # one page: 16 keys


@pytest.mark.parametrize(
    "field, values, message",
    [
        ("shared_start", [0, 5], "shared_start must stay within"),  # 5 shared pages named, 1 given
        ("own_start", [1, 0], "own_start must stay within|own_start must be non-decreasing"),
        ("own_start", [0, 3], "own_start must stay within"),
        ("group_start", [1, 1], "group_start must run from 0"),
    ],
)
def test_bad_plan_offsets_raise(field: str, values: list[int], message: str) -> None:
    """Offsets into the page lists are checked too: a bad plan must not read past them."""
    q = torch.randn(1, 9, 64)
    kp = torch.randn(4, 16, 3, 64)
    bad = native.AttentionPlan.build([([native.Member(0, 1, [1], 3)], [2])])
    setattr(bad, field, torch.tensor(values, dtype=torch.int64))
    with pytest.raises(RuntimeError, match=message):
        native.paged_attention(q, kp, kp, q.clone(), bad, 1.0)


def _ragged_batch(
    page_size: int, news: list[int], before: list[int], hq: int, hkv: int, d: int
) -> tuple[native.AttentionPlan, torch.Tensor, list[list[int]]]:
    """Members with ``news[i]`` new tokens after ``before[i]`` older ones, each on its own
    shuffled pages; the plan (one group each) and the flat slots of the new tokens in row order."""
    rng = random.Random(page_size)
    need = [-(-(b + n) // page_size) for b, n in zip(before, news)]
    free = list(range(1, 1 + sum(need)))
    rng.shuffle(free)
    groups, slots, pages_of, row = [], [], [], 0
    for n, b, p in zip(news, before, need):
        pages = [free.pop() for _ in range(p)]
        groups.append(([native.Member(row, n, pages, b + n)], []))
        slots += [pages[j // page_size] * page_size + j % page_size for j in range(b, b + n)]
        pages_of.append(pages)
        row += n
    return native.AttentionPlan.build(groups), torch.tensor(slots), pages_of


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    ("act", "kv"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
    ],
)
def test_store_in_the_call_equals_storing_first(
    page_size: int, act: torch.dtype, kv: torch.dtype
) -> None:
    """The kernel's own store of the new K/V (strided views of a fused qkv, converted to the
    pool's dtype) writes what index_copy_ writes, and the attention then sees it."""
    hq, hkv, d = 9, 3, 64
    plan, slots, _ = _ragged_batch(page_size, [1, 5, 1, 3], [7, 0, 40, 20], hq, hkv, d)
    t = int(slots.numel())
    qkv = torch.randn(t, hq + 2 * hkv, d).to(act)
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    num_pages = 2 + (80 // page_size) * 4
    kp = torch.randn(num_pages, page_size, hkv, d).to(kv)
    vp = torch.randn(num_pages, page_size, hkv, d).to(kv)
    kp_ref, vp_ref = kp.clone(), vp.clone()
    kp_ref.view(-1, hkv, d).index_copy_(0, slots, k.to(kv))
    vp_ref.view(-1, hkv, d).index_copy_(0, slots, v.to(kv))
    want = torch.empty_like(q)
    native.paged_attention(q, kp_ref, vp_ref, want, plan, d**-0.5)
    got = torch.empty_like(q)
    native.paged_attention(q, kp, vp, got, plan, d**-0.5, store=(k, v, slots))
    assert torch.equal(kp, kp_ref) and torch.equal(vp, vp_ref)
    assert torch.equal(got, want)


def _over_thread_counts(
    q: torch.Tensor,
    kp: torch.Tensor,
    vp: torch.Tensor,
    plan: native.AttentionPlan,
    repeats: int,
) -> list[torch.Tensor]:
    """The call's outputs with torch's pool at 1, 2, 3 and 5 threads, ``repeats`` calls each
    (more threads than cores: some are preempted, and the others take what they own)."""
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3, 5):
            torch.set_num_threads(n)
            for _ in range(repeats):
                outs.append(torch.empty_like(q))
                native.paged_attention(q, kp, vp, outs[-1], plan, q.size(2) ** -0.5)
    finally:
        torch.set_num_threads(threads)
    return outs


def test_threads_give_the_serial_result() -> None:
    """A batch big enough to be split over the threads gives bit for bit the result of the
    calling thread alone (small calls run there), and matches the reference: with 2 threads,
    and with 3 and 5 (more than the cores: a preempted thread's run of whole items is
    finished by the others)."""
    hq, hkv, d, ps = 9, 3, 64, 16
    news, before = [1] * 24 + [37], [300 + 7 * i for i in range(24)] + [5]
    plan, _, pages_of = _ragged_batch(ps, news, before, hq, hkv, d)
    kp = torch.randn(1 + sum(len(p) for p in pages_of), ps, hkv, d)
    vp = torch.randn_like(kp)
    q = torch.randn(sum(news), hq, d)
    outs = _over_thread_counts(q, kp, vp, plan, repeats=1)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    for i in (0, 23, 24):
        start, n = int(plan.q_start[i]), news[i]
        ref = _reference(q[start : start + n], kp, vp, pages_of[i], before[i] + n, d**-0.5)
        assert (outs[1][start : start + n].double() - ref).abs().max().item() < 2e-5


@pytest.mark.parametrize("first", [699, 4099], ids=["short", "past-l2"])
@pytest.mark.parametrize("kv", [torch.float32, torch.bfloat16])
def test_decode_chunks_over_any_thread_count(kv: torch.dtype, first: int) -> None:
    """A few decode rows over contexts of different lengths (different chunk counts per KV
    head): every thread owns a run of the chunk-major task order and takes the rest of the
    others' from their ends; with 1, 2, 3 or 5 threads (more than the cores: a preempted
    thread's run is finished by the others) the result is the same bits, and the reference's.
    ``past-l2``: a thread's run of pages (3.4 MB in float32 at 2 threads) is more than half
    its L2, so it is not read ahead of attending (the other path of the same arithmetic)."""
    hq, hkv, d, ps = 9, 3, 64, 16
    news, before = [1, 1], [first, 332]  # 6 items: too few to hand out whole, even at 2 threads
    plan, _, pages_of = _ragged_batch(ps, news, before, hq, hkv, d)
    kp = torch.randn(1 + sum(len(p) for p in pages_of), ps, hkv, d).to(kv)
    vp = torch.randn_like(kp)
    q = torch.randn(sum(news), hq, d)
    outs = _over_thread_counts(q, kp, vp, plan, repeats=3)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    for i in range(2):
        ref = _reference(q[i : i + 1], kp.float(), vp.float(), pages_of[i], before[i] + 1, d**-0.5)
        assert (outs[0][i : i + 1].double() - ref).abs().max().item() < 2e-5


def test_bad_store_arguments_raise() -> None:
    q, kp = torch.randn(1, 9, 64), torch.randn(4, 16, 3, 64)
    plan = native.AttentionPlan.build([([native.Member(0, 1, [1], 3)], [])])
    k = torch.randn(1, 3, 64)
    with pytest.raises(RuntimeError, match="slot 64 out of range"):
        native.paged_attention(
            q, kp, kp.clone(), q.clone(), plan, 1.0, store=(k, k, torch.tensor([64]))
        )
    with pytest.raises(RuntimeError, match=r"k_new and v_new must be \[len\(slots\)"):
        native.paged_attention(
            q, kp, kp.clone(), q.clone(), plan, 1.0, store=(k, k, torch.tensor([1, 2]))
        )


@pytest.mark.parametrize(
    ("dtype", "d"),
    [(torch.float32, 64), (torch.bfloat16, 64), (torch.bfloat16, 256)],
    ids=["float32", "bfloat16", "bfloat16-d256"],
)
@pytest.mark.parametrize("shared_pages", [0, 3])
@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_decode_rows_equal_prefill_rows_over_many_chunks(
    page_size: int, shared_pages: int, dtype: torch.dtype, d: int
) -> None:
    """A long context's decode row spreads its key chunks over the threads and merges them
    afterwards; the prefill row of the same position computes and merges the same chunks on
    one thread: the two agree bit for bit, with one thread or two, and match the reference.
    bf16 queries over bf16 keys take AMX tiles where the CPU has them: keys read in place
    (16-token pages) or copied (pages of 1 and 5 tokens), partial blocks padded, head sizes
    up to 256 (eight 32-dimension steps)."""
    hq, hkv, n = 9, 3, 700  # 700 keys: past the serial threshold, several chunks per head
    shared = list(range(1, 1 + shared_pages))
    s_len = shared_pages * page_size
    own = list(range(1 + shared_pages, 1 + shared_pages + -(-n // page_size)))
    random.Random(page_size).shuffle(own)
    kp = torch.randn(1 + shared_pages + len(own), page_size, hkv, d).to(dtype)
    vp = torch.randn_like(kp)
    q = torch.randn(n, hq, d).to(dtype)
    scale = d**-0.5
    prefill = torch.empty_like(q)
    native.paged_attention(
        q,
        kp,
        vp,
        prefill,
        native.AttentionPlan.build([([native.Member(0, n, own, n)], shared)]),
        scale,
    )
    threads = torch.get_num_threads()
    try:
        for nthreads in (1, 2):
            torch.set_num_threads(nthreads)
            # The row's own keys end inside a chunk, exactly at a chunk's end, 3 keys past one
            # (chunks of 256 keys).
            for pos in (n - 1, 511, 258):
                out = torch.empty_like(q[:1])
                plan = native.AttentionPlan.build([([native.Member(0, 1, own, pos + 1)], shared)])
                native.paged_attention(q[pos : pos + 1], kp, vp, out, plan, scale)
                assert torch.equal(out[0], prefill[pos]), (nthreads, pos)
    finally:
        torch.set_num_threads(threads)
    ref = _reference(q.float(), kp.float(), vp.float(), shared + own, s_len + n, scale)
    assert (prefill.double() - ref).abs().max().item() < (2e-5 if dtype is torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d", [32, 64, 80, 96, 128])
@pytest.mark.parametrize("heads", [(4, 4), (8, 4), (9, 3), (8, 2), (10, 2)], ids=str)
def test_few_row_blocks_equal_wide_ones(heads: tuple[int, int], d: int, dtype: torch.dtype) -> None:
    """A decode row's few query rows per KV head (1 to 4 here; 5 takes the wide path) score
    their keys with the keys in the vector lanes, a prefill's 16 rows with the rows in them:
    the same arithmetic in the same order, so a decode row equals the prefill row of its
    position bit for bit, for every query group size, head size and KV dtype (float and bf16
    keys are read in place, float16 ones converted first; bf16 queries over bf16 keys of an
    even number of vectors, d = 32, 64, 96, 128, score by pairs of dimensions on both paths,
    on AMX tiles where the CPU has them)."""
    hq, hkv = heads
    n, page_size = 600, 16  # two full chunks (256 keys) and a partial one
    pages = list(range(1, 1 + -(-n // page_size)))
    random.Random(d).shuffle(pages)
    kp = torch.randn(1 + len(pages), page_size, hkv, d).to(dtype)
    vp = torch.randn_like(kp)
    q = torch.randn(n, hq, d).to(dtype)
    prefill = torch.empty_like(q)
    plan = native.AttentionPlan.build([([native.Member(0, n, pages, n)], [])])
    native.paged_attention(q, kp, vp, prefill, plan, d**-0.5)
    for pos in (n - 1, 511, 255, 200, 64):
        out = torch.empty_like(q[:1])
        plan = native.AttentionPlan.build([([native.Member(0, 1, pages, pos + 1)], [])])
        native.paged_attention(q[pos : pos + 1], kp, vp, out, plan, d**-0.5)
        assert torch.equal(out[0], prefill[pos]), pos
    ref = _reference(q.float(), kp.float(), vp.float(), pages, n, d**-0.5)
    tol = 2e-5 if dtype is torch.float32 else 2e-2
    assert (prefill.double() - ref).abs().max().item() < tol


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@pytest.mark.skipif(
    "amx_bf16" not in _cpu_flags(), reason="no AMX here: the AVX-512 path is the only bf16 one"
)
def test_bf16_tests_pass_without_amx() -> None:
    """Where the CPU has AMX, bf16 queries over bf16 keys take its tiles, and the tests above
    test those; other CPUs take the AVX-512 pair scores. RADIXSERVE_CPU_AMX=0 declines the
    tiles (read once per process: a child pytest), and the same bf16 tests pass on that path."""
    env = {**os.environ, "RADIXSERVE_CPU_AMX": "0"}
    tests = "bfloat16 and (few_row or over_many_chunks or half_precisions)"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", tests]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:]
    assert " passed" in result.stdout and " deselected" in result.stdout


def test_values_stored_between_calls_are_read_anew() -> None:
    """A prefill's blocks of rows reuse the value tiles a thread built for the blocks before
    them (AMX, bf16), within one call only: values stored into the same pages between two
    calls of the same plan are read anew, by one thread or two."""
    hq, hkv, d, ps, n = 9, 3, 64, 16, 300
    pages = list(range(1, 1 + -(-n // ps)))
    random.Random(3).shuffle(pages)
    kp = torch.randn(1 + len(pages), ps, hkv, d).bfloat16()
    vp = torch.randn_like(kp)
    q = torch.randn(n, hq, d).bfloat16()
    plan = native.AttentionPlan.build([([native.Member(0, n, pages, n)], [])])
    threads = torch.get_num_threads()
    try:
        for nthreads in (1, 2):
            torch.set_num_threads(nthreads)
            for _ in range(2):
                vp.copy_(torch.randn_like(vp))  # new values, same pages, same plan
                out = torch.empty_like(q)
                native.paged_attention(q, kp, vp, out, plan, d**-0.5)
                ref = _reference(q.float(), kp.float(), vp.float(), pages, n, d**-0.5)
                assert (out.double() - ref).abs().max().item() < 2e-2
    finally:
        torch.set_num_threads(threads)
