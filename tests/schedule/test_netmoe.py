"""NetMoE's sample placement solver (moe_compile/schedule/netmoe.py) against brute force and the paper's example."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from moe_compile.schedule.netmoe import (
    TransitionPredictor,
    contiguous_expert_devices,
    cost_matrices,
    sample_expert_counts,
    solve_placement,
    volumes,
)


def _local_routing(rng, samples, experts, tokens, k, concentration):
    """``[I, L, K]`` expert ids: each sample draws its tokens' top-k from its own Dirichlet preference."""
    route = np.empty((samples, tokens, k), dtype=np.int64)
    for i in range(samples):
        pref = rng.dirichlet(np.full(experts, concentration))
        for t in range(tokens):
            route[i, t] = rng.choice(experts, size=k, replace=False, p=pref)
    return route


def _balanced_placements(samples, devices):
    """Every ``SmpDev`` with ``I / J`` samples per device."""
    per = samples // devices
    slots = [j for j in range(devices) for _ in range(per)]
    return {tuple(p) for p in itertools.permutations(slots)}


def test_sample_expert_counts_is_eq_2():
    route = np.array([[[0, 1], [0, 2]], [[3, 3], [1, 0]]])
    num = sample_expert_counts(route, 4)
    assert num.tolist() == [[2, 1, 1, 0], [1, 1, 0, 2]]
    with pytest.raises(ValueError, match="outside"):
        sample_expert_counts(route, 3)


def test_paper_figure_2():
    """Fig. 2: I = 4, E = J = 4, K = 1, two nodes of two; swapping samples 0 and 3 cuts node 0's inter volume 5 → 2.

    The token colours are not in the text; this routing has the figure's numbers: node 0's
    samples 0 and 1 send 5 tokens to node 1 (sample 0 prefers expert 2, sample 3 expert 0).
    """
    num = np.array([[0, 0, 3, 1],    # sample 0: 4 of its 4 tokens to node 1, 3 to expert 2
                    [2, 1, 0, 1],    # sample 1: 1 token to node 1
                    [0, 1, 2, 1],
                    [3, 0, 0, 1]])   # sample 3: prefers expert 0 (node 0)
    experts = contiguous_expert_devices(4, 4)
    node0 = lambda placement: volumes(num[[i for i in range(4) if placement[i] < 2]], experts,  # noqa: E731
                                      [d for d in placement if d < 2], 2).inter
    assert num.sum(axis=1).tolist() == [4] * 4                 # L = 4 tokens, K = 1
    assert node0([0, 1, 2, 3]) == 5
    assert node0([3, 1, 2, 0]) == 2
    best = solve_placement(num, experts, 4, 2)
    assert best.after.inter <= volumes(num, experts, [3, 1, 2, 0], 2).inter
    assert best.after.inter < best.before.inter


def test_cost_matrices_are_eq_8():
    rng = np.random.default_rng(0)
    num = rng.integers(0, 5, size=(8, 8))
    experts = contiguous_expert_devices(8, 4)
    c, c_prime = cost_matrices(num, experts, 4, 2)
    for i in range(8):
        for j in range(4):
            alone = volumes(num[i:i + 1], experts, [j], 2)
            assert c[i, j // 2] == alone.inter
            assert c_prime[i, j] == alone.intra


@pytest.mark.parametrize("seed", range(6))
def test_two_stages_equal_brute_force(seed):
    """Stage 1 reaches the least inter-node volume of all balanced placements; stage 2 the least
    intra-node volume among the placements with stage 1's nodes; every device keeps I / J samples."""
    rng = np.random.default_rng(seed)
    samples, devices, per_node = 8, 4, 2
    num = sample_expert_counts(_local_routing(rng, samples, 8, 6, 2, 0.3), 8)
    experts = contiguous_expert_devices(8, devices)
    solved = solve_placement(num, experts, devices, per_node)
    assert np.bincount(solved.sample_device, minlength=devices).tolist() == [2] * devices

    candidates = [(p, volumes(num, experts, p, per_node)) for p in _balanced_placements(samples, devices)]
    assert solved.after.inter == min(v.inter for _, v in candidates)
    nodes = tuple(solved.sample_device // per_node)
    same_nodes = [v.intra for p, v in candidates if tuple(np.array(p) // per_node) == nodes]
    assert solved.after.intra == min(same_nodes)


@pytest.mark.parametrize("seed", range(20))
def test_never_more_inter_node_volume_than_the_current_placement(seed):
    rng = np.random.default_rng(100 + seed)
    samples, devices, per_node, experts_n = 16, 8, 4, 16
    num = sample_expert_counts(_local_routing(rng, samples, experts_n, 10, 2, float(rng.choice([0.1, 1.0, 10.0]))),
                               experts_n)
    experts = contiguous_expert_devices(experts_n, devices)
    current = rng.permutation(np.repeat(np.arange(devices), samples // devices))
    solved = solve_placement(num, experts, devices, per_node, sample_device=current)
    assert solved.before == volumes(num, experts, current, per_node)
    assert solved.after.inter <= solved.before.inter
    assert np.bincount(solved.sample_device, minlength=devices).tolist() == [samples // devices] * devices
    assert solved.moved_devices == int((solved.sample_device != current).sum())


def test_uniform_routing_moves_nothing():
    """Ties keep samples where they are: with the same counts everywhere, no sample moves."""
    num = np.full((8, 8), 3)
    solved = solve_placement(num, contiguous_expert_devices(8, 4), 4, 2)
    assert solved.sample_device.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert solved.moved_nodes == solved.moved_devices == 0
    assert solved.after == solved.before


def test_locality_lowers_inter_node_volume():
    """Each sample sends all its tokens to one expert on the other node: stage 1 swaps them all home."""
    experts = contiguous_expert_devices(4, 4)
    num = np.zeros((8, 4), dtype=np.int64)
    for i in range(8):
        num[i, (i // 2 + 2) % 4] = 10        # samples of devices 0,1 → experts 2,3 and vice versa
    solved = solve_placement(num, experts, 4, 2)
    assert solved.before.inter == 80 and solved.after.inter == 0 and solved.after.intra == 0
    assert solved.moved_nodes == 8


def test_bad_inputs_name_the_problem():
    experts = contiguous_expert_devices(4, 4)
    with pytest.raises(ValueError, match="multiple of J"):
        solve_placement(np.ones((6, 4), dtype=np.int64), experts, 4, 2)
    with pytest.raises(ValueError, match="ranks_per_node=3"):
        solve_placement(np.ones((8, 4), dtype=np.int64), experts, 4, 3)
    with pytest.raises(ValueError, match="I/J = 2 samples"):
        solve_placement(np.ones((8, 4), dtype=np.int64), experts, 4, 2, sample_device=np.zeros(8, dtype=np.int64))


def test_predicted_counts_are_solved_like_counts():
    """Float (predicted) counts: same answer as the integer counts they round to."""
    rng = np.random.default_rng(3)
    num = sample_expert_counts(_local_routing(rng, 8, 8, 6, 2, 0.3), 8)
    experts = contiguous_expert_devices(8, 4)
    exact = solve_placement(num, experts, 4, 2)
    floats = solve_placement(num.astype(np.float64), experts, 4, 2)
    assert floats.sample_device.tolist() == exact.sample_device.tolist()


def test_transition_predictor_learns_routing_statistics():
    """Layer l+1 routes a token to π(e) when layer l routed it to e: the predictor learns π."""
    rng = np.random.default_rng(7)
    pi = rng.permutation(8)
    predictor = TransitionPredictor(8)
    num = np.eye(8, dtype=np.int64)[:4] * 5
    assert np.allclose(predictor.predict(num), num)           # nothing observed: the preference persists
    for _ in range(3):
        ids = rng.integers(0, 8, size=(64, 2))
        predictor.observe(ids, pi[ids])
    predicted = predictor.predict(num)
    for i in range(4):
        assert predicted[i].argmax() == pi[i]
        assert predicted[i].sum() == pytest.approx(5.0)


@pytest.mark.parametrize("seed", range(4))
def test_move_cost_is_counted_and_never_worse_than_staying(seed):
    """With a cost per moved sample (its residual), stage 1 still never sends more between nodes
    than the current placement, moves included, and equals brute force over node placements."""
    rng = np.random.default_rng(200 + seed)
    num = sample_expert_counts(_local_routing(rng, 8, 8, 6, 2, 0.3), 8)
    experts = contiguous_expert_devices(8, 4)
    home = np.repeat(np.arange(4), 2)
    for move in (0, 3, 6, 100):
        solved = solve_placement(num, experts, 4, 2, move_tokens=move)
        assert solved.after.inter <= solved.before.inter
        best = min(volumes(num, experts, p, 2).inter + move * int((np.array(p) // 2 != home // 2).sum())
                   for p in _balanced_placements(8, 4))
        assert solved.after.inter == best
    assert solve_placement(num, experts, 4, 2, move_tokens=10_000).moved_devices == 0


def test_return_home_cost_pulls_samples_back():
    """At the last placed layer a sample away from its origin costs return_tokens to bring back."""
    experts = contiguous_expert_devices(4, 4)
    num = np.zeros((8, 4), dtype=np.int64)
    for i in range(8):
        num[i, (i // 2 + 2) % 4] = 10       # every sample's tokens go to the other node
    away = np.array([2, 2, 3, 3, 0, 0, 1, 1])  # currently on the other node (where its experts are)
    origin = np.repeat(np.arange(4), 2)
    stay = solve_placement(num, experts, 4, 2, sample_device=away, origin=origin, return_tokens=1)
    assert stay.sample_device.tolist() == away.tolist() and stay.before.inter == 8  # 8 samples × 1 to go home
    home = solve_placement(num, experts, 4, 2, sample_device=away, origin=origin, return_tokens=100)
    assert home.sample_device.tolist() == origin.tolist() and home.after.inter == 80


def test_link_bytes_split_the_volumes_by_sender():
    from moe_compile.schedule.collective_models import NetworkModel
    from moe_compile.schedule.netmoe import all_to_all_seconds, link_bytes

    rng = np.random.default_rng(5)
    num = rng.integers(0, 6, size=(8, 8))
    experts = contiguous_expert_devices(8, 4)
    place = rng.permutation(np.repeat(np.arange(4), 2))
    total = volumes(num, experts, place, 2)
    for direction in ("scatter", "gather"):
        intra, inter = link_bytes(num, experts, place, 2, 2.0, direction)
        assert intra.sum() == 2.0 * total.intra and inter.sum() == 2.0 * total.inter
    intra, inter = link_bytes(num, experts, place, 2, 1.0, "scatter")
    for j in range(4):   # scatter: device j sends its samples' tokens to experts of its node on other devices
        mine = num[place == j]
        assert intra[j] == sum(mine[:, e].sum() for e in range(8) if experts[e] // 2 == j // 2 and experts[e] != j)
    net = NetworkModel(alpha_intra=1.0, beta_intra=0.5, alpha_inter=2.0, beta_nic=1.0, nics_per_node=2,
                       beta_memory=0.0, ranks_per_node=2)
    expected = max(1.0 + intra.max() * 0.5, 2 * 2.0 + inter.max() * 1.0 / 2)
    assert all_to_all_seconds(intra, inter, 2, net) == pytest.approx(expected)
    with pytest.raises(ValueError, match="direction"):
        link_bytes(num, experts, place, 2, 1.0, "both")
