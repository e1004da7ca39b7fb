"""Attention modules and helpers that the attention pass (`passes/attention.py`) puts into graphs.

- `sdpa_dropout`: `scaled_dot_product_attention` whose dropout follows the module's training flag (the exact
  rewrite of attention with dropout on the probabilities: p in train mode, 0 in eval mode).
- `HybridAttention` (lossy): per-query top-k attention computed over blocks of query rows, so the (Lq x Lk) matrix
  never exists; backward recomputes from what forward keeps (top-k indices and probabilities): O(Lq * k) saved.
- `SemiseparableAttention` (lossy): the attention matrix as an exact block band plus a low-rank far field
  (positive random features of the softmax kernel, as in Performer / Scatterbrain's sparse + low-rank), normalised
  together; O(N * (band + r)) memory and time; causal variant; optional two-level (hierarchical) rank; low-rank
  factors may run in bf16/fp16 while the band stays in the input dtype.

Both take (q, k, v, attn_mask) in SDPA's (B, H, L, E) layout, with the scale given at construction.
"""
from __future__ import annotations

import math

import torch
from torch import nn

LOWRANK_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# (nine parameters: aten's scaled_dot_product_attention arguments plus the mode flag; graphs call it by position)
def sdpa_dropout(query, key, value, attn_mask, dropout_p: float, training: bool, is_causal: bool, scale,
                 enable_gqa: bool):
    """SDPA with dropout on the probabilities only in training mode (`training` is the graph's ModeFlag)."""
    return torch.ops.aten.scaled_dot_product_attention.default(
        query, key, value, attn_mask=attn_mask, dropout_p=float(dropout_p) if training else 0.0, is_causal=is_causal,
        scale=scale, enable_gqa=enable_gqa)


torch.fx.wrap("sdpa_dropout")


# ============================================================================================ HybridAttention

def _rows(mask, row_start, row_end):
    if mask is None:
        return None
    return mask if mask.shape[-2] == 1 else mask[..., row_start:row_end, :]


class _TopKAttention(torch.autograd.Function):
    """Forward and backward over blocks of query rows. Each block's (C x Lk) scores exist only while that block is
    processed; what is saved for backward is the top-k indices and probabilities (O(Lq * k)). Products with the
    sparse probabilities are dense matmuls on the block (scatter into a zero C x Lk block), which is much faster on
    CPU than gathering k rows of K/V per query."""

    # (nine parameters: autograd's ctx and the op's inputs, as Function.apply passes them)
    @staticmethod
    def forward(ctx, query, key, value, mask, scale, causal, top_k, chunk):
        batch, heads, query_len, head_dim = query.shape
        key_len = key.shape[-2]
        kept = min(top_k, key_len)
        out = query.new_empty(batch, heads, query_len, value.shape[-1])
        idx = torch.empty(batch, heads, query_len, kept, dtype=torch.int64, device=query.device)
        prob = query.new_empty(batch, heads, query_len, kept)
        cols = torch.arange(key_len, device=query.device)
        key_t = key.transpose(-2, -1)
        for row_start in range(0, query_len, chunk):
            row_end = min(query_len, row_start + chunk)
            scores = torch.matmul(query[:, :, row_start:row_end], key_t) * scale
            block_mask = _rows(mask, row_start, row_end)
            if block_mask is not None:
                scores = scores + block_mask
            if causal:
                rows = torch.arange(row_start, row_end, device=query.device)
                scores = scores.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
            top_scores, top_index = scores.topk(kept, dim=-1)
            probs = torch.softmax(top_scores, dim=-1)
            dense = torch.zeros_like(scores).scatter_(-1, top_index, probs)
            out[:, :, row_start:row_end] = torch.matmul(dense, value)
            idx[:, :, row_start:row_end] = top_index
            prob[:, :, row_start:row_end] = probs
        ctx.save_for_backward(query, key, value, idx, prob)
        ctx.scale, ctx.chunk = scale, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, idx, prob = ctx.saved_tensors
        scale, chunk = ctx.scale, ctx.chunk
        batch, heads, query_len, head_dim = query.shape
        key_len = key.shape[-2]
        grad_query = torch.empty_like(query)
        grad_key = torch.zeros_like(key)
        grad_value = torch.zeros_like(value)
        value_t = value.transpose(-2, -1)
        for row_start in range(0, query_len, chunk):
            row_end = min(query_len, row_start + chunk)
            block = slice(row_start, row_end)
            top_index, probs, grad_rows = idx[:, :, block], prob[:, :, block], grad_out[:, :, block]
            grad_probs = torch.matmul(grad_rows, value_t).gather(-1, top_index)  # (B,H,C,k)
            grad_scores = probs * (grad_probs - (probs * grad_probs).sum(-1, keepdim=True))
            zero = query.new_zeros(batch, heads, row_end - row_start, key_len)
            ds_dense = zero.scatter(-1, top_index, grad_scores)
            p_dense = zero.scatter_(-1, top_index, probs)
            grad_query[:, :, row_start:row_end] = torch.matmul(ds_dense, key) * scale
            grad_key += torch.matmul(ds_dense.transpose(-2, -1), query[:, :, row_start:row_end]) * scale
            grad_value += torch.matmul(p_dense.transpose(-2, -1), grad_rows)
        return grad_query, grad_key, grad_value, None, None, None, None, None


class HybridAttention(nn.Module):
    """Top-k sparse attention over query blocks: softmax over each query's `top_k` best keys.

    The (Lq x Lk) matrix exists only one block of `chunk_size` rows at a time; backward recomputes from the saved
    top-k indices and probabilities, so what backward keeps is O(Lq * top_k) (plus q, k, v themselves). Exact when
    top_k >= Lk. `attn_mask` is additive (float) and may be any shape broadcastable to (B, H, Lq, Lk). The mask is
    treated as a constant (no gradient flows into it).
    """

    def __init__(self, scale: float, causal: bool = False, top_k: int = 64, chunk_size: int = 128):
        super().__init__()
        self.scale, self.causal, self.top_k, self.chunk_size = float(scale), bool(causal), int(top_k), int(chunk_size)
        self.q_proj = self.k_proj = None
        self.heads = self.rank = 0

    def extra_repr(self):
        low_rank = f", low-rank q/k rank {self.rank} per head" if self.q_proj is not None else ""
        return (f"scale={self.scale:.4g}, causal={self.causal}, top_k={self.top_k}, chunk_size={self.chunk_size}"
                f"{low_rank}")

    @torch.no_grad()
    def set_low_rank(self, query_weight, query_bias, key_weight, key_bias, heads: int, rank_ratio: float) -> int:
        """Low-rank q/k projections from a truncated SVD of the existing weights: per head h the bilinear form
        [x, 1] [Wq_h | bq_h]^T [Wk_h | bk_h] [x, 1]^T (rank <= head_dim) is truncated to rank
        r = ceil(rank_ratio * head_dim), split as (U_r S_r^1/2)(V_r S_r^1/2)^T into new q/k projections
        (trainable parameters of this module). Returns r."""
        head_dim = query_weight.shape[0] // heads
        in_features = query_weight.shape[1]
        rank = max(1, math.ceil(rank_ratio * head_dim))
        query_factors, key_factors = [], []
        for head in range(heads):
            rows = slice(head * head_dim, (head + 1) * head_dim)
            head_query_bias = query_bias[rows] if query_bias is not None else query_weight.new_zeros(head_dim)
            head_key_bias = key_bias[rows] if key_bias is not None else key_weight.new_zeros(head_dim)
            query_form = torch.cat([query_weight[rows], head_query_bias[:, None]], 1).double()
            key_form = torch.cat([key_weight[rows], head_key_bias[:, None]], 1).double()
            left, singular, right_t = torch.linalg.svd(query_form.T @ key_form)
            root = singular[:rank].sqrt()
            query_factors.append((left[:, :rank] * root).T)  # (r, d+1)
            key_factors.append((right_t[:rank].T * root).T)
        query_factors = torch.cat(query_factors).to(query_weight.dtype)  # (heads*r, d+1)
        key_factors = torch.cat(key_factors).to(key_weight.dtype)
        self.q_proj, self.k_proj = nn.Linear(in_features, heads * rank), nn.Linear(in_features, heads * rank)
        self.q_proj.weight.copy_(query_factors[:, :in_features])
        self.q_proj.bias.copy_(query_factors[:, in_features])
        self.k_proj.weight.copy_(key_factors[:, :in_features])
        self.k_proj.bias.copy_(key_factors[:, in_features])
        self.heads, self.rank = heads, rank
        return rank

    def forward(self, query, key, value, attn_mask=None, projection_input=None):
        if self.q_proj is not None:
            if projection_input is None:
                raise ValueError("HybridAttention with low-rank projections needs the projection input x")
            batch, tokens = projection_input.shape[0], projection_input.shape[1]
            query = self.q_proj(projection_input).view(batch, tokens, self.heads, self.rank).transpose(1, 2)
            key = self.k_proj(projection_input).view(batch, tokens, self.heads, self.rank).transpose(1, 2)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.where(attn_mask, 0.0, float("-inf")).to(query.dtype)
        if attn_mask is not None:
            attn_mask = attn_mask.detach()
        return _TopKAttention.apply(query, key, value, attn_mask, self.scale, self.causal, self.top_k, self.chunk_size)


# ============================================================================================ Semiseparable

def _orthogonal_features(rank: int, dim: int, generator) -> torch.Tensor:
    """Rows: gaussian directions, orthogonalised in blocks of `dim` and rescaled to chi-distributed norms."""
    rows = []
    while sum(r.shape[0] for r in rows) < rank:
        gaussian = torch.randn(dim, dim, generator=generator, dtype=torch.float64)
        orthonormal, _ = torch.linalg.qr(gaussian)
        rows.append(orthonormal.T)
    directions = torch.cat(rows)[:rank]
    norms = torch.randn(rank, dim, generator=generator, dtype=torch.float64).norm(dim=-1, keepdim=True)
    return (directions * norms).float()


class SemiseparableAttention(nn.Module):
    """softmax attention ~ exact block band + low-rank (positive random features) outside the band.

    For a query in block c the keys of blocks c-1, c, c+1 (causal: c-1, c with the causal mask) are attended
    exactly; the keys beyond contribute through positive random features phi(q) . phi(k) ~ exp(scale q . k)
    (Performer's FAVOR+ estimator, orthogonal directions), of rank `rank`. Both parts share one normaliser and one
    per-row stabiliser, so rows still sum to one. With `hierarchical`, the ring of blocks next to the band uses rank
    2 * rank, the far field `rank`. `lowrank_dtype` runs the features and block states in bf16/fp16 (stabilised
    values are <= 1); the band stays in the input dtype. Memory and time O(N * (3 * band + rank)).
    `attn_mask` (additive) must be a key-padding mask (dim -2 of size 1).
    """

    def __init__(self, scale: float, causal: bool = False, rank: int = 8, band: int = 64, hierarchical: bool = False,
                 lowrank_dtype: str = "fp32", seed: int = 0, head_dim: int = 64):
        super().__init__()
        self.scale, self.causal, self.rank, self.band = float(scale), bool(causal), int(rank), int(band)
        self.hierarchical, self.lowrank_dtype = bool(hierarchical), lowrank_dtype
        generator = torch.Generator().manual_seed(seed)
        self.register_buffer("features", _orthogonal_features(self.rank, head_dim, generator), persistent=False)
        if hierarchical:
            near_features = _orthogonal_features(2 * self.rank, head_dim, generator)
            self.register_buffer("features_near", near_features, persistent=False)
        else:
            self.features_near = None

    def extra_repr(self):
        return (f"scale={self.scale:.4g}, causal={self.causal}, rank={self.rank}, band={self.band}, "
                f"hierarchical={self.hierarchical}, lowrank_dtype={self.lowrank_dtype}")

    # -------------------------------------------------------------------------------------------- pieces
    @staticmethod
    def _blocks(tensor, block_count, block_size):
        batch, heads, length, dim = tensor.shape
        pad = block_count * block_size - length
        if pad:
            tensor = torch.nn.functional.pad(tensor, (0, 0, 0, pad))
        return tensor.reshape(batch, heads, block_count, block_size, dim)

    def _logfeat(self, scaled, features):
        # log phi(x) without 1/sqrt(r): x W^T - |x|^2 / 2  (x already scaled by sqrt(scale))
        return scaled @ features.to(scaled.dtype).T - 0.5 * (scaled * scaled).sum(-1, keepdim=True)

    def forward(self, query, key, value, attn_mask=None):
        batch, heads, query_len, head_dim = query.shape
        key_len = key.shape[-2]
        if self.causal and query_len != key_len:
            raise ValueError("SemiseparableAttention: causal attention needs Lq == Lk")
        band = self.band
        query_blocks, key_blocks = -(-query_len // band), -(-key_len // band)
        root_scale = math.sqrt(self.scale)
        query_scaled, key_scaled = query * root_scale, key * root_scale
        mask_batch = batch if attn_mask is None else attn_mask.shape[0]
        key_bias = torch.zeros(mask_batch, 1, key_len, dtype=query.dtype, device=query.device)
        if attn_mask is not None:
            if attn_mask.shape[-2] != 1:
                raise ValueError("SemiseparableAttention: attn_mask must be a key-padding mask (dim -2 of size 1)")
            mask = attn_mask if attn_mask.dtype != torch.bool else torch.where(attn_mask, 0.0, float("-inf"))
            key_bias = mask.to(query.dtype).reshape(mask.shape[0], mask.shape[1], key_len).detach()
        # ---- band: keys of blocks c-1, c, c+1 for query block c
        query_blocked = self._blocks(query_scaled, query_blocks, band)  # (B,H,nq,b,E)
        key_blocked, value_blocked = self._blocks(key_scaled, key_blocks, band), self._blocks(value, key_blocks, band)
        kbias = torch.nn.functional.pad(key_bias, (0, key_blocks * band - key_len), value=float("-inf")).reshape(
            key_bias.shape[0], key_bias.shape[1], key_blocks, band)
        offs = (-1, 0) if self.causal else (-1, 0, 1)
        kband, vband, bband, pos = [], [], [], []
        for offset in offs:
            kband.append(_shift(key_blocked, offset, query_blocks))
            vband.append(_shift(value_blocked, offset, query_blocks))
            bband.append(_shift(kbias.unsqueeze(-1), offset, query_blocks, fill=float("-inf")).squeeze(-1))
            pos.append(torch.arange(query_blocks, device=query.device)[:, None] * band + offset * band
                       + torch.arange(band, device=query.device)[None, :])
        kband, vband = torch.cat(kband, -2), torch.cat(vband, -2)  # (B,H,nq,nb*b,E)
        bband = torch.cat(bband, -1)  # (B?,1?,nq,nb*b)
        kpos = torch.cat(pos, -1)  # (nq, nb*b) absolute key positions
        # centring (an exact rewrite): q.k - q.mu = (q - nu).(k - mu) + nu.(k - mu) for constant means nu, mu; the
        # row term q.mu cancels in the normalisation, nu.(k - mu) is a per-key weight. The random features then see
        # the smaller centred vectors, whose estimator variance is lower.
        key_mean, query_mean = key_scaled.detach().mean(-2, keepdim=True), query_scaled.detach().mean(-2, keepdim=True)
        query_centred, key_centred = query_scaled - query_mean, key_scaled - key_mean
        rowterm = self._blocks((query_scaled * key_mean).sum(-1, keepdim=True), query_blocks, band)  # (B,H,nq,b,1)
        scores = torch.einsum("bhcie,bhcje->bhcij", query_blocked, kband) + bband.unsqueeze(-2) - rowterm
        if self.causal:
            qpos = torch.arange(query_blocks * band, device=query.device).reshape(query_blocks, band)
            scores = scores.masked_fill(kpos[:, None, :] > qpos[:, :, None], float("-inf"))
        # ---- low-rank: per-block states of phi(k) v and phi(k), outside the band
        lowrank_dtype = LOWRANK_DTYPES[self.lowrank_dtype]
        levels = [(self.features, None, 2)]  # (features, ring distance, far-field start distance)
        if self.hierarchical:
            levels = [(self.features_near, 2, 2), (self.features, 3, None)]
        lq_all, lk_all = [], []
        for features, _, _ in levels:
            lq_all.append(self._logfeat(query_centred, features))
            lkf = self._logfeat(key_centred, features) + key_bias.unsqueeze(-1) \
                + (query_mean * key_centred).sum(-1, keepdim=True)
            lk_all.append(lkf)
        with torch.no_grad():
            key_maxes = [log_key.amax(dim=(-2, -1), keepdim=True).clamp_min(-1e30) for log_key in lk_all]  # (B,H,1,1)
            row = scores.amax(-1).reshape(batch, heads, query_blocks * band)[..., :query_len]
            for log_query, key_max in zip(lq_all, key_maxes):
                row = torch.maximum(row, log_query.amax(-1) + key_max.squeeze(-1))
            mrow = row.unsqueeze(-1)  # (B,H,L,1)
            mrow = torch.where(torch.isfinite(mrow), mrow, torch.zeros_like(mrow))
        row_max_blocks = self._blocks(mrow, query_blocks, band)  # (B,H,nq,b,1)
        w_band = torch.exp(scores - row_max_blocks)
        num = torch.einsum("bhcij,bhcjd->bhcid", w_band, vband)
        den = w_band.sum(-1, keepdim=True)
        value_low = value.to(lowrank_dtype)
        for (features, near, far), log_query, log_key, key_max in zip(levels, lq_all, lk_all, key_maxes):
            rank = features.shape[0]
            phik = torch.exp(log_key - key_max).to(lowrank_dtype)  # (B,H,S,r) <= 1
            phiq = torch.exp(log_query - mrow + key_max).to(lowrank_dtype)  # (B,H,L,r) <= 1
            key_features = self._blocks(phik, key_blocks, band)  # padded keys have phi = 0
            value_blocked_low = self._blocks(value_low, key_blocks, band)
            key_value_state = torch.einsum("bhcjr,bhcjd->bhcrd", key_features, value_blocked_low)  # (B,H,nk,r,D)
            key_state = key_features.sum(-2)  # (B,H,nk,r)
            st_kv = _outside(key_value_state, near, far, query_blocks, self.causal)
            st_z = _outside(key_state, near, far, query_blocks, self.causal)
            query_features = self._blocks(phiq, query_blocks, band)
            num = num + (torch.einsum("bhcir,bhcrd->bhcid", query_features, st_kv) / rank).to(num.dtype)
            den = den + (torch.einsum("bhcir,bhcr->bhci", query_features, st_z).unsqueeze(-1) / rank).to(den.dtype)
        out = num / den
        return out.reshape(batch, heads, query_blocks * band, value.shape[-1])[:, :, :query_len]


def _shift(blocks, offset, count, fill=0.0):
    """Block c of the result holds block c + o of x (dim 2), for c in range(nq); missing blocks are `fill`."""
    available = blocks.shape[2]
    idx = torch.arange(count, device=blocks.device) + offset
    ok = (idx >= 0) & (idx < available)
    out = blocks.index_select(2, idx.clamp(0, max(available - 1, 0)))
    shape = [1] * out.dim()
    shape[2] = count
    return torch.where(ok.reshape(shape), out, torch.full((), fill, dtype=blocks.dtype, device=blocks.device))


def _outside(state, near, far, count, causal):
    """Sum of per-key-block states over the blocks a query block reaches through this level.

    Level with `near` = d (and far None): blocks at distance exactly d (the ring next to the band);
    level with near None... : `far` = d: blocks at distance >= d. Non-hierarchical: far = 2 (everything past
    the band). Causal: only blocks before the query block.
    """
    block_count = state.shape[2]
    if far is None:  # ring at distance `near` exactly
        parts = [_shift(state, -near, count)]
        if not causal:
            parts.append(_shift(state, near, count))
        return sum(parts)
    distance = far
    zero = torch.zeros_like(state.narrow(2, 0, 1))
    pre = torch.cat([zero, state.cumsum(2)], 2)  # pre[j] = sum of blocks < j
    idx = (torch.arange(count, device=state.device) - distance + 1).clamp(0, block_count)  # blocks <= c - d
    out = pre.index_select(2, idx)
    if not causal:
        suf = torch.cat([state.flip(2).cumsum(2).flip(2), zero], 2)  # suf[j] = sum of blocks >= j
        idx2 = (torch.arange(count, device=state.device) + distance).clamp(0, block_count)
        out = out + suf.index_select(2, idx2)
    return out
