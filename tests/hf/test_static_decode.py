"""Static-shape decoding (kvcompose.hf.static, kvcompose.runtime.schedule): the same tokens, evictions and memory as the eager path."""

import pytest
import torch

from conftest import SHORT_RUN_EVICTION, char_tokenizer, greedy, left_padded
from sync_guard import HostSyncError, forced_step_kernels, no_host_sync
from kvcompose import Policy
from kvcompose.hf.static import STEP_RANGE, fast_generate
from kvcompose.runtime.schedule import Schedule, StepPlan, static_capacity

# Small budgets and periods so that every trigger fires within a short run.
POLICIES = {
    "fullkv": {},
    **SHORT_RUN_EVICTION,
    "fp8": {},
    "nvfp4": {},
    "kivi2": {"residual": 8},  # buffer of 40: groups of 32 leave it within the run
    "thinkv": {"budget": 48, "refresh": 16},
    "thinkv-tbe": {"budget": 48, "refresh": 16},
}
NEW_TOKENS = 40  # enough for every trigger above to fire, and for thinkv's refreshes and step-downs
QUICK = {"fp8", "nvfp4", "kivi2"}  # formats without eviction: a few buffer flushes suffice (interpreted kernels are slow)


def _run_both(model, policy, ids, mask, new):
    eager = policy.make_cache(model)
    expected = greedy(model, ids, mask, new, cache=eager)
    static = policy.make_cache(model)
    got = fast_generate(model, static, ids, mask, new)[:, ids.shape[1]:]
    return expected, got, eager, static


def _payload(cache):
    return sum(layer.store.memory()["payload"] for layer in cache.layers)


@pytest.mark.parametrize("preset", sorted(POLICIES))
def test_static_path_gives_the_eager_tokens_evictions_and_memory(llama, preset):
    policy = Policy.from_preset(preset, **POLICIES[preset])
    _, ids, mask = left_padded([20, 13, 31])  # rows of different lengths: buffers fill on different steps
    new = 24 if preset in QUICK else NEW_TOKENS
    expected, got, eager, static = _run_both(llama, policy, ids, mask, new)
    assert torch.equal(expected, got)
    for e, st in zip(eager.layers, static.layers):  # the static ring, read oldest first, is the eager window
        for x, y in zip(e.recent_queries(), st.recent_queries()):
            assert (x is None and y is None) or torch.equal(x, y)
    a, b = eager.report(), static.report()
    assert a.evictions == b.evictions
    assert a.eviction_call_rate == b.eviction_call_rate
    assert a.refreshes == b.refreshes and a.thought_mix == b.thought_mix  # refreshes inside the steps
    if policy.evicts_in_place:  # no compaction: evicted slots stay allocated as holes until refilled
        pool = static.layers[0].store.regions[0].pool
        holes = len(static.layers) * ids.shape[0] * 2 * pool.payload_bytes_per_block
        assert _payload(eager) <= _payload(static) <= _payload(eager) + holes
    else:
        assert _payload(eager) == _payload(static)
    for x, y in zip(eager.layers, static.layers):  # the same tokens kept, at the same positions, stored alike
        vx, vy = x.store.view(), y.store.view()
        for r in range(ids.shape[0]):
            (px, kx, ux), (py, ky, uy) = _by_position(vx, r), _by_position(vy, r)
            assert torch.equal(px, py)
            torch.testing.assert_close(ky, kx, rtol=0, atol=1e-6)  # decoded: the same codes and scales
            torch.testing.assert_close(uy, ux, rtol=0, atol=1e-6)
    assert static.static_decoder.eager_steps <= new - 1


def _by_position(view, row: int):
    """Positions, keys and values ``[H, n, D]`` of a row's live tokens, in position order."""
    live = view.valid[row]
    order = view.positions[row].masked_fill(~live, torch.iinfo(view.positions.dtype).max).argsort()[: int(live.sum())]
    return view.positions[row][order], view.keys[row][:, order], view.values[row][:, order]


def test_schedule_predicts_exactly_the_steps_whose_trigger_fires(llama):
    policy = Policy.from_preset("rkv", budget=32, trigger={"buffer": 8})
    _, ids, mask = left_padded([20, 13, 31])
    eager = policy.make_cache(llama)
    greedy(llama, ids, mask, NEW_TOKENS, cache=eager)
    static = policy.make_cache(llama)
    fast_generate(llama, static, ids, mask, NEW_TOKENS)
    # Every scheduled eviction step of the static path is an eviction step of the eager path and
    # vice versa; R-KV's selection is graph-safe, so none of them runs eagerly.
    assert static.static_decoder.eviction_steps == eager.report().eviction_steps
    assert static.static_decoder.eager_steps == 0 and eager.report().eviction_steps > 1
    assert static.report().eviction_steps == eager.report().eviction_steps


def test_profiler_ranges_name_each_step_by_what_it_does(llama):
    policy = Policy.from_preset("rkv", budget=32, trigger={"buffer": 8})
    _, ids, mask = left_padded([20, 13, 31])
    cache = policy.make_cache(llama)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fast_generate(llama, cache, ids, mask, NEW_TOKENS)
    kinds = [e.name.removeprefix(STEP_RANGE) for e in prof.events() if e.name.startswith(STEP_RANGE)]
    decoder = cache.static_decoder
    assert len(kinds) == NEW_TOKENS - 1  # the prefill gave the first token
    assert sum(k.startswith("evict") for k in kinds) == decoder.eviction_steps > 0
    assert "plain" in kinds and any(k.endswith(" flush") for k in kinds)
    assert set(kinds) <= {"plain", "evict", "plain flush", "evict flush"}


@pytest.mark.parametrize("preset", ["thinkv", "h2o", "rkv"])
def test_static_step_keeps_every_state_tensor_in_place(llama, preset):
    """What a captured CUDA graph needs: a step writes into the tensors it read, never new ones."""
    policy = Policy.from_preset(preset, **POLICIES[preset])
    _, ids, mask = left_padded([20, 13, 31])
    cache = policy.make_cache(llama)
    fast_generate(llama, cache, ids, mask, 2)  # prefill + one step: static mode entered

    def tensors(c):
        out = {}
        for i, layer in enumerate(c.layers):
            s = layer.store
            named = {"buf_k": s.buf_k, "buf_len": s.buf_len, "tokens_seen": s.tokens_seen, "column": s.column,
                     "queries": layer.queries, **{f"meta.{n}": t for n, t in s.buf_meta.items()}}
            for j, r in enumerate(s.regions):
                named.update({f"r{j}.table": r.table, f"r{j}.length": r.length, f"r{j}.blocks": r.num_blocks})
            for name, p in s.pools.items():
                named.update({f"{name}.{n}": t for n, t in {**p.slots, **p.meta}.items()})
            out.update({(i, n): t.data_ptr() for n, t in named.items() if t is not None})
        return out

    before = tensors(cache)
    decoder = cache.static_decoder
    schedule = Schedule(cache, 40)
    token = torch.zeros(ids.shape[0], dtype=torch.long)
    with torch.inference_mode():
        for _ in range(40):  # flushes, refreshes and segment evictions included
            decoder.begin_step()
            decoder.step(token, schedule.next())
            schedule.sync()
    cache.step_plan = None
    assert tensors(cache) == before


def test_sync_guard_refuses_host_reads():
    t = torch.arange(4)
    with no_host_sync():
        for read in (lambda: bool(t.sum()), lambda: t[t > 1], lambda: t.sum().item(), lambda: t.tolist(),
                     lambda: torch.tensor([1, 2]), lambda: t.cpu(), lambda: t.numpy(), lambda: t.nonzero(),
                     lambda: torch.nonzero(t), lambda: torch.argwhere(t), lambda: t.unique(),
                     lambda: torch.unique(t), lambda: t.masked_select(t > 1), lambda: torch.where(t > 1)):
            with pytest.raises(HostSyncError):
                read()
        with pytest.raises(HostSyncError, match="Tensor.item reads a device value"):
            t.sum().item()
        with pytest.raises(HostSyncError, match="torch.unique has a data-dependent output size"):
            torch.unique(t)
        t[t.clamp(max=2)] = t.flip(0)  # tensor values through tensor indices are fine
        assert torch.equal(torch.where(t > 1, t, 0), t.where(t > 1, 0))  # both values given: fixed size
    assert "cpu" not in vars(torch.Tensor) and torch.unique is torch.functional.unique  # restored as they were
    assert torch.where(torch.arange(4) > 1)[0].tolist() == [2, 3] and torch.arange(3).cpu().numpy().sum() == 3  # restored


def guard_replayed_steps(monkeypatch) -> None:
    """Run every step that the GPU would replay from a graph (not the eager ones) under
    :func:`no_host_sync`."""
    from kvcompose.hf import static

    forward = static.StaticDecoder._forward

    def guarded(self):
        if self.cache.step_plan.eager:
            return forward(self)
        with no_host_sync():
            return forward(self)

    monkeypatch.setattr(static.StaticDecoder, "_forward", guarded)


def head_dim_64_llama(device: str = "cpu"):
    """A 2-layer random Llama with head dim 64, where the compiled kernels take every format."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).to(device).eval()
    model.set_attn_implementation("kvcompose")
    return model


@pytest.mark.parametrize("preset", sorted(POLICIES))
def test_steps_between_eager_ones_never_read_the_device(llama, preset, monkeypatch):
    """What CUDA graph capture needs, checked on CPU: no host synchronization in the steps that
    the GPU replays (every preset; eager steps may synchronize, and no built-in preset has any:
    evictions and classifier refreshes are scheduled inside the steps)."""
    guard_replayed_steps(monkeypatch)
    policy = Policy.from_preset(preset, **POLICIES[preset])
    _, ids, mask = left_padded([20, 13, 31])
    cache = policy.make_cache(llama)
    fast_generate(llama, cache, ids, mask, 24)
    decoder = cache.static_decoder
    assert decoder.eager_steps == 0
    if preset.startswith("thinkv"):  # refresh = 16: one refresh (and segment-end eviction) in 23 steps
        assert decoder.eviction_steps + decoder.refresh_steps == 1


def test_capacity_follows_the_trigger():
    assert static_capacity(Policy.from_preset("fullkv"), 100, 50) == 150
    assert static_capacity(Policy.from_preset("rkv", budget=64), 100, 500) == 100 + 128 + 16
    assert static_capacity(Policy.from_preset("rkv", budget=64), 10, 20) == 30
    assert static_capacity(Policy.from_preset("rpc"), 10, 9000) == 9010  # no bound: the whole length
    # tbe keeps the prompt and at least 4 tokens of every completed segment: 31 + 12 x 4 = 79 > budget 40
    thinkv = Policy.from_preset("thinkv", budget=40, refresh=8, block_size=4, group_size=4)
    assert static_capacity(thinkv, 31, 100) == 79 + 8 + 4


def test_a_prompt_cut_at_the_prefill_reserves_the_budget_not_the_prompt(llama):
    """R-KV evicts a long prompt down to its budget at the end of the prefill: static decode
    then reserves room for the budget and the trigger's headroom, and decodes the eager tokens."""
    policy = Policy.from_preset("rkv", budget=32, trigger={"buffer": 8})
    _, ids, mask = left_padded([100, 70, 90])
    expected, got, eager, static = _run_both(llama, policy, ids, mask, 30)
    assert torch.equal(expected, got)
    store = static.layers[0].store
    reserved = max(r.table.shape[1] * r.pool.block_size for r in store.regions)
    assert reserved < ids.shape[1] < static_capacity(policy, ids.shape[1], 30)  # the prompt's reservation


def test_static_path_refuses_what_it_cannot_run(llama):
    policy = Policy.from_preset("fullkv")
    _, ids, mask = left_padded([5, 7])
    with pytest.raises(ValueError, match="fused_attention=False"):
        fast_generate(llama, policy.make_cache(llama, fused_attention=False), ids, mask, 4)
    cache = policy.make_cache(llama)
    cache.observers.append(lambda *a: None)
    with pytest.raises(ValueError, match="observers"):
        fast_generate(llama, cache, ids, mask, 4)
    with pytest.raises(ValueError, match="graphs=True needs"):
        fast_generate(llama, policy.make_cache(llama), ids, mask, 4, graphs=True)
    used = policy.make_cache(llama)
    fast_generate(llama, used, ids, mask, 3)
    with pytest.raises(ValueError, match="fresh cache"):
        fast_generate(llama, used, ids, mask, 3)


def test_policy_generate_fast_matches_eager_and_refuses_sampling(llama):
    tok = char_tokenizer()
    policy = Policy.from_preset("snapkv", budget=32, trigger={"buffer": 8})
    a = policy.generate(llama, tok, ["abc", "hello world"], max_new_tokens=24, fast=False, do_sample=False)
    b = policy.generate(llama, tok, ["abc", "hello world"], max_new_tokens=24, fast=True)
    assert a.sequences == b.sequences
    assert a.report.evictions == b.report.evictions
    with pytest.raises(ValueError, match="fast=False"):
        policy.generate(llama, tok, ["abc"], max_new_tokens=4, fast=True, do_sample=True)


CALIBRATED = {"classifier": {"name": "sparsity_kde", "thresholds": [0.5, 0.8], "layers": [0, 1]}}


@pytest.mark.parametrize("preset,overrides", [("h2o", {}), ("kivi2", {}), ("rkv", {}), ("thinkv", {}),
                                              ("thinkv", CALIBRATED)],
                         ids=["h2o", "kivi2", "rkv", "thinkv", "thinkv-calibrated"])
def test_kernel_launching_code_of_the_replayed_steps_never_reads_the_device(preset, overrides, monkeypatch):
    """The host code around the per-step kernels (on CPU it only runs with the kernels forced
    into the interpreter) is what a CUDA graph captures too: it must not copy host data or
    synchronize. The tokens match the references' run. ThinKV with calibrated layers also
    measures their sparsity in its (captured) refresh steps."""
    model = head_dim_64_llama()
    policy = Policy.from_preset(preset, **{**POLICIES[preset], **overrides})
    _, ids, mask = left_padded([20, 13, 31])
    expected = fast_generate(model, policy.make_cache(model), ids, mask, 20)
    guard_replayed_steps(monkeypatch)
    picked = forced_step_kernels(monkeypatch)
    cache = policy.make_cache(model)
    assert torch.equal(fast_generate(model, cache, ids, mask, 20), expected)
    assert cache.static_decoder.eager_steps == 0  # every step was guarded
    assert {"_append_token_kernel", "_paged_partial_kernel"} <= picked
    if overrides:
        assert cache.static_decoder.refresh_steps + cache.static_decoder.eviction_steps > 0


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["fullkv", "nvfp4", "rkv", "thinkv", "streamingllm", "h2o"])
def test_graph_replay_gives_the_eager_static_tokens(preset):
    model = head_dim_64_llama("cuda")
    policy = Policy.from_preset(preset, **POLICIES[preset])
    _, ids, mask = left_padded([20, 13, 31])
    ids, mask = ids.cuda(), mask.cuda()
    plain = fast_generate(model, policy.make_cache(model), ids, mask, 60, graphs=False)
    cache = policy.make_cache(model)
    graphed = fast_generate(model, cache, ids, mask, 60, graphs=True)
    assert torch.equal(plain, graphed)
    assert cache.static_decoder.replays > 0


@pytest.mark.gpu
def test_cuda_host_time_leaves_out_the_graph_capture(monkeypatch):
    """The capture is one-time work: a slow one must not show in the host's time per step."""
    import time

    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcompose.hf import static

    config = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).cuda().eval()
    model.set_attn_implementation("kvcompose")
    capture = static.StaticDecoder._capture
    monkeypatch.setattr(static.StaticDecoder, "_capture", lambda self: time.sleep(0.5) or capture(self))
    _, ids, mask = left_padded([9, 14])
    cache = Policy.from_preset("fullkv").make_cache(model)
    fast_generate(model, cache, ids.cuda(), mask.cuda(), 24, profile=True)
    summary = cache.static_decoder.summary()
    replays = summary["replays"]  # 23 steps less warm-ups, captures and the buffer flushes' own graph
    assert replays >= 10
    assert summary["host_ms_per_replay"] < 250 / replays  # half of what the capture's 500 ms would add
    captures = summary["steps_by_kind"]["capture"]
    assert summary["capture_host_s"] >= 0.5 * captures  # the sleeps, where the GPU events do not see them
    assert {"warm-up plain", "capture plain"} <= set(summary["one_time_ms_by_step"])
    assert sum(summary["one_time_ms_by_step"].values()) == pytest.approx(
        summary["ms_by_kind"]["warm-up"] + summary["ms_by_kind"]["capture"])


def test_speed_times_the_steps_it_says_and_evicts_exactly_past_the_budget(llama):
    from kvcompose import speed

    ids, mask = speed.random_prompts(96, 2, 12, "cpu")
    policy = Policy.from_preset("rkv", budget=32, trigger={"buffer": 8})
    short = speed.time_policy(llama, policy, ids, mask, 6)  # 12 + 6 tokens: under the budget all along
    long = speed.time_policy(llama, policy, ids, mask, 40)  # 12 + 40 tokens: past budget + buffer
    eager = policy.make_cache(llama)
    greedy(llama, ids, mask, 40, cache=eager)
    for row, new in ((short, 6), (long, 40)):
        assert row["new_tokens"] == new and row["timed_steps"] == new - 1
        assert row["ms_per_step"] == pytest.approx(1e3 * row["decode_s"] / (new - 1))
        assert row["eviction_call_rate"] == row["eviction_steps"] / (new - 1)
        assert row["eager_steps"] == 0  # R-KV's eviction is graph-safe: none runs outside the schedule
        assert row["fused"] is False  # on CPU the decoder layers run uncompiled
    assert short["eviction_steps"] == 0 and short["kv_live_bytes_at_end"] > short["kv_live_bytes_after_prefill"]
    assert long["eviction_steps"] == eager.report().eviction_steps > 0
    prefilled = policy.make_cache(llama)
    fast_generate(llama, prefilled, ids, mask, 1)
    assert long["kv_live_bytes_after_prefill"] == prefilled.report().held_bytes["in_use"]
    assert long["kv_live_bytes_at_end"] < speed.time_policy(llama, Policy.from_preset("fullkv"), ids, mask, 40)[
        "kv_live_bytes_at_end"]  # evicted: fewer bytes held at the end than a full cache of the same tokens
    assert long["kv_bytes_read_per_step"] == (long["kv_live_bytes_after_prefill"] + long["kv_live_bytes_at_end"]) / 2

    base = speed.time_transformers_static(llama, ids, mask, 6)
    text = llama.config
    per_token = 2 * text.num_hidden_layers * text.num_key_value_heads * (text.hidden_size // text.num_attention_heads) * 4
    assert base["cache_len"] == 18 and base["timed_steps"] == 5
    assert base["kv_bytes_read_per_step"] == 2 * 18 * per_token  # the whole reserved cache, every step
    assert base["weight_bytes_per_step"] == short["weight_bytes_per_step"] == speed.weight_bytes_per_step(llama, 2)
    assert llama.config._attn_implementation == "kvcompose"  # both restore the attention implementation


def test_fixed_memory_runs_back_off_from_out_of_memory_and_the_cap():
    from kvcompose.speed import largest_batch, run_backing_off

    assert largest_batch(10, 3, 100) == 30 and largest_batch(200, 3, 100) == 1 and largest_batch(0, 1, 1e9) == 1024
    assert largest_batch(10, 0, 100, limit=64) == 64
    tried = []

    def run_at(batch):
        tried.append(batch)
        if batch > 150:
            raise torch.OutOfMemoryError("no room")
        return {"batch": batch, "peak_gib": batch / 2}  # over a 70 GiB cap above 140 rows

    row = run_backing_off(run_at, 200, cap_gib=70.0, retries=4)
    assert tried == [200, 180, 162, 145, 130] and row["batch"] == 130
    assert row["over_cap_at"] == [200, 180, 162, 145] and not row["over_cap"]
    with pytest.raises(torch.OutOfMemoryError):
        run_backing_off(run_at, 200, cap_gib=70.0, retries=2)
    assert run_backing_off(run_at, 100, cap_gib=70.0, retries=2) == {
        "batch": 100, "peak_gib": 50.0, "over_cap": False, "over_cap_at": []}
    tried.clear()
    row = run_backing_off(run_at, 145, cap_gib=70.0, retries=0)  # no retry left: kept, and flagged
    assert tried == [145] and row["over_cap"] and row["over_cap_at"] == []
    tried.clear()
    row = run_backing_off(lambda b: tried.append(b) or {"batch": b, "peak_gib": 99.0}, 2, 70.0, 5)
    assert tried == [2, 1] and row["over_cap"]  # never below one row

    # Knowing the memory that does not grow with the batch, a peak over the cap gives the batch
    # that fits at once: 16 GiB fixed and 0.132 GiB per row measured at 518 rows -> 400 rows (2% under).
    tried.clear()
    row = run_backing_off(lambda b: tried.append(b) or {"batch": b, "peak_gib": 16 + 0.132 * b}, 518, 70.0, 4,
                          fixed_gib=16.0)
    assert tried == [518, 400] and row["peak_gib"] <= 70.0 and row["over_cap_at"] == [518]
    tried.clear()  # a peak barely over the cap: 2% fewer rows
    row = run_backing_off(lambda b: tried.append(b) or {"batch": b, "peak_gib": 70.01 if b == 100 else 69.0}, 100,
                          70.0, 4, fixed_gib=16.0)
    assert tried == [100, 97]
    with pytest.raises(ValueError, match="fixed_gib=17179869184"):  # bytes where GiB are meant
        run_backing_off(lambda b: {"batch": b, "peak_gib": 1.0}, 8, 70.0, 4, fixed_gib=17179869184)


@pytest.mark.gpu
def test_cuda_fixed_memory_finds_a_batch_under_the_cap():
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcompose import speed

    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="kvcompose")
    model = LlamaForCausalLM(config).cuda().to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    cap = (torch.cuda.memory_allocated() + 512 * 2**20) / 2**30  # 512 MiB beyond the weights
    row = speed.fit_policy(model, Policy.from_preset("rkv", budget=64), 32, 256, cap, window=40)
    assert row["batch"] > 4 and row["reserved_new_tokens"] == 256 and not row["over_cap"]
    base = speed.fit_transformers_static(model, 32, 256, cap, window=8, headroom_gib=0.1)
    assert base["batch"] > 4 and base["cache_len"] == 288 and not base["over_cap"]
    with pytest.raises(ValueError, match="window=300"):
        speed.fit_policy(model, Policy.from_preset("rkv", budget=64), 32, 256, cap, window=300)


def test_warm_up_policy_reaches_every_step_kind_quickly():
    from kvcompose.speed import warm_up_policy

    rkv = warm_up_policy(Policy.from_preset("rkv"))
    assert (rkv.budget, rkv.trigger.buffer, rkv.evictor.name) == (64, 16, "rkv")
    rpc = warm_up_policy(Policy.from_preset("rpc"))
    assert rpc.trigger.period == 32 and rpc.recent_tokens <= 8
    assert warm_up_policy(Policy.from_preset("thinkv")).refresh == 16


def test_bench_command_names_an_unknown_preset_before_loading(capsys):
    from kvcompose.cli import main

    assert main(["bench", "--presets", "fullkv,nope"]) == 2
    assert "nope" in capsys.readouterr().err


@pytest.mark.parametrize("pager", ["gather", "ct"])
def test_static_compaction_keeps_the_eager_tokens_without_reading_the_device(pager):
    """Both pagers in static mode: the same kept tokens (positions, keys, values, classes) as the
    eager pager after the same eviction, with fixed shapes and no host synchronization."""
    from kvcompose.pagers import ContinuousThinkingPager, GatherPager
    from kvcompose.paging import DenseCodec, LayerStore

    def filled():
        codecs = {"R": DenseCodec(torch.float32), "T": DenseCodec(torch.float32)}
        store = LayerStore(3, 2, 8, torch.float32, torch.device("cpu"), block_size=4, group_size=4, codecs=codecs)
        g = torch.Generator().manual_seed(0)
        k, v = torch.randn(3, 2, 30, 8, generator=g), torch.randn(3, 2, 30, 8, generator=g)
        real = torch.ones(3, 30, dtype=torch.bool)
        real[1, :9] = False  # a left-padded row
        store.append(k, v, real, torch.randint(0, 2, (3, 30), generator=g))
        return store

    make = (lambda: GatherPager()) if pager == "gather" else (lambda: ContinuousThinkingPager(max_hole_blocks=None))
    eager, static = filled(), filled()
    static.fix_capacity(48)

    def keep_for(view):  # drop every position divisible by 3 (same rule on both layouts)
        return view.valid & (view.positions % 3 != 0)

    make().compact(eager, eager.view(), keep_for(eager.view()))
    view = static.view()
    keep = keep_for(view)
    with no_host_sync():
        make().compact(static, view, keep)

    def kept(store):
        v = store.view()
        out = []
        for r in range(3):
            live = v.valid[r]
            order = torch.argsort(v.positions[r][live])
            out.append((v.positions[r][live][order], v.keys[r][:, live][:, order], v.values[r][:, live][:, order],
                        v.classes[r][live][order]))
        return out

    for a, b in zip(kept(eager), kept(static)):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    report = [s.live_tokens().tolist() for s in (eager, static)]
    assert report[0] == report[1] and int(static.evictions_on_device) == 1


@pytest.mark.slow
def test_thinkv_static_path_matches_eager_after_the_ct_pager_moves_tokens(llama):
    """Long enough for the eager ct pager to move tokens into holes (static mode never moves
    them): ThinKV's selection must not depend on which slots its tokens lie in."""
    policy = Policy.from_preset("thinkv-tbe", budget=48, refresh=16)
    _, ids, mask = left_padded([20, 13, 31])
    expected, got, _, _ = _run_both(llama, policy, ids, mask, 100)
    assert torch.equal(expected, got)  # failed while tbe fed K-means its segments in slot order


def test_static_capacity_covers_what_tbe_cannot_evict(llama):
    """A budget below what ThinKV's step-downs can reach (prompt + 4 tokens per completed
    segment) still decodes on the static path, with the eager tokens."""
    policy = Policy.from_preset("thinkv-tbe", budget=40, refresh=8, block_size=4, group_size=4)
    _, ids, mask = left_padded([20, 13, 31])
    expected, got, eager, static = _run_both(llama, policy, ids, mask, 60)
    static.check_errors()
    assert torch.equal(expected, got)
    assert int(eager.layers[0].store.live_tokens().max()) > 40  # the eager path keeps more than the budget too


def test_a_graph_variants_eager_first_run_is_filed_as_one_time_work():
    """The first run of an eviction or refresh graph is eager warm-up, not an eviction step's cost."""
    from kvcompose.hf.static import step_kind

    evict, refresh, plain = StepPlan(False, False, evict=True), StepPlan(False, False, refresh=True), StepPlan(True, False)
    assert [step_kind(p, False, False, True) for p in (evict, refresh, plain)] == ["warm-up"] * 3
    assert [step_kind(p, True, True, True) for p in (evict, refresh, plain)] == ["capture"] * 3
    assert [step_kind(p, True, False, True) for p in (evict, refresh, plain)] == ["evict", "refresh", "replay"]
    assert step_kind(StepPlan(False, True), False, False, True) == "eager"
    assert [step_kind(p, False, False, False) for p in (evict, refresh, plain)] == ["evict", "refresh", "plain"]


def test_one_time_work_is_named_by_graph_variant():
    from kvcompose.hf.static import _variant

    assert _variant(StepPlan(False, False)) == "plain"
    assert _variant(StepPlan(True, False, evict=True)) == "flush+evict"
    assert _variant(StepPlan(False, False, refresh=True)) == "refresh"


def test_decode_time_split_leaves_one_time_work_out_of_the_steady_rate():
    from kvcompose.speed import decode_time_split

    by_step = {"warm-up plain": 100.0, "warm-up evict": 200.0, "capture plain": 10.0, "capture evict": 20.0}
    summary = {"ms_by_kind": {"warm-up": 300.0, "capture": 30.0, "replay": 900.0, "evict": 60.0},
               "steps_by_kind": {"warm-up": 2, "capture": 2, "replay": 90, "evict": 2},
               "replays": 90, "host_ms_per_replay": 0.5, "one_time_ms_by_step": by_step, "capture_host_s": 0.2}
    split = decode_time_split(summary)
    assert split["one_time_s"] == pytest.approx(0.33) == sum(by_step.values()) / 1e3
    assert split["one_time_ms_by_step"] == by_step and split["capture_host_s"] == 0.2
    assert split["steady_ms_per_step"] == pytest.approx(960.0 / 92)
    assert split["replay_gpu_ms"] == pytest.approx(10.0)
    assert split["eviction_share"] == pytest.approx((60.0 - 2 * 10.0) / 960.0)
    assert split["evict_ms_per_step"] == pytest.approx(30.0) and split["host_share"] == pytest.approx(0.05)
    only_one_time = dict(summary, ms_by_kind={"warm-up": 5.0}, steps_by_kind={"warm-up": 1}, replays=0)
    assert decode_time_split(only_one_time)["steady_ms_per_step"] is None
