"""The named scheduling policies follow the seed's factor order and take what their keys need from the workload:
``priority`` ranks MID > CType > LID with the iteration only breaking ties (digest A6.1 #2), ``hermod-dscp`` needs the
layers per stage its LID bits bucket (A6.1 #3), and a phase cap nothing reads is refused."""

import pytest

from flowlane.hermod.order import HermodOrderConfig
from flowlane.hermod.policy import HermodPolicy
from flowlane.policies import POLICIES, make_policy
from flowlane.policy import CoflowMeta, PriorityByKeyPolicy


def test_priority_ranks_microbatch_ctype_layer_and_the_iteration_only_breaks_ties():
    pri, hermod = PriorityByKeyPolicy(), HermodPolicy(HermodOrderConfig(4))
    late_dp = CoflowMeta("dp", iteration=0, microbatch=3, layer=0, op="reduce_scatter")
    next_pp = CoflowMeta("pp", iteration=1, microbatch=0, layer=5, op="send_fwd")
    # the next iteration's first microbatch goes before the last one's reduction, as in Hermod's order
    assert pri.priority(next_pp) < pri.priority(late_dp)
    assert hermod.priority(next_pp) < hermod.priority(late_dp)
    same = [CoflowMeta("ep", iteration=it, microbatch=1, layer=2) for it in (1, 0)]
    assert sorted(same, key=pri.priority) == same[::-1]  # equal (MID, CType, LID): older iteration first
    assert make_policy("priority").priority(next_pp) == pri.priority(next_pp)


def test_hermod_dscp_takes_the_workloads_layers_per_stage():
    with pytest.raises(ValueError, match=r"'hermod-dscp' .* needs the workload's layers per stage"):
        make_policy("hermod-dscp", "1f1b", 4)
    with pytest.raises(ValueError, match=r"'hermod-dscp' .* needs the workload's layers per stage"):
        POLICIES["hermod-dscp"]()
    with pytest.raises(ValueError, match="layers_per_stage must be an integer >= 1, got 0"):
        make_policy("hermod", layers_per_stage=0)
    p = make_policy("hermod-dscp", "1f1b", 4, layers_per_stage=8)
    # local layers 0..7 fill the two LID bits: 0, 1, 2, 3 (seed 000 §5.4)
    lids = [p.priority(CoflowMeta("ep", microbatch=0, layer=layer))[0] & 0b11 for layer in range(0, 8, 2)]
    assert lids == [0, 1, 2, 3]
    assert make_policy("hermod-nccl", layers_per_stage=8).priority(CoflowMeta("dp")) == (2,)  # ignored there


def test_a_phase_cap_nothing_reads_is_refused():
    from flowlane.sched.alltoall import AllToAllRunner

    for alg in ("alg3", "plain"):
        with pytest.raises(
            ValueError, match=rf"max_phases=4 has no effect with '{alg}': .*\(bvn, bvn_bottleneck\)"
        ):
            AllToAllRunner(alg, max_phases=4)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"max_phases=4 has no effect with auto with candidates \['plain', 'alg3'\]"
    ):
        AllToAllRunner("auto", candidates="plain,alg3", max_phases=4)
    with pytest.raises(ValueError, match="max_phases must be an integer >= 0"):
        AllToAllRunner("bvn", max_phases=-1)
    assert AllToAllRunner("bvn_bottleneck", max_phases=4).max_phases == 4
    assert (
        AllToAllRunner("auto", candidates="alg3,bvn", max_phases=4).max_phases == 4
    )  # bvn's plans are capped
    assert AllToAllRunner("alg3").max_phases == 0
