"""Counters of what the backend did, process-wide: ``moe_compile.counters``.

Keys: ``graphs`` (graphs compiled), ``regions_found``, ``regions_rewritten``,
``regions_skipped``, ``pattern:<name>`` per matched pattern, ``regions_verified_again`` (canonicalize's
check answered from an earlier identical one), ``views_reshaped`` (the eager inner compiler's
``aten.view`` nodes turned into ``reshape``, ``passes/safe_views.py``), ``tiled_grads_joined`` (the eager
inner compiler's sums of zero-padded gradient pieces joined by one ``stack`` / ``cat``,
``passes/tiled_grads.py``), ``activations_fused`` (per-block expert ops
whose gated activation runs as Inductor's one-pass kernels, ``passes/lower.py``), ``routing_inlined``
(``moe.combine`` / ``moe.dispatch_backward`` / ``moe.combine_backward`` calls replaced by their aten forms for
Inductor to fuse, CPU, ``passes/lower.py``), ``tier_up_compiles`` /
``tiered_up`` / ``tier_up_failed`` / ``calls_on_inductor`` (CPU graphs Inductor compiled once hot, switched to its code, whose compile failed or whose code
disagreed with the eager inner compiler's, and calls its code served,
``tiered.py``), ``normalize:<rule>`` per spelling
normalised (``cast``, ``no_op_cast``, ``linear_arguments``, ``one_hot``, ``addcmul``, ``cast_function``,
``passes/normalize.py``); wall seconds (floats,
summed over graphs): ``seconds:pass:<name>`` per pass (stage-2 names prefixed
``fw_`` / ``bw_``), ``seconds:passes`` all of them, ``seconds:verify`` canonicalize's check of its rewrites
(part of its pass; ``verify_regions=False`` skips it), ``seconds:inner`` the inner
compiler (Inductor's ``compile_fx_inner``, or the eager wrapping), ``seconds:tier_up`` the
tier-up Inductor compiles, ``seconds:backend``
the whole backend call (stage 1, AOTAutograd, and what it compiles then). Tests and users
read them after a compile; ``counters.clear()`` resets.
"""
from collections import Counter

counters: Counter[str] = Counter()
