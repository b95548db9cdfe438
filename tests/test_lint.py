"""The code reads one way: ruff, with the project's configuration (pyproject.toml), finds nothing."""

import subprocess
import sys

import pytest

from colo_kit.paths import REPO_ROOT

KIT = sorted([*(REPO_ROOT / "colo_kit").rglob("*.py"), *(REPO_ROOT / "colo_kit_cli").rglob("*.py")])  # library, commands


def test_ruff_finds_nothing():
    pytest.importorskip("ruff", reason="ruff is in requirements/common.txt; this environment lacks it")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "colo_kit", "colo_kit_cli", "tests", "scripts", "record"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]


def _module_level_kit_imports(called_too: bool = False) -> dict[str, set[str]]:
    """Each module of colo_kit and colo_kit_cli -> the modules of the two that importing it imports: its top-level
    `import` and `from` statements (in `if`/`try` blocks too, not under `if TYPE_CHECKING:`), read with `ast`; imports
    inside functions run when called and are left out unless `called_too`. `import colo_kit.a.b` also
    imports `colo_kit.a`."""
    import ast

    files = {}
    for package in ("colo_kit", "colo_kit_cli"):
        for p in (REPO_ROOT / package).rglob("*.py"):
            parts = (package,) + p.relative_to(REPO_ROOT / package).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph = {}
    for mod, path in files.items():
        package = mod if path.stem == "__init__" else mod.rpartition(".")[0]
        named = set()

        def visit(body):
            for node in body:
                if isinstance(node, ast.Import):
                    named.update(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                        base = ".".join(up + ([node.module] if node.module else []))
                    named.add(base)
                    named.update(f"{base}.{a.name}" for a in node.names)
                elif isinstance(node, ast.If):
                    if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                        visit(node.body)
                    visit(node.orelse)
                elif isinstance(node, ast.Try):
                    for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                        visit(block)

        tree = ast.parse(path.read_text())
        visit(list(ast.walk(tree)) if called_too else tree.body)
        deps = set()
        for name in named:
            parts = name.split(".")
            deps.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in files)
        graph[mod] = deps - {mod}
    return graph


def _a_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def dfs(v):
        state[v] = "open"
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == "open":
                return stack[stack.index(w):] + [w]
            if w not in state and (found := dfs(w)):
                return found
        state[v] = "done"
        stack.pop()
        return None

    for v in sorted(graph):
        if v not in state and (found := dfs(v)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert _a_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _a_cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) is None


def test_no_kit_module_imports_itself_through_others():
    """No import circle among colo_kit's modules at import time: a shared piece lives in the module it belongs
    to, and the modules that need it import it from there."""
    graph = _module_level_kit_imports()
    assert len(graph) > 40 and "colo_kit.env" in graph["colo_kit"]  # the reader sees the kit's imports
    assert "colo_kit.paths" in graph["colo_kit_cli.notebooks"]
    cycle = _a_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


# Who may import whom: the plumbing every lesson shares, the lessons' subpackages (one per notebook), and on top
# the exercises, and last the command line (colo_kit_cli, and `python -m colo_kit` that calls it). A module imports
# its own layer or a lower one, never a higher one, so a lesson's code reads without the exercises or the command line
# above it: the library never imports its commands.
LAYERS = [
    {"colo_kit", "colo_kit.paths", "colo_kit.procs", "colo_kit.env", "colo_kit.gpu_free", "colo_kit.models",
     "colo_kit.data", "colo_kit.results"},
    {"grpo", "serving", "colocate", "parallel", "memory", "answers", "async_lora"},
    {"labs"},
    {"colo_kit_cli", "colo_kit.__main__"},
]


def _layer(module: str) -> int:
    top, _, rest = module.partition(".")
    subpackage = rest.partition(".")[0] if top == "colo_kit" else top  # colo_kit_cli's modules: one layer
    for i, members in enumerate(LAYERS):
        if module in members or subpackage in members:
            return i
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def test_no_module_imports_a_higher_layer_even_inside_a_function():
    graph = _module_level_kit_imports(called_too=True)
    assert "colo_kit.procs" in graph["colo_kit_cli.notebooks"]  # function-level imports are read too
    upward = sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps if _layer(b) > _layer(a))
    assert not upward, upward


def test_no_import_circle_even_through_imports_inside_functions():
    """What a function imports when called counts too: a circle there is the same knot, only later. The root
    package is left out as a target: any kit import has run `colo_kit/__init__.py` (which imports only `env`)
    before the module that asks, so `models -> env` does not lead back through it."""
    graph = {m: deps - {"colo_kit"} for m, deps in _module_level_kit_imports(called_too=True).items()}
    assert "colo_kit.env" in graph["colo_kit.models"]
    cycle = _a_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_no_kit_module_is_over_450_lines():
    """One idea per module: a module past 450 lines is two ideas waiting to be split."""
    long = {str(p.relative_to(REPO_ROOT)): n for p in KIT if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long


# Names a public function may pass on under TRL's name: the lesson's own term, and vLLM's sampling names at a
# vLLM generate call (ColocatedEngine.generate speaks SamplingParams, as vLLM's LLM.generate does).
ALIASES_ALLOWED = {("tp", "vllm_tensor_parallel_size"), ("n", "num_generations")}


def _settings_passed_under_another_name(source: str, fields: set[str]) -> list[str]:
    """Each public function (no leading underscore) that passes one of its own parameters on as a `GRPOConfig`
    field of another name, as a keyword or a dict key: `def f(steps): run_grpo(max_steps=steps)`."""
    import ast

    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name.startswith("_"):
            continue
        params = {a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs}
        for node in ast.walk(fn):
            pairs = [(kw.arg, kw.value) for kw in node.keywords] if isinstance(node, ast.Call) else []
            if isinstance(node, ast.Dict):
                pairs = [(k.value, v) for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant)]
            for name, value in pairs:
                if (name in fields and isinstance(value, ast.Name) and value.id in params and value.id != name
                        and (value.id, name) not in ALIASES_ALLOWED):
                    found.append(f"{fn.name}({value.id}) passes it on as {name} (line {node.lineno})")
    return found


def test_the_alias_finder_finds_an_alias():
    fields = {"max_steps", "vllm_tensor_parallel_size"}
    assert _settings_passed_under_another_name("def f(steps):\n    g(max_steps=steps)\n", fields) == [
        "f(steps) passes it on as max_steps (line 2)"]
    assert _settings_passed_under_another_name("def f(steps):\n    return {'max_steps': steps}\n", fields)
    assert not _settings_passed_under_another_name("def f(max_steps, tp):\n    g(max_steps=max_steps, "
                                                   "vllm_tensor_parallel_size=tp)\n", fields)
    assert not _settings_passed_under_another_name("def _worker(steps):\n    g(max_steps=steps)\n", fields)


def test_one_name_per_setting_no_kit_function_renames_a_grpo_config_field():
    """A learner who calls the kit learns TRL's names: a kit function takes `max_steps`, not `steps`, where it hands
    the value to TRL's `GRPOConfig` (or to anything that takes its fields: `run_grpo`, `ColocateSettings`, the
    planner)."""
    import dataclasses

    from trl import GRPOConfig

    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    found = {str(p.relative_to(REPO_ROOT)): hits for p in KIT
             if (hits := _settings_passed_under_another_name(p.read_text(), fields))}
    assert not found, found
