"""The gnn lane has a working DGL: this test fails (never skips) when DGL or dgl.distributed does not import, so a
broken install cannot turn every other gnn test into a skip and leave CI green."""

import pytest

pytestmark = pytest.mark.gnn


def test_dgl_imports_in_the_gnn_lane():
    import dgl
    import dgl.distributed
    import dgl.nn  # noqa: F401

    major, minor = (int(x) for x in dgl.__version__.split(".")[:2])
    assert (major, minor) >= (2, 1), f"gnn lane expects DGL >= 2.1, got {dgl.__version__}"
    assert callable(dgl.distributed.partition_graph) and callable(dgl.distributed.load_partition)
