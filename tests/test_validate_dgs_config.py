"""gnn_dgs's config is checked before any process starts, every key: `+data.num_node=100` (a typo of a generator
field) was a TypeError in the parent after the run had started, exit 1 with a traceback; so were a bad data value,
`timeout_s=soon` and an unwritable `output_dir` (found after training); `peer_timeout_s=1e20` passed and failed in
every trainer. Now each is refused with exit 2 and one line naming the key (dgl_plugin.dgs_train.check_config)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gnn
pytest.importorskip("dgl")

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from dgl_plugin import dgs_train  # noqa: E402
from recipes.train import run_job  # noqa: E402
from recipes.validate import ConfigError  # noqa: E402

CONF = Path(__file__).resolve().parent.parent / "recipes" / "conf"
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "SLURM_STEP_ID", "SLURM_PROCID")
LAUNCHER_VARS += ("DGL_ROLE", "DGL_CONF_PATH", "DGL_IP_CONFIG")
ALLOWED = (
    r"allowed: \['num_nodes', 'avg_degree', 'num_classes', 'signal_dims', 'redundant_dims', 'noise_dims', "
    r"'signal', 'p_in', 'alpha', 'label_noise', 'train_frac', 'val_frac'\]$"
)


def _no_run(*a, **kw):
    raise AssertionError("the run started before the config was checked")


@pytest.fixture
def local(monkeypatch):
    """No launcher around this process (the recipe then partitions and starts servers + trainers), and nothing
    may start."""
    for k in LAUNCHER_VARS:
        monkeypatch.delenv(k, raising=False)
    for name in ("partition_redundant", "run_cluster", "_trainer"):
        monkeypatch.setattr(f"dgl_plugin.dgs_train.{name}", _no_run)


def _recipe(tmp: Path) -> dict:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = OmegaConf.to_container(compose(config_name="gnn_dgs"), resolve=True)
    assert isinstance(cfg, dict)
    return {**cfg, "output_dir": str(tmp / "out")}


@pytest.mark.parametrize(
    "override, match",
    [
        ({"data": {"num_node": 100}}, r"^gnn_dgs: unknown data key\(s\) \['num_node'\]; " + ALLOWED),
        (
            {"data": {"seed": 1}},
            r"unknown data key\(s\) \['seed'\] \(the graph's seed is the recipe's seed\)",
        ),
        # set by redundant_graph itself (a TypeError there: multiple values)
        ({"data": {"feat_dim": 8}}, r"^gnn_dgs: unknown data key\(s\) \['feat_dim'\]"),
        ({"data": {"num_nodes": "many"}}, r"^gnn_dgs: data.num_nodes='many' must be an integer$"),
        ({"data": {"num_nodes": 2.5}}, r"^gnn_dgs: data.num_nodes=2.5 must be an integer$"),
        ({"data": {"p_in": "high"}}, r"^gnn_dgs: data.p_in='high' must be a finite number$"),
        ({"data": {"avg_degree": float("nan")}}, r"^gnn_dgs: data.avg_degree=nan must be a finite number$"),
        ({"data": {"num_classes": 1}}, r"^gnn_dgs: synthetic graph: bad data.num_classes=1 "),
        ({"data": {"signal_dims": 0}}, r"^gnn_dgs: synthetic graph: bad data.signal_dims=0 "),
        ({"data": {"p_in": 1.5}}, r"^gnn_dgs: synthetic graph: bad data.p_in=1.5 "),
        (
            {"data": {"train_frac": 0.8, "val_frac": 0.3}},
            r"^gnn_dgs: synthetic graph: bad data.train_frac \+ data.val_frac=1.1",
        ),
        (
            {"data": {"num_nodes": 12, "avg_degree": 4}},
            r"^gnn_dgs: data.num_nodes=12 is too small for data.num_classes=4: the graph has max\(4 x num_classes, "
            r"8\) = 16 communities",
        ),
        ({"data": {"noise_dims": -1}}, r"^gnn_dgs: data.noise_dims=-1 must be an integer >= 0$"),
        ({"data": 5}, r"^gnn_dgs: data=5 must be a group of \['num_nodes', "),
        ({"timeout_s": "soon"}, r"^gnn_dgs: timeout_s='soon' must be a finite number of seconds > 0$"),
        ({"timeout_s": 0}, r"^gnn_dgs: timeout_s=0 must be a finite number of seconds > 0$"),
        ({"timeout_s": float("inf")}, r"^gnn_dgs: timeout_s=inf must be"),
        # the trainers' gloo timeout: datetime.timedelta overflows past ~8.6e13 s
        (
            {"peer_timeout_s": 1e20},
            r"^gnn_dgs: peer_timeout_s=1e\+20 must be a number of seconds > 0 and at most 31536000",
        ),
        ({"output_dir": "/dev/null/out"}, r"^gnn_dgs: output_dir='/dev/null/out' is not a writable folder"),
        ({"output_dir": 5}, r"^gnn_dgs: output_dir=5 must be a folder path$"),
        ({"workdir": "/dev/null/work"}, r"^gnn_dgs: workdir='/dev/null/work' is not a writable folder"),
        ({"flowlane": 5}, r"^gnn_dgs: flowlane=5 must be a group of \['dgs', 'direct'\]$"),
        ({"flowlane": {"dgs": 5}}, r"^gnn_dgs: flowlane.dgs=5 must be a group of DGSConfig's keys, or null"),
    ],
)
def test_a_bad_gnn_dgs_key_is_refused_before_anything_starts(tmp_path, local, override, match):
    with pytest.raises(ConfigError, match=match):
        run_job({**_recipe(tmp_path), **override})


def test_the_recipe_and_every_data_key_pass(tmp_path, local):
    cfg = _recipe(tmp_path)
    every = {
        "num_nodes": 300,
        "avg_degree": 6,
        "num_classes": 3,
        "signal_dims": 4,
        "redundant_dims": 0,
        "noise_dims": 2,
        "signal": 0.5,
        "p_in": 0.7,
        "alpha": 3.0,
        "label_noise": 0.0,
        "train_frac": 0.5,
        "val_frac": 0.2,
    }
    assert set(every) == set(dgs_train.data_fields())
    for c in (
        cfg,
        {**cfg, "data": every},
        {**cfg, "data": None, "workdir": str(tmp_path / "work")},
        {**cfg, "flowlane": {"dgs": None, "direct": None}, "timeout_s": 5, "peer_timeout_s": 365 * 86400},
    ):
        with pytest.raises(AssertionError, match="the run started"):  # checked, then the run would start
            run_job(c)
    assert (tmp_path / "out").is_dir() and (tmp_path / "work").is_dir()


def test_the_checked_spec_is_the_one_redundant_graph_builds(monkeypatch):
    """check_data validates redundant_spec(data); redundant_graph builds its own: they must be the same spec, and
    the keys the check refuses as set by the graph must be refused by redundant_graph too."""
    import dgl_plugin.synthetic as synthetic

    built = []

    def capture(spec):
        built.append(spec)
        raise StopIteration

    monkeypatch.setattr(synthetic, "synthetic_arrays", capture)
    for data in ({}, {"num_nodes": 300, "num_classes": 5, "signal_dims": 3, "signal": 2.0, "p_in": 0.6}):
        with pytest.raises(StopIteration):
            dgs_train.redundant_graph(**data)
        assert built[-1] == dgs_train.redundant_spec(data)
    for key in ("feat_dim", "num_communities"):
        with pytest.raises(TypeError, match="multiple values"):
            dgs_train.redundant_graph(**{key: 8})


def test_flowlane_train_refuses_a_bad_data_key_with_exit_2(tmp_path):
    exe = Path(sys.executable).parent / "flowlane-train"
    r = subprocess.run(
        [
            str(exe),
            "--config-name",
            "gnn_dgs",
            "+data.num_node=100",
            f"output_dir={tmp_path}/out",
            f"+workdir={tmp_path}/work",
            f"hydra.run.dir={tmp_path}/hydra",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.startswith(
        "flowlane-train: error: gnn_dgs: unknown data key(s) ['num_node']; allowed: ["
    ), r.stderr[-3000:]
    assert "Traceback" not in r.stderr and not (tmp_path / "work").exists()


def test_peer_timeout_is_bounded_for_every_distdgl_user() -> None:
    """gnn_fullgraph's DistDGL path checks peer_timeout_s with the same function: inf and 1e20 passed it and
    overflowed the trainers' gloo timeout (datetime.timedelta)."""
    from dgl_plugin.distdgl import check_peer_timeout

    assert check_peer_timeout(300) == 300.0
    for bad in (0, -1, float("inf"), 1e20, True, "5"):
        with pytest.raises(
            ValueError, match=r"peer_timeout_s=.* must be a number of seconds > 0 and at most"
        ):
            check_peer_timeout(bad)
