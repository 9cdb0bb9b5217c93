"""The fidelity harness: what a KV-cache policy costs, measured on the very text full KV produced.

Protocol (design §6), per batch of prompts:

1. **Trajectory.** Greedy decoding with the model's plain ``sdpa`` attention and a
   transformers ``DynamicCache``: full KV, no kvcompose code involved. Every step's
   raw logits are kept. EOS ids are masked from the argmax until ``min_new_tokens``;
   the masked ids are recorded so every replay applies the same rule (otherwise a
   replay that "prefers EOS" would count as a disagreement it never made).
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

KL and NLL use the raw (unmasked) distributions: they measure the model, the argmax
measures the decoding rule. Memory is ``cache.report().kv_bytes`` against
``full_kv_bytes`` on the report's basis, a bf16 full cache (see :mod:`kvcompose.report`):
metadata, recent buffer and block rounding included.
A batched replay shares one report; each row's share is the per-layer bytes split
by the tokens each row keeps in that layer (exact for one prompt per batch, and the
shares always sum to the report's total).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import json
import math
import platform
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.nn.functional as F

TOPK = 10
KL_TOLERANCE = 1e-6
MEMORY_BASIS = "bfloat16"  # memory is stated against a full cache in this dtype, whatever the model computes in
MATCH_TOLERANCE = 5.0  # percentage points: a calibrated memory farther than this from the target is reported
TRAJECTORY_ATTENTION = "sdpa"
DEFAULT_PRESETS = ("fullkv", "streamingllm", "snapkv", "h2o", "rkv", "rpc")


# ------------------------------------------------------------------ trajectory
@dataclass
class Trajectory:
    """A greedy full-KV decode of a (left-padded) batch, with what its argmax was allowed to pick."""

    input_ids: torch.Tensor  # [B, P] prompt, left padded
    attention_mask: torch.Tensor  # [B, P]
    tokens: torch.Tensor  # [B, T] greedy tokens (pad after a row's EOS)
    logits: torch.Tensor  # [B, T, V] float32 raw full-KV logits of each step
    steps: torch.Tensor  # [B] valid steps per row (up to and including its EOS)
    suppressed_ids: tuple[int, ...]  # ids masked from the argmax ...
    suppress_before: int  # ... at steps t < suppress_before (min_new_tokens)
    suppression_mattered: torch.Tensor  # [B, T] bool: the unmasked argmax was a suppressed id
    attn_implementation: str = TRAJECTORY_ATTENTION

    @property
    def num_steps(self) -> int:
        return self.tokens.shape[1]

    @property
    def valid(self) -> torch.Tensor:
        """``[B, T]`` bool: steps inside each row's trajectory."""
        return torch.arange(self.num_steps)[None, :] < self.steps[:, None]

    def suppress_mask(self, t: int, vocab: int) -> torch.Tensor | None:
        """``[V]`` bool of the ids the argmax may not pick at step ``t`` (``None``: nothing masked)."""
        if t >= self.suppress_before or not self.suppressed_ids:
            return None
        mask = torch.zeros(vocab, dtype=torch.bool, device=self.logits.device)
        mask[list(self.suppressed_ids)] = True
        return mask

    def select(self, row: int) -> "Trajectory":
        """One row alone: padding stripped, cut to its own steps (used to calibrate budgets)."""
        keep = self.attention_mask[row].bool()
        n = int(self.steps[row])
        ids = self.input_ids[row][keep][None]
        return Trajectory(
            ids, torch.ones_like(ids), self.tokens[row : row + 1, :n], self.logits[row : row + 1, :n],
            torch.tensor([n]), self.suppressed_ids, self.suppress_before,
            self.suppression_mattered[row : row + 1, :n], self.attn_implementation,
        )


@contextlib.contextmanager
def _attention(model, name: str):
    previous = model.config._attn_implementation
    if previous != name:
        model.set_attn_implementation(name)
    try:
        yield
    finally:
        if previous != name:
            model.set_attn_implementation(previous)


def _step(model, ids: torch.Tensor, mask: torch.Tensor, cache):
    """One forward of the new columns ``ids``; positions count real tokens only (as ``generate`` does)."""
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                use_cache=True, logits_to_keep=1)
    return out.logits[:, -1], out.past_key_values


def _eos_ids(model, eos_token_id) -> list[int]:
    ids = eos_token_id if eos_token_id is not None else getattr(model.generation_config, "eos_token_id", None)
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])]


def greedy_trajectory(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                      max_new_tokens: int, min_new_tokens: int = 0, eos_token_id=None,
                      pad_token_id: int | None = None, attn_implementation: str = TRAJECTORY_ATTENTION,
                      progress=None) -> Trajectory:
    """Greedy full-KV decode of a left-padded batch, keeping each step's raw logits.

    Runs with ``attn_implementation`` (default plain ``sdpa``) and a transformers cache,
    so the reference owes nothing to kvcompose. A row stops at its first EOS once
    ``min_new_tokens`` are out; before that, EOS ids are masked and recorded.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not 0 <= min_new_tokens <= max_new_tokens:
        raise ValueError(f"min_new_tokens must lie in [0, max_new_tokens={max_new_tokens}], got {min_new_tokens}")
    eos = _eos_ids(model, eos_token_id)
    if pad_token_id is None:
        pad_token_id = getattr(model.generation_config, "pad_token_id", None)
        pad_token_id = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    B = input_ids.shape[0]
    eos_t = torch.tensor(eos, dtype=torch.long, device=input_ids.device)
    done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    steps = torch.full((B,), max_new_tokens, dtype=torch.long)
    tokens, logits_all, mattered = [], [], []
    suppressed = tuple(eos) if min_new_tokens > 0 else ()
    ids, cache = input_ids, None
    with _attention(model, attn_implementation), torch.inference_mode():
        for t in range(max_new_tokens):
            logits, cache = _step(model, ids, mask, cache)
            pick = logits
            if t < min_new_tokens and suppressed:
                pick = logits.clone()
                pick[:, list(suppressed)] = float("-inf")
            tok = pick.argmax(-1)
            mattered.append(logits.argmax(-1) != tok)
            tok = torch.where(done, pad_token_id, tok)
            tokens.append(tok)
            logits_all.append(logits.float())
            if eos:
                ended = ~done & torch.isin(tok, eos_t)
                steps = torch.where(ended.cpu(), t + 1, steps)
                done = done | ended
            if progress is not None:
                progress.update(1)
            if bool(done.all()):
                break
            ids = tok[:, None]
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
    valid = torch.arange(len(tokens))[None, :] < steps[:, None]
    return Trajectory(
        input_ids, mask[:, : input_ids.shape[1]], torch.stack(tokens, 1), torch.stack(logits_all, 1), steps,
        suppressed, min_new_tokens, torch.stack(mattered, 1).cpu() & valid, attn_implementation,
    )


# --------------------------------------------------------------------- metrics
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


# ---------------------------------------------------------------------- replay
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

    @property
    def memory_pct(self) -> torch.Tensor:
        return 100.0 * self.kv_bytes / self.full_kv_bytes.clamp(min=1)


def replay(model, trajectory: Trajectory, policy, *, label: str | None = None, reference: list | None = None,
           collect_topk: int = 0, metrics: bool = True, progress=None) -> Replay:
    """Feed ``trajectory`` through ``model`` on a fresh cache of ``policy`` and measure every step.

    ``collect_topk=k`` also records the top-k attention positions (use it with
    ``fullkv`` to build the reference); ``reference`` is such a record, against which
    key recall is measured. ``metrics=False`` measures memory only (calibration).
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
    with _attention(model, ATTENTION_NAME), torch.inference_mode():
        cache = policy.make_cache(model, memory_basis=MEMORY_BASIS)
        if metrics:
            cache.observers.append(rec)
        ids, mask = trajectory.input_ids, trajectory.attention_mask
        for t in range(T):
            rec.layers.clear()
            logits, _ = _step(model, ids, mask, cache)
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
            ids = trajectory.tokens[:, t : t + 1]
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
    report = cache.report()
    return Replay(
        label or policy_label(policy), policy.to_config(), agree, kl, nll, nll_full, recall,
        torch.stack(recall_layers, 1) if recall_layers else torch.zeros(B, T, 0), kv, full, batch_kv, batch_full,
        report.evictions, report.peak_kv_bytes, time.perf_counter() - start, tops if collect_topk else None,
    )


def self_check(reference: Replay, trajectory: Trajectory) -> dict:
    """Did the fullkv replay reproduce its own trajectory (100% agreement, KL < tolerance)?"""
    valid = trajectory.valid
    steps = int(valid.sum())
    return _combine_checks([{
        "steps": steps, "agreed": int(reference.agree[valid].sum()),
        "max_kl": float(reference.kl[valid].max()) if steps else 0.0,
        "attention": trajectory.attn_implementation,
    }])


def _combine_checks(checks: list[dict]) -> dict:
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


def evaluate(model, trajectory: Trajectory, policies: dict, *, topk: int = TOPK, progress=None):
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
        out[label] = replay(model, trajectory, policy, label=label, reference=reference.topk, progress=progress)
    return out, check


# ------------------------------------------------------------ policy building
def policy_label(policy) -> str:
    """Short name for tables and plots: ``h2o@64`` (budget) or ``rpc@P64`` (RPC period)."""
    if policy.evictor is None:
        return policy.name
    if policy.trigger.needs_budget and policy.budget is not None:
        return f"{policy.name}@{policy.budget}"
    period = getattr(policy.trigger, "period", None)
    return f"{policy.name}@P{period}" if period is not None else policy.name


def _parse_value(raw: str):
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def parse_overrides(items: Iterable[str] | None) -> dict[str, dict]:
    """``["rpc.trigger.period=64", "h2o.protect_recent=16"]`` → ``{"rpc": {"trigger": {"period": 64}}, ...}``.

    Values are JSON (numbers, ``true``, ``null``, ``{...}``), else plain strings.
    """
    out: dict[str, dict] = {}
    for item in items or ():
        key, sep, raw = item.partition("=")
        parts = key.strip().split(".")
        if not sep or len(parts) < 2 or not all(parts):
            raise ValueError(f"--set expects PRESET.FIELD[.SUBFIELD]=VALUE (e.g. rpc.trigger.period=64), got {item!r}")
        node = out.setdefault(parts[0], {})
        for p in parts[1:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {item!r} conflicts with an earlier --set of {p!r}")
        node[parts[-1]] = _parse_value(raw.strip())
    return out


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def preset_policy(name: str, overrides: dict | None = None, **fields):
    """A preset with ``--set`` overrides (nested, merged) and then ``fields`` applied."""
    from ..policies import Policy
    from ..policies.presets import preset_config

    config = _merge(preset_config(name), (overrides or {}).get(name, {}))
    return Policy.from_config(_merge(config, fields))


def _check_overrides(presets: list[str], overrides: dict | None) -> None:
    stray = sorted(set(overrides or {}) - set(presets))
    if stray:
        raise ValueError(f"--set names preset(s) {stray} that are not being compared ({', '.join(presets)})")


def build_policies(presets: Iterable[str], budgets: Iterable[int] | None = None,
                   overrides: dict | None = None) -> dict:
    """``{label: Policy}``: each preset once per budget; presets without a budget knob
    (``fullkv``, and ``rpc`` whose memory follows its period) once."""
    presets = list(presets)
    _check_overrides(presets, overrides)
    out = {}
    for name in presets:
        base = preset_policy(name, overrides)
        if base.evictor is None or not base.trigger.needs_budget or not budgets:
            out.setdefault(policy_label(base), base)
            continue
        for b in budgets:
            policy = preset_policy(name, overrides, budget=int(b))
            out.setdefault(policy_label(policy), policy)
    return out


def match_memory(model, trajectory: Trajectory, presets: Iterable[str], target_pct: float, *,
                 overrides: dict | None = None, max_evals: int = 6, progress=None):
    """Per compressing preset, the knob value whose *measured* mean KV memory is closest to ``target_pct``.

    Nominal budgets are not comparable across presets (R-KV's buffer holds up to 128
    extra tokens, RPC has no budget at all), so each preset is calibrated by
    measurement. Method: replay ``trajectory`` (one prompt; the CLI uses the first)
    with memory accounting only, and run a geometric bisection on the knob, assuming
    memory grows with it: ``budget`` over ``[policy.min_budget(), prompt + steps]``
    for budgeted presets, ``trigger.period`` over ``[ratio, steps]`` for RPC's
    interval trigger. At most ``max_evals`` replays (+1 to probe the range's end when
    the target lies outside what was measured); the measured value closest to the
    target wins. A target the knob cannot reach (e.g. RPC keeps its prompt and 32
    recent tokens) is warned about and marked ``reached: False`` in the record.
    Returns ``({label: Policy}, calibration records)``.
    """
    presets = list(presets)
    _check_overrides(presets, overrides)
    if trajectory.tokens.shape[0] != 1:
        raise ValueError("calibrate on a one-prompt trajectory (Trajectory.select(0))")
    prompt_len, steps = int(trajectory.attention_mask.sum()), trajectory.num_steps
    chosen, records = {}, []
    for name in presets:
        base = preset_policy(name, overrides)
        if base.evictor is None:
            chosen.setdefault(policy_label(base), base)
            continue
        if base.trigger.needs_budget:
            knob, lo, hi = "budget", base.min_budget(), prompt_len + steps

            def make(k, name=name):
                return preset_policy(name, overrides, budget=k)
        elif hasattr(base.trigger, "period"):
            knob, lo, hi = "trigger.period", max(base.trigger.ratio, 1), max(steps, base.trigger.ratio)

            def make(k, name=name):
                return preset_policy(name, _merge(overrides or {}, {name: {"trigger": {"period": k}}}))
        else:
            warnings.warn(f"{name}: no budget or period to calibrate; it runs as configured")
            chosen.setdefault(policy_label(base), base)
            continue
        measured: dict[int, float] = {}

        def measure(k):
            if progress is not None:
                progress.set_postfix_str(f"calibrating {name} {knob}={k}")
            r = replay(model, trajectory, make(k), metrics=False, progress=progress)
            measured[k] = float(r.memory_pct.mean())
            return measured[k]

        a, b = lo, hi
        for _ in range(max_evals):
            if b - a <= 1:
                break
            mid = min(max(int(round(math.sqrt(a * b))), a + 1), b - 1)
            if measure(mid) < target_pct:
                a = mid
            else:
                b = mid
        if measured and all(m > target_pct for m in measured.values()) and lo not in measured:
            measure(lo)
        if measured and all(m < target_pct for m in measured.values()) and hi not in measured:
            measure(hi)
        if not measured:
            measure(lo)
        best = min(measured, key=lambda k: (abs(measured[k] - target_pct), k))
        reached = abs(measured[best] - target_pct) <= MATCH_TOLERANCE
        if not reached:
            warnings.warn(
                f"{name}: no {knob} in [{lo}, {hi}] brings the measured memory within {MATCH_TOLERANCE:g} points of "
                f"{target_pct:g}% on this trajectory (closest: {measured[best]:.1f}% at {knob}={best}); tokens the "
                "policy protects (prompt, sinks, recent window, buffer) set a floor that short runs cannot go below"
            )
        policy = make(best)
        chosen.setdefault(policy_label(policy), policy)
        records.append({"preset": name, "knob": knob, "value": best, "measured_pct": measured[best],
                        "target_pct": target_pct, "reached": reached,
                        "tried": {str(k): v for k, v in sorted(measured.items())}})
    return chosen, records


# ---------------------------------------------------------------------- result
def _r(x: float, digits: int = 6):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return None
    return float(f"{x:.{digits}g}")


@dataclass
class FidelityResult:
    """Per-policy aggregates, per-prompt per-step arrays, the self-check and the run's metadata."""

    policies: list[dict]  # {label, preset, config, aggregates, per_prompt: [{metric: [per step]}]}
    prompts: list[dict]  # {prompt, prompt_tokens, steps, tokens, text, nll_full, ...}
    self_check: dict
    metadata: dict = field(default_factory=dict)

    def rows(self) -> list[dict]:
        """One flat dict per policy: label, preset and the aggregates."""
        return [{"label": p["label"], "preset": p["preset"], **p["aggregates"]} for p in self.policies]

    def markdown(self) -> str:
        """The comparison table as markdown."""
        k = self.metadata.get("replay", {}).get("topk", TOPK)
        head = ["policy", "KV mem % (mean)", "KV mem % (final)", "top-1 agree %", "mean KL", "ΔNLL",
                f"top-{k} recall %"]
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
        for r in self.rows():
            lines.append("| " + " | ".join([
                r["label"], f"{r['memory_pct_mean']:.1f}", f"{r['memory_pct_final']:.1f}",
                f"{100 * r['agreement']:.2f}", f"{r['kl_mean']:.2e}", f"{r['delta_nll_mean']:+.4f}",
                f"{100 * r['recall_mean']:.1f}",
            ]) + " |")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"metadata": self.metadata, "self_check": self.self_check, "prompts": self.prompts,
                "policies": self.policies}

    def save(self, out_dir: str | Path, stem: str = "fidelity") -> dict[str, Path]:
        """Write ``fidelity.json``, ``fidelity.md`` and ``fidelity.png`` under ``out_dir``."""
        from .plot import plot_fidelity

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md", "png": out / f"{stem}.png"}
        paths["json"].write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
        paths["md"].write_text(self.report_markdown() + "\n", encoding="utf-8")
        replay = self.metadata.get("replay", {})
        plot_fidelity(self.rows(), paths["png"], title=self._title(), topk=replay.get("topk", TOPK),
                      basis=replay.get("memory_basis", MEMORY_BASIS))
        return paths

    def _title(self) -> str:
        m = self.metadata
        return (f"{m.get('model', {}).get('name', 'model')}: {len(self.prompts)} prompts × "
                f"{m.get('trajectory', {}).get('max_new_tokens', '?')} tokens")

    def report_markdown(self) -> str:
        """The markdown file: what was run, the self-check, the table and what the columns mean."""
        m = self.metadata
        tr = m.get("trajectory", {})
        steps = sum(p["steps"] for p in self.prompts)
        k = m.get("replay", {}).get("topk", TOPK)
        lines = [
            f"# Fidelity: {self._title()}",
            "",
            f"{m.get('date', '')} · kvcompose {m.get('versions', {}).get('kvcompose', '?')} · "
            f"torch {m.get('versions', {}).get('torch', '?')} · "
            f"transformers {m.get('versions', {}).get('transformers', '?')} · "
            f"runtime {m.get('runtime_s', 0):.0f} s",
            "",
            f"Greedy full-KV trajectories ({tr.get('attention', TRAJECTORY_ATTENTION)} attention, "
            f"min {tr.get('min_new_tokens')} / max {tr.get('max_new_tokens')} new tokens, {steps} steps in all), "
            "replayed token by token under each policy.",
            "",
            f"**{self.self_check['message']}**",
            "",
            self.markdown(),
            "",
            "KV mem %: the cache's `report().kv_bytes` (payload, metadata, buffer, block rounding) over a "
            f"full {m['replay'].get('memory_basis', MEMORY_BASIS)} KV cache of the same tokens, averaged over steps (mean) and at the last step (final). "
            "top-1 agree: the policy's argmax equals the trajectory token. mean KL: KL(full ‖ policy) of the "
            "next-token distributions, nats. ΔNLL: mean NLL of the trajectory token under the policy minus under "
            f"full KV, nats. top-{k} recall: share of the {k} keys with the highest full-KV attention (per layer "
            "and query head) that the policy's cache still holds when it attends at that step.",
        ]
        sel = m.get("selection", {})
        if sel.get("calibration"):
            lines += ["", f"Matched memory: target {sel.get('match_memory')}% of full KV, calibrated on the first "
                      "prompt (geometric bisection over each preset's budget, or RPC's period)."]
            for c in sel["calibration"]:
                miss = "" if c.get("reached", True) else " (target not reachable with this knob on this prompt)"
                lines.append(f"- {c['preset']}: {c['knob']}={c['value']} → {c['measured_pct']:.1f}% measured{miss}")
        return "\n".join(lines)


def _aggregate(replays: list[Replay], trajectories: list[Trajectory]) -> tuple[dict, list[dict]]:
    """Pool the valid steps of every prompt: one aggregate dict and per-prompt per-step arrays."""
    agree, kl, dnll, recall, mem, final, layers, per_prompt = [], [], [], [], [], [], [], []
    for rep, traj in zip(replays, trajectories):
        valid = traj.valid
        pct = rep.memory_pct
        for b in range(valid.shape[0]):  # loop over prompts, for the per-prompt JSON arrays
            n = int(traj.steps[b])
            per_prompt.append({
                "agree": rep.agree[b, :n].int().tolist(),
                "kl": [_r(x) for x in rep.kl[b, :n].tolist()],
                "nll": [_r(x) for x in rep.nll[b, :n].tolist()],
                "delta_nll": [_r(x) for x in (rep.nll - rep.nll_full)[b, :n].tolist()],
                "recall": [_r(x, 4) for x in rep.recall[b, :n].tolist()],
                "memory_pct": [_r(x, 5) for x in pct[b, :n].tolist()],
                "kv_bytes": [round(x) for x in rep.kv_bytes[b, :n].tolist()],
                "full_kv_bytes": [round(x) for x in rep.full_kv_bytes[b, :n].tolist()],
            })
            final.append(float(pct[b, n - 1]))
        agree.append(rep.agree[valid].double())
        kl.append(rep.kl[valid])
        dnll.append((rep.nll - rep.nll_full)[valid])
        recall.append(rep.recall[valid])
        mem.append(pct[valid])
        if rep.recall_layers.numel():
            layers.append(rep.recall_layers[valid])
    cat = torch.cat
    per_layer = cat(layers).mean(0).tolist() if layers else []
    agg = {
        "memory_pct_mean": float(cat(mem).mean()),
        "memory_pct_final": sum(final) / len(final),
        "agreement": float(cat(agree).mean()),
        "kl_mean": float(cat(kl).mean()),
        "delta_nll_mean": float(cat(dnll).mean()),
        "recall_mean": float(cat(recall).mean()),
        "recall_per_layer": [_r(x, 4) for x in per_layer],
        "steps": int(sum(int(t.steps.sum()) for t in trajectories)),
        "evictions": sum(r.evictions for r in replays),
        "peak_kv_bytes": max(r.peak_kv_bytes for r in replays),
        "seconds": sum(r.seconds for r in replays),
    }
    return agg, per_prompt


def _versions() -> dict:
    import transformers

    from .. import __version__

    return {"kvcompose": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "platform": platform.platform()}


def _model_info(model, name: str | None) -> dict:
    cfg = model.config
    return {
        "name": name or getattr(cfg, "name_or_path", None) or type(model).__name__,
        "architecture": type(model).__name__,
        "layers": getattr(cfg, "num_hidden_layers", None),
        "query_heads": getattr(cfg, "num_attention_heads", None),
        "kv_heads": getattr(cfg, "num_key_value_heads", None),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "device": str(next(model.parameters()).device),
    }


def compare(model, tokenizer, prompts: list[str], policies: dict, *, max_new_tokens: int = 256,
            min_new_tokens: int | None = None, batch_size: int = 4, topk: int = TOPK, chat: bool | None = None,
            progress: bool = True, model_name: str | None = None, selection: dict | None = None,
            input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None) -> FidelityResult:
    """Run the protocol for ``{label: Policy}`` on ``prompts`` and collect a :class:`FidelityResult`.

    ``min_new_tokens=None`` means ``max_new_tokens``: every prompt is replayed for the
    same number of steps, EOS masked until then (and the masking replayed). Prompts go
    in batches of ``batch_size``. Without a tokenizer, pass a left-padded
    ``input_ids``/``attention_mask`` instead (``prompts`` then only labels them).
    """
    from tqdm.auto import tqdm

    from ..hf.generate import encode_prompts
    from ..policies import Policy

    if not policies:
        raise ValueError("no policies to compare")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    min_new = max_new_tokens if min_new_tokens is None else min_new_tokens
    start = time.perf_counter()
    if input_ids is None:
        enc = encode_prompts(tokenizer, list(prompts), chat)
        input_ids, attention_mask = enc["input_ids"], enc["attention_mask"]
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    device = next(model.parameters()).device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    n_prompts = input_ids.shape[0]
    full_config = Policy.from_preset("fullkv").to_config()
    n_passes = 2 + sum(1 for p in policies.values() if p.to_config() != full_config)
    bar = tqdm(total=0, desc="fidelity", unit="step", disable=not progress, leave=False)
    replays: dict[str, list[Replay]] = {label: [] for label in policies}
    trajectories, checks = [], []
    try:
        for lo in range(0, n_prompts, batch_size):
            rows = slice(lo, lo + batch_size)
            ids, mask = input_ids[rows], attention_mask[rows]
            width = int(mask.sum(1).max())  # drop columns that are padding in every row of this batch
            ids, mask = ids[:, -width:], mask[:, -width:]
            bar.total += max_new_tokens * n_passes
            bar.set_postfix_str("trajectory")
            traj = greedy_trajectory(model, ids, mask, max_new_tokens=max_new_tokens, min_new_tokens=min_new,
                                     pad_token_id=pad, progress=bar)
            bar.total -= (max_new_tokens - traj.num_steps) * n_passes
            bar.refresh()
            results, check = evaluate(model, traj, policies, topk=topk, progress=bar)
            trajectories.append(traj)
            checks.append(check)
            for label, rep in results.items():
                replays[label].append(rep)
    finally:
        bar.close()

    check = _combine_checks(checks)
    if not check["ok"]:
        warnings.warn(check["message"])

    prompt_records = []
    first_ref = replays[next(iter(replays))]  # any replay carries nll_full
    for traj, rep in zip(trajectories, first_ref):
        for b in range(traj.tokens.shape[0]):
            n = int(traj.steps[b])
            toks = traj.tokens[b, :n].tolist()
            prompt_records.append({
                "prompt_tokens": int(traj.attention_mask[b].sum()),
                "steps": n,
                "tokens": toks,
                "text": tokenizer.decode(toks, skip_special_tokens=False) if tokenizer is not None else None,
                "nll_full": [_r(x) for x in rep.nll_full[b, :n].tolist()],
                "suppressed_token_ids": list(traj.suppressed_ids),
                "suppressed_before_step": traj.suppress_before,
                "suppression_changed_argmax_at": torch.nonzero(traj.suppression_mattered[b, :n]).flatten().tolist(),
            })
    for i, rec in enumerate(prompt_records):
        rec["prompt"] = prompts[i] if i < len(prompts) else None

    policy_records = []
    for label, policy in policies.items():
        agg, per_prompt = _aggregate(replays[label], trajectories)
        policy_records.append({"label": label, "preset": policy.name, "config": policy.to_config(),
                               "aggregates": agg, "per_prompt": per_prompt})

    metadata = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(),
        "model": _model_info(model, model_name),
        "trajectory": {"attention": TRAJECTORY_ATTENTION, "cache": "transformers DynamicCache", "decoding": "greedy",
                       "max_new_tokens": max_new_tokens, "min_new_tokens": min_new,
                       "suppressed_token_ids": list(trajectories[0].suppressed_ids),
                       "chat_template": chat if chat is not None else bool(getattr(tokenizer, "chat_template", None))},
        "replay": {"attention": "kvcompose", "topk": topk, "batch_size": batch_size,
                   "memory": "report().kv_bytes / full_kv_bytes after each step; in a batch, each row gets the "
                             "per-layer bytes split by the tokens it keeps (exact with batch_size=1)",
                   "memory_basis": MEMORY_BASIS,
                   "kl": "KL(full || policy), raw distributions, float64 log-softmax"},
        "selection": selection or {},
        "prompts": len(prompt_records),
        "runtime_s": time.perf_counter() - start,
    }
    return FidelityResult(policy_records, prompt_records, check, metadata)


def compare_presets(model, tokenizer, prompts: list[str], presets: Iterable[str] = DEFAULT_PRESETS, *,
                    budgets: Iterable[int] | None = None, match_memory_pct: float | None = None,
                    overrides: dict | None = None, max_new_tokens: int = 256, min_new_tokens: int | None = None,
                    batch_size: int = 4, progress: bool = True, **kwargs) -> FidelityResult:
    """:func:`compare` over named presets: a budget sweep (``budgets``) or memory matched by measurement.

    With ``match_memory_pct``, each compressing preset's budget (RPC: its period) is
    calibrated on the first prompt by :func:`match_memory` before the comparison.
    """
    from tqdm.auto import tqdm

    from ..hf.generate import encode_prompts

    presets = list(presets)
    if budgets is not None and match_memory_pct is not None:
        raise ValueError("give budgets or match_memory_pct, not both")
    selection: dict[str, Any] = {"presets": presets, "budgets": list(budgets) if budgets else None,
                                 "match_memory": match_memory_pct, "overrides": overrides or {}}
    if match_memory_pct is None:
        policies = build_policies(presets, budgets, overrides)
    else:
        _check_overrides(presets, overrides)
        for name in presets:  # fail on a bad preset before minutes of calibration
            preset_policy(name, overrides)
        enc = encode_prompts(tokenizer, [prompts[0]], kwargs.get("chat"))
        min_new = max_new_tokens if min_new_tokens is None else min_new_tokens
        with tqdm(total=0, desc="calibrating", unit="step", disable=not progress, leave=False) as bar:
            bar.total = max_new_tokens
            traj = greedy_trajectory(model, enc["input_ids"], enc["attention_mask"], max_new_tokens=max_new_tokens,
                                     min_new_tokens=min_new, pad_token_id=tokenizer.pad_token_id, progress=bar)

            class _Grow:  # calibration runs an unknown number of replays; grow the bar as they come
                def update(self, n):
                    if bar.n + n > bar.total:
                        bar.total += traj.num_steps
                    bar.update(n)

                def set_postfix_str(self, s):
                    bar.set_postfix_str(s)

            policies, records = match_memory(model, traj, presets, match_memory_pct, overrides=overrides,
                                             progress=_Grow())
        selection["calibration"] = records
    return compare(model, tokenizer, prompts, policies, max_new_tokens=max_new_tokens,
                   min_new_tokens=min_new_tokens, batch_size=batch_size, progress=progress,
                   selection=selection, **kwargs)
