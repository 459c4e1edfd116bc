"""The llm lane has a working Megatron-core and DeepSpeed: this test fails (never skips) when either does not import or
is outside the range the plugins accept, so a broken install cannot turn the Megatron and DeepSpeed tests (which
``importorskip`` them: the gnn lane collects them too) into skips and leave CI green. The gnn lane's twin is
tests/test_dgl_lane.py."""

import pytest

pytestmark = pytest.mark.llm


def test_megatron_core_and_deepspeed_import_in_the_llm_lane_inside_the_plugins_ranges():
    import deepspeed  # noqa: F401
    from megatron.core.distributed import DistributedDataParallel  # noqa: F401
    from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: F401

    from deepspeed_plugin.hermod import check_deepspeed_version
    from megatron_plugin.hermod import check_megatron_core_version

    check_megatron_core_version("the llm lane")  # raises outside MEGATRON_CORE_VERSIONS
    check_deepspeed_version()  # raises outside DEEPSPEED_VERSIONS
