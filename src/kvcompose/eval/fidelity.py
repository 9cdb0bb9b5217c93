"""The fidelity harness: what a KV-cache policy costs, measured on the very text full KV produced.

Protocol (design §6), per batch of prompts: a greedy full-KV **trajectory** with no
kvcompose code (:mod:`~kvcompose.eval.trajectory`); a **reference replay** under
kvcompose ``fullkv`` that must reproduce it (the self-check) and records where full
attention looks; then **policy replays** of the same tokens, scored step by step
(:mod:`~kvcompose.eval.replays`, :mod:`~kvcompose.eval.metrics`). The steps are
pooled into a :class:`~kvcompose.eval.result.FidelityResult`. Policies come from
presets and overrides (:mod:`~kvcompose.eval.overrides`), at fixed budgets or at a
measured memory target (:mod:`~kvcompose.eval.match`). This module runs it all.
"""

from __future__ import annotations

import datetime
import platform
import time
import warnings
from typing import Any, Iterable

import torch

from .. import threads as cpu_threads
from .match import match_memory, match_share_rate
from .metrics import MEMORY_BASIS, TOPK
from .overrides import build_policies, check_overrides, preset_policy
from .replays import Replay, combine_checks, evaluate
from .result import FidelityResult, policy_record, prompt_records
from .trajectory import TRAJECTORY_ATTENTION, greedy_trajectory

DEFAULT_PRESETS = ("fullkv", "streamingllm", "snapkv", "h2o", "rkv", "rpc")

#: CPU threads a comparison runs at unless told otherwise. A CPU matmul's sums are split
#: across threads, so its last bits (and then a near-tie argmax) depend on the thread
#: count; one count for every run keeps the numbers comparable across machines and loads.
FIDELITY_THREADS = 1


def _pinned_threads(model, threads: int | None):
    """The thread count a comparison on ``model`` runs at (a no-op off the CPU or with ``threads=None``)."""
    import contextlib

    if threads is None or next(model.parameters()).device.type != "cpu":
        return contextlib.nullcontext()
    return cpu_threads.fixed(cpu_threads.choose(threads).threads)


def _versions() -> dict:
    """The software a run used: a table is only comparable to one made with the same versions."""
    import transformers

    from .. import __version__

    return {"kvcompose": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "platform": platform.platform()}


def _model_info(model, name: str | None) -> dict:
    """The model's shape, dtype and device, recorded with the numbers they produced."""
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
            input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
            threads: int | None = FIDELITY_THREADS) -> FidelityResult:
    """Run the protocol for ``{label: Policy}`` on ``prompts`` and collect a :class:`FidelityResult`.

    ``min_new_tokens=None`` means ``max_new_tokens``: every prompt is replayed for the
    same number of steps, EOS masked until then (and the masking replayed). Prompts go
    in batches of ``batch_size``. Without a tokenizer, pass a left-padded
    ``input_ids``/``attention_mask`` instead (``prompts`` then only labels them).
    ``threads``: CPU threads the trajectory and replays run at (restored afterwards), so
    the numbers do not depend on the machine or its load; ``None`` keeps torch's setting.
    """
    with _pinned_threads(model, threads):
        result = _compare(model, tokenizer, prompts, policies, max_new_tokens=max_new_tokens,
                          min_new_tokens=min_new_tokens, batch_size=batch_size, topk=topk, chat=chat,
                          progress=progress, model_name=model_name, selection=selection, input_ids=input_ids,
                          attention_mask=attention_mask)
    result.metadata["replay"]["cpu_threads"] = threads if next(model.parameters()).device.type == "cpu" else None
    return result


def _compare(model, tokenizer, prompts, policies, *, max_new_tokens, min_new_tokens, batch_size, topk, chat,
             progress, model_name, selection, input_ids, attention_mask) -> FidelityResult:
    from tqdm.auto import tqdm

    from ..classifiers.model_match import warn_if_calibrated_for_another_model

    from ..hf.generate import encode_prompts
    from ..policies import Policy

    if not policies:
        raise ValueError("no policies to compare")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for policy in policies.values():
        warn_if_calibrated_for_another_model(policy, model)
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
            results, check = evaluate(model, traj, policies, topk=topk, progress=bar, tokenizer=tokenizer)
            trajectories.append(traj)
            checks.append(check)
            for label, rep in results.items():
                replays[label].append(rep)
    finally:
        bar.close()

    check = combine_checks(checks)
    if not check["ok"]:
        warnings.warn(check["message"])

    prompts_out = prompt_records(trajectories, replays[next(iter(replays))], tokenizer, prompts)
    policies_out = [policy_record(label, policy, replays[label], trajectories) for label, policy in policies.items()]

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
        "prompts": len(prompts_out),
        "runtime_s": time.perf_counter() - start,
    }
    return FidelityResult(policies_out, prompts_out, check, metadata)


def compare_presets(model, tokenizer, prompts: list[str], presets: Iterable[str] = DEFAULT_PRESETS, *,
                    budgets: Iterable[int] | None = None, match_memory_pct: float | None = None,
                    overrides: dict | None = None, max_new_tokens: int = 256, min_new_tokens: int | None = None,
                    batch_size: int = 4, progress: bool = True, threads: int | None = FIDELITY_THREADS,
                    **kwargs) -> FidelityResult:
    """:func:`compare` over named presets: a budget sweep (``budgets``) or memory matched by measurement.

    With ``match_memory_pct``, each compressing preset's budget (RPC: its period) is
    calibrated on the first prompt by :func:`match_memory` before the comparison. With both
    ``reasoncache`` and ``reasoncache-random``, the random baseline's share rate is set to
    the one ``reasoncache`` measures on the first prompt (:func:`match_share_rate`), so the
    two save the same share of sealed step blocks. ``threads``: as in :func:`compare`
    (the calibration runs at the same count).
    """
    with _pinned_threads(model, threads):
        return _compare_presets(model, tokenizer, prompts, presets, budgets=budgets,
                                match_memory_pct=match_memory_pct, overrides=overrides,
                                max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                                batch_size=batch_size, progress=progress, threads=threads, **kwargs)


def _compare_presets(model, tokenizer, prompts, presets, *, budgets, match_memory_pct, overrides, max_new_tokens,
                     min_new_tokens, batch_size, progress, threads, **kwargs) -> FidelityResult:
    from tqdm.auto import tqdm

    from ..hf.generate import encode_prompts

    presets = list(presets)
    if budgets is not None and match_memory_pct is not None:
        raise ValueError("give budgets or match_memory_pct, not both")
    selection: dict[str, Any] = {"presets": presets, "budgets": list(budgets) if budgets else None,
                                 "match_memory": match_memory_pct, "overrides": overrides or {}}
    check_overrides(presets, overrides)
    for name in presets:  # fail on a bad preset before minutes of calibration
        preset_policy(name, overrides)
    policies = build_policies(presets, budgets, overrides) if match_memory_pct is None else None
    sharing_pair = {"reasoncache", "reasoncache-random"} <= set(presets)
    if match_memory_pct is not None or sharing_pair:  # calibrate on the first prompt
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

            records = []
            if match_memory_pct is not None:
                policies, records = match_memory(model, traj, presets, match_memory_pct, overrides=overrides,
                                                 progress=_Grow())
            shared = match_share_rate(model, traj, policies, overrides=overrides, tokenizer=tokenizer,
                                      progress=_Grow())
        selection["calibration"] = records + ([shared] if shared else [])
    return compare(model, tokenizer, prompts, policies, max_new_tokens=max_new_tokens,
                   min_new_tokens=min_new_tokens, batch_size=batch_size, progress=progress,
                   selection=selection, threads=threads, **kwargs)
