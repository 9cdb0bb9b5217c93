"""Record decode-time attention sparsity from a model, then fit the ``sparsity_kde`` calibration.

:mod:`kvcompose.calibration.fit` does the statistics on recorded arrays; this module
records them. Each prompt is decoded greedily under the ``fullkv`` policy (the
calibration must see the attention of an uncompressed cache, as in ThinKV §3.1.3),
and a cache observer measures, at every decode step and in every layer, the
sparsity of the current query over all cached keys with
:func:`kvcompose.ops.sparsity.attention_sparsity` (1% of the row maximum, as in the
paper). The prefill forward is skipped: ThinKV's distributions are over decode steps.

Which steps a prompt contributes. Decode step ``k`` feeds the ``k``-th generated
token (counting from 0) back through the model, so its query belongs to that
token. A row keeps the steps whose token comes before its first EOS: the EOS token's
own query and everything after it (padding fed to finished rows of the batch) are
dropped. ``min_new_tokens`` masks EOS for that many steps, which gives equal lengths
at the price of text the model wanted to end; the default lets each prompt end
where it ends.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import numpy as np
import torch

from ..hf.attention import ATTENTION_NAME
from ..hf.compat import cache_kwargs
from ..hf.generate import _eos_ids, encode_prompts
from ..ops.sparsity import attention_sparsity
from .fit import calibrate

__all__ = ["collect_sparsity", "run_calibration"]


class _SparsityRecorder:
    """Cache observer: the sparsity of each decode query, per layer, for the whole batch.

    The first call of a layer is the prefill and is skipped; every later call must be
    one decode token (``model.generate`` without chunking or speculation).
    """

    def __init__(self, num_layers: int, threshold: float, combine: str, backend: str | None):
        self.threshold, self.combine, self.backend = threshold, combine, backend
        self.calls = [0] * num_layers
        self.values: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]

    def __call__(self, layer_idx, query, view, query_positions, scaling) -> None:
        self.calls[layer_idx] += 1
        if self.calls[layer_idx] == 1:
            return
        if query.shape[2] != 1:
            raise RuntimeError(
                f"layer {layer_idx}: a decode forward had {query.shape[2]} query tokens; sparsity collection "
                "expects one token per step after the prefill"
            )
        backend = self.backend or (None if view.keys.is_cuda else "torch")
        s = attention_sparsity(
            query[:, :, -1], view.keys, view.valid, scaling, threshold=self.threshold,
            backend=backend, combine=self.combine, validate=False,
        )
        self.values[layer_idx].append(s.float())

    def stacked(self, batch: int) -> torch.Tensor:
        """``[steps, batch, layers]`` on the CPU (steps = decode forwards seen by every layer)."""
        steps = min(len(v) for v in self.values)
        if steps == 0:  # every row ended on its first token: no decode forward ran
            return torch.zeros(0, batch, len(self.values))
        return torch.stack([torch.stack(v[:steps]) for v in self.values], dim=-1).cpu()


class _TokenProgress:
    """A logits processor that advances a shared bar by the batch size each step."""

    def __init__(self, bar):
        self.bar = bar
        self.done = 0

    def __call__(self, input_ids, scores):
        self.bar.update(scores.shape[0])
        self.done += scores.shape[0]
        return scores


def collect_sparsity(
    model,
    tokenizer,
    prompts: Sequence[str],
    max_new_tokens: int = 256,
    *,
    min_new_tokens: int = 0,
    batch_size: int = 4,
    threshold: float = 0.01,
    combine: str = "scores",
    backend: str | None = None,
    chat: bool | None = None,
    progress: bool = True,
) -> list[np.ndarray]:
    """Greedy-decode each prompt under ``fullkv`` and return its per-step, per-layer attention sparsity.

    Returns one float32 array ``[steps, num_layers]`` per prompt, in prompt order,
    values in ``[0, 1]``; ``steps`` is the number of generated tokens before the
    prompt's first EOS, at most ``max_new_tokens - 1`` (the last token is never fed
    back). Prompts go through :func:`kvcompose.hf.encode_prompts` (chat template when
    the tokenizer has one, left padding) in batches of ``batch_size``.

    ``backend=None`` lets :func:`attention_sparsity` choose on CUDA (Triton when
    installed) and uses the torch reference on the CPU, so an interpreted Triton
    (``TRITON_INTERPRET=1``, a test setting) does not slow collection down.
    ``threshold`` and ``combine`` are passed to :func:`attention_sparsity` and should
    match what the classifier sees at decode time (its defaults do).
    """
    from tqdm.auto import tqdm
    from transformers import LogitsProcessorList

    from ..policies import Policy

    if isinstance(prompts, str) or not prompts:
        raise ValueError("prompts must be a non-empty list of strings")
    for name, value, low in (("max_new_tokens", max_new_tokens, 2), ("batch_size", batch_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if isinstance(min_new_tokens, bool) or not isinstance(min_new_tokens, int) or min_new_tokens < 0:
        raise ValueError(f"min_new_tokens must be an int >= 0, got {min_new_tokens!r}")
    if min_new_tokens > max_new_tokens:
        raise ValueError(f"min_new_tokens ({min_new_tokens}) exceeds max_new_tokens ({max_new_tokens})")

    policy = Policy.from_preset("fullkv")
    eos = _eos_ids(model, tokenizer)
    results: list[np.ndarray] = []
    bar = tqdm(total=len(prompts) * max_new_tokens, desc="calibration decode", unit="tok", disable=not progress)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        for start in range(0, len(prompts), batch_size):
            batch = list(prompts[start : start + batch_size])
            enc = encode_prompts(tokenizer, batch, chat).to(model.device)  # sets a pad token if missing
            cache = policy.make_cache(model)
            recorder = _SparsityRecorder(len(cache.layers), threshold, combine, backend)
            cache.observers.append(recorder)
            ticker = _TokenProgress(bar)
            with torch.inference_mode():
                out = model.generate(
                    **enc, **cache_kwargs(model, cache), max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                    do_sample=False, pad_token_id=tokenizer.pad_token_id,
                    logits_processor=LogitsProcessorList([ticker]),
                )
            bar.update(len(batch) * max_new_tokens - ticker.done)
            recorded = recorder.stacked(len(batch))  # [steps, B, layers]
            generated = out[:, enc["input_ids"].shape[1] :].cpu()
            for row in range(len(batch)):
                keep = min(_first_eos(generated[row].tolist(), eos), recorded.shape[0])
                results.append(recorded[:keep, row].numpy().astype(np.float32))
    finally:
        model.set_attn_implementation(previous)
        bar.close()
    return results


def _first_eos(ids: list[int], eos: set[int]) -> int:
    """Index of the first EOS in ``ids``, or ``len(ids)`` when there is none."""
    for i, t in enumerate(ids):
        if t in eos:
            return i
    return len(ids)


def run_calibration(
    model,
    tokenizer,
    prompts: Sequence[str],
    num_types: int = 3,
    num_layers: int = 4,
    max_new_tokens: int = 256,
    model_name: str | None = None,
    *,
    min_steps: int = 16,
    progress: bool = True,
    collect_options: dict[str, Any] | None = None,
    **calibrate_options,
) -> dict[str, Any]:
    """Collect sparsity for ``prompts`` and fit thresholds and ``L*`` (:func:`~kvcompose.calibration.fit.calibrate`).

    Prompts that produced fewer than ``min_steps`` decode steps are left out of the
    fit (a KDE of a handful of points has no meaningful modes); how many, and how
    many steps every prompt gave, is recorded under ``"collection"`` in the returned
    dict together with the collection settings. ``collect_options`` go to
    :func:`collect_sparsity` (e.g. ``batch_size``, ``min_new_tokens``),
    ``calibrate_options`` to :func:`~kvcompose.calibration.fit.calibrate`. A fallback to
    fewer types is reported in ``"fallback"`` and as a ``CalibrationWarning``.
    """
    if isinstance(min_steps, bool) or not isinstance(min_steps, int) or min_steps < 2:
        raise ValueError(f"min_steps must be an int >= 2, got {min_steps!r}")
    options = dict(collect_options or {})
    arrays = collect_sparsity(model, tokenizer, prompts, max_new_tokens=max_new_tokens, progress=progress, **options)
    steps = [int(a.shape[0]) for a in arrays]
    kept = [a for a in arrays if a.shape[0] >= min_steps]
    if not kept:
        raise ValueError(
            f"every prompt ended within {min_steps} decode steps (steps per prompt: {steps}); "
            "raise max_new_tokens, pass collect_options={'min_new_tokens': ...} or lower min_steps"
        )
    if len(kept) < len(arrays):
        warnings.warn(
            f"{len(arrays) - len(kept)} of {len(arrays)} prompts gave fewer than {min_steps} decode steps "
            "and were left out of the calibration",
            UserWarning,
            stacklevel=2,
        )
    result = calibrate(kept, num_types, num_layers, model=model_name, **calibrate_options)
    result["collection"] = {
        "policy": "fullkv",
        "num_prompts": len(arrays),
        "num_prompts_used": len(kept),
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": options.get("min_new_tokens", 0),
        "min_steps": min_steps,
        "steps_per_prompt": steps,
        "total_steps": int(sum(a.shape[0] for a in kept)),
        "sparsity_threshold": options.get("threshold", 0.01),
        "combine": options.get("combine", "scores"),
        "decoding": "greedy",
    }
    return result
