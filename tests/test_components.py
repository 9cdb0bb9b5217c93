"""The contract every registered component keeps, checked for each registered name of each kind.

Parametrized over the registry (``components.params``), so a newly registered component is
tested here without listing it: config round-trip, documentation, named errors for bad
fields, its paper, and the generic behaviour of its kind.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch

from components import BAD, BASES, PAPERS, builtin, default, params
from kvcompose import registry
from kvcompose.classifiers import THOUGHT_TYPES
from kvcompose.evictors import EvictionContext
from kvcompose.filters import Step
from kvcompose.filters.lexical import make_step
from kvcompose.paging import DenseCodec, LayerStore
from kvcompose.registry import ComponentSpecError
from kvcompose.triggers import TriggerInput


# ------------------------------------------------------------------ every kind
@pytest.mark.parametrize("kind, name", params())
def test_registered_under_its_name_and_kind(kind, name):
    cls = registry.get(kind, name)
    assert cls.name == name and cls.kind == kind and dataclasses.is_dataclass(cls)
    assert issubclass(cls, BASES[kind])
    assert isinstance(default(kind, name), cls)


@pytest.mark.parametrize("kind, name", params())
def test_config_round_trips_through_json(kind, name):
    component = default(kind, name)
    config = registry.to_config(component)
    assert config["name"] == name
    again = registry.build(kind, json.loads(json.dumps(config)))
    assert again == component and registry.to_config(again) == config
    assert registry.build(kind, again) is again  # an instance passes through


@pytest.mark.parametrize("kind, name", params())
def test_documented(kind, name):
    cls = registry.get(kind, name)
    assert registry.available()[kind][name], f"{kind} {name!r}: the class docstring has no summary line"
    assert (sys.modules[cls.__module__].__doc__ or "").strip(), f"{cls.__module__} has no module docstring"


@pytest.mark.parametrize("kind, name", params())
def test_unknown_field_and_wrong_spec_are_named(kind, name):
    cls = registry.get(kind, name)
    accepted = sorted(f.name for f in dataclasses.fields(cls))
    with pytest.raises(ValueError) as err:
        registry.build(kind, {"name": name, "no_such_field": 1})
    assert str(err.value) == f"{kind} {name!r} has no field(s) ['no_such_field']; accepted fields: {accepted}"
    with pytest.raises(ComponentSpecError, match=f"cannot build an? {kind} from 3"):
        registry.build(kind, 3)


@pytest.mark.parametrize("kind, name", params())
def test_bad_field_value_names_the_component_and_what_is_accepted(kind, name):
    if (kind, name) not in BAD:
        has_fields = dataclasses.fields(registry.get(kind, name))
        assert not (has_fields and builtin(kind, name)), f"add a bad value for {kind} {name!r} to components.BAD"
        pytest.skip("no fields to get wrong")
    fields, message = BAD[kind, name]
    with pytest.raises(ValueError) as err:
        registry.build(kind, {"name": name, **fields})
    assert str(err.value) == message
    assert message.startswith(f"{name} {kind}")


@pytest.mark.parametrize("kind, name", params())
def test_method_cites_its_paper(kind, name):
    if not builtin(kind, name) or (kind, name) not in PAPERS:
        pytest.skip("not a published method")
    doc = sys.modules[registry.get(kind, name).__module__].__doc__
    for arxiv_id in PAPERS[kind, name]:
        assert f"arXiv:{arxiv_id}" in doc, f"{kind} {name!r} does not cite arXiv:{arxiv_id}"


# ------------------------------------------------------------------- triggers
@pytest.mark.parametrize("kind, name", params("trigger"))
def test_trigger_keeps_at_most_what_is_stored(kind, name):
    trigger = default(kind, name)
    t = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    counts = TriggerInput(stored=t([3, 40, 200, 5000]), prompt=t([3, 10, 20, 100]), generated=t([0, 30, 180, 4900]),
                          budget=32, segment=16)
    keep = trigger.plan(counts)
    assert keep.shape == (4,) and keep.dtype == torch.long
    assert bool((keep <= counts.stored).all()) and bool((keep >= 0).all())
    fires = trigger.fires(counts, keep)
    assert fires.shape == (4,) and fires.dtype == torch.bool
    assert trigger.min_budget() >= 1
    room = trigger.headroom(counts)
    assert room is None or isinstance(room, int)


# ------------------------------------------------------------------- evictors
def _eviction_context(B=2, L=24, W=8, Hkv=2, Hq=4, D=8, prompt=4, segment=4) -> EvictionContext:
    """A batch with every field an evictor may read: queries, slot channels, token classes."""
    g = torch.Generator().manual_seed(0)
    positions = torch.stack([torch.randperm(L, generator=g) for _ in range(B)])
    valid = torch.ones(B, L, dtype=torch.bool)
    valid[1, positions[1] >= L - 3] = False  # row 1 has empty slots
    positions = torch.where(valid, positions, -1)
    protected = valid & (positions < 2)
    return EvictionContext(
        keys=torch.randn(B, Hkv, L, D, generator=g), positions=positions, valid=valid,
        keep=torch.tensor([10, 8]), protected=protected,
        queries=torch.randn(B, Hq, W, D, generator=g), query_valid=torch.ones(B, W, dtype=torch.bool),
        query_positions=torch.arange(L - W, L).expand(B, W).clone(), scaling=D ** -0.5,
        state={"acc": torch.rand(B, L, generator=g)},
        classes=torch.randint(0, 3, (B, L), generator=g), class_names=("R", "E", "T"),
        prompt_columns=prompt, segment=segment,
    )


@pytest.mark.parametrize("kind, name", params("evictor"))
def test_evictor_keeps_live_tokens_and_every_protected_one(kind, name):
    evictor = default(kind, name)
    ctx = _eviction_context()
    keep = evictor.select(ctx)
    assert keep.shape == ctx.valid.shape and keep.dtype == torch.bool
    assert not bool((keep & ~ctx.valid).any()), "kept an empty slot"
    assert bool(keep[ctx.protected & ctx.valid].all()), "evicted a protected token"
    assert set(evictor.slot_channels) <= set(ctx.state) | {"acc"}
    assert evictor.min_kept(4, 100, 4) >= 0


# --------------------------------------------------------------------- pagers
@pytest.mark.parametrize("kind, name", params("pager"))
def test_pager_leaves_exactly_the_kept_tokens(kind, name):
    pager = default(kind, name)
    store = LayerStore(2, 2, 4, torch.float32, torch.device("cpu"), block_size=4, group_size=4, residual=0,
                       codecs={"all": DenseCodec(torch.float32)}, refcounted=getattr(pager, "shares_blocks", False))
    g = torch.Generator().manual_seed(0)
    real = torch.ones(2, 19, dtype=torch.bool)
    real[1, :5] = False  # a left-padded row
    store.append(torch.randn(2, 2, 19, 4, generator=g), torch.randn(2, 2, 19, 4, generator=g), real)
    view = store.view()
    keep = view.valid & (torch.rand(view.valid.shape, generator=g) < 0.5)
    kept = [sorted(view.positions[b][keep[b]].tolist()) for b in range(2)]
    pager.compact(store, view, keep)
    after = store.view()
    assert [sorted(after.positions[b][after.valid[b]].tolist()) for b in range(2)] == kept


# -------------------------------------------------------------------- filters
@pytest.mark.parametrize("kind, name", params("filter"))
def test_filter_decides_nothing_without_earlier_steps(kind, name):
    flt = default(kind, name)
    assert flt.needs == "text" and isinstance(flt.delimiter, str) and flt.delimiter
    row = flt.new_row([1, 2, 3])
    step = Step(first=0, last=4, text=make_step([5, 6, 7, 8], "x = 1 + 2\n\n"), blocks=1)
    flt.prepare(step)
    assert flt.choose(row, step, [], lambda pairs: [0.0] * len(pairs)) == []


# ---------------------------------------------------------------- classifiers
@pytest.mark.parametrize("kind, name", params("classifier"))
def test_classifier_emits_thought_types(kind, name):
    clf = default(kind, name)
    assert clf.types and set(clf.types) <= set(THOUGHT_TYPES)
    assert clf.needs in (None, "sparsity", "text")
    assert clf.labels(torch.arange(len(clf.types))) == list(clf.types)


# ----------------------------------------------------------------- quantizers
@pytest.mark.parametrize("kind, name", params("quantizer"))
def test_quantizer_round_trips_shape_and_dtype(kind, name):
    q = default(kind, name)
    x = torch.randn(8, 2, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    y = q.dequantize(q.quantize(x, backend="torch"), backend="torch")
    assert y.shape == x.shape and y.dtype == x.dtype
    assert 0 < q.bits_per_value_for(x.shape[-1]) < 16 and isinstance(q.slot_local, bool)


@pytest.mark.parametrize("base", ["trigger", "pager"])
def test_a_base_class_without_its_decision_cannot_be_built(base):
    from kvcompose.pagers import Pager
    from kvcompose.triggers import Trigger

    with pytest.raises(TypeError, match="abstract"):
        {"trigger": Trigger, "pager": Pager}[base]()
