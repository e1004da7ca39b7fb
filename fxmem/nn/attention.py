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
def sdpa_dropout(q, k, v, attn_mask, dropout_p: float, training: bool, is_causal: bool, scale, enable_gqa: bool):
    """SDPA with dropout on the probabilities only in training mode (`training` is the graph's ModeFlag)."""
    return torch.ops.aten.scaled_dot_product_attention.default(
        q, k, v, attn_mask=attn_mask, dropout_p=float(dropout_p) if training else 0.0, is_causal=is_causal,
        scale=scale, enable_gqa=enable_gqa)


torch.fx.wrap("sdpa_dropout")


# ============================================================================================ HybridAttention

def _rows(mask, r0, r1):
    if mask is None:
        return None
    return mask if mask.shape[-2] == 1 else mask[..., r0:r1, :]


class _TopKAttention(torch.autograd.Function):
    """Forward and backward over blocks of query rows. Each block's (C x Lk) scores exist only while that block is
    processed; what is saved for backward is the top-k indices and probabilities (O(Lq * k)). Products with the
    sparse probabilities are dense matmuls on the block (scatter into a zero C x Lk block), which is much faster on
    CPU than gathering k rows of K/V per query."""

    # (nine parameters: autograd's ctx and the op's inputs, as Function.apply passes them)
    @staticmethod
    def forward(ctx, q, k, v, mask, scale, causal, top_k, chunk):
        B, H, L, E = q.shape
        S = k.shape[-2]
        kk = min(top_k, S)
        out = q.new_empty(B, H, L, v.shape[-1])
        idx = torch.empty(B, H, L, kk, dtype=torch.int64, device=q.device)
        prob = q.new_empty(B, H, L, kk)
        cols = torch.arange(S, device=q.device)
        kt = k.transpose(-2, -1)
        for r0 in range(0, L, chunk):
            r1 = min(L, r0 + chunk)
            s = torch.matmul(q[:, :, r0:r1], kt) * scale
            m = _rows(mask, r0, r1)
            if m is not None:
                s = s + m
            if causal:
                rows = torch.arange(r0, r1, device=q.device)
                s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
            vals, ix = s.topk(kk, dim=-1)
            p = torch.softmax(vals, dim=-1)
            dense = torch.zeros_like(s).scatter_(-1, ix, p)
            out[:, :, r0:r1] = torch.matmul(dense, v)
            idx[:, :, r0:r1] = ix
            prob[:, :, r0:r1] = p
        ctx.save_for_backward(q, k, v, idx, prob)
        ctx.scale, ctx.chunk = scale, chunk
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, idx, prob = ctx.saved_tensors
        scale, chunk = ctx.scale, ctx.chunk
        B, H, L, E = q.shape
        S = k.shape[-2]
        dq = torch.empty_like(q)
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
        vt = v.transpose(-2, -1)
        for r0 in range(0, L, chunk):
            r1 = min(L, r0 + chunk)
            ix, p, do = idx[:, :, r0:r1], prob[:, :, r0:r1], dout[:, :, r0:r1]
            dp = torch.matmul(do, vt).gather(-1, ix)  # (B,H,C,k)
            ds = p * (dp - (p * dp).sum(-1, keepdim=True))
            zero = q.new_zeros(B, H, r1 - r0, S)
            ds_dense = zero.scatter(-1, ix, ds)
            p_dense = zero.scatter_(-1, ix, p)
            dq[:, :, r0:r1] = torch.matmul(ds_dense, k) * scale
            dk += torch.matmul(ds_dense.transpose(-2, -1), q[:, :, r0:r1]) * scale
            dv += torch.matmul(p_dense.transpose(-2, -1), do)
        return dq, dk, dv, None, None, None, None, None


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
        lr = f", low-rank q/k rank {self.rank} per head" if self.q_proj is not None else ""
        return f"scale={self.scale:.4g}, causal={self.causal}, top_k={self.top_k}, chunk_size={self.chunk_size}{lr}"

    @torch.no_grad()
    def set_low_rank(self, wq, bq, wk, bk, heads: int, rank_ratio: float) -> int:
        """Low-rank q/k projections from a truncated SVD of the existing weights: per head h the bilinear form
        [x, 1] [Wq_h | bq_h]^T [Wk_h | bk_h] [x, 1]^T (rank <= head_dim) is truncated to rank
        r = ceil(rank_ratio * head_dim), split as (U_r S_r^1/2)(V_r S_r^1/2)^T into new q/k projections
        (trainable parameters of this module). Returns r."""
        dh = wq.shape[0] // heads
        d = wq.shape[1]
        r = max(1, math.ceil(rank_ratio * dh))
        pq, pk = [], []
        for h in range(heads):
            rows = slice(h * dh, (h + 1) * dh)
            a = torch.cat([wq[rows], (bq[rows] if bq is not None else wq.new_zeros(dh))[:, None]], 1).double()
            b = torch.cat([wk[rows], (bk[rows] if bk is not None else wk.new_zeros(dh))[:, None]], 1).double()
            u, s, vh = torch.linalg.svd(a.T @ b)
            root = s[:r].sqrt()
            pq.append((u[:, :r] * root).T)  # (r, d+1)
            pk.append((vh[:r].T * root).T)
        pq, pk = torch.cat(pq).to(wq.dtype), torch.cat(pk).to(wk.dtype)  # (heads*r, d+1)
        self.q_proj, self.k_proj = nn.Linear(d, heads * r), nn.Linear(d, heads * r)
        self.q_proj.weight.copy_(pq[:, :d])
        self.q_proj.bias.copy_(pq[:, d])
        self.k_proj.weight.copy_(pk[:, :d])
        self.k_proj.bias.copy_(pk[:, d])
        self.heads, self.rank = heads, r
        return r

    def forward(self, q, k, v, attn_mask=None, x=None):
        if self.q_proj is not None:
            if x is None:
                raise ValueError("HybridAttention with low-rank projections needs the projection input x")
            B, T = x.shape[0], x.shape[1]
            q = self.q_proj(x).view(B, T, self.heads, self.rank).transpose(1, 2)
            k = self.k_proj(x).view(B, T, self.heads, self.rank).transpose(1, 2)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.where(attn_mask, 0.0, float("-inf")).to(q.dtype)
        if attn_mask is not None:
            attn_mask = attn_mask.detach()
        return _TopKAttention.apply(q, k, v, attn_mask, self.scale, self.causal, self.top_k, self.chunk_size)


# ============================================================================================ Semiseparable

def _orthogonal_features(rank: int, dim: int, generator) -> torch.Tensor:
    """Rows: gaussian directions, orthogonalised in blocks of `dim` and rescaled to chi-distributed norms."""
    rows = []
    while sum(r.shape[0] for r in rows) < rank:
        g = torch.randn(dim, dim, generator=generator, dtype=torch.float64)
        qm, _ = torch.linalg.qr(g)
        rows.append(qm.T)
    w = torch.cat(rows)[:rank]
    norms = torch.randn(rank, dim, generator=generator, dtype=torch.float64).norm(dim=-1, keepdim=True)
    return (w * norms).float()


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
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("features", _orthogonal_features(self.rank, head_dim, g), persistent=False)
        if hierarchical:
            self.register_buffer("features_near", _orthogonal_features(2 * self.rank, head_dim, g), persistent=False)
        else:
            self.features_near = None

    def extra_repr(self):
        return (f"scale={self.scale:.4g}, causal={self.causal}, rank={self.rank}, band={self.band}, "
                f"hierarchical={self.hierarchical}, lowrank_dtype={self.lowrank_dtype}")

    # -------------------------------------------------------------------------------------------- pieces
    @staticmethod
    def _blocks(x, nb, b):
        B, H, L, D = x.shape
        pad = nb * b - L
        if pad:
            x = torch.nn.functional.pad(x, (0, 0, 0, pad))
        return x.reshape(B, H, nb, b, D)

    def _logfeat(self, x, w):
        # log phi(x) without 1/sqrt(r): x W^T - |x|^2 / 2  (x already scaled by sqrt(scale))
        return x @ w.to(x.dtype).T - 0.5 * (x * x).sum(-1, keepdim=True)

    def forward(self, q, k, v, attn_mask=None):
        B, H, L, E = q.shape
        S = k.shape[-2]
        if self.causal and L != S:
            raise ValueError("SemiseparableAttention: causal attention needs Lq == Lk")
        b = self.band
        nq, nk = -(-L // b), -(-S // b)
        c = math.sqrt(self.scale)
        qs, ks = q * c, k * c
        key_bias = torch.zeros(B if attn_mask is None else attn_mask.shape[0], 1, S, dtype=q.dtype, device=q.device)
        if attn_mask is not None:
            if attn_mask.shape[-2] != 1:
                raise ValueError("SemiseparableAttention: attn_mask must be a key-padding mask (dim -2 of size 1)")
            m = attn_mask if attn_mask.dtype != torch.bool else torch.where(attn_mask, 0.0, float("-inf"))
            key_bias = m.to(q.dtype).reshape(m.shape[0], m.shape[1], S).detach()
        # ---- band: keys of blocks c-1, c, c+1 for query block c
        qb = self._blocks(qs, nq, b)  # (B,H,nq,b,E)
        kb, vb = self._blocks(ks, nk, b), self._blocks(v, nk, b)
        kbias = torch.nn.functional.pad(key_bias, (0, nk * b - S), value=float("-inf")).reshape(
            key_bias.shape[0], key_bias.shape[1], nk, b)
        offs = (-1, 0) if self.causal else (-1, 0, 1)
        kband, vband, bband, pos = [], [], [], []
        for o in offs:
            kband.append(_shift(kb, o, nq))
            vband.append(_shift(vb, o, nq))
            bband.append(_shift(kbias.unsqueeze(-1), o, nq, fill=float("-inf")).squeeze(-1))
            pos.append(torch.arange(nq, device=q.device)[:, None] * b + o * b
                       + torch.arange(b, device=q.device)[None, :])
        kband, vband = torch.cat(kband, -2), torch.cat(vband, -2)  # (B,H,nq,nb*b,E)
        bband = torch.cat(bband, -1)  # (B?,1?,nq,nb*b)
        kpos = torch.cat(pos, -1)  # (nq, nb*b) absolute key positions
        # centring (an exact rewrite): q.k - q.mu = (q - nu).(k - mu) + nu.(k - mu) for constant means nu, mu; the
        # row term q.mu cancels in the normalisation, nu.(k - mu) is a per-key weight. The random features then see
        # the smaller centred vectors, whose estimator variance is lower.
        mu, nu = ks.detach().mean(-2, keepdim=True), qs.detach().mean(-2, keepdim=True)
        qc, kc = qs - nu, ks - mu
        rowterm = self._blocks((qs * mu).sum(-1, keepdim=True), nq, b)  # (B,H,nq,b,1)
        s = torch.einsum("bhcie,bhcje->bhcij", qb, kband) + bband.unsqueeze(-2) - rowterm
        if self.causal:
            qpos = torch.arange(nq * b, device=q.device).reshape(nq, b)
            s = s.masked_fill(kpos[:, None, :] > qpos[:, :, None], float("-inf"))
        # ---- low-rank: per-block states of phi(k) v and phi(k), outside the band
        dt = LOWRANK_DTYPES[self.lowrank_dtype]
        levels = [(self.features, None, 2)]  # (features, ring distance, far-field start distance)
        if self.hierarchical:
            levels = [(self.features_near, 2, 2), (self.features, 3, None)]
        lq_all, lk_all = [], []
        for w, _, _ in levels:
            lq_all.append(self._logfeat(qc, w))
            lkf = self._logfeat(kc, w) + key_bias.unsqueeze(-1) + (nu * kc).sum(-1, keepdim=True)
            lk_all.append(lkf)
        with torch.no_grad():
            ck = [lk.amax(dim=(-2, -1), keepdim=True).clamp_min(-1e30) for lk in lk_all]  # (B,H,1,1)
            row = s.amax(-1).reshape(B, H, nq * b)[..., :L]
            for lq, c_ in zip(lq_all, ck):
                row = torch.maximum(row, lq.amax(-1) + c_.squeeze(-1))
            mrow = row.unsqueeze(-1)  # (B,H,L,1)
            mrow = torch.where(torch.isfinite(mrow), mrow, torch.zeros_like(mrow))
        mb = self._blocks(mrow, nq, b)  # (B,H,nq,b,1)
        w_band = torch.exp(s - mb)
        num = torch.einsum("bhcij,bhcjd->bhcid", w_band, vband)
        den = w_band.sum(-1, keepdim=True)
        vl = v.to(dt)
        for (w, near, far), lq, lk, c_ in zip(levels, lq_all, lk_all, ck):
            r = w.shape[0]
            phik = torch.exp(lk - c_).to(dt)  # (B,H,S,r) <= 1
            phiq = torch.exp(lq - mrow + c_).to(dt)  # (B,H,L,r) <= 1
            pk = self._blocks(phik, nk, b)  # padded keys have phi = 0
            kv = torch.einsum("bhcjr,bhcjd->bhcrd", pk, self._blocks(vl, nk, b))  # (B,H,nk,r,D)
            z = pk.sum(-2)  # (B,H,nk,r)
            st_kv, st_z = _outside(kv, near, far, nq, self.causal), _outside(z, near, far, nq, self.causal)
            pq = self._blocks(phiq, nq, b)
            num = num + (torch.einsum("bhcir,bhcrd->bhcid", pq, st_kv) / r).to(num.dtype)
            den = den + (torch.einsum("bhcir,bhcr->bhci", pq, st_z).unsqueeze(-1) / r).to(den.dtype)
        out = num / den
        return out.reshape(B, H, nq * b, v.shape[-1])[:, :, :L]


def _shift(x, o, nq, fill=0.0):
    """Block c of the result holds block c + o of x (dim 2), for c in range(nq); missing blocks are `fill`."""
    n = x.shape[2]
    idx = torch.arange(nq, device=x.device) + o
    ok = (idx >= 0) & (idx < n)
    out = x.index_select(2, idx.clamp(0, max(n - 1, 0)))
    shape = [1] * out.dim()
    shape[2] = nq
    return torch.where(ok.reshape(shape), out, torch.full((), fill, dtype=x.dtype, device=x.device))


def _outside(state, near, far, nq, causal):
    """Sum of per-key-block states over the blocks a query block reaches through this level.

    Level with `near` = d (and far None): blocks at distance exactly d (the ring next to the band);
    level with near None... : `far` = d: blocks at distance >= d. Non-hierarchical: far = 2 (everything past
    the band). Causal: only blocks before the query block.
    """
    n = state.shape[2]
    if far is None:  # ring at distance `near` exactly
        parts = [_shift(state, -near, nq)]
        if not causal:
            parts.append(_shift(state, near, nq))
        return sum(parts)
    d = far
    zero = torch.zeros_like(state.narrow(2, 0, 1))
    pre = torch.cat([zero, state.cumsum(2)], 2)  # pre[j] = sum of blocks < j
    idx = (torch.arange(nq, device=state.device) - d + 1).clamp(0, n)  # blocks <= c - d
    out = pre.index_select(2, idx)
    if not causal:
        suf = torch.cat([state.flip(2).cumsum(2).flip(2), zero], 2)  # suf[j] = sum of blocks >= j
        idx2 = (torch.arange(nq, device=state.device) + d).clamp(0, n)
        out = out + suf.index_select(2, idx2)
    return out
