"""What every benchmark shares, so that its records can be trusted and compared.

- :mod:`harness.environment`: where a run ran (GPU, versions, git commit and dirty flag, read by the
  script itself);
- :mod:`harness.results`: ``benchmarks/results/<name>.json`` as an append-only history of runs;
- :mod:`harness.timing`: CUDA-event and wall-clock timers, CUDA-graph capture;
- :mod:`harness.table`: the short text table a run prints at its end;
- :mod:`harness.llama` and :mod:`harness.eviction`: the random Llama-3-8B-shaped model and the
  one-layer eviction state that several benchmarks time.

Scripts in ``benchmarks/`` import it as ``harness`` (their own folder is on ``sys.path``);
scripts in ``benchmarks/tools/`` put ``benchmarks/`` on the path first.
"""
