"""The KV-transfer seed units: hand-worked examples and property tests."""
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from longserve.kv_transfer.topology import KVLayout, KVPiece, TpKVTopology, plan_kv_pieces
from longserve.kv_transfer.transfer import PieceRange, pack_piece, payload_shape, slots_of, unpack_piece
from longserve.kv_transfer.utils import (KVConnectorOutput, KVOutputAggregator, _make_src_and_dst_indices,
                                         copy_kv_blocks, get_kv_connector_cache_layout,
                                         kv_postprocess_blksize_and_layout_on_receive,
                                         kv_postprocess_blksize_on_receive,
                                         kv_postprocess_layout_on_receive, yield_req_data)
from longserve.step_plan import ScheduledRequest, SchedulerOutput


@dataclass
class Out:  # a ModelRunnerOutput stand-in
    sampled: dict
    kv_connector_output: KVConnectorOutput | None = None


def kvo(send=(), recv=(), bad=()):
    return KVConnectorOutput(set(send), set(recv), set(bad))


# ---- KVOutputAggregator ------------------------------------------------------------------
def test_aggregator_waits_for_every_worker_across_steps():
    agg = KVOutputAggregator(expected_finished_count=3)
    r = agg.aggregate([Out({"a": 1}, kvo(send=["x"], recv=["y"])), Out({}, kvo(send=["x"])), None])
    assert r.sampled == {"a": 1} and r.kv_connector_output.finished_sending == set()
    r = agg.aggregate([Out({}, kvo(recv=["y"])), Out({}, kvo(recv=["y"], bad=[4])),
                       Out({}, kvo(send=["x"], bad=[7]))])
    assert r.kv_connector_output.finished_sending == {"x"}
    assert r.kv_connector_output.finished_recving == {"y"}
    assert r.kv_connector_output.invalid_block_ids == {4, 7}
    r = agg.aggregate([Out({}, kvo(send=["x"])), Out({}), Out({})])  # x starts a new count
    assert r.kv_connector_output.finished_sending == set()
    assert agg._send_remaining_count == {"x": 2}


def test_aggregator_output_rank_and_from_connector():
    class Conn:
        def get_finished_count(self):
            return 2
    agg = KVOutputAggregator.from_connector(Conn(), world_size=8)
    r = agg.aggregate([Out({"a": 1}, kvo(recv=["q"])), Out({"b": 2}, kvo(recv=["q"]))], output_rank=1)
    assert r.sampled == {"b": 2} and r.kv_connector_output.finished_recving == {"q"}
    assert KVOutputAggregator.from_connector(object(), world_size=4)._expected_finished_count == 4
    with pytest.raises(ValueError, match="expected_finished_count"):
        KVOutputAggregator(0)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.lists(st.lists(st.sets(st.sampled_from("abcd"), max_size=3),
                                            min_size=1, max_size=4), max_size=6))
def test_aggregator_finishes_exactly_when_all_reported(n, steps):
    """Property: a request is reported finished exactly when its report count reaches n."""
    agg, counts = KVOutputAggregator(n), {}
    for step in steps:
        reports = (step + [set()] * n)[:n]
        done = agg.aggregate([Out({}, kvo(send=s)) for s in reports]).kv_connector_output
        expect = set()
        for s in reports:  # worker by worker: the n-th report finishes it, the next starts over
            for r in s:
                counts[r] = counts.get(r, 0) + 1
                if counts[r] == n:
                    expect.add(r)
                    del counts[r]
        assert done.finished_sending == expect


# ---- TpKVTopology ---------------------------------------------------------------------------
def topo(tp_rank, local_tp, remote_tp, heads=8, local_bs=16, remote_bs=16, **kw):
    return TpKVTopology(tp_rank, {"D": local_tp, "P": remote_tp}, False, heads, None, "D",
                        {"D": local_bs, "P": remote_bs}, **kw)


def test_tp_ratio_block_size_ratio_and_targets():
    t = topo(3, local_tp=4, remote_tp=2, local_bs=16, remote_bs=4)
    assert t.tp_ratio(2) == 2 and t.tp_ratio_from_engine_id("P") == 2
    assert t.block_size_ratio(4) == 4 and t.block_size_ratio_from_engine_id("P") == 4
    assert t.get_target_remote_ranks(2) == [1] == t.get_target_remote_ranks_from_engine_id("P")
    t = topo(1, local_tp=2, remote_tp=4)
    assert t.tp_ratio(4) == -2 and t.get_target_remote_ranks(4) == [2, 3]
    assert topo(0, 1, 1).get_target_remote_ranks(1) == [0]
    with pytest.raises(ValueError, match="multiple"):
        topo(0, 2, 3).tp_ratio(3)
    with pytest.raises(ValueError, match="block size"):
        topo(0, 1, 1, local_bs=4, remote_bs=16).block_size_ratio(16)


def test_replication():
    t = topo(0, local_tp=1, remote_tp=4, heads=2)
    assert t.is_kv_replicated("P") and not t.is_kv_replicated("D")
    assert t.replicates_kv_cache("P") and not t.replicates_kv_cache("D")
    assert TpKVTopology(0, {"D": 1}, True, 8, None, "D", {"D": 16}).replicates_kv_cache("D")
    # remote ranks 0,1 hold head 0 and 2,3 hold head 1: one copy of each is read
    assert t.get_target_remote_ranks(4) == [0, 2]
    # with DCP a tp=4 x dcp=2 instance has 2 head groups: 2 heads are not replicated
    d = TpKVTopology(0, {}, False, 2, None, "D", {}, remote_layout={"D": KVLayout(2, 16, tp=4, dcp=2)})
    assert not d.is_kv_replicated("D")


def test_one_kv_head_shape_tp2_replicates_and_tp2_dcp2_shards():
    """llama3-8b-1kv-shape (the layout guide's case): at tp=2 both ranks hold the one head
    and every token; at tp=2 x dcp=2 both hold the head and half the tokens each."""
    from longserve.models.builtin import model_config, resolve_model
    cfg = model_config(resolve_model("builtin:llama3-8b-1kv-shape"))
    assert (cfg.num_kv_heads, cfg.num_heads, cfg.num_layers, cfg.hidden_size) == (1, 32, 32, 4096)
    tp2, tp2dcp2 = KVLayout(1, 16, tp=2), KVLayout(1, 16, tp=2, dcp=2)
    assert [tp2.heads(r) for r in (0, 1)] == [(0, 1), (0, 1)] and tp2.cp_size == 1
    assert [tp2dcp2.heads(r) for r in (0, 1)] == [(0, 1), (0, 1)] and tp2dcp2.cp_size == 2
    p = np.arange(64)
    assert [int((tp2dcp2.owner(p) == tp2dcp2.cp_rank(r)).sum()) for r in (0, 1)] == [32, 32]
    t = TpKVTopology(0, {}, False, 1, None, "D", {}, remote_layout={"D": tp2, "E": tp2dcp2})
    assert t.is_kv_replicated("D") and not t.is_kv_replicated("E")


def test_cp_pieces_producer_pcp2_to_consumer_tp2():
    prod, cons = KVLayout(4, 16, pcp=2), KVLayout(4, 16, tp=2)
    assert plan_kv_pieces(cons, prod, 1) == [KVPiece(1, 0, 0, 0, 0, 2, 2), KVPiece(1, 1, 0, 1, 0, 2, 2)]
    piece = plan_kv_pieces(cons, prod, 1)[1]
    assert piece.positions(cons, prod, 0, 7).tolist() == [1, 3, 5]
    t = TpKVTopology(1, {}, False, 4, None, "D", {}, remote_layout={"D": cons, "P": prod})
    assert t.get_target_remote_ranks_from_engine_id("P") == [0, 1]


def test_cp_pieces_producer_tp1_to_consumer_tp2_dcp2():
    prod, cons = KVLayout(4, 16), KVLayout(4, 16, tp=2, dcp=2)
    # consumer rank 1: dcp rank 1 (odd positions), and its DCP group holds all 4 heads
    assert plan_kv_pieces(cons, prod, 1) == [KVPiece(1, 0, 1, 0, 0, 0, 4)]
    assert plan_kv_pieces(cons, prod, 1)[0].positions(cons, prod, 0, 6).tolist() == [1, 3, 5]
    cons4 = KVLayout(4, 16, tp=4, dcp=2)  # rank 3: head group 1 (heads 2, 3), dcp rank 1
    assert plan_kv_pieces(cons4, prod, 3) == [KVPiece(3, 0, 1, 0, 0, 2, 2)]


def test_cp_pieces_interleaved_producer_pcp2_dcp2_to_consumer_pcp2_tp2():
    prod = KVLayout(2, 8, tp=2, pcp=2, dcp=2, interleave=2)  # 4 shards, runs of 2
    cons = KVLayout(2, 8, tp=2, pcp=2)  # 2 shards, heads split over tp
    # consumer rank 3 (pcp 1, tp 1): head 1, CP rank 1 = odd positions; producer position p
    # is on CP rank (p // 2) % 4 = model rank, and every producer rank holds both heads
    pieces = plan_kv_pieces(cons, prod, 3)
    assert [(p.remote_rank, p.remote_cp_rank, p.remote_head) for p in pieces] == \
        [(0, 0, 1), (1, 1, 1), (2, 2, 1), (3, 3, 1)]
    assert [p.positions(cons, prod, 0, 10).tolist() for p in pieces] == [[1, 9], [3], [5], [7]]


# ---- receive-side fix-ups -----------------------------------------------------------------
def test_layout_on_receive_hand_example():
    cache = torch.zeros(3, 3, 2, 1)  # NHD [blocks, N=3, H=2, D=1]
    cache[1] = torch.arange(6.).view(3, 2, 1)  # bytes of HND |h0: 0 1 2|h1: 3 4 5|
    kv_postprocess_layout_on_receive(cache, torch.tensor([1]))
    assert cache[1, :, :, 0].tolist() == [[0, 3], [1, 4], [2, 5]]
    assert cache[0].abs().sum() == 0


def test_blksize_on_receive_hand_example():
    cache = torch.zeros(2, 2, 4, 1)  # HND [blocks, H=2, N=4, D=1], remote N=2
    cache[0] = torch.arange(8.).view(2, 4, 1)  # |h0-b0 0 1|h1-b0 2 3|h0-b1 4 5|h1-b1 6 7|
    kv_postprocess_blksize_on_receive(cache, torch.tensor([0]), 2)
    assert cache[0, :, :, 0].tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_blksize_and_layout_on_receive_equals_reference():
    H, Nr, D, k = 3, 2, 2, 4
    remote = torch.randn(5 * k, H, Nr, D)  # HND remote blocks of one layer
    cache = torch.zeros(7, k * Nr, H, D)
    dst = torch.tensor([6, 0, 3, 2, 5])
    cache.view(7, -1)[dst] = remote.reshape(5, -1)  # raw bytes of k remote blocks per local block
    kv_postprocess_blksize_and_layout_on_receive(cache, dst, k)
    expect = remote.view(5, k, H, Nr, D).permute(0, 1, 3, 2, 4).reshape(5, k * Nr, H, D)
    assert torch.equal(cache[dst], expect)


# ---- copies, step plan, layout -------------------------------------------------------------
def test_copy_kv_blocks_runs_and_scattered():
    src = {f"l{i}": torch.randn(2, 6, 4, 2, 3) for i in range(2)}
    dst = {f"l{i}": torch.zeros(2, 9, 4, 2, 3) for i in range(2)}
    copy_kv_blocks(src, dst, [3, 1, 5], [8, 0, 2], "d2h")
    copy_kv_blocks(src, dst, [0, 1], [4, 5], "h2d")  # both contiguous: slice copies
    for n in src:
        assert torch.equal(dst[n][:, [8, 0, 2, 4, 5]], src[n][:, [3, 1, 5, 0, 1]])
        assert dst[n][:, [1, 3, 6, 7]].abs().sum() == 0
    with pytest.raises(ValueError, match="direction"):
        copy_kv_blocks(src, dst, [0], [0], "d2d")
    with pytest.raises(ValueError, match="2 source blocks for 1"):
        _make_src_and_dst_indices([0, 1], [0], "cpu", "cpu")
    s, d = _make_src_and_dst_indices([4, 2], [1, 0], "cpu", "cpu")
    assert s.tolist() == [4, 2] and d.dtype == torch.long


def test_yield_req_data_and_cache_layout():
    out = SchedulerOutput([
        ScheduledRequest("a", [1, 2], 0, [4, 5], True, True),
        ScheduledRequest("b", [3], 7, [9], False, True),
        ScheduledRequest("c", [1, 2, 3], 0, [1, 2], True, True, resumed_from_preemption=True)])
    assert list(yield_req_data(out)) == [("a", ([4, 5],), False), ("b", ([9],), False),
                                         ("c", ([1, 2],), True)]
    assert get_kv_connector_cache_layout() == "NHD"

    class C:
        kv_buffer_layout = "HND"
    assert get_kv_connector_cache_layout(C()) == "HND"
    C.kv_buffer_layout = "XYZ"
    with pytest.raises(ValueError, match="kv_buffer_layout"):
        get_kv_connector_cache_layout(C())


# ---- the whole transfer path: shard, move, reassemble --------------------------------------
def write_sequence(layout: KVLayout, rank: int, cache: list, blocks, kv: torch.Tensor) -> None:
    """Store kv [L, 2, n, H, D] into one rank's caches as the engine would."""
    first, count = layout.heads(rank)
    pos = np.arange(kv.shape[2])
    slots = slots_of(layout, layout.cp_rank(rank), blocks, pos)
    mine = slots >= 0
    for layer, c in enumerate(cache):
        c.view(2, -1, *c.shape[-2:])[:, torch.from_numpy(slots[mine])] = \
            kv[layer][:, torch.from_numpy(pos[mine]), first:first + count]


def new_caches(layout: KVLayout, layers: int, num_blocks: int, dim: int) -> list:
    heads = layout.heads(0)[1]
    return [[torch.zeros(layers, 2, num_blocks, layout.block_size, heads, dim)[i] for i in range(layers)]
            for _ in range(layout.world_size)]


@st.composite
def layouts(draw, heads):
    tp = draw(st.sampled_from([1, 2, 4]))
    dcp = draw(st.sampled_from([d for d in (1, 2, 4) if tp % d == 0]))
    bs = draw(st.sampled_from([2, 4, 8]))
    return KVLayout(heads, bs, tp=tp, pcp=draw(st.sampled_from([1, 2])), dcp=dcp,
                    interleave=draw(st.sampled_from([i for i in (1, 2) if bs % i == 0])),
                    cache_layout=draw(st.sampled_from(["NHD", "HND"])))


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_shard_move_reassemble_is_bit_exact(data):
    heads = data.draw(st.sampled_from([1, 2, 4]))
    prod, cons = data.draw(layouts(heads)), data.draw(layouts(heads))
    if data.draw(st.booleans()):  # often: same sharding, consumer's block a multiple (block wire)
        cons = KVLayout(heads, prod.block_size * data.draw(st.sampled_from([1, 2])), tp=cons.tp,
                        pcp=prod.cp_size, interleave=prod.interleave)
    n = data.draw(st.integers(2, 40))
    start = data.draw(st.integers(0, (n - 1) // cons.tokens_per_block)) * cons.tokens_per_block
    L, D = 2, 3
    kv = torch.randn(L, 2, n, heads, D)
    pb, cb = -(-n // prod.tokens_per_block), -(-n // cons.tokens_per_block)
    rng = np.random.default_rng(data.draw(st.integers(0, 99)))
    p_blocks, c_blocks = rng.permutation(pb + 3)[:pb].tolist(), rng.permutation(cb + 3)[:cb].tolist()
    p_caches, c_caches = new_caches(prod, L, pb + 3, D), new_caches(cons, L, cb + 3, D)
    for r in range(prod.world_size):
        write_sequence(prod, r, p_caches[r], p_blocks, kv)
    span = PieceRange(start, n, tuple(p_blocks), tuple(c_blocks))
    for r in range(cons.world_size):
        pieces = plan_kv_pieces(cons, prod, r)
        for cp in {p.remote_cp_rank for p in pieces}:  # each shard's pieces cover all my heads
            covered = [h for p in pieces if p.remote_cp_rank == cp
                       for h in range(p.local_head, p.local_head + p.num_heads)]
            assert sorted(covered) == list(range(cons.heads(r)[1]))
        for piece in pieces:
            payload = pack_piece(p_caches[piece.remote_rank], piece, prod, cons, span)
            assert payload.shape == payload_shape(piece, prod, cons, span, L, D)
            unpack_piece(c_caches[r], piece, prod, cons, span, payload.clone())
    for r in range(cons.world_size):  # reassemble what each consumer rank holds
        first, count = cons.heads(r)
        pos = np.arange(n)
        slots = slots_of(cons, cons.cp_rank(r), c_blocks, pos)
        for layer, c in enumerate(c_caches[r]):
            flat = c.view(2, -1, *c.shape[-2:])
            for p, s in zip(pos, slots):
                if s < 0:
                    continue
                got = flat[:, s]
                if p >= start:
                    assert torch.equal(got, kv[layer][:, p, first:first + count]), (p, r, layer)
                else:
                    assert got.abs().sum() == 0  # a prefix hit: never overwritten


@pytest.mark.parametrize("heads, tp, dcp", [(8, 4, 1), (2, 4, 1), (1, 4, 2), (4, 4, 2), (2, 8, 2), (8, 1, 1)])
def test_head_placement(heads, tp, dcp):
    """(The model's QKV projection and the transfer both place heads by kv_heads_of_rank.) A DCP
    group's ranks hold the same heads; the tp / dcp groups split the heads, or each holds one
    (replicated) when there are fewer heads than groups; together they hold every head."""
    from longserve.kv_transfer.topology import kv_heads_of_rank
    placed = [kv_heads_of_rank(heads, tp, r, dcp) for r in range(tp)]
    assert all(placed[r] == placed[r - r % dcp] for r in range(tp))
    assert all(count == max(1, heads // (tp // dcp)) for _, count in placed)
    assert set().union(*(range(f, f + c) for f, c in placed)) == set(range(heads))


@pytest.mark.timeout(60)
def test_pair_group_warm_wait_and_timeout():
    """A pair's two ranks (threads here) build and warm their group; wait_work waits for a
    receive and gives up after its timeout when nothing is sent."""
    import threading
    import torch.distributed as dist
    from longserve.kv_transfer.transport import make_pair_group, wait_work
    store, groups = dist.HashStore(), {}

    def build(rank):
        groups[rank] = make_pair_group(store, "t", rank, torch.device("cpu"), 10)
    threads = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    waiter = torch.device("cpu")
    got, sent = torch.zeros(3), torch.tensor([1.0, 2.0, 3.0])
    recv = groups[1].recv([got], 0, 5)
    wait_work(groups[0].send([sent], 1, 5), 5, waiter)
    wait_work(recv, 5, waiter)
    assert got.tolist() == [1.0, 2.0, 3.0]
    with pytest.raises((TimeoutError, RuntimeError)):
        wait_work(groups[1].recv([got], 0, 6), 0.3, waiter)
