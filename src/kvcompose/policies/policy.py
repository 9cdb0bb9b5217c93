"""``Policy``: a composition of registered components plus the schedule fields.

A policy is plain configuration: which evictor scores tokens, which trigger decides
when and how much to compress, which pager turns evictions into freed memory, the
token budget per (sequence, layer), and the tokens that are never evicted. It builds
caches (:meth:`Policy.make_cache`) but holds no per-sequence state itself, so one
policy can serve any number of ``generate`` calls.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import registry
from ..evictors import Evictor
from ..pagers import GatherPager, Pager
from ..paging import DenseCodec, LayerStore
from ..triggers import Trigger, TriggerInput
from ..validation import check_int
from .integration import integration
from .overrides import apply_overrides

COMPONENT_FIELDS = {"evictor": "evictor", "trigger": "trigger", "pager": "pager", "classifier": "classifier",
                    "filter": "filter", "rotation": "rotation"}


#: ``Policy.pool_layout`` values: pools keep a slot's heads side by side ("slot"), or each head's
#: slots side by side ("head"; see :func:`kvcompose.ops.paged_attention.row_layout`).
POOL_LAYOUTS = ("slot", "head")
#: The default: head-major rows are what the decode attention reads as runs of bytes
#: (``docs/development.md``: the CUDA kernel ran faster on them, the Triton kernel within about 5%).
DEFAULT_POOL_LAYOUT = "head"


@dataclass
class Policy:
    """How a KV cache is compressed. Build one from a preset, a config dict, or components."""

    name: str = "custom"
    budget: int | None = None  # tokens kept per (sequence, layer); None: unbounded
    evictor: Evictor | None = None
    trigger: Trigger | None = None
    pager: Pager = field(default_factory=GatherPager)
    sinks: int = 0  # first tokens of each sequence that are never evicted
    protect_recent: int | float = 0  # most recent tokens never evicted (a float in (0, 1): that share of the budget)
    protect_prompt: bool = False  # never evict prompt tokens
    block_size: int = 16  # token slots per block
    group_size: int = 16  # recent-buffer group: tokens move to blocks this many at a time
    residual: int = 0  # newest tokens always kept in full precision in the recent buffer (KIVI's R)
    precision: dict | None = None  # token class -> storage format (quantizer spec, or None for full precision)
    scale_headroom: float = 2.0  # per-sequence scale of two-level formats = headroom x amax of its first encode
    classifier: Any = None  # thought classifier: assigns each new segment a class of ``precision``
    refresh: int = 128  # tokens per thought segment: the classifier runs once per segment (ThinKV tau)
    filter: Any = None  # sharing filter: which sealed blocks the share pager maps onto earlier ones (ReasonCache)
    rotation: Any = None  # rotation of the stored keys and values (e.g. "hadamard"); None: as computed
    pool_layout: str = DEFAULT_POOL_LAYOUT  # a pool's (slot, head) rows: "head" (a head's slots together) or "slot"

    def __post_init__(self) -> None:
        for fname, kind in COMPONENT_FIELDS.items():
            setattr(self, fname, registry.build(kind, getattr(self, fname)))
        if self.precision is not None:
            if not isinstance(self.precision, dict) or not self.precision:
                raise ValueError(
                    f"Policy.precision must map token classes to formats, e.g. {{'all': 'nvfp4'}}; got {self.precision!r}"
                )
            self.precision = {
                str(cls): None if spec in (None, "none") else registry.build("quantizer", spec)
                for cls, spec in self.precision.items()
            }
        self._validate()

    # ------------------------------------------------------------ validation
    def _validate(self) -> None:
        def positive_int(fname: str, value: Any, minimum: int) -> None:
            check_int(f"Policy.{fname}", value, minimum, noun="an integer")

        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Policy.name must be a non-empty string, got {self.name!r}")
        positive_int("block_size", self.block_size, 1)
        positive_int("group_size", self.group_size, 1)
        positive_int("residual", self.residual, 0)
        positive_int("refresh", self.refresh, 1)
        if self.classifier is not None:
            missing = [t for t in self.classifier.types if t not in self.classes]
            if missing:
                raise ValueError(
                    f"Policy {self.name!r}: classifier {self.classifier.name!r} emits classes {missing} that "
                    f"Policy.precision does not map; precision classes: {self.classes}"
                )
        if isinstance(self.scale_headroom, bool) or not isinstance(self.scale_headroom, (int, float)) \
                or not 1 <= self.scale_headroom < float("inf"):
            raise ValueError(f"Policy.scale_headroom must be a number >= 1 and finite, got {self.scale_headroom!r}")
        for cls, q in (self.precision or {}).items():
            if q is None:
                continue
            group = getattr(q, "token_group", 1) if not q.slot_local else 1
            if group > 1 and (self.group_size % group or self.block_size % group):
                raise ValueError(
                    f"Policy {self.name!r}: class {cls!r} uses {q.name} with scales shared by {group} tokens; "
                    f"group_size ({self.group_size}) and block_size ({self.block_size}) must be multiples of {group}"
                )
            if not q.slot_local and self.evictor is not None:
                raise ValueError(
                    f"Policy {self.name!r}: class {cls!r} uses {q.name} layout {getattr(q, 'layout', '')!r}, whose "
                    "scales span several tokens; its blocks cannot be compacted after eviction. Use a slot-local "
                    "format (fp8, nvfp4, ternary, int per_token) with an evictor, or no evictor"
                )
        if self.pool_layout not in POOL_LAYOUTS:
            raise ValueError(f"Policy.pool_layout={self.pool_layout!r}; accepted: {', '.join(map(repr, POOL_LAYOUTS))}")
        positive_int("sinks", self.sinks, 0)
        if isinstance(self.protect_recent, float):
            if not 0.0 < self.protect_recent < 1.0 or self.budget is None:
                raise ValueError(
                    f"Policy.protect_recent={self.protect_recent!r}: a float means a share of the budget and must "
                    "lie in (0, 1) with a budget set; use an int for a number of tokens"
                )
        else:
            positive_int("protect_recent", self.protect_recent, 0)
        if not isinstance(self.protect_prompt, bool):
            raise ValueError(f"Policy.protect_prompt must be true or false, got {self.protect_prompt!r}")
        if self.pager is None:
            raise ValueError(f"Policy.pager is required; known pagers: {', '.join(registry.names('pager'))}")
        shares = getattr(self.pager, "shares_blocks", False)
        if self.filter is not None and not shares:
            raise ValueError(f"Policy {self.name!r}: filter {self.filter.name!r} decides which blocks to share, which "
                             f"needs pager 'share' (got {self.pager.name!r})")
        if shares and len(self.classes) > 1:
            raise ValueError(f"Policy {self.name!r}: pager 'share' works on one token class; precision maps "
                             f"{self.classes}. Use one class, e.g. precision={{'all': 'nvfp4'}}")
        if self.budget is not None:
            positive_int("budget", self.budget, 1)
            if self.evictor is None:
                raise ValueError(
                    f"Policy {self.name!r} never evicts (it has no evictor), so budget={self.budget} would change "
                    "nothing; drop the budget, or choose a preset with an evictor (kvcompose presets lists them)"
                )
        if (self.evictor is None) != (self.trigger is None):
            raise ValueError(
                "Policy needs both an evictor and a trigger to compress (or neither for a full cache); "
                f"got evictor={self.evictor!r}, trigger={self.trigger!r}"
            )
        if self.evictor is not None:
            if self.budget is None and self.trigger.needs_budget:
                raise ValueError(
                    f"Policy {self.name!r}: trigger {self.trigger.name!r} needs a budget (tokens per sequence and layer)"
                )
            needed = self.min_budget()
            if self.budget is not None and self.budget < needed:
                raise ValueError(
                    f"Policy {self.name!r}: budget={self.budget} is smaller than this policy needs ({needed}: "
                    f"{self.sinks} sinks + {self.recent_tokens} protected recent tokens + "
                    f"{self.trigger.min_budget()} for trigger {self.trigger.name!r}); use budget >= {needed}"
                )

    def min_budget(self) -> int:
        """The smallest budget this composition can honour."""
        if self.evictor is None:
            return 1
        return self.sinks + self.recent_tokens + self.trigger.min_budget()

    @property
    def recent_tokens(self) -> int:
        """``protect_recent`` in tokens (a float share is taken of the budget)."""
        if isinstance(self.protect_recent, float):
            return int(round(self.protect_recent * self.budget))
        return self.protect_recent

    # ---------------------------------------------------------- construction
    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "Policy":
        """A registered preset with fields overridden (see :func:`~kvcompose.policies.overrides.apply_overrides`)."""
        from .presets import preset_config

        config = apply_overrides(preset_config(name), overrides)
        return cls.from_config(config)

    @classmethod
    def from_config(cls, config: dict) -> "Policy":
        """Build from a JSON-style dict (the inverse of :meth:`to_config`)."""
        if not isinstance(config, dict):
            raise TypeError(f"a policy config must be a dict, got {type(config).__name__}")
        allowed = {f.name for f in dataclasses.fields(cls)}
        unknown = set(config) - allowed
        if unknown:
            raise ValueError(f"unknown policy field(s) {sorted(unknown)}; accepted fields: {sorted(allowed)}")
        return cls(**config)

    def to_config(self) -> dict:
        """A JSON-serializable dict that :meth:`from_config` turns back into an equal policy."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in COMPONENT_FIELDS:
                value = registry.to_config(value)
            elif f.name == "precision" and value is not None:
                value = {cls: registry.to_config(q) for cls, q in value.items()}
            out[f.name] = value
        json.dumps(out)  # fail here, not in the user's json.dump, if a field is not serializable
        return out

    # ----------------------------------------------------------------- caches
    @property
    def query_window(self) -> int:
        """How many recent queries per layer the attention function must record."""
        return self.evictor.query_window if self.evictor is not None else 0

    @property
    def needs_text(self) -> str | None:
        """What reads the generated token ids (a text classifier, a sharing filter), or None.
        Such a policy's cache needs a tokenizer and :meth:`KVComposeCache.observe_tokens`."""
        if self.filter is not None:
            return f"filter {self.filter.name!r}"
        if self.classifier is not None and self.classifier.needs == "text":
            return f"classifier {self.classifier.name!r}"
        return None

    @property
    def classes(self) -> list[str]:
        """Token classes in index order (one class, ``"all"``, without a precision map)."""
        return list(self.precision) if self.precision else ["all"]

    def make_store(self, batch_size: int, num_kv_heads: int, head_dim: int, dtype, device) -> LayerStore:
        """An empty store for one layer: one region per token class, in that class's format."""
        from ..quantizers.codec import QuantCodec

        codecs = {
            cls: DenseCodec(dtype) if q is None else QuantCodec(q, num_kv_heads, head_dim, device, self.scale_headroom)
            for cls, q in (self.precision or {"all": None}).items()
        }
        return LayerStore(
            batch_size, num_kv_heads, head_dim, dtype, device,
            block_size=self.block_size, group_size=self.group_size, residual=self.residual,
            float_channels=tuple(getattr(self.evictor, "slot_channels", ())), codecs=codecs,
            refcounted=getattr(self.pager, "shares_blocks", False), head_major=self.pool_layout == "head",
        )

    def make_cache(self, model, fused_attention: bool = True, memory_basis="bfloat16", tokenizer=None):
        """A fresh transformers cache for ``model`` (which must use ``attn_implementation="kvcompose"``).

        ``fused_attention=False`` keeps every step on the dense view + SDPA (the eager reference).
        ``memory_basis``: the dtype of the full cache its report states memory against (see
        :mod:`kvcompose.report`; None: the model's own dtype). ``tokenizer``: needed by policies
        whose components read the generated text (:attr:`needs_text`)."""
        return integration().make_cache(self, model, fused_attention=fused_attention, memory_basis=memory_basis,
                                         tokenizer=tokenizer)

    def generate(self, model, tokenizer, prompts, max_new_tokens: int = 256, **generate_kwargs):
        """Generate for a list of prompts under this policy; see :func:`kvcompose.hf.generate`."""
        return integration().generate(self, model, tokenizer, prompts, max_new_tokens=max_new_tokens, **generate_kwargs)

    @property
    def captures_eviction(self) -> bool:
        """Whether static decode replays this policy's eviction steps as a CUDA graph: the
        evictor reads keys (so it cannot evict inside every step) and its selection is graph-safe."""
        return self.evictor is not None and not self.evicts_in_place and self.evictor.graph_safe

    @property
    def captures_refresh(self) -> bool:
        """Whether static decode replays classifier-refresh steps as a CUDA graph (the classifier
        is graph-safe, or there is none)."""
        return self.classifier is None or self.classifier.graph_safe

    @property
    def static_hole_blocks(self) -> int | None:
        """The most blocks beyond its live tokens that a class of a row keeps between static
        decode steps (what lets the classes of one pool share a row's reserve; see
        :meth:`~kvcompose.paging.LayerStore.fix_capacity`): 0 without eviction, the pager's bound
        with one, None where nothing bounds it (in-place evictors leave holes they never pack)."""
        if self.evictor is None:
            return 0
        return None if self.evicts_in_place else self.pager.static_hole_blocks

    @property
    def evicts_in_place(self) -> bool:
        """Whether static decode evicts inside the captured step: the evictor reads only
        positions and slot channels (StreamingLLM's window, H2O), so its trigger and selection
        run on the device with fixed shapes, every step."""
        return self.evictor is not None and not self.evictor.reads_keys and self.query_window == 0

    def trigger_input(self, stored: torch.Tensor, prompt: torch.Tensor, generated: torch.Tensor) -> TriggerInput:
        """What this policy's trigger decides on, from per-row counts (any shape, int64): the live
        tokens held, the live prompt tokens, and the tokens generated so far. The eager and the
        static-shape path both ask the trigger through this, so they read the same budget."""
        return TriggerInput(stored=stored, prompt=prompt, generated=generated, budget=self.budget,
                            segment=self.refresh)
