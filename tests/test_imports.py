"""The layering holds: ``import kdray`` stays off Ray and the actors, and no two kdray modules import each
other (module-level or inside functions)."""
import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kdray"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def kdray_imports() -> dict[str, set[str]]:
    """module -> the kdray modules it imports anywhere in its source."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kdray"):
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("kdray"))
        graph[name] = {m for m in found if m in modules and m != name and not name.startswith(m + ".")}
    return graph


def test_import_kdray_stays_off_ray_and_the_actors():
    code = ("import sys; from kdray import *; LLM, SamplingParams, StructuredOutputsParams; "
            "bad = sorted(m for m in sys.modules if m == 'ray' or m.startswith('kdray.actors') "
            "or m.startswith('kdray.serve.server')); print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_cli_and_its_batch_client_import_no_torch():
    """``kdray batch submit`` is an HTTP client: it starts without torch (~2 s) and runs where torch is absent."""
    code = "import sys, kdray, kdray.cli, kdray.serve.batch; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_no_import_cycles_between_kdray_modules():
    graph = kdray_imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]):
        state[node] = 1
        for nxt in sorted(graph[node]):
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt])
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])


def test_a_benchmark_run_as_a_script_can_import_transformers():
    """``python benchmarks/x.py`` puts ``benchmarks/`` first on ``sys.path``: no file there may shadow a package
    that transformers imports (a ``kernels.py`` did: transformers 5 imports the ``kernels`` hub package)."""
    bench = PACKAGE.parent / "benchmarks"
    code = (f"import sys; sys.path.insert(0, {str(bench)!r}); "
            "from transformers import LlamaConfig, LlamaForCausalLM; print('ok')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
