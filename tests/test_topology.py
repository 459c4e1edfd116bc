import math

import pytest

from flowlane import topology as T


def test_dgx1_nvlink_pairs_route_direct_and_others_cross_qpi():
    t = T.dgx1()
    assert len(t.gpus) == 8
    assert [lk.kind for lk in t.route("gpu0", "gpu1").links] == ["nvlink"]
    assert [lk.kind for lk in t.route("gpu0", "gpu4").links] == ["nvlink"]
    r = t.route("gpu0", "gpu5")  # no NVLink: PCIe up, QPI, PCIe down (GPUs do not forward in hardware)
    assert [lk.kind for lk in r.links] == ["pcie", "pcie", "qpi", "pcie", "pcie"]
    assert r.bandwidth == pytest.approx(T.QPI_BW)


def test_dgx1_gpus_under_one_switch_share_the_uplink_hop():
    t = T.dgx1()
    a, b = t.route("gpu0", "gpu6"), t.route("gpu1", "gpu7")
    shared = {lk.name for lk in a.links} & {lk.name for lk in b.links}
    assert "pcie0->cpu0" in shared and "cpu0->cpu1" in shared


def test_leaf_spine_ecmp_set_spans_all_spines_and_hash_picks_deterministically():
    t = T.leaf_spine(servers=8, gpus_per_server=4, servers_per_leaf=4)
    routes = t.routes("s0/gpu0", "s5/gpu2")
    spines = {lk.dst for r in routes for lk in r.links if lk.dst.startswith("spine")}
    assert len(routes) == len(spines) >= 2
    assert t.route("s0/gpu0", "s5/gpu2", flow_hash=3) == t.route("s0/gpu0", "s5/gpu2", flow_hash=3)


def test_leaf_spine_oversubscription_scales_uplinks():
    full = T.leaf_spine(servers=8, gpus_per_server=4, oversubscription=1.0)
    over = T.leaf_spine(servers=8, gpus_per_server=4, oversubscription=4.0)

    def up(t):
        return sum(lk.bandwidth for (a, b), lk in t.links.items() if a == "leaf0" and b.startswith("spine"))

    down = sum(lk.bandwidth for (a, b), lk in full.links.items() if b == "leaf0" and "/nic" in a)
    assert up(full) == pytest.approx(down)
    assert up(over) == pytest.approx(down / 4)


def test_leaf_spine_shared_nics_carry_several_gpus_and_keep_full_bisection():
    t = T.leaf_spine(servers=8, gpus_per_server=8, servers_per_leaf=4, nics_per_server=2)
    nics = {a for a in t.devices if "/nic" in a}
    assert len(nics) == 16  # 2 per server

    # GPUs 0-3 share NIC 0, GPUs 4-7 NIC 1: their off-server routes cross the same NIC uplink
    def first_eth(g):
        return {lk.name for r in t.routes(f"s0/gpu{g}", "s5/gpu0") for lk in r.links if lk.kind == "eth"}

    assert "s0/nic0->leaf0" in first_eth(0) and "s0/nic0->leaf0" in first_eth(3)
    assert "s0/nic1->leaf0" in first_eth(4) and "s0/nic0->leaf0" not in first_eth(4)
    up = sum(lk.bandwidth for (a, b), lk in t.links.items() if a == "leaf0" and b.startswith("spine"))
    down = sum(lk.bandwidth for (a, b), lk in t.links.items() if b == "leaf0" and "/nic" in a)
    assert down == pytest.approx(4 * 2 * T.NIC_100G) and up == pytest.approx(down)
    # one NIC per server: 8 GPUs' off-server traffic shares one 100 Gb/s link
    one = T.leaf_spine(servers=8, gpus_per_server=8, nics_per_server=1)
    assert one.route("s0/gpu7", "s6/gpu7").bandwidth == pytest.approx(T.NIC_100G)
    assert [lk.kind for lk in one.route("s0/gpu7", "s0/gpu2").links] == ["nvlink", "nvlink"]


def test_star_route_bottleneck_is_the_slower_access_link():
    t = T.star([T.gbps(10), T.gbps(1), T.gbps(40)])
    assert t.route("host0", "host1").bandwidth == pytest.approx(T.gbps(1))
    assert t.route("host0", "host2").time(1e9) == pytest.approx(2 * 5e-6 + 1e9 / T.gbps(10))


def test_pcie_server_and_two_servers_are_connected():
    T.pcie_server().validate()
    t = T.two_servers()
    t.validate()
    assert any(lk.kind == "eth" for lk in t.route("s0/gpu3", "s1/gpu6").links)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: T.star([1e9]), "at least 2 hosts"),
        (lambda: T.leaf_spine(servers=0), "servers must be an integer >= 1, got 0"),
        (lambda: T.leaf_spine(servers=2, oversubscription=0.5), "oversubscription must be >= 1"),
        (lambda: T.leaf_spine(servers=2, nics_per_server=3), "nics_per_server must be 0 .* got 3"),
        (lambda: T.pcie_server(num_gpus=7), "num_gpus=7"),
        (lambda: T.preset("torus"), "unknown topology preset 'torus'"),
    ],
)
def test_invalid_presets_are_rejected_with_the_bad_value(build, match):
    with pytest.raises(T.TopologyError, match=match):
        build()


def test_invalid_links_and_devices_are_rejected():
    t = T.Topology()
    t.add_device("a", "gpu")
    t.add_device("b", "gpu")
    with pytest.raises(T.TopologyError, match="kind 'tpu'"):
        t.add_device("c", "tpu")
    with pytest.raises(T.TopologyError, match="defined twice"):
        t.add_device("a", "gpu")
    with pytest.raises(T.TopologyError, match="bandwidth must be a finite number > 0"):
        t.add_link("a", "b", 0)
    with pytest.raises(T.TopologyError, match="bandwidth"):
        t.add_link("a", "b", math.inf)
    with pytest.raises(T.TopologyError, match="latency must be"):
        t.add_link("a", "b", 1e9, -1)
    with pytest.raises(T.TopologyError, match="unknown device 'z'"):
        t.add_link("a", "z", 1e9)
    with pytest.raises(T.TopologyError, match="no route"):
        t.route("a", "b")
