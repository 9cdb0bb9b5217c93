"""Every code block of README.md and docs/ runs, or is checked against the code it names.

- ``python`` blocks run in order, one namespace per page (a reader types them one after
  another), in a scratch working directory.
- ``bash`` blocks: each ``kvcompose ...`` line must parse with the CLI's own parser
  (``kvcompose presets`` runs); ``make`` targets, ``pip install -e`` extras, ``pytest``
  markers and the scripts run by ``python``/``pytest`` must exist.
- ``json`` and ``toml`` blocks must parse; ``text`` blocks are program output, not code.

The pages run in one child process, as a reader runs them: without ``TRITON_INTERPRET``
(which the suite sets, and under which every quantizer call would crawl through Triton's
interpreter), one torch thread, the embedded model loaded once (a page that loads it
itself loads it for real, from the GGUF file parsed once: ``conftest.share_gguf_parses``).

A block changes only through a directive written just above it in the page, one per
HTML comment (invisible in the rendered page, visible in its source):

- ``<!-- snippet: model -->``: the embedded model is loaded for it; names the page has
  not defined yet are given: ``model``, ``tokenizer``, ``prompts`` (two short questions),
  ``inputs`` (their chat-templated encoding) and ``policy`` (``streamingllm``, budget 64).
- ``<!-- snippet: reuse-model -->``: ``kvcompose.models.load_default()`` returns the copy
  of the embedded model this run already loaded, instead of loading it again.
- ``<!-- snippet: max_new_tokens=N -->``: every ``max_new_tokens=``/``min_new_tokens=``
  number in the block becomes at most N (the block must have one).
- ``<!-- snippet: replace OLD => NEW -->``: a text substitution (OLD must be in the block).
- ``<!-- snippet: setup CODE -->``: CODE runs first, in the page's namespace.
- ``<!-- snippet: check EXPR -->``: EXPR must be true after the block ran.
- ``<!-- snippet: signature MODULE -->``: the block lists signatures ``name(params) -> ...``;
  each name must be importable from MODULE (or one of its submodules) and take the listed
  parameters in that order, with a default exactly where the page shows one.
- ``<!-- snippet: equals EXPR -->`` (json): the block equals the value of EXPR.

Pages whose source this test cannot annotate yet get the same directives from
``DIRECTIVES`` below, keyed by the page and a piece of the block's text.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import os
import pkgutil
import re
import shlex
import subprocess
import sys
import tomllib
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))

# Directives for blocks of pages not yet annotated in their source: {page: [(text in the block, directive)]}.
DIRECTIVES: dict[str, list[tuple[str, str]]] = {
    "docs/api/eval.md": [
        ("compare_presets(", "reuse-model"),
        ("compare_presets(", "replace load_prompts(limit=3) => load_prompts(limit=1)"),
        ("compare_presets(", "replace budgets=[128, 256] => budgets=[16]"),
        ("compare_presets(", "max_new_tokens=6"),
    ],
    "docs/api/ops.md": [("->", "signature kvcompose.ops")],
    "docs/presets/fp8.md": [("policy.generate(", "model"), ("policy.generate(", "max_new_tokens=6")],
    "docs/presets/fullkv.md": [("policy.generate(", "model"), ("policy.generate(", "max_new_tokens=6")],
    "docs/presets/h2o.md": [("policy.generate(", "model"), ("policy.generate(", "max_new_tokens=6")],
    "docs/presets/kivi.md": [
        ("policy.generate(", "model"),
        ("policy.generate(", "max_new_tokens=6"),
        ('"layout": "per_token", "group_size": 32', "setup from kvcompose import Policy"),
    ],
    "docs/presets/nvfp4.md": [("policy.generate(", "model"), ("policy.generate(", "max_new_tokens=6")],
    "docs/presets/rkv.md": [("policy.generate(", "model"), ("policy.generate(", "max_new_tokens=6")],
    "docs/presets/rpc.md": [("policy.generate(", "model"), ("policy.generate(", "max_new_tokens=6")],
    "docs/presets/snapkv.md": [("policy.generate(", "model"), ("policy.generate(", "max_new_tokens=6")],
    "docs/presets/streamingllm.md": [("policy.generate(", "model"), ("policy.generate(", "max_new_tokens=6")],
    "docs/presets/thinkv.md": [
        ("policy.generate(", "model"),
        ("policy.generate(", "max_new_tokens=6"),
        ("calib.json", "replace \"calibration\": \"calib.json\" => \"calibration\": "
                       "str(kvcompose.calibration.default_calibration_path())"),
        ("calib.json", "setup import kvcompose.calibration"),
    ],
    "docs/presets/reasoncache.md": [
        ("policy.generate(", "model"),
        ("policy.generate(", "max_new_tokens=6"),
        ("token_streamer", "max_new_tokens=6"),
        ("for _ in range(steps)", "setup import torch; input_ids, attention_mask, steps = "
                                  "inputs['input_ids'], inputs['attention_mask'], 4"),
    ],
}

MODEL_WORDS = ("load_default(", "models.load(", "policy.generate(", "model.generate(")


@dataclass
class Block:
    page: str        # path relative to the repository root
    line: int        # 1-based line of the opening fence
    lang: str
    code: str
    directives: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    """The fenced code blocks of a page, with the ``snippet`` directives written above each."""
    page = str(path.relative_to(ROOT))
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = re.match(r"^(\s*)```(\w+)", lines[i])
        if not opening:
            i += 1
            continue
        indent, lang = len(opening.group(1)), opening.group(2)
        end = i + 1
        while not re.match(r"^\s*```\s*$", lines[end]):
            end += 1
        code = "\n".join(line[indent:] for line in lines[i + 1:end])
        directives, above = [], i - 1
        while above >= 0 and (m := re.match(r"^\s*<!--\s*snippet:\s*(.*?)\s*-->\s*$", lines[above])):
            directives.insert(0, m.group(1))
            above -= 1
        found.append(Block(page, i + 1, lang, code, directives))
        i = end + 1
    for text, directive in DIRECTIVES.get(page, []):
        matching = [b for b in found if text in b.code]
        assert matching, f"{page}: no code block contains {text!r} (directive {directive!r} is stale)"
        for block in matching:
            block.directives.append(directive)
    return found


def _needs_model(blocks: list[Block]) -> bool:
    return any(
        b.lang == "python" and ("model" in b.directives or "reuse-model" in b.directives
                                or any(word in b.code for word in MODEL_WORDS))
        for b in blocks
    )


def _pages(with_model: bool) -> list[str]:
    pages = []
    for path in PAGES:
        blocks = blocks_of(path)
        if any(b.lang in ("python", "bash", "json", "toml") for b in blocks) and _needs_model(blocks) == with_model:
            pages.append(str(path.relative_to(ROOT)))
    return pages


# --- the embedded model, loaded once ------------------------------------------------------------

_loaded = {}


def _embedded():
    if "model" not in _loaded:
        from kvcompose import models

        _loaded["model"] = models.load_default()
    return _loaded["model"]


def _model_context() -> dict:
    from kvcompose import Policy
    from kvcompose.hf import encode_prompts

    model, tokenizer = _embedded()
    prompts = ["What is 2 + 3?", "Name a prime number."]
    return {"model": model, "tokenizer": tokenizer, "prompts": prompts,
            "inputs": encode_prompts(tokenizer, prompts), "policy": Policy.from_preset("streamingllm", budget=64)}


@contextlib.contextmanager
def _reused_model():
    from kvcompose import models

    real = models.load_default
    _embedded()   # loaded before the patch, by the real loader

    def load_default(**kwargs):
        return _embedded() if not kwargs else real(**kwargs)

    models.load_default = load_default
    try:
        yield
    finally:
        models.load_default = real


# --- python -------------------------------------------------------------------------------------

def _rewrite(block: Block) -> tuple[str, list[str], list[str], list[str], list[str]]:
    """The code to run, and the setup code, checks, signature modules and json targets."""
    code, setup, checks, signatures, equals = block.code, [], [], [], []
    for directive in block.directives:
        word, _, rest = directive.partition(" ")
        if directive in ("model", "reuse-model"):
            continue
        if word.startswith("max_new_tokens="):
            most = int(word.split("=")[1])
            counts = r"\b(max_new_tokens|min_new_tokens)=(\d+)"
            assert re.search(counts, code), f"{block.where}: max_new_tokens directive, but no count in the block"
            code = re.sub(counts, lambda m: f"{m.group(1)}={min(int(m.group(2)), most)}", code)
        elif word == "replace":
            old, new = (part.strip() for part in rest.split("=>", 1))
            assert old in code, f"{block.where}: replace directive, but {old!r} is not in the block"
            code = code.replace(old, new)
        elif word == "setup":
            setup.append(rest)
        elif word == "check":
            checks.append(rest)
        elif word == "signature":
            signatures.append(rest)
        elif word == "equals":
            equals.append(rest)
        else:
            raise AssertionError(f"{block.where}: unknown snippet directive {directive!r}")
    return code, setup, checks, signatures, equals


def _find(module_name: str, name: str):
    module = importlib.import_module(module_name)
    for info in [None, *pkgutil.walk_packages(module.__path__, module_name + ".")]:
        found = getattr(module if info is None else importlib.import_module(info.name), name, None)
        if inspect.ismodule(found):   # a submodule named after its function
            found = getattr(found, name, None)
        if callable(found):
            return found
    raise AssertionError(f"{name} is not in {module_name} or its submodules")


def _split_top(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    return parts + ([current.strip()] if current.strip() else [])


def _check_signatures(block: Block, module_name: str) -> None:
    text = re.sub(r"#.*", "", block.code)
    for m in re.finditer(r"^(\w+)\(", text, flags=re.M):
        depth, end = 0, m.end() - 1
        for end in range(m.end() - 1, len(text)):
            depth += text[end] == "("
            depth -= text[end] == ")"
            if depth == 0:
                break
        listed = [p for p in _split_top(text[m.end():end]) if p not in ("*", "/")]
        func = _find(module_name, m.group(1))
        if listed == ["..."]:
            continue
        real = inspect.signature(func).parameters
        names = [p.split("=")[0].strip().lstrip("*") for p in listed]
        order = [name for name in real if name in names]   # a page may leave trailing options out
        assert order == names, f"{block.where}: {m.group(1)}{tuple(names)} but the code takes {tuple(real)}"
        for p in listed:
            name = p.split("=")[0].strip().lstrip("*")
            has_default = real[name].default is not inspect.Parameter.empty
            assert ("=" in p) == has_default, f"{block.where}: {m.group(1)}: default of {name!r} differs from the code"


def _run_python(block: Block, namespace: dict) -> None:
    code, setup, checks, signatures, _ = _rewrite(block)
    if signatures:
        for module_name in signatures:
            _check_signatures(block, module_name)
        return
    if "model" in block.directives:
        for name, value in _model_context().items():
            namespace.setdefault(name, value)
    reuse = _reused_model() if "reuse-model" in block.directives else contextlib.nullcontext()
    with reuse, contextlib.redirect_stdout(io.StringIO()):
        for line in setup:
            exec(compile(line, f"{block.where} (setup)", "exec"), namespace)
        exec(compile(_for_installed_transformers(code), block.where, "exec"), namespace)
    for expr in checks:
        assert eval(expr, namespace), f"{block.where}: check failed: {expr}"


def _for_installed_transformers(code: str) -> str:
    """The docs pass ``cache=``; their compatibility note says releases before the rename call
    it ``past_key_values=``. On such a release, run the block the way that note tells a reader to."""
    from transformers import LlamaForCausalLM

    from kvcompose.hf.compat import _cache_name

    if _cache_name(LlamaForCausalLM) == "cache":
        return code
    return re.sub(r"(?<![\w.])cache=", "past_key_values=", code)


# --- bash, json, toml ---------------------------------------------------------------------------

def _commands(code: str) -> list[list[str]]:
    """The commands of a shell block: continuations joined, split at ``;``, ``|``, ``&&``,
    without ``VAR=value`` prefixes and redirections."""
    commands = []
    for line in re.sub(r"\\\n\s*", " ", code).splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split, lex.commenters = True, "#"
        argv, tokens = [], iter(lex)
        for token in tokens:
            if token in (";", "|", "&&", "||"):
                commands.append(argv)
                argv = []
            elif token.startswith((">", "&>")):
                next(tokens, None)
            elif argv or not re.match(r"^\w+=", token):
                argv.append(token)
        commands.append(argv)
    return [argv for argv in commands if argv]


def _makefile_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _check_command(block: Block, argv: list[str]) -> None:
    from kvcompose.cli import build_parser, main

    where = f"{block.where}: `{' '.join(argv)}`"
    if argv[0] == "kvcompose":
        try:
            build_parser().parse_args(argv[1:])
        except SystemExit as exc:
            raise AssertionError(f"{where} does not parse") from exc
        if argv[1:] == ["presets"]:
            with contextlib.redirect_stdout(io.StringIO()) as out:
                assert main(["presets"]) == 0, where
            assert "filters:" in out.getvalue(), where
    elif argv[0] == "make":
        assert set(argv[1:]) <= _makefile_targets(), f"{where}: no such Makefile target"
    elif argv[0] == "pip" and "-e" in argv:
        spec = argv[argv.index("-e") + 1]
        extras = re.search(r"\[(.*)\]", spec).group(1).split(",")
        known = _pyproject()["project"]["optional-dependencies"]
        assert set(extras) <= set(known), f"{where}: extras {extras} not in {sorted(known)}"
    elif argv[0] in ("python", "pytest"):
        args, runner = argv[1:], argv[0]
        if runner == "python":
            args = [a for a in args if a != "-u"]
            args, runner = (args[2:], "pytest") if args[:2] == ["-m", "pytest"] else (args[:1], "python")
        if runner == "pytest" and "-m" in args:
            expr = args[args.index("-m") + 1]
            markers = {m.split(":")[0] for m in _pyproject()["tool"]["pytest"]["ini_options"]["markers"]}
            named = set(re.findall(r"\w+", expr)) - {"not", "and", "or"}
            assert named <= markers, f"{where}: unknown markers {sorted(named - markers)}"
        for arg in args:
            if arg.endswith(".py") or arg.startswith("tests/"):
                assert (ROOT / arg).exists(), f"{where}: {arg} does not exist"
    # pip install of a named package, `.`, tail and grep are not checked.


def _check_data(block: Block, namespace: dict) -> None:
    if block.lang == "toml":
        tomllib.loads(block.code)
        return
    value = json.loads(block.code)
    for expr in _rewrite(block)[4]:
        assert value == eval(expr, namespace), f"{block.where}: the JSON differs from {expr}"


def run_page(path: Path, workdir: Path) -> None:
    """Run one page's blocks in order, in ``workdir``, in a namespace of its own."""
    from kvcompose import registry

    saved = {kind: dict(names) for kind, names in registry._REGISTRY.items()}
    page = types.ModuleType("__snippet__")   # a real module: dataclasses look their module up
    sys.modules[page.__name__] = page
    namespace, cwd = page.__dict__, os.getcwd()
    os.chdir(workdir)
    try:
        for block in blocks_of(path):
            if block.lang == "python":
                _run_python(block, namespace)
            elif block.lang == "bash":
                for argv in _commands(block.code):
                    _check_command(block, argv)
            elif block.lang in ("json", "toml"):
                _check_data(block, namespace)
    finally:
        os.chdir(cwd)
        del sys.modules[page.__name__]
        for kind, names in saved.items():   # components a page registers do not leak into the next
            registry._REGISTRY[kind].clear()
            registry._REGISTRY[kind].update(names)


def _main(out: str, pages: list[str]) -> None:
    import traceback

    import torch

    import kvcompose  # noqa: F401  (registers the kvcompose attention)
    from conftest import share_gguf_parses   # this file's folder is the child's sys.path[0]

    share_gguf_parses()   # the model loads (getting-started's from_pretrained among them) parse the file once
    torch.set_num_threads(1)
    results = {}
    for page in pages:
        workdir = Path(out).parent / re.sub(r"\W", "_", page)
        workdir.mkdir()
        try:
            run_page(ROOT / page, workdir)
            results[page] = "ok"
        except BaseException:   # noqa: BLE001  (reported by the test of this page)
            results[page] = traceback.format_exc()
    Path(out).write_text(json.dumps(results))


def _run_pages(pages: list[str], tmp_path: Path) -> None:
    """Run the pages in one child process and fail with every failing page's traceback."""
    import kvcompose

    out = tmp_path / "results.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = str(Path(kvcompose.__file__).resolve().parents[1])
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, __file__, str(out), *pages], env=env, capture_output=True,
                         text=True, timeout=1800)
    assert run.returncode == 0 and out.exists(), run.stderr[-4000:]
    results = json.loads(out.read_text())
    assert sorted(results) == sorted(pages)
    failed = {page: result for page, result in results.items() if result != "ok"}
    assert not failed, "\n\n".join(f"{page}:\n{result}" for page, result in failed.items())


def test_code_blocks_of_pages_without_the_model_run(tmp_path):
    _run_pages(_pages(with_model=False), tmp_path)


@pytest.mark.model
@pytest.mark.slow
def test_code_blocks_of_pages_with_the_model_run(tmp_path):
    _run_pages(_pages(with_model=True), tmp_path)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2:])
