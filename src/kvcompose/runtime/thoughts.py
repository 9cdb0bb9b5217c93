"""Per-cache thought tracking: which class new tokens get, refreshed once per segment.

Every ``policy.refresh`` generated tokens (and once after the prefill) the layers the
classifier reads measure the attention sparsity of the current query; after the last
layer (when every layer has filed this forward's tokens) the classifier's answer
becomes the class of the following tokens, so every layer files a token under the same
class and a segment's tokens share one class. Without a classifier every token gets
the policy's first class (``"R"`` if the precision map has one: prefill tokens are
reasoning, as in ThinKV). Nothing here reads the device, so static decode replays
refresh steps inside its captured graphs.
"""

from __future__ import annotations

import torch

from ..classifiers.base import ClassifierInput
from ..device_constants import device_constant
from ..distributed import LOCAL, HeadShards
from ..ops.sparsity import attention_sparsity
from .timing import PhaseTimer


class ThoughtTracker:
    """Current thought class per sequence, its refresh, and the thought mix for the report."""

    def __init__(self, policy, num_layers: int, timer: PhaseTimer | None = None, tokens=None,
                 heads: HeadShards = LOCAL):
        self.policy = policy
        self.heads = heads  # sparsity spans the KV heads of every tensor-parallel rank
        self.num_layers = num_layers
        classes = policy.classes
        self.default = classes.index("R") if "R" in classes else 0
        self.current: torch.Tensor | None = None  # [B] class index of new tokens (written in place)
        self.sparsity: torch.Tensor | None = None  # [B, num_layers], NaN where not measured
        self.class_tokens: torch.Tensor | None = None  # [num classes] real tokens filed per class (layer 0)
        self.refresh_count: torch.Tensor | None = None  # refreshes so far, counted on the device
        self.timer = timer or PhaseTimer()  # the cache's (refresh time is one of its phases)
        self.tokens = tokens  # the cache's TokenStream (text classifiers read the recent segment from it)

    # ------------------------------------------------------------- per step
    def classes_for(self, layer_idx: int, batch: int, tokens: int, real, device) -> torch.Tensor:
        """Class index of each new token ``[B, T]`` (switching to a pending decision at layer 0)."""
        if self.current is None:
            self.current = torch.full((batch,), self.default, dtype=torch.long, device=device)
            self.class_tokens = torch.zeros(len(self.policy.classes), dtype=torch.long, device=device)
            self.refresh_count = torch.zeros((), dtype=torch.long, device=device)
        if layer_idx == 0:
            n_real = real.sum(1) if real is not None else torch.full((batch,), tokens, device=device)
            self.class_tokens.index_add_(0, self.current, n_real.to(torch.long))
        return self.current[:, None].expand(batch, tokens)

    def step_classes(self, layer_idx: int) -> torch.Tensor:
        """Static decode: the class of each row's one new token ``[B]`` (counted at layer 0, on the device)."""
        if layer_idx == 0:
            self.class_tokens.index_add_(0, self.current, torch.ones_like(self.current))
        return self.current

    def is_refresh_step(self, store) -> bool:
        """True in the prefill forward and whenever a segment of generated tokens completes."""
        generated = store.columns_seen - (store.prompt_columns or 0)
        return self.policy.classifier is not None and generated % self.policy.refresh == 0

    def needs_view(self, layer_idx: int, store) -> bool:
        """Whether :meth:`observe` reads this layer's keys now (a refresh step on a classifier layer)."""
        classifier = self.policy.classifier
        return (self.is_refresh_step(store) and classifier.needs == "sparsity"
                and layer_idx in classifier.layers)

    def observe(self, layer_idx: int, query, view, scaling: float, store) -> None:
        """At refresh steps: measure sparsity on the classifier's layers; classify after the last layer.

        ``view`` may be None except where :meth:`needs_view` says the keys are read."""
        if not self.is_refresh_step(store):
            return
        classifier = self.policy.classifier
        B = query.shape[0]
        if self.sparsity is None or self.sparsity.shape[0] != B:
            self.sparsity = torch.full((B, self.num_layers), float("nan"), device=query.device)
        with self.timer.phase("refresh"):
            if classifier.needs == "sparsity" and layer_idx in classifier.layers:
                self.sparsity[:, layer_idx] = attention_sparsity(
                    query[:, :, -1], view.keys, view.valid, scaling, validate=False, heads=self.heads
                )
            if layer_idx == self.num_layers - 1:
                texts = None
                if classifier.needs == "text":  # the segment that just ended (the prompt's tail at prefill)
                    texts = [self.tokens.recent_text(b, self.policy.refresh) for b in range(B)]
                signal = ClassifierInput(
                    sparsity=self.sparsity if classifier.needs == "sparsity" else None,
                    texts=texts, batch_size=B, device=query.device, check=not store.static,
                )
                lookup = device_constant(tuple(self.policy.classes.index(t) for t in classifier.types),
                                         query.device)
                self.current.copy_(lookup[classifier.classify(signal)])  # every layer filed this forward's tokens
                self.refresh_count += 1
                self.sparsity = None

    def report(self) -> dict:
        """Thought mix (% of real tokens per class) and classifier refreshes."""
        total = int(self.class_tokens.sum()) if self.class_tokens is not None else 0
        mix = {c: (100.0 * int(n) / total if total else 0.0)
               for c, n in zip(self.policy.classes, (self.class_tokens.tolist() if total else []))}
        refreshes = int(self.refresh_count) if self.refresh_count is not None else 0
        return {"thought_mix": mix, "refreshes": refreshes}
