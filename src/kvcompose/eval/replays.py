"""Replaying a trajectory under a policy, token by token, and scoring every step.

Protocol steps 2 and 3 (design §6):

2. **Reference replay.** The trajectory replayed under kvcompose ``fullkv``: prefill
   the prompt, then feed the trajectory's tokens one at a time. A cache observer
   records, per step, layer and query head, the positions of the ``topk`` keys with
   the highest full-KV attention probability for the step's query. This replay is
   also the **self-check**: it must pick the trajectory's token at every step with
   KL ≈ 0 against the sdpa logits, or the harness (not a policy) is wrong.
3. **Policy replays.** The same feed on a fresh ``policy.make_cache(model)``. Per step:
   top-1 agreement of the policy's (masked) argmax with the trajectory token,
   KL(full ‖ policy) of the next-token distributions, NLL of the trajectory token
   (ΔNLL against full KV), recall of the reference top-k keys (the share of those
   positions the policy's layer still holds when it attends at that step, averaged
   over layers and query heads), and the KV bytes the cache holds after the step.

The module is named ``replays`` so that ``kvcompose.eval.replay`` stays the function.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from .metrics import MEMORY_BASIS, TOPK, attention_topk, key_recall, row_memory, token_metrics
from .overrides import policy_label
from .trajectory import TRAJECTORY_ATTENTION, Trajectory, attention, forward_step, next_input

KL_TOLERANCE = 1e-6


class _Recorder:
    """Cache observer: what every layer attended over at the current step (and, optionally, its query)."""

    def __init__(self, keep_attention: bool):
        self.keep_attention = keep_attention
        self.layers: dict[int, tuple] = {}

    def __call__(self, layer_idx, query, view, query_positions, scaling) -> None:
        entry = (view.positions.clone(), view.valid.clone())
        if self.keep_attention:  # only the last query of the step predicts the next token
            entry += (query[:, :, -1].clone(), view.keys.clone(), query_positions[:, -1].clone())
        self.layers[layer_idx] = entry

    def stacked(self):
        """Tensors stacked over layers, padded to the widest view: positions, valid[, query, keys, qpos]."""
        entries = [self.layers[i] for i in sorted(self.layers)]
        L = max(e[0].shape[1] for e in entries)

        def pad(t, value, dim):
            extra = L - t.shape[dim]
            if extra == 0:
                return t
            shape = list(t.shape)
            shape[dim] = extra
            return torch.cat([t, t.new_full(shape, value)], dim=dim)

        out = [torch.stack([pad(e[0], -1, 1) for e in entries]), torch.stack([pad(e[1], False, 1) for e in entries])]
        if self.keep_attention:
            out += [torch.stack([e[2] for e in entries]), torch.stack([pad(e[3], 0.0, 2) for e in entries]),
                    torch.stack([e[4] for e in entries])]
        return out


@dataclass
class Replay:
    """Per-step measurements of one policy on one trajectory batch (arrays ``[B, T]``)."""

    label: str
    config: dict
    agree: torch.Tensor
    kl: torch.Tensor
    nll: torch.Tensor
    nll_full: torch.Tensor
    recall: torch.Tensor  # NaN without a reference
    recall_layers: torch.Tensor  # [B, T, N]
    kv_bytes: torch.Tensor  # row shares of report().kv_bytes after each step
    full_kv_bytes: torch.Tensor
    batch_kv_bytes: list[int]  # report().kv_bytes after each step (exact, whole batch)
    batch_full_kv_bytes: list[int]
    evictions: int
    peak_kv_bytes: int
    seconds: float
    topk: list | None = None  # reference only: per step (positions, ok) [N, B, Hq, k]
    sharing: dict | None = None  # the final report's sharing counts (share pager policies)

    @property
    def memory_pct(self) -> torch.Tensor:
        return 100.0 * self.kv_bytes / self.full_kv_bytes.clamp(min=1)


def replay(model, trajectory: Trajectory, policy, *, label: str | None = None, reference: list | None = None,
           collect_topk: int = 0, metrics: bool = True, progress=None, tokenizer=None) -> Replay:
    """Feed ``trajectory`` through ``model`` on a fresh cache of ``policy`` and measure every step.

    ``collect_topk=k`` also records the top-k attention positions (use it with
    ``fullkv`` to build the reference); ``reference`` is such a record, against which
    key recall is measured. ``metrics=False`` measures memory only (calibration).
    ``tokenizer``: for policies that read the generated text (the ids are fed to the
    cache before each forward, as ``policy.generate`` does).
    """
    from ..hf.attention import ATTENTION_NAME

    B, T = trajectory.tokens.shape
    start = time.perf_counter()
    rec = _Recorder(keep_attention=collect_topk > 0)
    nan = torch.full((B, T), float("nan"), dtype=torch.float64)
    agree = torch.zeros(B, T, dtype=torch.bool)
    kl, nll, nll_full, recall = nan.clone(), nan.clone(), nan.clone(), nan.clone()
    recall_layers, tops = [], []
    kv, full = torch.zeros(B, T, dtype=torch.float64), torch.zeros(B, T, dtype=torch.float64)
    batch_kv, batch_full = [], []
    with attention(model, ATTENTION_NAME), torch.inference_mode():
        cache = policy.make_cache(model, memory_basis=MEMORY_BASIS, tokenizer=tokenizer if policy.needs_text else None)
        if metrics:
            cache.observers.append(rec)
        ids, mask = trajectory.input_ids, trajectory.attention_mask
        for t in range(T):
            rec.layers.clear()
            if policy.needs_text:
                cache.observe_tokens(ids, mask)
            logits, _ = forward_step(model, ids, mask, cache)
            report = cache.report()
            kv[:, t], full[:, t] = row_memory(report, B)
            batch_kv.append(report.kv_bytes)
            batch_full.append(report.full_kv_bytes)
            if metrics:
                target = trajectory.tokens[:, t]
                a, k, n, nf = token_metrics(logits, trajectory.logits[:, t], target,
                                            trajectory.suppress_mask(t, logits.shape[-1]))
                agree[:, t], kl[:, t], nll[:, t], nll_full[:, t] = a.cpu(), k.cpu(), n.cpu(), nf.cpu()
                stacked = rec.stacked()
                if collect_topk:
                    top = attention_topk(stacked[2], stacked[3], stacked[0], stacked[1], stacked[4], collect_topk)
                    tops.append(top)
                else:
                    top = reference[t] if reference is not None else None
                if top is not None:
                    per_layer = key_recall(*top, stacked[0], stacked[1])  # [N, B]
                    recall[:, t] = per_layer.mean(0).double().cpu()
                    recall_layers.append(per_layer.T.float().cpu())
            if progress is not None:
                progress.update(1)
            ids, mask = next_input(trajectory.tokens[:, t], mask)
    report = cache.report()
    return Replay(
        label or policy_label(policy), policy.to_config(), agree, kl, nll, nll_full, recall,
        torch.stack(recall_layers, 1) if recall_layers else torch.zeros(B, T, 0), kv, full, batch_kv, batch_full,
        report.evictions, report.peak_kv_bytes, time.perf_counter() - start, tops if collect_topk else None,
        report.sharing or None,
    )


def self_check(reference: Replay, trajectory: Trajectory) -> dict:
    """Did the fullkv replay reproduce its own trajectory (100% agreement, KL < tolerance)?"""
    valid = trajectory.valid
    steps = int(valid.sum())
    return combine_checks([{
        "steps": steps, "agreed": int(reference.agree[valid].sum()),
        "max_kl": float(reference.kl[valid].max()) if steps else 0.0,
        "attention": trajectory.attn_implementation,
    }])


def combine_checks(checks: list[dict]) -> dict:
    """One verdict over several batches' self-checks: every step must agree, the worst KL must pass."""
    steps = sum(c["steps"] for c in checks)
    agreed = sum(c["agreed"] for c in checks)
    max_kl = max(c["max_kl"] for c in checks)
    ok = agreed == steps and max_kl < KL_TOLERANCE
    verdict = "OK" if ok else "FAILED (the harness, not a policy, is wrong)"
    attention = checks[0].get("attention", TRAJECTORY_ATTENTION)
    message = (f"self-check {verdict}: fullkv replay (kvcompose) vs the {attention} trajectory: "
               f"{agreed}/{steps} steps agree, max KL {max_kl:.1e} (tolerance {KL_TOLERANCE:.0e})")
    return {"ok": ok, "steps": steps, "agreed": agreed, "max_kl": max_kl, "kl_tolerance": KL_TOLERANCE,
            "attention": attention, "message": message}


def evaluate(model, trajectory: Trajectory, policies: dict, *, topk: int = TOPK, progress=None, tokenizer=None):
    """Reference fullkv replay (+ self-check), then every policy, on one trajectory batch.

    Returns ``({label: Replay}, self_check dict)``. A policy configured exactly like
    ``fullkv`` reuses the reference replay instead of running it twice.
    """
    from ..policies import Policy

    ref_policy = Policy.from_preset("fullkv")
    if progress is not None:
        progress.set_postfix_str("fullkv (reference)")
    reference = replay(model, trajectory, ref_policy, label="fullkv", collect_topk=topk, progress=progress)
    check = self_check(reference, trajectory)
    out = {}
    for label, policy in policies.items():
        if policy.to_config() == reference.config:
            out[label] = dataclasses.replace(reference, label=label, topk=None)
            continue
        if progress is not None:
            progress.set_postfix_str(label)
        out[label] = replay(model, trajectory, policy, label=label, reference=reference.topk, progress=progress,
                            tokenizer=tokenizer)
    return out, check
