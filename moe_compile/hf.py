"""Hugging Face transformers models made capturable in one line: ``moe_compile.hf.prepare(model)``.

    model = transformers.AutoModelForCausalLM.from_config(config)   # any MoE family
    moe_compile.hf.prepare(model)                                    # in place; returns model
    torch.compile(model, backend="moe", fullgraph=True)

Three things stop Dynamo before the ``moe`` backend ever sees a transformers MoE model:

1. ``experts_implementation="eager"`` (transformers' per-expert loop ``for expert_idx in
   expert_hit`` over the rows of a ``nonzero()``: a loop of data-dependent length). ``prepare``
   switches the model (and its sub-models) to ``"grouped_mm"`` with transformers' own
   ``set_experts_implementation``; the parameters are the same, only the experts' forward changes.
2. Families whose experts module is not decorated with ``@use_experts_implementation`` and loops
   over ``nonzero()`` itself, or picks an expert module by a tensor value (dbrx's ``DbrxExperts``,
   switch_transformers' and nllb_moe's ``ModuleDict`` of experts). ``prepare`` gives each such
   module a Dynamo-safe forward registered here (:func:`register_forward`): a loop over every
   expert ``e`` in ``range(E)`` with ``torch.where(mask[e])``, the Mixtral-before-transformers-5
   loop form the backend recognises (README, "Supported MoE patterns"). Same parameters, same
   result; an expert that receives no token contributes nothing, as before.

3. switch_transformers' encoder stack (``SwitchTransformersStack``) builds its all-ones attention
   mask only when Dynamo is *not* tracing (``if attention_mask is None and not
   is_torchdynamo_compiling()``) and then subscripts it anyway (``attention_mask[:, None, None, :]``:
   ``TypeError: 'NoneType' object is not subscriptable`` under Dynamo). ``prepare`` gives the stack a
   forward that passes the mask eager would build (ones ``[B, S]``) when none is given; a decoder
   stack, or a given mask, is passed through as it is.

   longcat_flash's ``LongcatFlashExperts`` (a loop over ``nonzero()`` that picks between its SwiGLU experts
   and its zero-computation, identity, experts by the expert id's value) gets one too: its routed experts
   looped over ``range(E)``, the identity experts' tokens added back scaled by their weights.

Families ``prepare`` cannot make capturable as a whole (qwen4_exp's attention branches on a tensor
value) are listed in
:data:`NO_SUBSTITUTE`; ``prepare`` says so at WARNING with the fix (and ``strict=True`` raises ``ValueError`` instead). transformers is never
imported by this module: classes are matched by module and name.
"""
from __future__ import annotations

import logging
import re
import types
from collections.abc import Callable

import torch

__all__ = ["prepare", "register_forward", "capture_fix", "dynamo_failure_reason", "NO_SUBSTITUTE"]

log = logging.getLogger("moe_compile")

_FORWARDS: dict[str, Callable] = {}

#: family → (why Dynamo cannot capture the whole model even after prepare, the fix); prepare warns with it.
NO_SUBSTITUTE: dict[str, tuple[str, str]] = {
    "qwen4_exp": (
        "its attention's token indexer (Qwen4ExpTextQSAIndexer) loops over every query with nonzero() of the mask "
        "and a top-k of data-dependent size (`if num_complete_blocks > 0:`), outside the MoE layers",
        "torch.compile without fullgraph=True (the graph breaks stay in the indexer; the MoE blocks are rewritten), "
        "or torch.compile(layer.mlp, backend=\"moe\") on its MoE blocks alone",
    ),
}


def register_forward(class_name: str, forward: Callable, *, replace: bool = False) -> None:
    """Give every module of a transformers class named ``class_name`` (``"DbrxExperts"``) the
    Dynamo-safe ``forward(self, ...)`` when :func:`prepare` sees one. ``forward`` must compute what
    the class's own forward computes, from the same parameters."""
    if class_name in _FORWARDS and not replace:
        raise ValueError(f"a Dynamo-safe forward for {class_name!r} is already registered; pass replace=True")
    _FORWARDS[class_name] = forward


def _is_transformers(module: torch.nn.Module) -> bool:
    return type(module).__module__.startswith("transformers.")


def _family(module: torch.nn.Module) -> str | None:
    parts = type(module).__module__.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "models" else None


def _runs_eager_experts(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a transformers model whose config asks for ``experts_implementation="eager"``
    and whose experts honour it (``@use_experts_implementation``)."""
    config = getattr(module, "config", None)
    return (hasattr(module, "set_experts_implementation") and config is not None
            and getattr(config, "_experts_implementation", None) == "eager"
            and module._can_set_experts_implementation())


def prepare(model: torch.nn.Module, experts_implementation: str = "grouped_mm", strict: bool = False) -> torch.nn.Module:
    """Make a transformers MoE ``model`` capturable by ``torch.compile(..., fullgraph=True)``, in place.

    - ``experts_implementation="eager"`` → ``experts_implementation`` (``"grouped_mm"`` or
      ``"batched_mm"``; both are rewritten by the backend) via transformers'
      ``set_experts_implementation``;
    - each module of a class with a registered Dynamo-safe forward (:func:`register_forward`) gets it;
    - a family in :data:`NO_SUBSTITUTE`: a WARNING naming the fix (``strict=True``: ``ValueError``).

    Returns ``model``. Idempotent; a model that needs nothing is returned unchanged.
    """
    _prepare(model, experts_implementation, strict)
    return model


def _prepare(model: torch.nn.Module, experts_implementation: str = "grouped_mm", strict: bool = False) -> int:
    """:func:`prepare`; returns how many (sub-)models and modules it changed."""
    if experts_implementation not in ("grouped_mm", "batched_mm"):
        raise ValueError(f"prepare(experts_implementation={experts_implementation!r}): choose 'grouped_mm' or "
                         "'batched_mm' (the forms the moe backend rewrites)")
    switched = 0
    for module in model.modules():   # outermost first: set_experts_implementation covers its sub-models
        if _runs_eager_experts(module):
            module.set_experts_implementation(experts_implementation)
            switched += 1
            log.info("moe_compile.hf.prepare: %s switched to experts_implementation=%r", type(module).__name__,
                     experts_implementation)
    replaced = 0
    for module in model.modules():
        forward = _FORWARDS.get(type(module).__name__)
        if forward is not None and _is_transformers(module) and getattr(module.forward, "__func__", None) is not forward:
            module.forward = types.MethodType(forward, module)
            replaced += 1
    if replaced:
        log.info("moe_compile.hf.prepare: %d module(s) given a Dynamo-safe forward", replaced)
    families = {_family(m) for m in model.modules() if _is_transformers(m)} & set(NO_SUBSTITUTE)
    for family in sorted(families):
        why, fix = NO_SUBSTITUTE[family]
        message = f"moe_compile.hf.prepare: transformers' {family} cannot be captured by Dynamo ({why}); use {fix}"
        if strict:
            raise ValueError(message)
        log.warning(message)
    return switched + replaced


GENERIC_FIX = (
    "torch.compile without fullgraph=True (Dynamo breaks the graph there; what it splits stays eager), or a "
    "Dynamo-safe forward for the module registered with moe_compile.hf.register_forward"
)


def capture_fix(family: str, experts_implementation: str | None = None) -> str:
    """What a user does when Dynamo cannot capture a transformers ``family`` model even after
    :func:`prepare` (the test table's ``use <fix>``)."""
    return NO_SUBSTITUTE[family][1] if family in NO_SUBSTITUTE else GENERIC_FIX


_CAUSED_BY = re.compile(r"Caused by: (?P<code>.+?)\s+# (?P<file>\S+?):\d+ in ")
_RAISED = re.compile(r"Developer debug context: raised exception (?P<exc>.+)")


def dynamo_failure_reason(error: BaseException) -> str:
    """The gist of Dynamo's error when it cannot capture a graph, stable enough to record in a table:
    the data-dependent Python statement and its file (``data-dependent `for expert_idx in expert_hit:`
    in transformers/models/mixtral/modeling_mixtral.py``), or the exception Dynamo saw raised while
    tracing, or the first line of its message."""
    text = str(error)
    caused = _CAUSED_BY.search(text)
    if caused:
        return f"data-dependent `{caused['code'].strip()}` in {caused['file']}"
    raised = _RAISED.search(text)
    if raised:
        return f"{raised['exc'].strip()} raised while tracing"
    first = text.strip().split("\n", 1)[0].strip().rstrip(".:")
    return re.sub(r"0x[0-9a-f]+", "0x…", first) or type(error).__name__


# ----------------------------------------------------------------------------- Dynamo-safe forwards
#
# Each loops over every expert e in range(E) (a Python loop of constant length, unrolled by Dynamo)
# where transformers loops over ``expert_hit = (...).nonzero()`` (data-dependent length). An expert
# no token chose gets empty rows from ``torch.where`` and adds nothing, so the sum is the same.


def _module_dict_experts_forward(self, hidden_states, router_mask, router_probs):
    """``NllbMoeExperts`` / ``SwitchTransformersExperts`` (a ``ModuleDict`` of ``expert_<e>``):
    ``router_mask`` is a ``[T, k, E]`` one-hot (switch), or what ``NllbMoeSparseMLP`` passes, one-hot encoded
    as transformers does: its kept top-1 one-hot ``[T, E]``, read as ``[T, E]`` expert ids in {0, 1} (so
    transformers 5.24's NLLB-MoE runs expert_1 weighted by each token's first choice and expert_0 by its
    second, whatever the router chose; reproduced as is)."""
    out = torch.zeros_like(hidden_states)
    if router_mask.dim() == hidden_states.dim():   # nllb: ids → one-hot
        router_mask = torch.nn.functional.one_hot(router_mask, num_classes=self.num_experts)
    expert_mask = router_mask.permute(2, 1, 0)     # [E, k, T]
    dropout = getattr(self, "moe_token_dropout", 0.0)
    for e in range(self.num_experts):
        idx, top_x = torch.where(expert_mask[e])
        y = self[f"expert_{e}"](hidden_states[top_x]) * router_probs[top_x, idx, None]
        if dropout > 0:
            y = self.token_dropout(y) if self.training else y * (1 - dropout)
        out.index_add_(0, top_x, y.to(hidden_states.dtype))
    return out


def _dbrx_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """``DbrxExperts``: the experts' ``w1``, ``v1``, ``w2`` stacked ``[E·F, H]``."""
    batch_size = hidden_states.shape[0]
    hidden_states = hidden_states.reshape(-1, self.hidden_size)
    out = torch.zeros_like(hidden_states)
    expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
    shape = (self.num_experts, self.ffn_hidden_size, self.hidden_size)
    w1, v1, w2 = (self.mlp.w1.view(shape), self.mlp.v1.view(shape), self.mlp.w2.view(shape))
    for e in range(self.num_experts):   # DbrxExpertGLU's computation, its weights read as W[e] by the backend
        idx, token_idx = torch.where(expert_mask[e])
        x = hidden_states[token_idx]
        h = self.mlp.activation_fn(torch.nn.functional.linear(x, w1[e])) * torch.nn.functional.linear(x, v1[e])
        y = torch.matmul(h, w2[e])
        out.index_add_(0, token_idx, y * top_k_weights[token_idx, idx, None])
    return out.view(batch_size, -1, self.hidden_size)


register_forward("NllbMoeExperts", _module_dict_experts_forward)
register_forward("SwitchTransformersExperts", _module_dict_experts_forward)
def _stacked_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Experts stored ``gate_up_proj [E, 2F, H]`` / ``down_proj [E, H, F]`` with the class's own
    ``_apply_gate`` whose loop transformers did not put behind ``@use_experts_implementation``
    (``Step3p7Experts``); expert ``E`` of the one-hot (a padding id) is skipped as there."""
    final = torch.zeros_like(hidden_states)
    mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
    for e in range(self.num_experts):
        top_k_pos, token_idx = torch.where(mask[e])
        current = self._apply_gate(torch.nn.functional.linear(hidden_states[token_idx], self.gate_up_proj[e]))
        current = torch.nn.functional.linear(current, self.down_proj[e]) * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, current.to(final.dtype))
    return final


def _switch_stack_forward(self, input_ids=None, attention_mask=None, *args, **kwargs):
    """``SwitchTransformersStack``: an encoder called without ``attention_mask`` gets the all-ones ``[B, S]``
    float mask its own forward builds outside Dynamo (and needs inside it); then the class's forward."""
    if attention_mask is None and not self.is_decoder:
        embeds = kwargs.get("inputs_embeds", args[2] if len(args) > 2 else None)
        source = input_ids if input_ids is not None else embeds
        if source is not None:
            attention_mask = torch.ones(tuple(source.shape[:2]), device=source.device)
    return type(self).forward(self, input_ids, attention_mask, *args, **kwargs)


def _zero_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """``LongcatFlashExperts``: ``num_routed_experts`` SwiGLU experts (``gate_up_proj [E + Z, 2F, H]``, its first
    E used, ``down_proj [E, H, F]``) and Z zero-computation experts, ids E .. E + Z - 1, whose output is the token
    itself (``nn.Identity``). A choice of a zero-computation expert is sent to expert 0 with weight 0 (as Zaya's
    skip expert) and its token added back scaled by its weight, after the routed experts (transformers adds the
    identity experts' rows after the routed ones too, expert by expert)."""
    final = torch.zeros_like(hidden_states)
    if top_k_index.numel() == 0:
        return final
    identity = top_k_index >= self.num_routed_experts
    ids = top_k_index.masked_fill(identity, 0)
    weights = top_k_weights.masked_fill(identity, 0)
    mask = torch.nn.functional.one_hot(ids, num_classes=self.num_routed_experts).permute(2, 1, 0)
    gate_up_proj = self.gate_up_proj[: self.num_routed_experts]   # [E, 2F, H]: the rows of the routed experts
    for e in range(self.num_routed_experts):
        top_k_pos, token_idx = torch.where(mask[e])
        gate, up = torch.nn.functional.linear(hidden_states[token_idx], gate_up_proj[e]).chunk(2, dim=-1)
        current = torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e])
        final.index_add_(0, token_idx, (current * weights[token_idx, top_k_pos, None]).to(final.dtype))
    return final + hidden_states * (top_k_weights * identity).sum(-1, keepdim=True).to(final.dtype)


register_forward("DbrxExperts", _dbrx_experts_forward)
register_forward("LongcatFlashExperts", _zero_experts_forward)
register_forward("SwitchTransformersStack", _switch_stack_forward)
register_forward("Step3p7Experts", _stacked_experts_forward)
