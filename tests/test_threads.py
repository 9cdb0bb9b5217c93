"""The CPU thread count: explicit choices win in their documented order; otherwise the usable
cores less the busy ones, at least one; every change is undone afterwards."""

import pytest
import torch

from kvcompose import threads


@pytest.fixture
def clean(monkeypatch):
    """No explicit choice in the environment, torch at a startup count of 8, a fresh automatic choice."""
    monkeypatch.delenv(threads.ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    previous = torch.get_num_threads()
    torch.set_num_threads(8)
    monkeypatch.setattr(threads, "_STARTUP_THREADS", 8)
    threads.automatic.cache_clear()
    yield monkeypatch
    threads.automatic.cache_clear()
    torch.set_num_threads(previous)


@pytest.mark.parametrize("cores, cpus, load, expected", [
    (2, 2, 0.1, 2),   # an idle machine: every usable core
    (2, 2, 1.0, 1),   # one busy neighbour on two cores: one thread
    (2, 2, 5.0, 1),   # overloaded: never below one
    (4, 64, 32.0, 2),  # four of 64 cores, the machine half busy: half of ours
    (16, 16, 0.0, 8),  # never more than torch's own default (physical cores)
])
def test_automatic_count_is_the_usable_cores_less_the_busy_ones(clean, cores, cpus, load, expected):
    clean.setattr(threads.os, "sched_getaffinity", lambda _: set(range(cores)), raising=False)
    clean.setattr(threads.os, "cpu_count", lambda: cpus)
    clean.setattr(threads.os, "getloadavg", lambda: (load, load, load))
    choice = threads.choose()
    assert choice.threads == expected
    assert f"{cores} usable cores" in choice.reason and str(choice).startswith(f"{expected} CPU thread")


def test_without_a_load_average_every_usable_core_is_used(clean):
    def no_load():
        raise OSError("no load average here")

    clean.setattr(threads.os, "sched_getaffinity", lambda _: {0, 1, 2}, raising=False)
    clean.setattr(threads.os, "getloadavg", no_load)
    assert threads.choose().threads == 3


def test_explicit_choices_win_in_order(clean):
    clean.setenv("OMP_NUM_THREADS", "1")
    assert threads.choose().reason == "OMP_NUM_THREADS=1"
    clean.setenv(threads.ENV, "3")
    assert threads.choose() == threads.ThreadChoice(3, "KVCOMPOSE_THREADS=3")
    assert threads.choose(2) == threads.ThreadChoice(2, "asked for")


def test_a_count_set_with_torch_is_respected(clean):
    start = torch.get_num_threads()
    torch.set_num_threads(start + 1)
    choice = threads.choose()
    assert choice == threads.ThreadChoice(start + 1, "set with torch.set_num_threads")


def test_the_automatic_choice_is_made_once_per_process(clean):
    loads = iter([0.0, 2.0])
    clean.setattr(threads.os, "sched_getaffinity", lambda _: {0, 1}, raising=False)
    clean.setattr(threads.os, "cpu_count", lambda: 2)
    clean.setattr(threads.os, "getloadavg", lambda: (next(loads),) * 3)
    assert threads.choose().threads == 2
    assert threads.choose().threads == 2  # its own load does not make a later call drop threads


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "x", "0"])
def test_bad_counts_name_the_value(clean, value):
    with pytest.raises(ValueError, match=r"threads=.*expected a positive integer"):
        threads.choose(value)


def test_fixed_restores_the_previous_count(clean):
    start = torch.get_num_threads()
    with threads.fixed(start + 1):
        assert torch.get_num_threads() == start + 1
    assert torch.get_num_threads() == start


def test_generate_runs_at_the_chosen_count_and_restores_it(clean, llama):
    from conftest import char_tokenizer
    from kvcompose import Policy

    seen = []

    class Spy:
        def __call__(self, input_ids, scores):
            seen.append(torch.get_num_threads())
            return scores

    start = torch.get_num_threads()
    Policy.from_preset("fullkv").generate(llama, char_tokenizer(), ["hi"], max_new_tokens=2, threads=start + 1,
                                          logits_processor=[Spy()])
    assert seen and set(seen) == {start + 1}
    assert torch.get_num_threads() == start


def test_the_cli_prints_its_choice(clean, capsys):
    from kvcompose.cli import main

    clean.setattr("kvcompose.models.load", _stop)
    with pytest.raises(_Stop):
        main(["generate", "--threads", "1", "--quiet", "hi"])
    assert "(on 1 CPU thread: asked for; change with --threads or KVCOMPOSE_THREADS)" in capsys.readouterr().err


class _Stop(Exception):
    pass


def _stop(*args, **kwargs):
    raise _Stop
