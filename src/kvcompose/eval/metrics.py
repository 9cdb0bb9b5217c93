"""What one replay step is scored on: the next token, the keys attention needed, and the bytes held.

KL and NLL use the raw (unmasked) distributions: they measure the model, the argmax
measures the decoding rule. Memory is ``cache.report().kv_bytes`` against
``full_kv_bytes`` on the report's basis, a bf16 full cache (see :mod:`kvcompose.report`):
metadata, recent buffer and block rounding included.
A batched replay shares one report; each row's share is the per-layer bytes split
by the tokens each row keeps in that layer (exact for one prompt per batch, and the
shares always sum to the report's total).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TOPK = 10
MEMORY_BASIS = "bfloat16"  # memory is stated against a full cache in this dtype, whatever the model computes in


def token_metrics(logits: torch.Tensor, full_logits: torch.Tensor, target: torch.Tensor,
                  suppress: torch.Tensor | None = None):
    """Per row: argmax agreement with ``target``, KL(full ‖ policy), NLL of ``target`` (policy, full).

    Log-softmax runs in float64 so that identical models give KL ~ 1e-12, not float32 noise.
    """
    lp = logits.double().log_softmax(-1)
    lf = full_logits.double().log_softmax(-1)
    kl = F.kl_div(lp, lf, log_target=True, reduction="none").sum(-1).clamp(min=0)
    nll = -lp.gather(-1, target[:, None]).squeeze(-1)
    nll_full = -lf.gather(-1, target[:, None]).squeeze(-1)
    pick = logits if suppress is None else logits.masked_fill(suppress, float("-inf"))
    return pick.argmax(-1) == target, kl, nll, nll_full


def attention_topk(query, keys, positions, valid, query_positions, k: int = TOPK):
    """Positions of the ``k`` keys each query head attends to most; vectorized over layers and heads.

    ``query [N, B, Hq, D]`` (one query per row), ``keys [N, B, Hkv, L, D]``, ``positions``
    and ``valid [N, B, L]``, ``query_positions [N, B]``. Query head ``h`` reads KV head
    ``h // (Hq // Hkv)`` (GQA); keys past the query are masked (causal). Ranking the
    logits ranks the softmax probabilities (monotone, positive scale), so no softmax
    is needed. Returns ``(positions [N, B, Hq, k'], ok)``, ``k' = min(k, L)``, ``ok``
    False where a row had fewer than ``k'`` visible keys.
    """
    N, B, Hq, D = query.shape
    Hkv, L = keys.shape[2], keys.shape[3]
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads cannot be grouped over {Hkv} KV heads")
    q = query.float().view(N, B, Hkv, Hq // Hkv, D)
    logits = torch.einsum("nbhgd,nbhld->nbhgl", q, keys.float()).reshape(N, B, Hq, L)
    sees = valid & (positions <= query_positions[..., None])
    logits = logits.masked_fill(~sees[:, :, None, :], float("-inf"))
    top, idx = logits.topk(min(k, L), dim=-1)
    pos = positions[:, :, None, :].expand(N, B, Hq, L).gather(-1, idx)
    return pos, torch.isfinite(top)


def key_recall(top_positions, top_ok, positions, valid) -> torch.Tensor:
    """``[N, B]``: share of the reference top-k positions that each layer's view still holds."""
    N, B, _ = positions.shape
    width = int(max(int(positions.max()), int(top_positions.max()))) + 1
    held = torch.zeros(N, B, width, dtype=torch.int32, device=positions.device)
    held.scatter_add_(2, positions.clamp(min=0), valid.int())  # scatter_add: -1 slots cannot clear position 0
    hit = held.gather(2, top_positions.clamp(min=0).flatten(2)).view_as(top_positions) > 0
    hit = hit & top_ok
    return hit.sum((2, 3)) / top_ok.sum((2, 3)).clamp(min=1)


def row_memory(report, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's KV bytes and full-KV bytes: the report's per-layer totals split by tokens kept / seen."""
    per_layer = torch.tensor(report.per_layer_bytes, dtype=torch.float64)
    kept = torch.tensor(report.tokens_kept, dtype=torch.float64).reshape(len(per_layer), batch_size)
    total = kept.sum(1, keepdim=True)
    share = torch.where(total > 0, kept / total.clamp(min=1), torch.full_like(kept, 1.0 / batch_size))
    seen = torch.tensor(report.tokens_seen, dtype=torch.float64)
    full = report.full_kv_bytes * seen / seen.sum().clamp(min=1)
    return (per_layer[:, None] * share).sum(0), full
