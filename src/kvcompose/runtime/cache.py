"""The per-generation state a cache runs its policy with, for every layer at once.

:class:`CacheRuntime` holds what the layers share: the policy, the step counters, the
phase timer, the thought classes, the token stream, block sharing, the static-decode
step plan and the memory accounting. The model integration (``kvcompose.hf``) adds the
framework's cache contract around it; everything here starts empty with each
generation (:meth:`CacheRuntime.start`).
"""

from __future__ import annotations

import torch

from ..distributed import LOCAL, HeadShards
from ..paging import StoreView
from ..report import Report, memory_dtype
from .counters import StepCounters
from .sharing import SharingTracker
from .thoughts import ThoughtTracker
from .timing import PhaseTimer
from .tokens import TokenStream


class CacheRuntime:
    """Shared per-generation state of a cache's layers (``self.layers``, set by the integration)."""

    def __init__(self, policy, fused_attention: bool = True,
                 memory_basis: "torch.dtype | str | None" = torch.bfloat16, tokenizer=None, heads: HeadShards = LOCAL):
        self.policy = policy
        # The tensor-parallel ranks holding this layer's other KV heads: decisions that combine
        # heads reduce over them (kvcompose.distributed).
        self.heads = heads
        self.tokenizer = tokenizer  # decodes the token stream for components that read text
        # The dtype of the full cache that memory figures compare with (None: the model's own);
        # see kvcompose.report.
        self.memory_basis = memory_dtype(memory_basis)
        # Decode steps attend through the fused paged kernel (Triton on CUDA, its torch
        # reference elsewhere); False: always the dense view + SDPA (the eager reference).
        self.fused_attention = fused_attention
        self.attention_backend: str | None = None  # None: auto; "triton", "cuda" or "torch" to force one
        # Callables ``(layer_idx, query, view, query_positions, scaling)`` run after each
        # attention, before compression: the fidelity harness reads attention through them.
        self.observers: list = []

    def start(self) -> None:
        """Fresh per-generation state (after the layers exist)."""
        self.timer = PhaseTimer()  # seconds per phase, when timing is on (time_phases)
        self.counters = StepCounters()
        self.tokens = TokenStream(self.tokenizer)  # ids fed through observe_tokens
        self.thoughts = ThoughtTracker(self.policy, len(self.layers), self.timer, self.tokens, self.heads)
        self.sharing = SharingTracker(self) if self.policy.filter is not None else None
        # Static decode sets this to the current step's StepPlan (kvcompose.runtime.schedule).
        self.step_plan = None
        self.static_decoder = None  # the static-decode driver, for its counts of eager steps and replays
        self._in_use = [0] * len(self.layers)
        self._peak = 0
        self._in_use_device: torch.Tensor | None = None  # [layers] bytes, static mode (no host sync)
        self._peak_device: torch.Tensor | None = None

    def observe_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Give the cache the ids of the tokens the next forward pass appends (``[B, T]``; the
        mask marks padding, and may cover these columns or all so far). Policies whose
        components read the generated text need it before every forward; others ignore it."""
        self.tokens.observe(input_ids, attention_mask)

    @property
    def peak_kv_bytes(self) -> int:
        """Most KV-cache bytes in use at once so far (all layers)."""
        if self._peak_device is None:
            return self._peak
        return max(self._peak, int(self._peak_device))

    def note_memory(self, layer_idx: int) -> None:
        """Account one layer's bytes in use now (on the device in static mode: no host sync)."""
        if self._in_use_device is not None:
            self._in_use_device[layer_idx] = self.layers[layer_idx].store.bytes_in_use(self.memory_basis)
            torch.maximum(self._peak_device, self._in_use_device.sum(), out=self._peak_device)
            return
        self._in_use[layer_idx] = self.layers[layer_idx].store.memory(self.memory_basis)["in_use"]
        self._peak = max(self._peak, sum(self._in_use))

    def fix_capacity(self, tokens: int, columns_limit: int | None = None) -> None:
        """Enter static mode after the prefill: every layer's store gets room for ``tokens``
        tokens per row now, and memory is tracked on the device from here on. ``columns_limit``:
        the most columns the run will have appended (see :meth:`LayerStore.fix_capacity`)."""
        device = self.layers[0].store.device
        self._in_use_device = torch.tensor(self._in_use, dtype=torch.long, device=device)
        self._peak_device = torch.tensor(self._peak, dtype=torch.long, device=device)
        self.counters.begin_static(device)
        for layer in self.layers:
            layer.fix_capacity(tokens, columns_limit)

    def most_tokens_held(self) -> int:
        """The most tokens any row holds in any layer, counting every slot written in its regions
        (holes included) and its recent buffer: what static decode must have room for after the
        prefill (one host synchronization)."""
        held = [sum(r.length for r in layer.store.regions) + layer.store.buf_len for layer in self.layers]
        return int(torch.stack(held).max()) if held else 0

    def views(self) -> list[StoreView]:
        """Current dense views of every initialized layer (for inspection and tests)."""
        return [layer.store.view() for layer in self.layers if layer.store is not None]

    def check_errors(self) -> None:
        """Raise for NaN/inf keys or values, or bad input that quantized encoding recorded.

        Appending and encoding do not wait for the GPU to say whether their input was
        finite; the cache asks once per forward pass (and :func:`~kvcompose.hf.generate.generate`
        at the end), reading every layer's flags with one host synchronization, and the
        error names the first layer that has one.
        """
        layers = [layer for layer in self.layers if layer.store is not None]
        flags = [f for layer in layers for f in layer.store.error_flags()]
        if flags and int(torch.stack([f.reshape(()) for f in flags]).amax()):
            for layer in layers:
                layer.store.check_errors(f"layer {layer.layer_idx}")

    def time_phases(self, enabled: bool = True) -> None:
        """Measure wall time of attention, eviction and classifier refresh (synchronizes CUDA; slows decoding)."""
        self.timer.enable(enabled)

    def report(self) -> Report:
        """Memory and token accounting so far (a :class:`kvcompose.report.Report`)."""
        return Report.from_cache(self)
