"""DGS core (flowlane.dgs): quota split, picks, columns, bytes, config and mask training. No DGL; both lanes."""

import numpy as np
import pytest
import torch

from flowlane.dgs import (
    ByteLedger,
    DGSConfig,
    labor_inclusion,
    node_probabilities,
    pick,
    pooled_target,
    pull_bytes,
    quota_split,
    shared_uniform,
    star_edges,
    top_columns,
    train_masks,
)


def test_quota_split_is_proportional_and_epsilon_moves_fanout_to_local_keeping_the_total():
    nl, nr = np.array([5, 2, 20, 0, 3]), np.array([15, 30, 1, 40, 2])
    q_loc0, q_rmt0 = quota_split(nl, nr, 10, 0.0)
    assert q_loc0.tolist() == [3, 1, 10, 0, 3] and q_rmt0.tolist() == [
        7,
        9,
        0,
        10,
        2,
    ]  # 10*5/20=2.5 rounds up
    q_loc, q_rmt = quota_split(nl, nr, 10, 0.1)  # round(0.1 * 10) = 1 moves to local
    assert q_loc.tolist() == [4, 2, 10, 0, 3] and q_rmt.tolist() == [6, 8, 0, 10, 2]
    big = np.array([50]), np.array([50])
    assert [int(a[0]) for a in quota_split(*big, 20, 0.2)] == [14, 6]  # 10 + 4 local, total stays 20
    assert (q_loc + q_rmt == np.minimum(nl + nr, 10)).all()
    assert [x.tolist() for x in quota_split(nl, nr, -1, 0.1)] == [nl.tolist(), nr.tolist()]


@pytest.mark.parametrize("bad", [{"fanout": 0}, {"epsilon": 1.5}])
def test_quota_split_rejects_bad_values_by_name(bad):
    kw = {"fanout": 10, "epsilon": 0.1, **bad}
    with pytest.raises(ValueError, match=next(iter(bad))):
        quota_split(np.array([1]), np.array([1]), **kw)


def test_one_remote_pick_follows_the_node_probabilities():
    # one frontier node with 1 local + 6 remote neighbours, fanout 2, eps 0.5: quota 1 local + 1 remote, and one
    # weighted pick has probability exactly w / sum(w)
    offsets = np.array([0, 7])
    local = np.array([True, False, False, False, False, False, False])
    w = np.array([1.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.25])
    q_loc, q_rmt = quota_split(np.array([1]), np.array([6]), 2, 0.5)
    assert (int(q_loc[0]), int(q_rmt[0])) == (1, 1)
    rng = np.random.default_rng(0)
    n = 8000
    counts = sum(pick(offsets, np.arange(7), local, w, 2, 0.5, rng).astype(np.int64) for _ in range(n))
    assert counts[0] == n  # the local quota takes the only local node
    freq = counts[1:] / n
    expect = w[1:] / w[1:].sum()
    assert np.abs(freq - expect).max() < 0.02  # 3-sigma at n=8000 is about 0.014


def test_labor_inclusion_matches_its_probability_and_shares_decisions_across_seeds():
    offsets = np.array([0, 6, 12])
    nbr = np.array([10, 11, 12, 13, 14, 15, 10, 11, 12, 13, 14, 15])  # two seeds, same six remote neighbours
    local = np.zeros(12, bool)
    w = np.tile(np.array([1.0, 1.0, 2.0, 2.0, 3.0, 3.0]), 2)
    n = 6000
    keep = np.array(
        [pick(offsets, nbr, local, w, 3, 0.0, np.random.default_rng(0), "labor", k) for k in range(n)]
    )
    assert (keep[:, :6] == keep[:, 6:]).all()  # shared variate: both seeds decide alike
    pi = np.minimum(1.0, 3 * w[:6] / w[:6].sum())
    assert np.abs(keep[:, :6].mean(0) - pi).max() < 0.03
    assert abs(keep[:, :6].sum(1).mean() - 3.0) < 0.1  # expected count = the quota


def test_labor_solves_the_scale_so_clipped_candidates_keep_the_expected_count_at_the_quota():
    # LABOR: π_t = min(1, c_s · w_t) with Σ π_t = q. The old rule c_s = q / Σ w lost the excess of the 5 heavy
    # candidates clipped at 1: 7.71 picks on average instead of 10 (the fanout was not kept)
    w = np.array([0.95] * 5 + [0.05] * 35)
    group, quota = np.zeros(40, np.int64), np.array([10])
    pi = labor_inclusion(group, w, quota)
    assert (pi[:5] == 1.0).all() and np.allclose(pi[5:], 5 / 35) and abs(pi.sum() - 10) < 1e-12
    # several groups at once, random weights (some zero, some heavy), every group's sum is its quota exactly
    rng = np.random.default_rng(3)
    group = np.repeat(np.arange(6), [12, 30, 7, 1, 25, 9])
    w = rng.pareto(0.8, group.size) * (rng.random(group.size) > 0.1)
    quota = np.array([3, 10, 7, 0, 12, 4])
    pi = labor_inclusion(group, w, quota)
    assert ((pi >= 0) & (pi <= 1)).all() and (pi[w == 0] == 0).all()
    npos = np.bincount(group, weights=w > 0)
    assert np.allclose(np.bincount(group, weights=pi), np.minimum(quota, npos), atol=1e-9)
    # the sampler draws that many: 4000 mini-batch keys (deterministic: hashed variates), 40 remote candidates
    offsets, nbr, local = np.array([0, 40]), np.arange(100, 140), np.zeros(40, bool)
    w = np.array([0.95] * 5 + [0.05] * 35)
    counts = [int(pick(offsets, nbr, local, w, 10, 0.0, rng, "labor", k).sum()) for k in range(4000)]
    assert abs(np.mean(counts) - 10) < 0.15  # sd of the mean ~0.033; before the fix 7.71


def test_labor_with_equal_weights_is_labor_zero_itself():
    # equal weights: c_s = q / d, every candidate kept iff r_t <= q / d (LABOR-0), local side and remote side alike
    offsets = np.array([0, 8, 20])
    nbr = np.arange(20) * 7 + 3
    local = np.arange(20) % 3 == 0
    w = np.ones(20)
    seg = np.repeat([0, 1], [8, 12])
    q_loc, q_rmt = quota_split(np.bincount(seg, weights=local), np.bincount(seg, weights=~local), 5, 0.0)
    quota = np.stack([q_loc, q_rmt], 1).reshape(-1)
    group = seg * 2 + ~local
    size = np.bincount(group, minlength=4)
    assert (labor_inclusion(group, w, quota) == (quota / size)[group]).all()
    for key in range(50):
        keep = pick(offsets, nbr, local, w, 5, 0.0, np.random.default_rng(0), "labor", key)
        assert (keep == (shared_uniform(nbr, key) <= (quota / size)[group])).all()


def test_minmax_transform_lets_a_nearly_flat_node_mask_rank_the_picks():
    # the explainer's node mask can come out nearly flat (measured 0.0076-0.0079 over 600 remote nodes): as σ(M)
    # weights it picks as uniform weights do; "minmax" (A6 #8) rescales it to [0, 1] and the ranking drives the picks
    n, fanout, draws = 40, 10, 3000
    sn = np.random.default_rng(7).permutation(np.linspace(0.0076, 0.0079, n))
    offsets, nbr, local = np.array([0, n]), np.arange(n), np.zeros(n, bool)
    rank = np.argsort(np.argsort(sn))

    def freq(w, base="uniform"):
        rng = np.random.default_rng(1)
        keep = [pick(offsets, nbr, local, w, fanout, 0.0, rng, base, k) for k in range(draws)]
        return np.mean(keep, axis=0), keep

    f_uni, k_uni = freq(np.ones(n))
    f_sig, k_sig = freq(node_probabilities(sn))
    f_mm, k_mm = freq(node_probabilities(sn, transform="minmax"))
    # σ weights: the same picks as equal weights in most draws (same random numbers)
    assert sum((a == b).all() for a, b in zip(k_uni, k_sig, strict=True)) > 0.9 * draws
    assert np.abs(f_sig - fanout / n).max() < 0.05
    # minmax: other picks, and the frequency follows the mask's ranking
    assert sum((a != b).any() for a, b in zip(k_uni, k_mm, strict=True)) > 0.9 * draws
    assert np.corrcoef(rank, f_mm)[0, 1] > 0.9
    top, bottom = f_mm[rank >= n - 10].mean(), f_mm[rank < 10].mean()
    assert top > 0.35 and bottom < 0.1  # equal weights: 0.25 each
    # LABOR on minmax weights: the same ranking, and the expected count is still the quota
    f_lab, k_lab = freq(node_probabilities(sn, transform="minmax"), "labor")
    assert np.corrcoef(rank, f_lab)[0, 1] > 0.9 and abs(np.sum(k_lab, axis=1).mean() - fanout) < 0.2


def test_node_probability_transforms():
    sn = np.array([0.2, 0.4, 0.3])
    assert node_probabilities(sn, 0.0).tolist() == sn.tolist()
    assert np.allclose(node_probabilities(sn, 1e-6, "minmax"), [1e-6, 1 + 1e-6, 0.5 + 1e-6])
    assert node_probabilities(np.full(3, 0.3), 0.0, "minmax").tolist() == [1.0, 1.0, 1.0]  # nothing to rank
    with pytest.raises(ValueError, match="transform='softmax'"):
        node_probabilities(sn, 1e-6, "softmax")


def test_top_columns_keeps_the_ceiling_fraction_with_largest_importance():
    sf = np.array([0.1, 0.9, 0.5, 0.9, 0.2, 0.7])
    assert top_columns(sf, 0.5).tolist() == [1, 3, 5]
    assert top_columns(sf, 0.51).tolist() == [1, 2, 3, 5]  # ceil(3.06) = 4
    assert top_columns(sf, 1.0).tolist() == list(range(6))
    with pytest.raises(ValueError, match="n_f=0"):
        top_columns(sf, 0)


def test_node_probabilities_floor_and_range_check():
    p = node_probabilities(np.array([0.0, 0.5, 1.0]), 1e-6)
    assert p[0] == 1e-6 and p[2] == 1.0 + 1e-6
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        node_probabilities(np.array([1.5]))


def test_pull_bytes_count_the_column_list_only_when_it_is_a_subset_and_ledger_rejects_unknown_kinds():
    assert pull_bytes(10, 32, 4, 32) == (80, 1280)
    assert pull_bytes(10, 27, 4, 32) == (80 + 27 * 8, 1080)
    led = ByteLedger()
    led.add("feature_remote", 5)
    led.add("feature_remote", 7)
    assert led.as_dict()["feature_remote"] == 12 and led.as_dict()["sampling_rpc"] == 0
    with pytest.raises(ValueError, match="'nic'"):
        led.add("nic", 1)


def test_config_rejects_unknown_keys_and_bad_values_by_name():
    assert DGSConfig.from_dict({}) == DGSConfig()
    with pytest.raises(ValueError, match="unknown option.*'nf'"):
        DGSConfig.from_dict({"nf": 0.8})
    for key, val in (
        ("n_f", 0.0),
        ("n_f", 1.2),
        ("epsilon", -0.1),
        ("t_ex", 0),
        ("t_ex", 2.5),
        ("base_sampler", "ladies"),
        ("sn_transform", "softmax"),
        ("node_sampling", "yes"),
        ("prob_floor", 0),
        ("explainer_min_epochs", 51),
        ("synchronous", 1),
        ("explainer_timeout_s", 1e20),  # a join() timeout that large overflows
    ):
        with pytest.raises(ValueError, match=f"bad {key}="):
            DGSConfig.from_dict({key: val})


def test_star_edges_put_each_remote_nodes_edge_into_the_super_node_first():
    src, dst = star_edges(3)
    assert src.tolist() == [1, 2, 3, 0, 0, 0, 0] and dst.tolist() == [0, 0, 0, 1, 2, 3, 0]


def test_mask_training_ranks_the_informative_remote_node_and_feature_first():
    # v_G's logit = mean over in-edges of (eweight * x[src]) . W: remote node 1's feature 0 carries the target class,
    # nodes 2..R carry the opposite sign on the same feature, so only their edges can be dropped to recover it
    torch.manual_seed(0)
    R, f = 4, 6
    x = torch.zeros(R + 1, f)
    x[1, 0] = 10.0
    x[2:, 0] = -3.0
    x[2:, 1:] = 0.2 * torch.randn(R - 1, f - 1)
    src, dst = star_edges(R)
    w = torch.zeros(f, 2)
    w[0, 0] = 1.0
    w[1:, 1] = 0.3

    def forward(xm, ew):
        msg = (xm[src] * ew[:, None])[dst == 0]
        return msg.mean(0) @ w

    target = pooled_target(torch.tensor([[6.0, 0.0], [5.0, 0.0]]))
    ex = train_masks(forward, x, target, R, epochs=100, lr=0.1, loss_threshold=0.0)
    assert ex.sn.shape == (R,) and ex.sf.shape == (f,)
    assert ex.sn[0] > 0.9 and (ex.sn[1:] < 0.1).all()  # remote node 1 (edge 0) kept, the others dropped
    assert ex.sf[0] > 0.9 and (ex.sf[1:] < 0.1).all()  # feature 0 is the informative dimension
    spread = ex.sn_spread()
    assert (
        spread["min"] == float(ex.sn.min())
        and spread["max"] == float(ex.sn.max())
        and spread["rel_spread"] > 1
    )
    early = train_masks(forward, x, target, R, epochs=200, min_epochs=5, lr=0.05, loss_threshold=10.0)
    assert early.early_stop and early.epochs == 6  # the threshold applies after min_epochs
