"""flowlane.hermod.keys: the key rules both LLM adapters follow (seed 000 §5.3.1; digest A6.1 #1, #6)."""

from __future__ import annotations

import pytest

from flowlane.hermod.keys import P2P_DIRECTIONS, HermodKeys, interleaved_order
from flowlane.hermod.order import HermodOrderConfig
from flowlane.hermod.policy import HermodPolicy


def test_pp_keys_count_microbatches_per_direction_and_name_the_boundary_layer() -> None:
    k = HermodKeys(num_microbatches=3, layers_per_stage=4, stage=1)  # layers 4..7
    sends = [k.pp("send_next") for _ in range(4)]
    assert [m.microbatch for m in sends] == [0, 1, 2, 2]  # clamped to M-1
    assert {m.layer for m in sends} == {7} and {m.ctype for m in sends} == {"pp"}
    assert k.pp("recv_prev").microbatch == 0  # each direction counts on its own
    assert k.pp("recv_prev").layer == 3 and k.pp("send_prev").layer == 3 and k.pp("recv_next").layer == 7
    # clamped at 0
    assert HermodKeys(num_microbatches=2, layers_per_stage=4, stage=0).pp("recv_prev").layer == 0
    k.end_iteration()
    m = k.pp("send_next")
    assert (m.iteration, m.microbatch) == (1, 0)


def test_dp_reductions_carry_the_last_microbatch_and_gathers_the_first() -> None:
    k = HermodKeys(num_microbatches=4, layers_per_stage=2, stage=2)
    r, g = k.dp_reduce(5, "reduce_scatter"), k.dp_gather(4)
    assert (r.ctype, r.microbatch, r.layer, r.op) == ("dp", 3, 5, "reduce_scatter")
    assert (g.ctype, g.microbatch, g.layer, g.op, g.iteration) == ("dp", 0, 4, "all_gather", 0)
    # with dp_mid="consumer" the gather of the next iteration's first layer goes before this iteration's reduction
    p = HermodPolicy(HermodOrderConfig(4, dp_mid="consumer"))
    assert p.priority(k.dp_gather(4, iteration=1)) < p.priority(r)
    assert HermodPolicy(HermodOrderConfig(4)).priority(k.pp("send_next")) < HermodPolicy(
        HermodOrderConfig(4)
    ).priority(r)


def test_keys_are_numbered_in_issue_order_by_the_given_sequence() -> None:
    seq = iter(range(100, 200))
    k = HermodKeys(num_microbatches=2, layers_per_stage=1, stage=0, next_seq=lambda: next(seq))
    assert [k.ep(0, 0).seq, k.dp_reduce(0).seq, k.pp("send_next").seq] == [100, 101, 102]
    own = HermodKeys(num_microbatches=2, layers_per_stage=1, stage=0)
    assert [own.ep(0, 0).seq, own.ep(1, 0).seq] == [0, 1]


def test_bad_layouts_and_directions_are_refused_with_what_is_allowed() -> None:
    with pytest.raises(ValueError, match="num_microbatches must be an integer >= 1, got 0"):
        HermodKeys(num_microbatches=0, layers_per_stage=1, stage=0)
    with pytest.raises(ValueError, match="stage must be an integer >= 0, got -1"):
        HermodKeys(num_microbatches=1, layers_per_stage=1, stage=-1)
    with pytest.raises(ValueError, match=r"'send_fwd' is not one of \['send_next'"):
        HermodKeys(num_microbatches=1, layers_per_stage=1, stage=0).pp("send_fwd")
    assert P2P_DIRECTIONS == ("send_next", "recv_prev", "send_prev", "recv_next")


def test_interleaved_order_runs_each_microbatch_group_through_every_chunk() -> None:
    assert interleaved_order(4, 2, 2) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    # the last group takes the rest
    assert interleaved_order(5, 2, 2)[-4:] == [(2, 1), (3, 1), (4, 0), (4, 1)]
    assert interleaved_order(3, 1, 2) == [(0, 0), (1, 0), (2, 0)]
    with pytest.raises(ValueError, match="microbatch_group must be an integer >= 1, got 0"):
        interleaved_order(3, 2, 0)


def test_interleaved_pp_keys_follow_the_virtual_microbatch_order_of_each_direction() -> None:
    # 2 stages x 2 chunks, 1 layer per chunk: stage 0 holds layers 0 (chunk 0) and 2 (chunk 1), stage 1 layers 1, 3
    s0 = HermodKeys(num_microbatches=4, layers_per_stage=2, stage=0, num_stages=2, virtual_chunks=2)
    assert s0.chunk_layers(0) == (0, 0) and s0.chunk_layers(1) == (2, 2)
    sends = [s0.pp("send_next") for _ in range(8)]  # every forward of both chunks goes to stage 1
    assert [(m.microbatch, m.layer) for m in sends] == [
        (0, 0),
        (1, 0),
        (0, 2),
        (1, 2),
        (2, 0),
        (3, 0),
        (2, 2),
        (3, 2),
    ]
    # stage 0's chunk 0 is the first virtual stage: only chunk 1 receives activations (from stage 1's chunk 0)
    recvs = [s0.pp("recv_prev") for _ in range(4)]
    assert [(m.microbatch, m.layer) for m in recvs] == [(0, 1), (1, 1), (2, 1), (3, 1)]
    s1 = HermodKeys(num_microbatches=4, layers_per_stage=2, stage=1, num_stages=2, virtual_chunks=2)
    # stage 1's chunk 1 is the last virtual stage: only chunk 0 sends on; backward runs the chunks in reverse
    assert [(m.microbatch, m.layer) for m in (s1.pp("send_next") for _ in range(4))] == [
        (0, 1),
        (1, 1),
        (2, 1),
        (3, 1),
    ]
    assert [(m.microbatch, m.layer) for m in (s1.pp("send_prev") for _ in range(8))] == [
        (0, 2),
        (1, 2),
        (0, 0),
        (1, 0),
        (2, 2),
        (3, 2),
        (2, 0),
        (3, 0),
    ]
    with pytest.raises(ValueError, match="layers_per_stage=3 must be divisible by virtual_chunks=2"):
        HermodKeys(num_microbatches=4, layers_per_stage=3, stage=0, num_stages=2, virtual_chunks=2)
