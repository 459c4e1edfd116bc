"""The process-wide comm recorder stays bounded in a long job and its totals stay whole."""

from flowlane import comm
from flowlane.comm import CommOp, CommRecorder


def _op(kind: str, op: str, nbytes: int) -> CommOp:
    return CommOp(kind, op, (0, 1), (1,), nbytes, 0.0)


def test_the_log_keeps_its_newest_ops_and_the_totals_count_every_op():
    rec = CommRecorder(max_entries=3)
    for i in range(5):
        rec.add(_op("pp", "isend", 10 + i))
    rec.add(_op("pp", "irecv", 1000))  # received bytes are not this rank's to count
    assert [o.nbytes for o in rec.ops] == [13, 14, 1000] and rec.dropped == 3
    assert rec.bytes_by_kind() == {"pp": 10 + 11 + 12 + 13 + 14} and rec.count_by_kind() == {"pp": 6}
    rec.enabled = False
    rec.add(_op("dp", "all_reduce", 7))
    assert rec.count_by_kind() == {"pp": 6}
    rec.clear()
    assert not rec.ops and rec.dropped == 0 and rec.bytes_by_kind() == {} and rec.count_by_kind() == {}


def test_the_process_wide_recorder_is_bounded_and_a_scoped_one_is_not():
    # a training job never clears it: Megatron's pipeline sends alone add ~256 ops per iteration and rank
    assert comm.get_recorder().ops.maxlen == 100_000
    with comm.recording() as rec:
        assert rec.ops.maxlen is None
