"""A tiny pre-norm decoder whose MoE layers the backend recognises (the sort / index form, dropless).

``h += attn(norm1(h)); h += MoE(norm2(h))`` per layer, causal attention within each sample,
``head(norm_f(h))``. ``locality``: the embedding's first feature is +3 on the lower half of the
vocabulary and -3 on the upper half, and each router favours, by that feature, the experts of
node 0 or node 1 (``experts // 2`` each): a sample drawn mostly from one half routes mostly to one
node (NetMoE Fig. 2's locality). ``mix``: a ``BatchNorm1d`` over the hidden state's ``[B·S, M]`` rows after the first
layer (samples are not independent there). ``loss``: ``forward(tokens, targets)`` returns the
summed cross-entropy (the loss inside the compiled graph). ``prenorm=False``: ``h += MoE(h)`` (no
norm between the residual stream and the experts: the residual is not inlined). ``forward(...,
mask=m)``: ``m`` (``[B, S, S]``, the caller's samples in their original order) is every
attention's mask. ``plain_last``: the last layer is ``h = MoE(norm2(h))`` (no residual add: the
backend leaves it as canonical ops, per token).
"""
import torch
import torch.nn.functional as F
from torch import nn

from tests.models.sort import SortMoE


class TinyMoEDecoder(nn.Module):
    def __init__(self, layers=2, model_dim=8, hidden=16, experts=8, vocab=32, locality=False, mix=False, loss=False,
                 prenorm=True, plain_last=False):
        super().__init__()
        self.loss, self.prenorm, self.plain_last = loss, prenorm, plain_last
        self.embed = nn.Embedding(vocab, model_dim)
        self.norm1 = nn.ModuleList(nn.LayerNorm(model_dim) for _ in range(layers))
        self.qkv = nn.ModuleList(nn.Linear(model_dim, 3 * model_dim, bias=False) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(model_dim, model_dim) for _ in range(layers))
        self.norm2 = nn.ModuleList(nn.LayerNorm(model_dim) for _ in range(layers))
        self.moe = nn.ModuleList(SortMoE(model_dim, hidden, experts) for _ in range(layers))
        self.mix = nn.BatchNorm1d(model_dim) if mix else None
        self.norm_f = nn.LayerNorm(model_dim)
        self.head = nn.Linear(model_dim, vocab)
        if locality:
            with torch.no_grad():
                self.embed.weight[:, 0] = torch.where(torch.arange(vocab) < vocab // 2, 3.0, -3.0)
                sign = torch.where(torch.arange(experts) < experts // 2, 1.0, -1.0)
                for moe in self.moe:
                    moe.router.weight[:, 0] = 2.0 * sign

    def forward(self, tokens, targets=None, mask=None):
        h = self.embed(tokens)
        for i, moe in enumerate(self.moe):
            q, k, v = self.qkv[i](self.norm1[i](h)).chunk(3, dim=-1)
            h = h + self.proj[i](F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None))
            x = self.norm2[i](h) if self.prenorm else h
            h = moe(x) if self.plain_last and i == len(self.moe) - 1 else h + moe(x)
            if self.mix is not None and i == 0:
                h = self.mix(h.reshape(-1, h.shape[-1])).reshape(h.shape)
        logits = self.head(self.norm_f(h))
        if self.loss:
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
        return logits


def local_tokens(samples, seq, vocab, seed, locality):
    """``[samples, seq + 1]`` token ids; with ``locality`` each sample takes 90 % of them from one half."""
    g = torch.Generator().manual_seed(seed)
    if not locality:
        return torch.randint(0, vocab, (samples, seq + 1), generator=g)
    half = vocab // 2
    side = torch.randint(0, 2, (samples, 1), generator=g)
    own = torch.rand(samples, seq + 1, generator=g) < 0.9
    low = torch.randint(0, half, (samples, seq + 1), generator=g)
    return torch.where(own == (side == 0), low, low + half)
