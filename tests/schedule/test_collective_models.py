"""The α-β models of the all-to-all algorithms and choose_all_to_all (moe_compile/schedule/collective_models.py)."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_compile.schedule.collective_models import (
    ALGORITHMS,
    NETWORKS,
    NetworkModel,
    all_to_all_plan,
    choose_all_to_all,
    fit_network,
    get_network,
    predict_all_to_all,
    stage_time,
)
from moe_compile.schedule.cost_model import AlphaBeta, CostModels, task_key

MiB = 2**20

# Round numbers so that every case below can be checked by hand.
TOY = NetworkModel(alpha_intra=1.0, beta_intra=0.01, alpha_inter=10.0, beta_nic=0.1, nics_per_node=1,
                   beta_memory=0.001, ranks_per_node=2)


# --------------------------------------------------------------------------- hand-computed


@pytest.mark.parametrize("algorithm, expected", [
    # P=4 ranks as N=2 nodes of M=2, S=400 bytes per rank, b = S/P = 100; one NIC per node.
    # flat: intra 1 msg (1) + 100 B·0.01 (1) = 2; own block copy 2·100·0.001 = 0.2;
    #       inter 2 msgs (20) + 200 B·0.1·(2 senders / 1 NIC) = 40 → 60.          total 62.2
    ("flat", 62.2),
    # 1dh (leader): gather 1 + 400·0.01 = 5, own input 2·400·0.001 = 0.8; transform 2·2·400·0.001 = 1.6;
    #       leaders 1 msg (10) + (1·2·400/2 = 400 B)·0.1·1 = 50, own node's block 2·400·0.001 = 0.8;
    #       transform 1.6; scatter 5 + 0.8.                                       total 65.6
    ("1dh", 65.6),
    # 2dh: stride copy 2·400·0.001 = 0.8; intra 1 + 200·0.01 = 3, own block 2·200·0.001 = 0.4;
    #       stride copy 0.8; inter 1 msg (10) + 200 B·0.1·2 = 50, own block 0.4.  total 55.4
    ("2dh", 55.4),
    # pipe: cat 2·200·0.001 = 0.4; max(intra stream 2 + 0.2, inter stream 60) = 60; cat output 2·400·0.001 = 0.8
    #                                                                            total 61.2
    ("pipe", 61.2),
])
def test_hand_computed_one_nic_per_node(algorithm, expected):
    assert predict_all_to_all(algorithm, 400, 4, 2, TOY) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("algorithm, expected", [
    # As above with 2 NICs per node: the 2 GPUs sending at once no longer share one NIC.
    ("flat", 2 + 0.2 + (20 + 200 * 0.1)),                     # 42.2
    ("1dh", 65.6),                                            # one sender per node: unchanged
    ("2dh", 0.8 + 3 + 0.4 + 0.8 + (10 + 200 * 0.1) + 0.4),    # 35.4
    ("pipe", 0.4 + max(2.2, 40.0) + 0.8),                     # 41.2
])
def test_hand_computed_one_nic_per_gpu(algorithm, expected):
    network = NetworkModel(**{**TOY.__dict__, "nics_per_node": 2})
    assert predict_all_to_all(algorithm, 400, 4, 2, network) == pytest.approx(expected, rel=1e-12)


def test_plan_streams_run_concurrently_and_stages_add_up():
    stages = all_to_all_plan("pipe", 400, 4, 2)
    assert [len(stage) for stage in stages] == [1, 2, 1]          # only the middle stage has two streams
    intra, inter = stages[1]
    assert [t.link for t in intra] == ["intra", "memory"] and [t.link for t in inter] == ["inter"]
    assert stage_time(stages[1], TOY) == pytest.approx(60.0)     # max(2.2, 60), ScheMoE eq (16)
    assert sum(stage_time(s, TOY) for s in stages) == pytest.approx(predict_all_to_all("pipe", 400, 4, 2, TOY))


@pytest.mark.parametrize("world, ranks_per_node", [(8, 8), (8, 1)])
@pytest.mark.parametrize("algorithm", ["1dh", "2dh", "pipe"])
def test_no_hierarchy_prices_the_flat_fallback(algorithm, world, ranks_per_node):
    network = get_network("tutel_a100")
    flat = predict_all_to_all("flat", 4 * MiB, world, ranks_per_node, network)
    assert predict_all_to_all(algorithm, 4 * MiB, world, ranks_per_node, network) == flat


def test_bad_arguments_name_the_argument_and_the_choices():
    with pytest.raises(ValueError, match=r"algorithm='ring'.*flat, 1dh, 2dh, pipe"):
        predict_all_to_all("ring", 1, 4, 2, TOY)
    with pytest.raises(ValueError, match=r"ranks_per_node=3 does not divide world=4"):
        predict_all_to_all("flat", 1, 4, 3, TOY)
    with pytest.raises(ValueError, match=r"nbytes=-1"):
        predict_all_to_all("flat", -1, 4, 2, TOY)
    with pytest.raises(ValueError, match=r"unknown network preset; choose one of schemoe, tutel_a100"):
        get_network("dgx")
    with pytest.raises(ValueError, match=r"NetworkModel.beta_nic=-1"):
        NetworkModel(**{**TOY.__dict__, "beta_nic": -1})


# --------------------------------------------------------------------------- shape of the curves


@pytest.mark.parametrize("preset", NETWORKS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("world", [32, 256, 2048])
def test_time_grows_with_bytes(preset, algorithm, world):
    network = get_network(preset)
    sizes = [0, 1, 1024, MiB, 16 * MiB, 256 * MiB, 2048 * MiB]
    times = [predict_all_to_all(algorithm, s, world, network.ranks_per_node, network) for s in sizes]
    assert all(a < b for a, b in zip(times, times[1:])), times


networks = st.builds(
    NetworkModel,
    alpha_intra=st.floats(0, 1e-4), beta_intra=st.floats(1e-13, 1e-9), alpha_inter=st.floats(0, 1e-4),
    beta_nic=st.floats(1e-12, 1e-8), nics_per_node=st.integers(1, 8), beta_memory=st.floats(1e-13, 1e-10),
    ranks_per_node=st.just(1),
)


@settings(max_examples=200, deadline=None)
@given(network=networks, nodes=st.integers(2, 64), ranks_per_node=st.integers(2, 16), nbytes=st.floats(0, 2**31))
def test_1dh_is_never_faster_than_2dh(network, nodes, ranks_per_node, nbytes):
    world = nodes * ranks_per_node
    one = predict_all_to_all("1dh", nbytes, world, ranks_per_node, network)
    two = predict_all_to_all("2dh", nbytes, world, ranks_per_node, network)
    assert one >= two * (1 - 1e-12)


@settings(max_examples=200, deadline=None)
@given(network=networks, nodes=st.integers(2, 64), ranks_per_node=st.integers(2, 16), nbytes=st.floats(0, 2**31))
def test_pipe_saves_the_shorter_half_minus_its_copies(network, nodes, ranks_per_node, nbytes):
    world = nodes * ranks_per_node
    flat = predict_all_to_all("flat", nbytes, world, ranks_per_node, network)
    pipe = predict_all_to_all("pipe", nbytes, world, ranks_per_node, network)
    b = nbytes / world
    copies = (2 * (world - ranks_per_node) * b + 2 * nbytes) * network.beta_memory
    assert pipe <= flat + copies + 1e-15 * flat


# --------------------------------------------------------------------------- the papers' findings


def test_tutel_2dh_beats_flat_for_small_messages_at_scale():
    """Tutel §3.4 / §5.1.1: at 1 MiB, 2DH has lower latency from 64 GPUs on, and its lead grows with P."""
    network = get_network("tutel_a100")
    ratios = []
    for world in (64, 128, 256, 512, 1024, 2048):
        flat = predict_all_to_all("flat", MiB, world, 8, network)
        two = predict_all_to_all("2dh", MiB, world, 8, network)
        ratios.append(flat / two)
    assert ratios[0] > 1 and all(a < b for a, b in zip(ratios, ratios[1:])), ratios
    # the α-β bound as S → 0: (P − M) / (N − 1) inter-node start-ups saved, at most ~M = 8
    assert ratios[-1] < (2048 - 8) / (2048 // 8 - 1)


def test_tutel_2dh_loses_at_256mib_on_64_gpus_and_wins_at_2048():
    """Tutel §5.1.1: for 256 MiB, 2DH is slower at small scale (extra copies), faster as the GPU number grows."""
    network = get_network("tutel_a100")
    at = lambda a, world: predict_all_to_all(a, 256 * MiB, world, 8, network)  # noqa: E731
    assert at("2dh", 64) > at("flat", 64)
    assert at("2dh", 2048) < at("flat", 2048)


def test_schemoe_pipe_beats_hierarchical_for_large_messages_when_links_are_comparable():
    """ScheMoE §5: with intra-node and inter-node bandwidth comparable, Pipe-A2A is the fastest for large messages."""
    m = 4
    network = NetworkModel(alpha_intra=5e-6, beta_intra=1 / 10e9, alpha_inter=5e-6, beta_nic=1 / 10e9,
                           nics_per_node=m, beta_memory=1 / 1000e9, ranks_per_node=m)
    for world in (8, 16, 32):
        times = {a: predict_all_to_all(a, 256 * MiB, world, m, network) for a in ALGORITHMS}
        assert times["pipe"] == min(times.values()), times
        assert times["pipe"] < times["1dh"] and times["pipe"] < times["2dh"]


def test_pipe_speedup_over_flat_is_eq_18_without_copies():
    """ScheMoE §7 eq (18): flat / pipe = (intra + inter) / max(intra, inter) (here the own block is a free copy)."""
    world, m, nbytes = 8, 4, 64 * MiB
    network = NetworkModel(alpha_intra=3e-6, beta_intra=1 / 15e9, alpha_inter=7e-6, beta_nic=1 / 12e9,
                           nics_per_node=m, beta_memory=0.0, ranks_per_node=m)
    b = nbytes / world
    t_intra = (m - 1) * (network.alpha_intra + b * network.beta_intra)
    t_inter = (world - m) * (network.alpha_inter + b * network.beta_nic)
    flat = predict_all_to_all("flat", nbytes, world, m, network)
    pipe = predict_all_to_all("pipe", nbytes, world, m, network)
    assert flat / pipe == pytest.approx((t_intra + t_inter) / max(t_intra, t_inter), rel=1e-12)
    assert flat / pipe > 1.5   # comparable halves: a large gain


def test_schemoe_testbed_pipe_gain_is_small():
    """On ScheMoE's testbed the shared 100 Gb/s NIC dominates: Pipe-A2A gains little over NCCL-A2A (§6.4: 3-5%)."""
    network = get_network("schemoe")
    for nbytes in (MiB, 16 * MiB, 256 * MiB):
        flat = predict_all_to_all("flat", nbytes, 32, 4, network)
        pipe = predict_all_to_all("pipe", nbytes, 32, 4, network)
        assert 0.95 * flat < pipe < flat


def test_schemoe_preset_flat_equals_the_cost_model_derived_from_the_paper():
    network = get_network("schemoe")
    flat = CostModels.paper("schemoe")[task_key("all_to_all", "flat", 32)]
    for nbytes in (0, MiB, 640 * MiB):
        assert predict_all_to_all("flat", nbytes, 32, 4, network) == pytest.approx(flat(nbytes), rel=1e-9)


# --------------------------------------------------------------------------- choose_all_to_all


def test_choose_flat_when_copies_are_expensive_and_intra_is_cheap():
    network = NetworkModel(alpha_intra=1e-6, beta_intra=1 / 1000e9, alpha_inter=2e-6, beta_nic=1 / 20e9,
                           nics_per_node=4, beta_memory=1 / 50e9, ranks_per_node=4)
    best, times = choose_all_to_all(256 * MiB, 8, 4, network)
    assert best == "flat" and set(times) == set(ALGORITHMS)


def test_choose_2dh_for_small_messages_on_many_gpus():
    best, times = choose_all_to_all(MiB, 2048, 8, "tutel_a100")
    assert best == "2dh" and times["2dh"] < times["flat"]


def test_choose_pipe_for_large_messages_on_comparable_links():
    network = NetworkModel(alpha_intra=5e-6, beta_intra=1 / 10e9, alpha_inter=5e-6, beta_nic=1 / 10e9,
                           nics_per_node=4, beta_memory=1 / 1000e9, ranks_per_node=4)
    assert choose_all_to_all(256 * MiB, 8, 4, network)[0] == "pipe"


def _measured(world: int, **alpha_beta: tuple[float, float]) -> CostModels:
    return CostModels(models={task_key("all_to_all", a, world): AlphaBeta(*ab) for a, ab in alpha_beta.items()},
                      machine={"hostname": "test"})


def test_choose_from_measured_models_picks_what_was_measured_fastest():
    models = _measured(4, flat=(1e-3, 1e-9), **{"1dh": (1e-4, 1e-9), "2dh": (5e-4, 1e-9)}, pipe=(2e-3, 1e-9))
    best, times = choose_all_to_all(MiB, 4, 2, models)
    assert best == "1dh" and times["1dh"] == pytest.approx(1e-4 + 1e-9 * MiB)
    # a candidate without a measured model is left out, not guessed
    best, times = choose_all_to_all(MiB, 4, 2, _measured(4, flat=(1e-3, 1e-9), pipe=(1e-4, 1e-9)))
    assert best == "pipe" and set(times) == {"flat", "pipe"}


def test_choose_from_models_without_this_world_says_to_profile():
    with pytest.raises(KeyError, match=r"all_to_all:flat:8.*known keys: all_to_all:flat:4.*moe_compile.profile"):
        choose_all_to_all(MiB, 8, 4, _measured(4, flat=(1e-3, 1e-9)))


@pytest.mark.parametrize("ranks_per_node", [None, 3, 1, 8])
def test_only_flat_without_a_usable_node_grouping(ranks_per_node):
    best, times = choose_all_to_all(MiB, 8, ranks_per_node, "tutel_a100")
    assert best == "flat" and list(times) == ["flat"]
    models = _measured(8, flat=(1e-3, 1e-9), **{"2dh": (1e-5, 1e-10)})
    assert choose_all_to_all(MiB, 8, ranks_per_node, models) == ("flat", {"flat": pytest.approx(1e-3 + 1e-9 * MiB)})


def test_choose_rejects_unknown_candidates_and_inputs():
    with pytest.raises(ValueError, match=r"candidates=\['ring'\].*flat, 1dh, 2dh, pipe"):
        choose_all_to_all(MiB, 8, 4, "schemoe", candidates=("ring",))
    with pytest.raises(TypeError, match=r"CostModels, a NetworkModel or a preset name"):
        choose_all_to_all(MiB, 8, 4, 3.0)


def test_candidates_restrict_the_choice_and_ties_go_to_the_first():
    best, times = choose_all_to_all(MiB, 2048, 8, "tutel_a100", candidates=("flat", "pipe"))
    assert set(times) == {"flat", "pipe"} and best == min(times, key=times.get)
    tied = _measured(4, flat=(1e-3, 0.0), pipe=(1e-3, 0.0))
    assert choose_all_to_all(MiB, 4, 2, tied, candidates=("pipe", "flat"))[0] == "pipe"


# --------------------------------------------------------------------------- fitting


@pytest.mark.parametrize("world, ranks_per_node, nics", [(4, 2, 2), (8, 4, 4), (16, 4, 1)])
def test_fit_network_recovers_the_network_from_exact_measurements(world, ranks_per_node, nics):
    true = NetworkModel(alpha_intra=3e-6, beta_intra=1 / 150e9, alpha_inter=9e-6, beta_nic=1 / 20e9,
                        nics_per_node=nics, beta_memory=1 / 900e9, ranks_per_node=ranks_per_node)
    models = {}
    for a in ("flat", "1dh", "2dh"):
        at = lambda n: predict_all_to_all(a, n, world, ranks_per_node, true)  # noqa: E731
        models[a] = (at(0), at(MiB) / MiB - at(0) / MiB)
    fitted = fit_network(_measured(world, **models), world, ranks_per_node, nics_per_node=nics)
    for field in ("alpha_intra", "beta_intra", "alpha_inter", "beta_nic", "beta_memory"):
        assert getattr(fitted, field) == pytest.approx(getattr(true, field), rel=1e-6), field
    # and so it extrapolates to other sizes, pipe included
    for a in ALGORITHMS:
        assert predict_all_to_all(a, 16 * MiB, 256, ranks_per_node, fitted) == pytest.approx(
            predict_all_to_all(a, 16 * MiB, 256, ranks_per_node, true), rel=1e-6)


def test_fit_network_needs_a_hierarchy_and_two_algorithms():
    with pytest.raises(ValueError, match=r"no hierarchy"):
        fit_network(_measured(4, flat=(1e-3, 1e-9)), 4, 4)
    with pytest.raises(ValueError, match=r"at least 2 of .*moe_compile.profile"):
        fit_network(_measured(4, flat=(1e-3, 1e-9)), 4, 2)
    with pytest.raises(ValueError, match=r"\['pipe'\] cannot be fitted"):
        fit_network(_measured(4, flat=(1e-3, 1e-9)), 4, 2, algorithms=("flat", "pipe"))


def test_presets_document_their_sources():
    for name in NETWORKS:
        network = get_network(name)
        assert network.name == name
        documented = set(network.sources)
        assert {"alpha_intra", "beta_intra", "alpha_inter", "beta_nic", "beta_memory"} <= documented
        assert all(math.isfinite(v) and v > 0 for v in network.bandwidths_gbps().values())
