"""gnn_fullgraph's data group is checked before any rank starts: `data.name=cora` started 2 ranks that failed after
33 s (exit 1, a traceback each), and a 2-part `data.part_config` with world_size=4 failed in all four ranks, because
the partition count was only checked under torchrun/srun. Now each is refused with exit 2, naming the key."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gnn
pytest.importorskip("dgl")

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from recipes.train import run_job  # noqa: E402
from recipes.validate import DGL_OFFLINE_DATASETS, ConfigError, check_gnn, check_launch_gnn  # noqa: E402

CONF = Path(__file__).resolve().parent.parent / "recipes" / "conf"
LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "TORCHELASTIC_RUN_ID",
    "SLURM_STEP_ID",
    "SLURM_PROCID",
    "DGL_ROLE",
)


def _no_ranks(*a, **kw):
    raise AssertionError("ranks were started before the config was checked")


@pytest.fixture
def local(monkeypatch):
    """No launcher around this process (flowlane-train then starts local ranks), and none may start."""
    for k in LAUNCHER_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr("dgl_plugin.train.launch", _no_ranks)


def _recipe() -> dict:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return OmegaConf.to_container(compose(config_name="gnn_fullgraph"), resolve=True)  # type: ignore[return-value]


def test_the_offline_dataset_names_are_the_loaders():
    """recipes.validate keeps a copy of load_graph's offline names (the loader keeps them inside the function);
    its error lists them sorted, so an added or removed name fails here."""
    from dgl_plugin.datasets import load_graph

    with pytest.raises(ValueError) as e:
        load_graph("no-such-dataset")
    assert str(e.value).endswith(f"one of {sorted(DGL_OFFLINE_DATASETS)}"), e.value


def _parts(tmp: Path, n: int) -> str:
    p = tmp / f"parts{n}.json"
    p.write_text(json.dumps({"graph_name": "g", "num_parts": n}))
    return str(p)


@pytest.mark.parametrize(
    "world, data, match",
    [
        (
            2,
            {"name": "cora"},
            r"^data.name='cora' must be 'synthetic', 'dgl-bin:<path>', 'ogbn-<name>' \(already on disk\) or one "
            r"of \['bacommunity', 'bashape', 'karate', 'treecycle'\]$",
        ),
        (
            2,
            {"num_node": 100},
            r"^unknown data key\(s\) \['num_node'\]; allowed: \['name', 'root', 'part_config', ",
        ),
        (2, {"seed": 1}, r"unknown data key\(s\) \['seed'\] \(the graph's seed is the recipe's seed\)"),
        (2, {"num_nodes": "many"}, r"^data.num_nodes='many' must be an integer$"),
        (2, {"num_classes": 1}, r"^synthetic graph: bad data.num_classes=1 "),
        (2, {"name": "dgl-bin:{tmp}/g.bin"}, r"^data.name='dgl-bin:.*g.bin': no file at '.*g.bin'"),
        (
            2,
            {"name": "ogbn-arxiv", "root": "{tmp}"},
            r"^data.name='ogbn-arxiv' is not on disk under '.*ogbn_arxiv'",
        ),
        (
            2,
            {"root": "{tmp}"},
            r"^data.root='.*' applies to data.name='ogbn-<name>' only; data.name='synthetic'",
        ),
        # the partition count, for local ranks as under torchrun/srun
        (
            4,
            {"part_config": "{parts2}"},
            r"^data.part_config='.*parts2.json' has num_parts=2 but world_size=4: full-graph training needs one "
            r"partition per rank",
        ),
        (2, {"part_config": "{tmp}/none.json"}, r"^data.part_config='.*none.json' is not a file"),
        (
            2,
            {"part_config": "{tmp}/bad.json"},
            r"^data.part_config='.*bad.json' cannot be read as a partition JSON",
        ),
        (2, {"part_config": "{tmp}/list.json"}, r"^data.part_config='.*list.json' has no integer num_parts"),
    ],
)
def test_a_bad_data_group_is_refused_before_any_rank_starts(tmp_path, local, world, data, match):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[2]")
    fmt = {"tmp": tmp_path, "parts2": _parts(tmp_path, 2)}
    cfg = _recipe()
    cfg["data"].update({k: v.format(**fmt) if isinstance(v, str) else v for k, v in data.items()})
    cfg.update(world_size=world, output_dir=str(tmp_path / "out"))
    with pytest.raises(ConfigError, match=match):
        run_job(cfg)


def test_the_recipes_data_and_its_alternatives_still_pass(tmp_path, local):
    cfg = {**_recipe(), "output_dir": str(tmp_path / "out")}
    check_gnn(cfg)
    for name in (
        *DGL_OFFLINE_DATASETS,
        f"dgl-bin:{_parts(tmp_path, 2)}",
    ):  # any file: the name's form and path
        check_gnn({**cfg, "data": {**cfg["data"], "name": name}})
    (tmp_path / "ogbn_arxiv").mkdir()
    ogbn = {**cfg, "data": {**cfg["data"], "name": "ogbn-arxiv", "root": str(tmp_path)}}
    if importlib.util.find_spec("ogb") is None:  # optional in the gnn lane: load_graph imports it for ogbn-*
        with pytest.raises(ConfigError, match=r"^data.name='ogbn-arxiv' needs the ogb package"):
            check_gnn(ogbn)
    else:
        check_gnn(ogbn)
    for world in (1, 2, 4):
        c = {**cfg, "world_size": world, "data": {**cfg["data"], "part_config": _parts(tmp_path, world)}}
        check_gnn(c)
        assert check_launch_gnn(c) == (c, None)


def test_flowlane_train_refuses_an_unknown_dataset_with_exit_2(tmp_path):
    exe = Path(sys.executable).parent / "flowlane-train"
    r = subprocess.run(
        [
            str(exe),
            "--config-name",
            "gnn_fullgraph",
            "data.name=cora",
            f"output_dir={tmp_path}/out",
            f"hydra.run.dir={tmp_path}/hydra",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.startswith("flowlane-train: error: data.name='cora' must be 'synthetic'"), r.stderr[
        -3000:
    ]
    assert "Traceback" not in r.stderr and "rank" not in r.stderr
