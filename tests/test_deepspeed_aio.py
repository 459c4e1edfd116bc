"""DeepSpeed's async I/O op (deepspeed.ops.aio) as the offload's SSD backend: chosen where it builds and loads,
flowlane's posix backend otherwise, the choice logged on the ``flowlane.offload`` logger; ``"on"`` refuses a machine
where it cannot load. The round trip runs where the op loads (libaio's headers and library present)."""

from __future__ import annotations

import logging

import pytest
import torch

pytestmark = pytest.mark.llm
pytest.importorskip("deepspeed")

from deepspeed_plugin.ssd_offload import (  # noqa: E402
    DeepSpeedAioBackend,
    choose_backend,
    deepspeed_aio_op,
)
from flowlane.offload import OffloadConfig  # noqa: E402
from flowlane.offload.backends import BackendUnavailableError  # noqa: E402


def _cfg(tmp_path, backend: str = "posix") -> OffloadConfig:
    return OffloadConfig(backend=backend, dirs=(str(tmp_path),))


def test_choice_follows_whether_the_op_loads_and_is_logged(tmp_path, caplog) -> None:
    op, why = deepspeed_aio_op()
    with caplog.at_level(logging.INFO, logger="flowlane.offload"):
        got = choose_backend(_cfg(tmp_path), "auto")
    try:
        if op is None:
            assert got is None and why in caplog.text and "SSD backend posix" in caplog.text
            with pytest.raises(BackendUnavailableError, match="libaio|did not build"):
                choose_backend(_cfg(tmp_path), "on")
        else:
            assert isinstance(got, DeepSpeedAioBackend)
            assert "SSD backend deepspeed.ops.aio" in caplog.text
    finally:
        if got is not None:
            got.close()
    assert choose_backend(_cfg(tmp_path), "off") is None
    # not a posix file tier: "auto" leaves flowlane's choice alone, "on" is refused naming the backend
    assert choose_backend(_cfg(tmp_path, "pinned_cpu"), "auto") is None
    with pytest.raises(ValueError, match="offload.backend='pinned_cpu'"):
        choose_backend(_cfg(tmp_path, "pinned_cpu"), "on")
    with pytest.raises(ValueError, match=r"'always' is not one of \['auto', 'on', 'off'\]"):
        choose_backend(_cfg(tmp_path), "always")


def test_aio_backend_round_trip(tmp_path) -> None:
    op, why = deepspeed_aio_op()
    if op is None:
        pytest.skip(why)
    backend = DeepSpeedAioBackend(op, (str(tmp_path),), rank=0)
    try:
        g = torch.Generator().manual_seed(0)
        for n in (4096, 5000, (1 << 20) + 7):  # aligned, unaligned, past one aio block
            data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
            h = backend.write(f"k{n}", data)
            assert torch.equal(backend.read(h, n, torch.device("cpu")), data)
            backend.delete(h)
    finally:
        backend.close()
    assert not list(tmp_path.iterdir())  # the run directory is removed
