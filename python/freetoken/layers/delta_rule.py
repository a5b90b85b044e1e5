"""Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention): short causal conv, gated delta rule,
and the layer (`GatedDeltaNet`) over the request's state in the engine's state pool.

Two forms of the same recurrence over a state S [heads, k_dim, v_dim] per request:

- `chunked` for prompt tokens, in batched torch ops over chunks of CHUNK tokens (the UT
  transform of the DeltaNet paper, one triangular solve per chunk, a Python loop over chunks
  only). Chunks sit at absolute positions, multiples of CHUNK from the sequence start: a
  prefill that starts on a boundary (a fresh prompt, a scheduler chunk cut on one, a prefix-cache
  snapshot) does the same arithmetic as one that ran through it, so it resumes bit for bit. A
  prefill starting mid-chunk is front-padded with tokens that leave the state as it is
  (k = v = 0, no decay): exact mathematically, rounded differently.
- `recurrent` for decoding requests, one token each, batched across requests.

The conv is written as K shifted multiply-adds rather than `conv1d`, so a token's value is the
same elementwise arithmetic whatever the batch and whichever form computes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.kvcache.forward_context import ForwardContext
from freetoken.kvcache.state_pool import CHUNK
from freetoken.layers.elementwise import lanewise
from freetoken.layers.linear import Linear
from freetoken.layers.norm import RMSNorm


def causal_conv(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """window [..., n + K - 1, C] (the K - 1 previous inputs first), weight [C, K] -> [..., n, C]
    after SiLU."""
    k = weight.shape[1]
    n = window.shape[-2] - k + 1
    out = window[..., :n, :] * weight[:, 0]
    for i in range(1, k):
        out = out + window[..., i : i + n, :] * weight[:, i]
    return F.silu(out)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def gates(b: torch.Tensor, a: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor):
    """beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias), the log decay (<= 0).
    [tokens, heads]: narrow rows, so lanewise (layers/elementwise.py)."""
    return lanewise(torch.sigmoid, b.float()), neg_a * lanewise(F.softplus, a.float() + dt_bias)


def _heads(q, k, v, groups: int):
    """q, k [.., k_heads, dk] -> per value head, l2-normed, q scaled by dk ** -0.5 (fp32)."""
    q, k = (l2norm(x.float().repeat_interleave(groups, dim=-2)) for x in (q, k))
    return q * q.shape[-1] ** -0.5, k, v.float()


def _solve_unit_lower(system: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """system^-1 @ rhs for unit lower-triangular systems, on one thread: the batched solve took
    200 ms on two threads of this shared machine and 2 ms on one (16 heads of 64 x 64)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    finally:
        torch.set_num_threads(threads)


def chunked(q, k, v, g, beta, state: torch.Tensor | None, start: int, groups: int):
    """One request's prompt tokens [n, heads, dim] (g, beta [n, heads]) from position `start`,
    with `state` the state before them (None: zeros). Returns (out [n, v_heads, dv], the state
    after each chunk that ends on a boundary as {position: state}, the final state)."""
    q, k, v = _heads(q, k, v, groups)
    n, heads, dk = k.shape
    dv = v.shape[-1]
    front = start % CHUNK
    back = -(front + n) % CHUNK
    # [heads, chunks, CHUNK, dim]; pad tokens have k = v = beta = 0 and g = 0 (no decay).
    q, k, v = (F.pad(x, (0, 0, 0, 0, front, back)).transpose(0, 1).reshape(heads, -1, CHUNK, x.shape[-1])
               for x in (q, k, v))
    beta, g = (F.pad(x.float(), (0, 0, front, back)).transpose(0, 1).reshape(heads, -1, CHUNK)
               for x in (beta, g))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(dim=-1)  # log decay from the chunk start to each token
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    # The UT transform: (I + strictly-lower(diag(beta) K K^T decays)) is solved once per chunk.
    system = (k_beta @ k.transpose(-1, -2)) * pair
    new_v, k_decayed = _solve_unit_lower(system, torch.cat([v_beta, k_beta * cum.exp()[..., None]], -1)
                                         ).split([dv, dk], dim=-1)
    intra = (q @ k.transpose(-1, -2)) * pair
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    s = torch.zeros(heads, dk, dv, device=q.device) if state is None else state.float()
    out = torch.empty_like(v)
    boundaries = {}
    first = start - front
    for i in range(q.shape[1]):
        fresh = new_v[:, i] - k_decayed[:, i] @ s
        out[:, i] = q[:, i] @ s + intra[:, i] @ fresh
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ fresh
        end = first + (i + 1) * CHUNK
        if end <= start + n:
            boundaries[end] = s
    out = out.reshape(heads, -1, dv)[:, front : front + n].transpose(0, 1)
    return out, boundaries, s


def recurrent(q, k, v, g, beta, state: torch.Tensor, groups: int):
    """One token per request: q, k [B, k_heads, dk], v [B, heads, dv], g, beta [B, heads],
    state [B, heads, dk, dv] fp32, updated in place (the caller's gathered copy: decode is
    memory-bound, and each pass over the states counts). Returns (out [B, heads, dv], state)."""
    q, k, v = _heads(q, k, v, groups)
    b, heads, dk, dv = state.shape
    s = state.mul_(lanewise(torch.exp, g)[..., None, None])
    remembered = k[..., None, :] @ s
    delta = (v[..., None, :] - remembered) * beta[..., None, None]
    s.view(-1, dk, dv).baddbmm_(k.reshape(-1, dk, 1), delta.view(-1, 1, dv))
    return (q[..., None, :] @ s).squeeze(-2), s


class GatedDeltaNet(nn.Module):
    """Linear attention: in_proj = [q k v | z | b | a] (q/k/v through the causal conv), the gated
    delta rule over the request's state, an RMSNorm gated by silu(z), out_proj."""

    def __init__(self, cfg, state_layer: int):
        """`cfg`: the hybrids' config (models/qwen3_5.py's HybridConfig)."""
        super().__init__()
        self.cfg, self.layer = cfg, state_layer
        v_dim = cfg.linear_v_heads * cfg.linear_v_dim
        self.in_proj = Linear(cfg.hidden_size, cfg.conv_dim + v_dim + 2 * cfg.linear_v_heads, bias=False)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.conv_kernel, groups=cfg.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(cfg.linear_v_heads))
        self.A_log = nn.Parameter(torch.zeros(cfg.linear_v_heads))
        self.norm = RMSNorm(cfg.linear_v_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(v_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        cfg, lin, t = self.cfg, ctx.linear, x.shape[0]
        kh, dk, vh, dv = cfg.linear_k_heads, cfg.linear_k_dim, cfg.linear_v_heads, cfg.linear_v_dim
        groups, c, past = vh // kh, cfg.conv_dim, cfg.conv_kernel - 1
        proj = self.in_proj(x)
        mixed, z, b, a = proj.split([c, vh * dv, vh, vh], dim=-1)
        beta, g = gates(b, a, -self.A_log.float().exp(), self.dt_bias)
        weight = self.conv1d.weight[:, 0]
        conv_pool, rec_pool = lin.pool.conv[self.layer], lin.pool.recurrent[self.layer]

        def split(conv_out):
            q, k, v = conv_out.split([kh * dk, kh * dk, vh * dv], dim=-1)
            lead = conv_out.shape[:-1]
            return q.view(*lead, kh, dk), k.view(*lead, kh, dk), v.view(*lead, vh, dv)

        out = torch.zeros(t, vh, dv, dtype=torch.float32, device=x.device)
        slots, convs, states = [], [], []
        for piece in lin.prefills:
            rows = slice(piece.row, piece.row + piece.n)
            resumed = piece.start > 0
            prev = conv_pool[piece.slot].to(mixed.dtype) if resumed else mixed.new_zeros(past, c)
            window = torch.cat([prev, mixed[rows]])
            q, k, v = split(causal_conv(window, weight))
            o, boundaries, state = chunked(q, k, v, g[rows], beta[rows],
                                               rec_pool[piece.slot] if resumed else None, piece.start, groups)
            out[rows] = o
            slots.append(piece.slot)
            convs.append(window[-past:])
            states.append(state)
            for pos, snap in piece.snapshots.items():
                slots.append(snap)
                convs.append(window[pos - piece.start : pos - piece.start + past])
                states.append(boundaries[pos])
        if slots:
            lin.staged.append((self.layer, torch.tensor(slots, device=x.device), torch.stack(convs),
                               torch.stack(states), 0, None))
        if lin.decode_rows is not None:
            self._decode(lin, mixed, g, beta, out, split)
        out = (self.norm(out) * F.silu(z.float().view(t, vh, dv))).to(x.dtype)
        return self.out_proj(out.view(t, -1))

    def _decode(self, lin, mixed, g, beta, out, split) -> None:
        """Decoding requests, one row each per round: round 0 their first rows from their slots'
        states, round j a drafted request's row j from its state after round j - 1, by the very
        computation of a plain decode step; each round's states are staged for commit to keep
        those of the rows the sampler accepts."""
        weight, groups = self.conv1d.weight[:, 0], self.cfg.linear_v_heads // self.cfg.linear_k_heads
        held = lin.decode_slots
        conv = lin.pool.conv[self.layer].index_select(0, held).to(mixed.dtype)
        rec = lin.pool.recurrent[self.layer].index_select(0, held)
        for round_, (members, rows) in enumerate([(None, lin.decode_rows), *lin.draft_rounds]):
            if members is not None:
                conv, rec = running_conv.index_select(0, members), running_rec.index_select(0, members)
            window = torch.cat([conv, mixed.index_select(0, rows)[:, None]], dim=1)
            q, k, v = split(causal_conv(window, weight)[:, 0])
            o, state = recurrent(q, k, v, g.index_select(0, rows), beta.index_select(0, rows), rec, groups)
            out.index_copy_(0, rows, o)
            slots = held if members is None else held.index_select(0, members)
            lin.staged.append((self.layer, slots, window[:, 1:], state, round_, members))
            if lin.draft_rounds:  # the states the next round starts from, staged ones kept intact
                if members is None:
                    running_conv, running_rec = window[:, 1:].clone(), state.clone()
                else:
                    running_conv.index_copy_(0, members, window[:, 1:])
                    running_rec.index_copy_(0, members, state)
