"""MoE layers that differ only in their router: the routing forms of today's MoE models, written by hand.

Every layer computes its experts the same way (a stable argsort of the (token, choice) pairs by
expert, ``bmm`` on the gathered stacked weights, ``index_add`` back: dropless, as
:mod:`tests.models.sort`); what differs is ``route(x) -> (expert ids, gate weights)``:

| layer | router | as in |
|---|---|---|
| :class:`GroupLimitedMoE` | sigmoid scores, a selection-only bias, top-k groups of E/G experts (each group scored by its 2 best), top-k experts within them, weights gathered from the unbiased scores, renormalised, scaled | DeepSeek-V3 (§2.1.2 of its report), GLM-4.5, dots.llm1 |
| :class:`BiasCorrectedMoE` | softmax scores, a selection-only bias, no groups; weights gathered, renormalised (clamped sum), scaled | ERNIE 4.5, MiniMax-M2, AFMoE |
| :class:`SoftmaxAfterTopkMoE` | top-k of the raw logits, softmax over the k | Granite MoE, Cohere2 MoE, Mixtral's paper form |
| :class:`PerExpertScaleMoE` | softmax of a gate that reads its own RMS-normed, scaled tokens (the experts another norm of them); top-k renormalised, times a learned scale per expert read at the ids | Gemma 4, DiffusionGemma |
| :class:`SwitchMaxMoE` | top-1 by ``max`` of the softmax, optionally with input jitter (training) | Switch Transformer (Fedus et al. 2021, §2.1) |
| :class:`NoisyTopkMoE` | noisy top-k gating: logits + N(0, 1)·softplus(noise linear) in training | Shazeer et al. 2017, §3.1 |
| :class:`TwoPickMoE` | two sequential ``max`` picks, the second over the scores without the first, weights a softmax of each, concatenated; no ``topk`` | PhiMoE's sparsemixer (eval form) |
| :class:`ScoresBeforeMoE` | sigmoid of the top-k logits, multiplied into the sorted tokens *before* the experts, the outputs summed unweighted | torchtitan's ``score_before_experts`` (its Llama 4) |
| :class:`HashMoE` | hash routing: each token id's experts a fixed row of a ``[V, k]`` table (a buffer), weights the sigmoid scores gathered at them, renormalised, scaled; no selection over scores | DeepSeek-V4's first layers (§2.1) |
| :class:`SkipExpertMoE` | a router MLP (its gate linear reads no token tensor) over ``[B, S, E + 1]`` scores: the last class a skip expert, its choices sent to expert 0 with weight 0 | Zaya |
| :class:`ZeroExpertsMoE` | top-k over E + Z classes, the last Z zero-computation experts (the token itself): their choices sent to expert 0 with weight 0 (``ids >= E``), the token added back scaled by their weights | LongCat-Flash (as ``moe_compile.hf.prepare`` writes its experts) |
| :class:`SharedGammaMoE` | one gate linear for E routed and 1 shared expert; the k gathered logits and the shared one normalised together (``sigmoid`` / their sum, via ``logsigmoid`` and ``logsumexp``); the shared expert scaled by its share | Inkling |
| :class:`SwitchCapacityMoE` | top-1 by ``argmax`` of the softmax, one-hot, ``cumsum`` positions ``<= C``: the tokens past an expert's capacity dropped (output 0), over all tokens or per sequence; weight the max probability; a ``ModuleList`` of ReLU experts looped over the kept one-hot | Switch Transformer (§2.1-2.2), transformers' ``SwitchTransformersSparseMLP`` |
| :class:`GShardTop2MoE` | top-2 by two ``argmax`` picks, the second over the logits (plus Gumbel noise in training) with the first masked to ``-inf``; ``cumsum`` positions, the second choices after all first choices, ``< C`` (or dropless); weights renormalised over the kept choices; ``l_aux`` from the choices before the drop; a ``ModuleList`` of ReLU experts looped over the kept one-hots | GShard (§2.2, Algorithm 1), fairscale's ``Top2Gate``, DeepSpeed-MoE's ``top2gating`` |
| :class:`DenseScoresMoE` | top-k logits scattered into ``-inf`` ``[T, E]`` scores, ``sigmoid``; every expert runs every token scaled by its score (``einsum`` over ``[E, T, M]``), summed over the experts | Llama 4 as transformers writes it |

:class:`IndexedAttentionBlock` puts an attention whose key selection is a ``topk`` over ``[B, S, S]``
q·k scores (DeepSeek-V3.2's sparse-attention indexer) before an MoE layer: a ``topk`` that is no router.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class _RoutedMoE(nn.Module):
    """Stacked SwiGLU experts [E, H, M]; a subclass writes ``route``."""

    def __init__(self, model_dim, hidden_dim, num_experts, top_k=2):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nn.Linear(model_dim, num_experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden_dim, model_dim) / math.sqrt(model_dim))
        self.w2 = nn.Parameter(torch.randn(num_experts, model_dim, hidden_dim) / math.sqrt(hidden_dim))
        self.w3 = nn.Parameter(torch.randn(num_experts, hidden_dim, model_dim) / math.sqrt(model_dim))

    #: the gate weights multiply the tokens before the experts (torchtitan's ``score_before_experts``)
    scores_before = False

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def forward(self, x):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        ids, weights = self.route(tokens)
        return self.experts(tokens, ids, weights).reshape(shape)

    def experts(self, tokens, ids, weights):
        """The routed output ``[T, M]`` of the tokens for their expert ids and gate weights."""
        flat = ids.reshape(-1)
        k = flat.numel() // tokens.shape[0]
        order = torch.argsort(flat, stable=True)
        rows = order // k
        experts = flat[order]
        h = tokens[rows]
        if self.scores_before:
            h = (h.float() * weights.reshape(-1)[order].unsqueeze(-1)).to(h.dtype)
        h = h.unsqueeze(-1)
        up = F.silu(torch.bmm(self.w1[experts], h).squeeze(-1)) * torch.bmm(self.w3[experts], h).squeeze(-1)
        y = torch.bmm(self.w2[experts], up.unsqueeze(-1)).squeeze(-1)
        if not self.scores_before:
            y = y * weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
        return torch.zeros_like(tokens).index_add(0, rows, y)


class GroupLimitedMoE(_RoutedMoE):
    def __init__(self, model_dim, hidden_dim, num_experts=8, top_k=2, num_groups=4, top_groups=2,
                 scaling=2.5, renormalize=True):
        super().__init__(model_dim, hidden_dim, num_experts, top_k)
        self.num_groups, self.top_groups = num_groups, top_groups
        self.scaling, self.renormalize = scaling, renormalize
        # updated outside the gradient by the load balancer in training; random here, so it changes the choice
        self.register_buffer("correction", torch.randn(num_experts) * 0.3)

    def route(self, x):
        scores = torch.sigmoid(self.router(x).float())
        biased = scores + self.correction
        grouped = biased.reshape(x.shape[0], self.num_groups, -1)
        group_score = torch.topk(grouped, 2, dim=-1).values.sum(dim=-1)                   # [T, G]
        best_groups = torch.topk(group_score, self.top_groups, dim=-1).indices
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter(1, best_groups, True)
        keep = keep[:, :, None].expand_as(grouped).reshape(x.shape[0], -1)
        ids = biased.masked_fill(~keep, float("-inf")).topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling


class BiasCorrectedMoE(_RoutedMoE):
    def __init__(self, model_dim, hidden_dim, num_experts=6, top_k=2, scaling=1.5):
        super().__init__(model_dim, hidden_dim, num_experts, top_k)
        self.scaling = scaling
        self.bias = nn.Parameter(torch.randn(num_experts) * 0.1, requires_grad=False)

    def route(self, x):
        scores = F.softmax(self.router(x), dim=-1, dtype=torch.float32)
        _, ids = torch.topk(scores + self.bias, self.top_k, dim=-1)
        weights = torch.gather(scores, dim=-1, index=ids)
        weights = weights / torch.clamp(weights.sum(-1, keepdim=True), min=1e-12)
        return ids, self.scaling * weights


class SoftmaxAfterTopkMoE(_RoutedMoE):
    def route(self, x):
        logits, ids = self.router(x).topk(self.top_k, dim=1)
        return ids, torch.softmax(logits, dim=1, dtype=torch.float32).type_as(x)


def _rms_norm(x, weight=None, eps=1e-6):
    normed = x.float() * torch.pow(x.float().pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return (normed if weight is None else normed * weight.float()).type_as(x)


class PerExpertScaleMoE(_RoutedMoE):
    """Gemma 4's router: the gate reads its own RMS-normed, scaled copy of the tokens, the experts another norm
    of them; the renormalised top-k weights multiplied by a learned scale per expert read at the ids."""

    def __init__(self, model_dim, hidden_dim, num_experts=6, top_k=2):
        super().__init__(model_dim, hidden_dim, num_experts, top_k)
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(model_dim))
        self.per_expert_scale = nn.Parameter(1 + 0.5 * torch.randn(num_experts))
        self.expert_norm = nn.Parameter(1 + 0.1 * torch.randn(model_dim))

    def route(self, x):
        probs = F.softmax(self.router(_rms_norm(x) * self.scale * x.shape[-1] ** -0.5), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights /= weights.sum(dim=-1, keepdim=True)
        return ids, weights * self.per_expert_scale[ids]

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        ids, weights = self.route(tokens)
        return self.experts(_rms_norm(tokens, self.expert_norm), ids, weights).reshape(x.shape)


class SwitchMaxMoE(_RoutedMoE):
    def __init__(self, model_dim, hidden_dim, num_experts=4, jitter=0.0):
        super().__init__(model_dim, hidden_dim, num_experts, 1)
        self.jitter = jitter

    def route(self, x):
        if self.training and self.jitter > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
        probs = F.softmax(self.router(x), dim=-1)
        weight, ids = probs.max(dim=-1)
        return ids, weight


class ArgmaxMoE(_RoutedMoE):
    """Top-1 as ``argmax`` over softmax scores, the weight gathered at the id (no one-hot, no capacity)."""

    def __init__(self, model_dim, hidden_dim, num_experts=4):
        super().__init__(model_dim, hidden_dim, num_experts, 1)

    def route(self, x):
        probs = F.softmax(self.router(x), dim=-1)
        ids = torch.argmax(probs, dim=-1)
        return ids, probs.gather(1, ids.unsqueeze(1)).squeeze(1)


class NoisyTopkMoE(_RoutedMoE):
    def __init__(self, model_dim, hidden_dim, num_experts=6, top_k=2):
        super().__init__(model_dim, hidden_dim, num_experts, top_k)
        self.noise = nn.Linear(model_dim, num_experts, bias=False)

    def route(self, x):
        logits = self.router(x)
        if self.training:
            logits = logits + torch.randn_like(logits) * F.softplus(self.noise(x))
        vals, ids = torch.topk(logits, self.top_k, dim=-1)
        return ids, F.softmax(vals, dim=-1)


class TwoPickMoE(_RoutedMoE):
    def __init__(self, model_dim, hidden_dim, num_experts=6):
        super().__init__(model_dim, hidden_dim, num_experts, 2)

    def route(self, x):
        scores = self.router(x)
        first = scores.max(dim=-1, keepdim=True).indices
        rest = scores.scatter(-1, first, float("-inf"))
        second = rest.max(dim=-1, keepdim=True).indices
        w_first = scores.softmax(-1).gather(-1, first)
        w_second = rest.softmax(-1).gather(-1, second)
        return torch.cat([first, second], dim=-1), torch.cat([w_first, w_second], dim=-1)


class ScoresBeforeMoE(_RoutedMoE):
    scores_before = True

    def route(self, x):
        vals, ids = self.router(x).topk(self.top_k, dim=-1)
        return ids, torch.sigmoid(vals.float())


class HashMoE(_RoutedMoE):
    """``forward(x, token_ids)``: experts chosen by a fixed token → experts table (k distinct experts per
    token id, a buffer) instead of a selection over the scores."""

    def __init__(self, vocab, model_dim, hidden_dim, num_experts=6, top_k=2, scaling=1.5):
        super().__init__(model_dim, hidden_dim, num_experts, top_k)
        self.scaling = scaling
        g = torch.Generator().manual_seed(0)
        self.register_buffer("tid2eid", torch.stack([torch.randperm(num_experts, generator=g)[:top_k]
                                                     for _ in range(vocab)]))

    def forward(self, x, token_ids):
        tokens = x.reshape(-1, x.shape[-1])
        scores = torch.sigmoid(self.router(tokens))
        ids = self.tid2eid[token_ids.reshape(-1)].long()
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling
        return self.experts(tokens, ids, weights).reshape(x.shape)


class SkipExpertMoE(_RoutedMoE):
    """``forward(x)`` with ``x`` ``[B, S, M]``: scores ``[B, S, E + 1]`` from a 2-layer router MLP; top-k over
    them; a choice of class E (the skip expert) becomes expert 0 with weight 0."""

    def __init__(self, model_dim, hidden_dim, num_experts=4, top_k=2):
        super().__init__(model_dim, hidden_dim, num_experts, top_k)
        self.router = nn.Sequential(nn.Linear(model_dim, 8), nn.GELU(), nn.Linear(8, num_experts + 1, bias=False))

    def forward(self, x):
        probs = torch.softmax(self.router(x), dim=-1)
        _, ids = torch.topk(probs.detach(), self.top_k, dim=-1)
        weights = torch.gather(probs, dim=2, index=ids)
        skip = ids == self.num_experts
        weights, ids = weights.masked_fill(skip, 0), ids.masked_fill(skip, 0)
        tokens = x.reshape(-1, x.shape[-1])
        out = self.experts(tokens, ids.reshape(-1, self.top_k), weights.reshape(-1, self.top_k))
        return out.reshape(x.shape)


class ZeroExpertsMoE(_RoutedMoE):
    """``forward(x)``: E routed SwiGLU experts and Z zero-computation experts (ids E .. E + Z - 1, whose output
    is the token itself); the gate linear scores E + Z classes."""

    def __init__(self, model_dim, hidden_dim, num_experts=4, zero_experts=2, top_k=2):
        super().__init__(model_dim, hidden_dim, num_experts, top_k)
        self.router = nn.Linear(model_dim, num_experts + zero_experts, bias=False)

    def route(self, x):
        weights, ids = torch.topk(torch.softmax(self.router(x), dim=-1), self.top_k, dim=-1)
        return ids, weights

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        ids, weights = self.route(tokens)
        identity = ids >= self.num_experts
        out = self.experts(tokens, ids.masked_fill(identity, 0), weights.masked_fill(identity, 0))
        return (out + tokens * (weights * identity).sum(-1, keepdim=True)).reshape(x.shape)


class SharedGammaMoE(_RoutedMoE):
    """``forward(x)``: routed experts plus a shared SwiGLU expert, all weighted by one normalisation of the
    gate linear's E + 1 logits (the k chosen routed ones and the shared one)."""

    def __init__(self, model_dim, hidden_dim, num_experts=4, top_k=2):
        super().__init__(model_dim, hidden_dim, num_experts, top_k)
        self.router = nn.Linear(model_dim, num_experts + 1, bias=False)
        self.shared_up = nn.Linear(model_dim, 2 * hidden_dim, bias=False)
        self.shared_down = nn.Linear(hidden_dim, model_dim, bias=False)

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        logits = self.router(tokens)
        routed, shared = logits[..., :-1], logits[..., -1:]
        ids = torch.topk(routed.sigmoid(), self.top_k, dim=-1)[1]
        log_probs = F.logsigmoid(torch.cat([routed.gather(-1, ids), shared], dim=-1))
        weights = torch.exp(log_probs - torch.logsumexp(log_probs, dim=-1, keepdim=True)) * 2.0
        gamma, weights = weights[..., -1:], weights[..., : self.top_k]
        gate, up = self.shared_up(tokens).chunk(2, dim=-1)
        out = self.experts(tokens, ids, weights) + self.shared_down(F.silu(gate) * up) * gamma
        return out.reshape(x.shape)


class HashRouted(nn.Module):
    """Token ids → embeddings → ``x + HashMoE(x, token_ids)``."""

    def __init__(self, vocab, model_dim, hidden_dim):
        super().__init__()
        self.embed = nn.Embedding(vocab, model_dim)
        self.moe = HashMoE(vocab, model_dim, hidden_dim)

    def forward(self, token_ids):
        x = self.embed(token_ids)
        return x + self.moe(x, token_ids)


class DenseScoresMoE(nn.Module):
    """Every expert on every token, the token scaled by its score first (0 for the unchosen experts)."""

    def __init__(self, model_dim, hidden_dim, num_experts=4, top_k=2, fill=float("-inf")):
        super().__init__()
        self.top_k, self.fill = top_k, fill
        self.router = nn.Linear(model_dim, num_experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(num_experts, model_dim, 2 * hidden_dim) / math.sqrt(model_dim))
        self.w_out = nn.Parameter(torch.randn(num_experts, hidden_dim, model_dim) / math.sqrt(hidden_dim))

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        logits = self.router(tokens)
        vals, ids = torch.topk(logits, self.top_k, dim=-1)
        scores = torch.sigmoid(torch.full_like(logits, self.fill).scatter(1, ids, vals))
        scaled = tokens.unsqueeze(0) * scores.t().unsqueeze(-1)                   # [E, T, M]
        gate, up = torch.einsum("etm,emh->eth", scaled, self.w_in).chunk(2, dim=-1)
        y = torch.einsum("eth,ehm->etm", F.silu(gate) * up, self.w_out)
        return y.sum(0).reshape(x.shape)


class IndexedAttentionBlock(nn.Module):
    """Attention over the ``top_keys`` best keys of each query (by an indexer's q·k scores), then an MoE."""

    def __init__(self, model_dim, moe: nn.Module, top_keys=3):
        super().__init__()
        self.top_keys = top_keys
        self.qkv = nn.Linear(model_dim, 3 * model_dim, bias=False)
        self.index_q = nn.Linear(model_dim, model_dim // 2, bias=False)
        self.index_k = nn.Linear(model_dim, model_dim // 2, bias=False)
        self.moe = moe

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        index = self.index_q(x) @ self.index_k(x).transpose(1, 2)                     # [B, S, S]
        keys = index.topk(min(self.top_keys, x.shape[1]), dim=-1).indices
        allowed = torch.zeros_like(index, dtype=torch.bool).scatter(-1, keys, True)
        att = (q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])).masked_fill(~allowed, float("-inf"))
        x = x + att.softmax(-1) @ v
        return x + self.moe(x)


class SwitchCapacityMoE(nn.Module):
    """Switch Transformer's token-dropping top-1 layer, as transformers writes it: the argmax of the softmax
    probabilities one-hot encoded, each token's position among its expert's tokens a ``cumsum``, those past
    ``capacity`` dropped (their routed output 0), the kept ones scaled by their expert's probability.
    ``per_sequence``: the router reads ``[B, S, M]`` and the positions run over each sequence (transformers'
    "expert capacity is accounted per sequence"); else the ``[T, M]`` tokens, all in one order."""

    def __init__(self, model_dim, hidden_dim, num_experts=4, capacity=3, per_sequence=False):
        super().__init__()
        self.num_experts, self.capacity, self.per_sequence = num_experts, capacity, per_sequence
        self.classifier = nn.Linear(model_dim, num_experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(model_dim, hidden_dim, bias=False), nn.ReLU(), nn.Linear(hidden_dim, model_dim, bias=False))
            for _ in range(num_experts))

    def route(self, x):
        probs = torch.softmax(self.classifier(x), dim=-1)
        hot = F.one_hot(torch.argmax(probs, dim=-1), num_classes=self.num_experts)
        kept = hot * (torch.cumsum(hot, dim=-2) <= self.capacity)
        return kept, probs.max(dim=-1).values

    def forward(self, x):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        kept, weight = self.route(x if self.per_sequence else tokens)
        kept, weight = kept.reshape(-1, self.num_experts), weight.reshape(-1)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            rows = torch.where(kept[:, e])[0]
            out.index_add_(0, rows, expert(tokens[rows]) * weight[rows, None])
        return out.reshape(shape)


class GShardTop2MoE(nn.Module):
    """GShard's top-2 layer (Lepikhin et al. 2020, §2.2, Algorithm 1) with the router as fairscale's ``top2gating``
    writes it: the first expert the argmax of the probabilities, the second the argmax of the logits (plus Gumbel
    noise when ``sampling`` and training) with the first masked to ``-inf``; each choice's position a ``cumsum`` of
    its one-hot, the second choices counted after all first choices; positions ``>= C = ceil(2 · f · T / E)``
    dropped (``capacity_factor=None``: dropless); the kept choices' probabilities renormalised over the kept
    choices. ``self.l_aux`` is GShard's auxiliary loss of the choices before the drop. The experts a ``ModuleList``
    of ReLU MLPs, each run on the rows that kept a choice of it, weighted by that choice's weight."""

    def __init__(self, model_dim, hidden_dim, num_experts=4, capacity_factor: float | None = 1.0, sampling=True):
        super().__init__()
        self.num_experts, self.capacity_factor, self.sampling = num_experts, capacity_factor, sampling
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(model_dim, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, model_dim))
            for _ in range(num_experts))

    def route(self, tokens):
        """(kept one-hots of the first and second choices [T, E], their weights [T]) and ``self.l_aux``."""
        logits = self.wg(tokens)
        gates = F.softmax(logits, dim=1)
        mask1 = F.one_hot(torch.argmax(gates, dim=1), num_classes=self.num_experts)
        if self.sampling and self.training:
            logits = logits - torch.log(-torch.log(torch.rand_like(logits)))   # Gumbel(0, 1) noise
        mask2 = F.one_hot(torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1),
                          num_classes=self.num_experts)
        locations1 = torch.cumsum(mask1, dim=0) - 1
        locations2 = torch.cumsum(mask2, dim=0) - 1 + torch.sum(mask1, dim=0, keepdim=True)
        self.l_aux = torch.mean(torch.mean(gates, dim=0) * torch.mean(mask1.float(), dim=0)) * self.num_experts ** 2
        if self.capacity_factor is not None:
            capacity = math.ceil(2 * self.capacity_factor * tokens.shape[0] / self.num_experts)
            mask1 = mask1 * torch.lt(locations1, capacity)
            mask2 = mask2 * torch.lt(locations2, capacity)
        gates1 = (gates * mask1).sum(dim=1)
        gates2 = (gates * mask2).sum(dim=1)
        denom = torch.clamp(gates1 + gates2, min=torch.finfo(gates.dtype).eps)
        return mask1, mask2, gates1 / denom, gates2 / denom

    def forward(self, x):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        mask1, mask2, gates1, gates2 = self.route(tokens)
        weights = gates1[:, None] * mask1 + gates2[:, None] * mask2          # [T, E], 0 where not kept
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            rows = torch.where(mask1[:, e] + mask2[:, e])[0]
            out.index_add_(0, rows, expert(tokens[rows]) * weights[rows, e, None])
        return out.reshape(shape)
