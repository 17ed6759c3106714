"""How much inter-node all-to-all traffic and time does NetMoE's sample placement save?

Four parts, each a table, all written to ``--json``:

1. **Simulated, NetMoE's Table 3** (no ranks spawned). GPT models S = 1024, H = 768 …
   4096, ``I / J = 4`` samples per GPU, ``E = 2·J`` experts, ``K = 2``, on 32 GPUs as
   4 nodes × 8 and 16 as 2 × 8 (Table 5's two clusters), ``--layers`` MoE layers. Routing
   with locality: each sample draws a preference over the experts from a symmetric
   Dirichlet(α), its ``S·K`` choices of a layer are a multinomial draw from it, and the
   next layer's preference is ``ρ·p + (1 − ρ)·Dirichlet(α)`` (ρ = ``--layer-corr``: the
   paper says tokens of a sample keep preferring the same experts, not how much).
   α is calibrated (``--alphas`` swept on MoE-GPT-S, 4 × 8) to the paper's measured
   inter-node reduction, Table 5(b): −39.0 %. The solver
   (:mod:`moe_compile.schedule.netmoe`) places samples after every layer, predicting the
   next layer's counts by this layer's. Every all-to-all (forward scatter and gather,
   and their backward exchanges) is priced with eq (1) on the paper's cluster (Table 2:
   NVLink 400 GB/s per GPU, 100 GB/s InfiniBand per node) by
   :func:`~moe_compile.schedule.netmoe.all_to_all_seconds`, bf16 tokens. Three accountings
   (``ACCOUNTINGS``): ``paper`` (the residual inlined, Appendix A, and the loss taken where
   the samples are: moving a sample costs nothing beyond the gather), ``inlined``
   (``collectives/sample_placement.py`` with ``pre``: inlined, and the samples return to
   their ranks after the last layer, ``restore_order``) and ``residual sent`` (without
   ``pre``: the residual of a moved sample is sent too, and the return).
   The end-to-end estimate adds the expert and attention GEMMs at ``--tflops`` (an
   assumption, stated in the table) to the all-to-all time, FastMoE-like: no overlap.

2. **Measured, 4 gloo ranks as 2 nodes × 2** (``moe_compile.testing.spawn``): a chain of
   ``--layers`` placed layers (``placed_moe_layer``) with the calibrated routing, forward
   and backward, placement off (FastMoE's layer) and on; the bytes each rank handed to
   ``all_to_all_single`` for another node / another device of its node, counted per
   exchange (``WireCounter``), payload and metadata; the solver's time next to the
   scatter + expert time it ran behind.

4. **Compiled, 4 gloo ranks as 2 × 2**: the tiny decoder of ``tests/models/decoder.py``
   (``--layers`` layers, routing with or without locality) compiled with
   ``options={"sample_placement": "netmoe"}``, forward and backward per step: bytes per step
   per link, placed and gathering home (``moe_compile.ops.netmoe.PLACE_SAMPLES``), the
   samples moved and the step time (``--compiled-only``: this part alone).

3. **Solver time, NetMoE's Table 4** (MoE-GPT-S, J = 16 as 2 × 8, I / J = 2 … 24): the
   median time of one ``solve_placement`` on this machine's CPU next to the paper's KM
   and PuLP times and its scatter + computation time.

    python benchmarks/netmoe.py                 # all four
    python benchmarks/netmoe.py --compiled-only # part 4 only (to ``<json>_compiled.json``)
    python benchmarks/netmoe.py --quick         # fewer draws and layers, smaller measured run
    python benchmarks/netmoe.py --no-measure    # parts 1 and 3 only (no ranks spawned)
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tables import print_table  # noqa: E402
from moe_compile.schedule.collective_models import NetworkModel  # noqa: E402
from moe_compile.schedule.netmoe import (  # noqa: E402
    all_to_all_seconds,
    contiguous_expert_devices,
    link_bytes,
    solve_placement,
)

#: NetMoE Table 3 (S = 1024, I/J = 4, E/J = 2, K = 2): model → hidden size H.
TABLE_3 = {"MoE-GPT-S": 768, "MoE-GPT-M": 1024, "MoE-GPT-L": 1280, "MoE-GPT-XL": 1600, "MoE-GPT-XXL": 4096}
#: NetMoE Table 5: inter-node volume reduction measured with NetMoE, per cluster and model.
TABLE_5_INTER = {(2, 8): {"MoE-GPT-S": -39.10, "MoE-GPT-M": -42.94, "MoE-GPT-L": -34.49, "MoE-GPT-XL": -36.10,
                          "MoE-GPT-XXL": -42.36},
                 (4, 8): {"MoE-GPT-S": -39.02, "MoE-GPT-M": -35.79, "MoE-GPT-L": -38.26, "MoE-GPT-XL": -34.02,
                          "MoE-GPT-XXL": -38.83}}
#: NetMoE Table 4 (MoE-GPT-S, J = 16): I/J → (KM ms, PuLP ms, scatter + computation ms).
TABLE_4 = {2: (0.08, 42.8, 3.69), 4: (0.48, 50.1, 7.13), 8: (1.48, 72.9, 13.50), 16: (10.82, 143.7, 27.31),
           24: (31.09, 266.5, 41.65)}
PAPER_MAX_SPEEDUP = 1.67

A800 = NetworkModel(
    alpha_intra=2e-6, beta_intra=1.0 / 400e9, alpha_inter=4e-6, beta_nic=1.0 / 100e9, nics_per_node=1,
    beta_memory=1.0 / (2039e9 * 0.8), ranks_per_node=8, name="netmoe_a800",
    sources={"beta_intra": "NetMoE Table 2: intra-node 400 GB/s (NVLink)",
             "beta_nic": "NetMoE Table 2 / §4.1: inter-node 100 GB/s InfiniBand per node",
             "alpha_intra": "assumption, as the tutel_a100 preset", "alpha_inter": "assumption, as the tutel_a100 preset",
             "beta_memory": "assumption: A800 HBM2e 2039 GB/s × 0.8 (copies are not priced here)"})


# --------------------------------------------------------------------------- routing with locality

def draw_routing(rng, samples, experts, tokens_x_k, layers, alpha, corr):
    """``[layers, I, E]`` counts: per sample a Dirichlet(α) preference, drifting by ``1 − corr`` per layer."""
    pref = rng.dirichlet(np.full(experts, alpha), size=samples)
    out = []
    for _ in range(layers):
        out.append(np.stack([rng.multinomial(tokens_x_k, p) for p in pref]))
        pref = corr * pref + (1.0 - corr) * rng.dirichlet(np.full(experts, alpha), size=samples)
    return np.stack(out)


ACCOUNTINGS = {
    # name: (a moved sample sends its residual, samples return to their ranks after the last layer)
    "paper": (False, False),        # Appendix A inlining; the loss is taken where the samples are
    "inlined": (False, True),       # placed_moe_layer(pre=norm) + restore_order
    "residual sent": (True, True),  # placed_moe_layer without pre + restore_order
}


def simulate_chain(nums, devices, per_node, seq, token_bytes, accounting):
    """Price one iteration's all-to-alls of a chain of layers, placement off and on (see the module docstring)."""
    experts = contiguous_expert_devices(nums.shape[2], devices)
    samples = nums.shape[1]
    home = np.arange(samples) // (samples // devices)
    sends_residual, restores = ACCOUNTINGS[accounting]

    def exchange(num, place, direction):
        return link_bytes(num, experts, place, per_node, token_bytes, direction)

    def price(num, src, dst):
        """scatter from src, gather to dst, and their backward exchanges (directions swapped)."""
        seconds, inter = 0.0, 0.0
        for place, forward, backward in ((src, "scatter", "gather"), (dst, "gather", "scatter")):
            for direction in (forward, backward):
                intra_b, inter_b = exchange(num, place, direction)
                seconds += all_to_all_seconds(intra_b, inter_b, per_node, A800)
                inter += inter_b.sum()
        return seconds, inter

    def move(src, dst):
        """S tokens per moved sample (a residual, or the return), forward and backward, count-exact."""
        if (src == dst).all():
            return 0.0, 0.0
        onehot = np.zeros((samples, devices))
        onehot[np.arange(samples), dst] = seq
        intra_b, inter_b = link_bytes(onehot, np.arange(devices), src, per_node, token_bytes, "scatter")
        return 2 * all_to_all_seconds(intra_b, inter_b, per_node, A800), 2 * inter_b.sum()

    base_t = base_inter = 0.0
    for num in nums:
        t, b = price(num, home, home)
        base_t, base_inter = base_t + t, base_inter + b
    net_t = net_inter = 0.0
    moved_nodes = []
    solve_s = []
    place = home
    for layer, num in enumerate(nums):
        last = layer == len(nums) - 1
        objective = num if last else num + num        # next layer predicted: this layer's counts
        solved = solve_placement(objective, experts, devices, per_node, place,
                                 move_tokens=seq if sends_residual else 0,
                                 origin=home, return_tokens=seq if (restores and last) else 0)
        solve_s.append(solved.seconds)
        moved_nodes.append(solved.moved_nodes / samples)
        new = solved.sample_device
        t, b = price(num, place, new)
        mt, mb = move(place, new) if sends_residual else (0.0, 0.0)
        net_t, net_inter = net_t + t + mt, net_inter + b + mb
        place = new
    if restores:   # restore_order: every sample back to its rank
        mt, mb = move(place, home)
        net_t, net_inter = net_t + mt, net_inter + mb
    return {"base_s": base_t, "netmoe_s": net_t, "base_inter": base_inter, "netmoe_inter": net_inter,
            "moved_across_nodes": float(np.mean(moved_nodes)), "solve_s": float(np.median(solve_s))}


def compute_seconds(hidden, seq, samples_per_gpu, top_k, tflops):
    """Per-GPU GEMM time of one layer, forward + backward (3× forward): experts (2 matmuls of H × 4H per choice)
    and attention (QKV + projection, 4H² per token, and the S × S scores and values)."""
    tokens = samples_per_gpu * seq
    expert = 2 * tokens * top_k * 2 * hidden * 4 * hidden
    attention = 2 * tokens * 4 * hidden * hidden + 2 * 2 * tokens * seq * hidden
    return 3 * (expert + attention) / (tflops * 1e12)


def part_simulated(args):
    rng = np.random.default_rng(args.seed)
    calibration = []
    for alpha in args.alphas:
        runs = [simulate_chain(draw_routing(rng, 128, 64, 1024 * 2, args.layers, alpha, args.layer_corr),
                               32, 8, 1024, 768 * 2, "paper") for _ in range(args.draws)]
        reduction = 100.0 * (sum(r["netmoe_inter"] for r in runs) / sum(r["base_inter"] for r in runs) - 1.0)
        calibration.append({"alpha": alpha, "inter_change_pct": reduction,
                            "moved_across_nodes_pct": 100 * statistics.mean(r["moved_across_nodes"] for r in runs)})
    target = TABLE_5_INTER[(4, 8)]["MoE-GPT-S"]
    alpha = min(calibration, key=lambda c: abs(c["inter_change_pct"] - target))["alpha"]
    print_table(f"calibration on MoE-GPT-S, 4 × 8, ρ = {args.layer_corr}: paper Table 5(b) inter {target:+.1f} %, "
                f"72.4 % of samples across nodes → α = {alpha}",
                ["α", "inter-node volume", "samples moved across nodes"],
                [[f"{c['alpha']}", f"{c['inter_change_pct']:+.1f} %", f"{c['moved_across_nodes_pct']:.1f} %"]
                 for c in calibration])
    rows, records = [], []
    for nodes, per_node in ((4, 8), (2, 8)):
        devices = nodes * per_node
        for model, hidden in TABLE_3.items():
            compute = args.layers * compute_seconds(hidden, 1024, 4, 2, args.tflops)
            for accounting in ACCOUNTINGS:
                runs = [simulate_chain(draw_routing(rng, 4 * devices, 2 * devices, 1024 * 2, args.layers, alpha,
                                                    args.layer_corr), devices, per_node, 1024, hidden * 2, accounting)
                        for _ in range(args.draws)]
                base = statistics.mean(r["base_s"] for r in runs)
                net = statistics.mean(r["netmoe_s"] for r in runs)
                inter = 100.0 * (sum(r["netmoe_inter"] for r in runs) / sum(r["base_inter"] for r in runs) - 1.0)
                record = {"nodes": nodes, "ranks_per_node": per_node, "model": model, "hidden": hidden,
                          "accounting": accounting, "a2a_base_ms": 1e3 * base, "a2a_netmoe_ms": 1e3 * net,
                          "a2a_speedup": base / net, "compute_ms": 1e3 * compute,
                          "e2e_speedup": (compute + base) / (compute + net), "inter_change_pct": inter,
                          "paper_inter_change_pct": TABLE_5_INTER[(nodes, per_node)][model],
                          "solve_ms": 1e3 * statistics.median(r["solve_s"] for r in runs)}
                records.append(record)
                rows.append([f"{nodes}×{per_node}", model, accounting, f"{inter:+.1f} %",
                             f"{record['paper_inter_change_pct']:+.1f} %", f"{1e3 * base:.2f}", f"{1e3 * net:.2f}",
                             f"{base / net:.2f}x", f"{1e3 * compute:.2f}", f"{record['e2e_speedup']:.2f}x",
                             f"{record['solve_ms']:.2f}"])
    print_table(f"simulated, {args.layers} MoE layers, fwd+bwd all-to-alls on NetMoE's cluster (eq 1), α = {alpha}, "
                f"ρ = {args.layer_corr}, GEMMs at {args.tflops} TFLOP/s (assumed); paper: up to {PAPER_MAX_SPEEDUP}x "
                "end to end over FastMoE",
                ["cluster", "model", "accounting", "inter-node", "paper", "a2a base ms", "a2a NetMoE ms",
                 "a2a speedup", "GEMM ms", "e2e speedup", "solve ms"], rows, left={"model", "accounting"})
    return {"alpha": alpha, "layer_corr": args.layer_corr, "calibration": calibration, "rows": records,
            "network": {"name": A800.name, **A800.bandwidths_gbps(), "sources": dict(A800.sources)}}


# --------------------------------------------------------------------------- measured on gloo

def _measured_rank(rank, world, layers, alpha, corr, seq, dim, seed, inline):
    import torch

    from moe_compile.collectives.sample_placement import WireCounter, placed_moe_layer, restore_order

    per_node, batch, experts, top_k = 2, 4, 2 * world, 2
    rng = np.random.default_rng(seed)
    pref = rng.dirichlet(np.full(experts, alpha), size=world * batch)
    routes = []
    for _ in range(layers):
        floor = (pref + 1e-9) / (pref + 1e-9).sum(axis=1, keepdims=True)   # K distinct experts need K non-zeros
        routes.append(torch.from_numpy(np.stack([
            np.stack([rng.choice(experts, top_k, replace=False, p=p) for _ in range(seq)]) for p in floor])))
        pref = corr * pref + (1 - corr) * rng.dirichlet(np.full(experts, alpha), size=world * batch)
    weights = [torch.randn(dim, dim, generator=torch.Generator().manual_seed(100 + e)) / dim ** 0.5
               for e in range(experts)]
    expert_rank = torch.arange(experts) // (experts // world)
    x0 = torch.randn(world * batch, seq, dim, generator=torch.Generator().manual_seed(seed))
    norm = torch.nn.LayerNorm(dim)
    out = {}
    for place in (False, True):
        counter = WireCounter(rank, per_node)
        held = torch.arange(rank * batch, (rank + 1) * batch)
        x = x0[held].clone().requires_grad_(True)
        h = x
        timing = []
        for layer in range(layers):
            result = placed_moe_layer(h, h, routes[layer][held], torch.full((batch, seq, top_k), 0.5), held,
                                      lambda e, rows: rows @ weights[rank * (experts // world) + e], expert_rank,
                                      per_node, counter=counter, place=place, last=layer == layers - 1,
                                      pre=norm if inline else None)
            h, held = result.out, result.held_new
            timing.append((result.solve_seconds, result.overlap_seconds, result.waited_seconds))
        h = restore_order(h, held, counter=counter)
        h.square().sum().backward()
        out[place] = {"h": h.detach(), "grad": x.grad,
                      "bytes": {f"{what}:{link}": n for (what, link), n in counter.bytes.items()},
                      "timing": timing}
    torch.testing.assert_close(out[True]["h"], out[False]["h"])
    torch.testing.assert_close(out[True]["grad"], out[False]["grad"])
    return {str(place): {"bytes": v["bytes"], "timing": v["timing"]} for place, v in out.items()}


def part_measured(args, alpha):
    from moe_compile.testing import spawn

    results = []
    for (locality, a), inline in [(loc, inl) for loc in (("calibrated", alpha), ("none", 1000.0))
                                  for inl in (True, False)]:
        per_rank = spawn(_measured_rank, 4, args.layers, a, args.layer_corr, args.seq, args.dim, args.seed, inline,
                         timeout=900)
        totals = {}
        for r in per_rank:
            for place, rec in r.items():
                for key, n in rec["bytes"].items():
                    what, link = key.split(":", 1)[0], key.rsplit(":", 1)[1]
                    kind = "meta" if what == "meta" else "payload"
                    totals[(place, kind, link)] = totals.get((place, kind, link), 0) + n
        timing = [t for r in per_rank for t in r["True"]["timing"]]
        results.append({"locality": locality, "alpha": a, "residual": "inlined" if inline else "sent",
                        "bytes": {f"{p}:{k}:{lk}": n for (p, k, lk), n in totals.items()},
                        "solve_ms": 1e3 * statistics.median(t[0] for t in timing),
                        "scatter_expert_ms": 1e3 * statistics.median(t[1] for t in timing),
                        "waited_ms": 1e3 * statistics.median(t[2] for t in timing)})
    rows = []
    for rec in results:
        b = rec["bytes"]
        for kind in ("payload", "meta"):
            for link in ("inter", "intra"):
                off, on = b.get(f"False:{kind}:{link}", 0), b.get(f"True:{kind}:{link}", 0)
                rows.append([rec["locality"], rec["residual"], kind, link, f"{off}", f"{on}",
                             f"{100.0 * (on / off - 1.0):+.1f} %" if off else "–"])
    print_table(f"measured: 4 gloo ranks as 2 nodes × 2, {args.layers} layers, I/J = 4, S = {args.seq}, M = {args.dim}, "
                "E = 8, K = 2, fwd+bwd bytes handed to all_to_all_single (all ranks)",
                ["routing", "residual", "bytes", "link", "placement off", "NetMoE", "change"], rows,
                left={"routing", "residual", "bytes", "link"})
    print_table("measured: the solver on its thread vs the scatter + experts it runs behind (medians per layer)",
                ["routing", "residual", "solve ms", "scatter + experts ms", "caller waited ms"],
                [[r["locality"], r["residual"], f"{r['solve_ms']:.2f}", f"{r['scatter_expert_ms']:.2f}", f"{r['waited_ms']:.2f}"]
                 for r in results], left={"routing", "residual"})
    return results


# --------------------------------------------------------------------------- compiled

def _compiled_rank(rank, world, layers, seq, dim, locality, steps):
    import torch

    import moe_compile
    from moe_compile.ops import netmoe as netmoe_ops
    from tests.models.decoder import TinyMoEDecoder, local_tokens

    torch.manual_seed(0)
    model = TinyMoEDecoder(layers=layers, model_dim=dim, hidden=2 * dim, experts=2 * world, vocab=64,
                           locality=locality)
    compiled = torch.compile(model, backend="moe", fullgraph=True,
                             options={"ep_group": "world", "ranks_per_node": 2, "sample_placement": "netmoe"})
    batch = 4
    out = {}
    moe_compile.counters.clear()
    for place in (False, True):
        netmoe_ops.PLACE_SAMPLES = place
        moved_before = sum(v for k, v in moe_compile.counters.items() if k.endswith(":samples_moved_in"))
        seconds, logits = [], None
        for step in range(steps + 1):
            data = local_tokens(world * batch, seq, 64, step, locality)[rank * batch:(rank + 1) * batch, :-1]
            if step == 1 and netmoe_ops.wire_counter() is not None:
                netmoe_ops.wire_counter().bytes.clear()       # step 0 compiles (and is not counted)
            start = time.perf_counter()
            y = compiled(data)
            y.square().mean().backward()
            seconds.append(time.perf_counter() - start)
            logits = y.detach() if step == 1 else logits
        counter = netmoe_ops.wire_counter()
        moved = sum(v for k, v in moe_compile.counters.items() if k.endswith(":samples_moved_in")) - moved_before
        out[place] = {"logits": logits, "bytes": {f"{what}:{link}": n for (what, link), n in counter.bytes.items()},
                      "step_ms": 1e3 * statistics.median(seconds[1:]), "moved": moved,
                      "placed": moe_compile.counters["sample_placement:placed"]}
    netmoe_ops.PLACE_SAMPLES = True
    torch.testing.assert_close(out[True]["logits"], out[False]["logits"], rtol=1e-4, atol=1e-5)
    return {str(place): {k: v for k, v in rec.items() if k != "logits"} for place, rec in out.items()}


def part_compiled(args):
    """4. The compiled step: ``options={"sample_placement": "netmoe"}`` on a tiny decoder, 4 gloo ranks as 2 × 2."""
    from moe_compile.testing import spawn

    results, rows = [], []
    for locality in (True, False):
        per_rank = spawn(_compiled_rank, 4, args.layers, args.seq, args.dim, locality, args.steps, timeout=900)
        totals = {}
        for r in per_rank:
            for place, rec in r.items():
                for key, n in rec["bytes"].items():
                    kind = "meta" if key.startswith("meta:") else "payload"
                    link = key.rsplit(":", 1)[1]
                    totals[(place, kind, link)] = totals.get((place, kind, link), 0) + n // args.steps
        rec = {"locality": locality, "bytes_per_step": {f"{p}:{k}:{lk}": n for (p, k, lk), n in totals.items()},
               "placed_layers": per_rank[0]["True"]["placed"],
               "samples_moved_in_per_step": sum(r["True"]["moved"] for r in per_rank) / (args.steps + 1),
               "step_ms": {p: statistics.median(r[p]["step_ms"] for r in per_rank) for p in ("False", "True")}}
        results.append(rec)
        b = rec["bytes_per_step"]
        for kind in ("payload", "meta"):
            for link in ("inter", "intra"):
                off, on = b.get(f"False:{kind}:{link}", 0), b.get(f"True:{kind}:{link}", 0)
                rows.append(["yes" if locality else "no", kind, link, f"{off}", f"{on}",
                             f"{100.0 * (on / off - 1.0):+.1f} %" if off else "–"])
    print_table(f"compiled: {args.layers}-layer decoder, options sample_placement='netmoe', 4 gloo ranks as 2 × 2, "
                f"I/J = 4, S = {args.seq}, M = {args.dim}, E = 8, K = 2; fwd+bwd bytes per step handed to "
                "all_to_all_single (all ranks), gathering home (off) vs placed",
                ["locality", "bytes", "link", "off", "NetMoE", "change"], rows, left={"locality", "bytes", "link"})
    print_table("compiled: layers placed, samples moved per step (all ranks), median step ms on this shared CPU",
                ["locality", "placed layers", "samples moved in / step", "step ms off", "step ms NetMoE"],
                [["yes" if r["locality"] else "no", str(r["placed_layers"]), f"{r['samples_moved_in_per_step']:.1f}",
                  f"{r['step_ms']['False']:.1f}", f"{r['step_ms']['True']:.1f}"] for r in results],
                left={"locality"})
    return results


# --------------------------------------------------------------------------- Table 4

def part_solver_time(args, alpha):
    rng = np.random.default_rng(args.seed + 1)
    devices, per_node, experts = 16, 8, 32
    hidden = TABLE_3["MoE-GPT-S"]
    rows, records = [], []
    for per_gpu, (km, pulp, paper_overlap) in TABLE_4.items():
        samples = per_gpu * devices
        nums = draw_routing(rng, samples, experts, 1024 * 2, 1, alpha, 1.0)[0]
        place = np.arange(samples) // per_gpu
        times = []
        for _ in range(args.solver_repeat):
            started = time.perf_counter()
            solve_placement(nums + nums, contiguous_expert_devices(experts, devices), devices, per_node, place)
            times.append(time.perf_counter() - started)
        intra_b, inter_b = link_bytes(nums, contiguous_expert_devices(experts, devices), place, per_node, hidden * 2,
                                      "scatter")
        scatter = all_to_all_seconds(intra_b, inter_b, per_node, A800)
        # the forward expert GEMMs of one GPU: I/J·S tokens × K choices × two H × 4H matmuls
        expert = 2 * per_gpu * 1024 * 2 * 2 * hidden * 4 * hidden / (args.tflops * 1e12)
        record = {"samples_per_gpu": per_gpu, "solve_ms": 1e3 * statistics.median(times), "paper_km_ms": km,
                  "paper_pulp_ms": pulp, "model_scatter_ms": 1e3 * scatter, "model_expert_ms": 1e3 * expert,
                  "paper_scatter_computation_ms": paper_overlap}
        records.append(record)
        rows.append([f"{per_gpu}", f"{record['solve_ms']:.2f}", f"{km}", f"{pulp}",
                     f"{1e3 * (scatter + expert):.2f} ({1e3 * scatter:.2f} + {1e3 * expert:.2f})", f"{paper_overlap}"])
    print_table(f"solver time (Table 4: MoE-GPT-S, J = 16 as 2 × 8, E = 32, K = 2), median of {args.solver_repeat}, "
                "scipy linear_sum_assignment on this CPU",
                ["I/J", "solve ms (here)", "KM ms (paper)", "PuLP ms (paper)", "scatter + experts ms (model)",
                 "scatter + computation ms (paper)"], rows)
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--draws", type=int, default=3)
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.3])
    parser.add_argument("--layer-corr", type=float, default=0.5)
    parser.add_argument("--tflops", type=float, default=150.0, help="assumed achieved bf16 GEMM TFLOP/s of an A800")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sample of the measured run")
    parser.add_argument("--dim", type=int, default=64, help="model dim of the measured run")
    parser.add_argument("--solver-repeat", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-measure", action="store_true")
    parser.add_argument("--steps", type=int, default=3, help="measured steps of the compiled part (after one compiling)")
    parser.add_argument("--compiled-only", action="store_true", help="part 4 only")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/netmoe.json"))
    args = parser.parse_args()
    if args.quick:
        args.layers, args.draws, args.seq, args.dim, args.solver_repeat = 2, 1, 16, 16, 2
        args.alphas = [0.05, 0.2]
    result = {"machine": platform.platform(), "args": {k: str(v) for k, v in vars(args).items()}}
    if args.compiled_only:
        result["compiled"] = part_compiled(args)
        args.json = args.json.with_name(args.json.stem + "_compiled.json")
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
        return
    result["simulated"] = part_simulated(args)
    alpha = result["simulated"]["alpha"]
    if not args.no_measure:
        result["measured"] = part_measured(args, alpha)
        result["compiled"] = part_compiled(args)
    result["solver_time"] = part_solver_time(args, alpha)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
