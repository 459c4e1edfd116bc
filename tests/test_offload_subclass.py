"""Activation offload of models built on DTensor (issue 36, item 4): tensor parallelism with DTensor parameters and
activations (one rank, and 2-way on two ranks), and FSDP2 (``fully_shard``) on one rank, over gloo. A saved DTensor
is offloaded by its local tensor and rebuilt with ``__tensor_unflatten__``; FSDP2's unsharded parameters (storages
it gathers before a layer's forward and frees after it) are parameters, never offloaded. Gradients are compared
bitwise with the same model trained without offloading; a subclass without the flatten protocol is refused
(tests/test_offload_bulk.py). FP8 with torchao's real classes: a saved ``Float8TrainingTensor`` (offloaded by its
e4m3 data, rebuilt with its metadata), and a model converted by ``convert_to_float8_training``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from flowlane.launch import launch
from flowlane.offload import OffloadConfig, TensorCache, install

pytestmark = pytest.mark.llm  # DTensor and fully_shard as torch 2.15 has them

H, FF, TOKENS, LAYERS = 64, 256, 32, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(H, FF), nn.Linear(FF, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block() for _ in range(LAYERS)))


@pytest.fixture(scope="module")
def mesh() -> Iterator[object]:
    from torch.distributed.device_mesh import init_device_mesh

    own = not dist.is_initialized()
    if own:  # one rank: an in-process store, no port
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if own:
        dist.destroy_process_group()


def _cfg(tmp_path: Path, **kw: object) -> OffloadConfig:
    return OffloadConfig(
        **{"dirs": (str(tmp_path),), "min_bytes": 1024, "offload_cpu_tensors": True, "keep_last_k": 0, **kw}
    )


def _offloaded(model: nn.Sequential, tmp_path: Path, bulk: bool, scope: str) -> TensorCache:
    """``model``'s blocks offloaded: the bulk pinned tier (synchronous copies on CPU) or ``install``'s posix tier."""
    if not bulk:
        return install(model, _cfg(tmp_path), [scope])
    cache = TensorCache(_cfg(tmp_path, backend="pinned_cpu"), bulk_on_cpu=True)
    cache.register_parameters(model.parameters())
    for blk in model:
        cache.add_scope(blk)
    return cache.activate()


def _steps(model: nn.Module, x: torch.Tensor, n: int = 2) -> list[list[torch.Tensor]]:
    """Gradients of ``n`` forward/backward steps, as local tensors (a DTensor's ``to_local``)."""
    out = []
    for _ in range(n):
        model.zero_grad()
        model(x).sum().backward()
        out.append([getattr(p.grad, "to_local", lambda g=p.grad: g)().clone() for p in model.parameters()])
    return out


def _tensor_parallel(mesh: object) -> tuple[nn.Sequential, torch.Tensor]:
    """Megatron's column/row split written with DTensor: ``up`` sharded by rows, ``down`` by columns, the input
    replicated; every activation is a DTensor."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    model = _model()
    for blk in model:
        for lin, dim in ((blk.up, 0), (blk.down, 1)):
            lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Shard(dim)]))
            bias = Shard(0) if dim == 0 else Replicate()
            lin.bias = nn.Parameter(distribute_tensor(lin.bias.detach(), mesh, [bias]))
    torch.manual_seed(1)
    x = distribute_tensor(torch.randn(TOKENS, H), mesh, [Replicate()])
    return model, x


@pytest.mark.parametrize("bulk", [False, True], ids=["thread_tier", "bulk_tier"])
def test_dtensor_activations_are_offloaded_by_their_local_tensors_bitwise(
    mesh: object, tmp_path: Path, bulk: bool
) -> None:
    from torch.distributed.tensor import DTensor

    model, x = _tensor_parallel(mesh)
    ref = _steps(model, x)
    saved: list[str] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(type(t).__name__) or t, lambda t: t):
        model(x).sum()
    assert "DTensor" in saved and "Tensor" not in saved  # the premise: what autograd saves is DTensors
    cache = _offloaded(model, tmp_path, bulk, "Block")
    with cache:
        got = _steps(model, x)
        s = cache.stats_snapshot()
    for step_ref, step_got in zip(ref, got, strict=True):
        for a, b in zip(step_ref, step_got, strict=True):
            assert torch.equal(a, b)
    assert isinstance(model[0].up.weight.grad, DTensor)
    assert model[0].up.weight.grad.placements == model[0].up.weight.placements
    # each step, each block: its input, up's output and gelu's output stored (or cancelled when backward came
    # first), the weights never (the first block's input needs no gradient, so its ``up`` saves no weight)
    # cancelled: still queued
    assert s.bytes_written + s.bytes_cancelled == 2 * LAYERS * (H + 2 * FF) * TOKENS * 4
    assert s.param_skips == 2 * (2 * LAYERS - 1)


def _fully_sharded(mesh: object) -> tuple[nn.Sequential, torch.Tensor]:
    """FSDP2 on every block and the root; reshard after forward: the gathered weights are freed, then gathered
    again for backward."""
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for blk in model:
        fully_shard(blk, mesh=mesh)
    torch.manual_seed(1)
    return fully_shard(model, mesh=mesh), torch.randn(TOKENS, H, requires_grad=True)


def test_fsdp2_unsharded_parameters_are_never_offloaded_and_grads_are_bitwise(
    mesh: object, tmp_path: Path
) -> None:
    ref_model, x = _fully_sharded(mesh)
    ref = _steps(ref_model, x)
    model, _ = _fully_sharded(mesh)
    with install(model, _cfg(tmp_path), ["Block"]) as cache:
        got = _steps(model, x)
        s = cache.stats_snapshot()
    for step_ref, step_got in zip(ref, got, strict=True):
        for a, b in zip(step_ref, step_got, strict=True):
            assert torch.equal(a, b)
    # the gathered weights (saved as W.t() views) are known as parameters from each block's forward start
    assert s.param_skips == 2 * LAYERS * 2
    # cancelled: still queued
    assert s.bytes_written + s.bytes_cancelled == 2 * LAYERS * (H + 2 * FF) * TOKENS * 4


def tensor_parallel_rank(rank: int, world: int, tmp: str) -> dict[str, object]:
    """One rank of a 2-way tensor-parallel run (launched): ``up``'s output and gelu's are each rank's half."""
    from torch.distributed.device_mesh import init_device_mesh

    model, x = _tensor_parallel(init_device_mesh("cpu", (world,)))
    ref = _steps(model, x)
    with install(model, _cfg(Path(tmp) / str(rank)), ["Block"]) as cache:
        got = _steps(model, x)
        s = cache.stats_snapshot()
    equal = all(torch.equal(a, b) for r, g in zip(ref, got, strict=True) for a, b in zip(r, g, strict=True))
    return {"equal": equal, "stored": s.bytes_written + s.bytes_cancelled, "param_skips": s.param_skips}


def test_dtensor_tensor_parallel_on_two_ranks_offloads_each_ranks_shards_bitwise(tmp_path: Path) -> None:
    for r in range(2):
        (tmp_path / str(r)).mkdir()
    res = launch(tensor_parallel_rank, 2, args=(str(tmp_path),), timeout=120)
    for r in res:
        assert r["equal"] is True
        # each rank stores the replicated block input and its own halves of up's and gelu's outputs
        assert r["stored"] == 2 * LAYERS * (H + FF) * TOKENS * 4
        assert r["param_skips"] == 2 * (2 * LAYERS - 1)


@pytest.mark.parametrize("build", [_fully_sharded, _tensor_parallel], ids=["fsdp2", "tensor_parallel"])
def test_recompute_on_fsdp2_and_dtensor_models_is_bitwise(mesh: object, tmp_path: Path, build) -> None:  # noqa: ANN001
    """``recompute``: the layers the budget names run their forward again in backward under torch's checkpoint (FSDP2
    gathers their weights again for it); a link of 1 kB/s hides nothing (1 MB/s hid a 73 kB layer behind a loaded
    host's 0.4 s step and the budget offloaded instead), so the slack buys recomputation."""
    (ref_model, x), (model, _) = build(mesh), build(mesh)
    ref = _steps(ref_model, x, n=4)
    cfg = _cfg(tmp_path, adaptive=True, profile_step=1, max_slowdown=0.9, recompute=True, link_GBps=1e-6)
    with install(model, cfg, ["Block"]) as cache:
        got = _steps(model, x, n=4)
        s = cache.stats_snapshot()
    assert s.recomputed_layers >= 1, s.profile
    for step_ref, step_got in zip(ref, got, strict=True):
        for a, b in zip(step_ref, step_got, strict=True):
            assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------ FP8 (torchao)
class _SavesFloat8(torch.autograd.Function):
    """``y = x @ w.T`` that saves ``x`` as torchao's ``Float8TrainingTensor`` (e4m3 data + a scale, the high-precision
    dtype and the GEMM role in its metadata) and computes ``grad_w`` from it: what a float8 recipe that keeps its
    cast inputs for backward saves."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        from torchao.float8.float8_training_tensor import LinearMMConfig, hp_tensor_and_scale_to_float8

        scale = torch.finfo(torch.float8_e4m3fn).max / x.abs().amax().clamp(min=1e-12).float()
        x8 = hp_tensor_and_scale_to_float8(x, scale, torch.float8_e4m3fn, LinearMMConfig())
        ctx.save_for_backward(x8, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        x8, w = ctx.saved_tensors
        return g @ w, g.t() @ x8.to_original_precision()


class Float8Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(H, H) / H**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(_SavesFloat8.apply(x, self.w))


@pytest.mark.parametrize("bulk", [False, True], ids=["posix", "pinned_cpu"])
def test_a_saved_float8_tensor_is_offloaded_by_its_inner_tensors_and_rebuilt(
    tmp_path: Path, bulk: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchao's ``Float8TrainingTensor`` saved for backward: flowlane stores its e4m3 data (its scale is below the
    size threshold), rebuilds it through ``__tensor_unflatten__`` with its metadata, and the gradients are bitwise
    those without offloading."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    rebuilt: list[torch.dtype] = []
    unflatten = Float8TrainingTensor.__tensor_unflatten__

    def counting(inner: dict, meta: dict, *a: object) -> Float8TrainingTensor:
        rebuilt.append(inner["_data"].dtype)
        return unflatten(inner, meta, *a)

    monkeypatch.setattr(Float8TrainingTensor, "__tensor_unflatten__", staticmethod(counting))

    torch.manual_seed(0)
    model = nn.Sequential(*(Float8Block() for _ in range(LAYERS)))
    x = torch.randn(TOKENS, H, requires_grad=True)
    ref = _steps(model, x)
    saved: list[type] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(type(t)) or t, lambda t: t):
        model(x).sum()
    assert Float8TrainingTensor in saved  # the premise
    cache = _offloaded(model, tmp_path, bulk, "Float8Block")
    with cache:
        got = _steps(model, x)
        s = cache.stats_snapshot()
    assert all(torch.equal(a, b) for r, g in zip(ref, got, strict=True) for a, b in zip(r, g, strict=True))
    assert rebuilt == [torch.float8_e4m3fn] * (2 * LAYERS)  # every saved x8 came back through flowlane, once
    if bulk:  # synchronous copies: exactly GELU's fp32 input and the e4m3 data, per block and step
        assert s.bytes_written == 2 * LAYERS * (4 + 1) * TOKENS * H, s


def test_torchao_float8_training_with_offload_is_bitwise(tmp_path: Path) -> None:
    """A model converted by torchao's ``convert_to_float8_training`` (Float8Linear: dynamic e4m3 casts, the scaled
    GEMM, here on CPU) with its layers offloaded: gradients bitwise those of the same float8 model without."""
    from torchao.float8 import convert_to_float8_training

    model = _model()
    convert_to_float8_training(model)
    assert type(model[0].up).__name__ == "Float8Linear"  # the premise
    torch.manual_seed(1)
    x = torch.randn(TOKENS, H, requires_grad=True)
    ref = _steps(model, x)
    with install(model, _cfg(tmp_path), ["Block"]) as cache:
        got = _steps(model, x)
        s = cache.stats_snapshot()
    assert all(torch.equal(a, b) for r, g in zip(ref, got, strict=True) for a, b in zip(r, g, strict=True))
    assert s.bytes_written > 0 and s.param_skips > 0, s
