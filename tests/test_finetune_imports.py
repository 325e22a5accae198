"""finetune/'s imports form no circle, and its task registry starts no torch.

The walk reads every module's imports that run or are read when the module is imported (module
level, class bodies, `try`/`if` blocks) and, so that a circle kept alive only by `TYPE_CHECKING`
counts too, the imports under `if TYPE_CHECKING:`. Imports inside functions are left out: they run
when called, after every module is whole (the config reaches the task registry that way)."""
import ast
import subprocess
import sys
from pathlib import Path

from distributed import REPO

PACKAGE = REPO / "finetune"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that `path` imports at import time (TYPE_CHECKING blocks included)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()

    def target(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = package.split(".")
        base = base[:len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def visit(body) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = target(node)
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)  # `from . import x`: module x
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    visit(getattr(node, field, []) or [])

    visit(ast.parse(path.read_text()).body)
    return {m for m in found if m in modules and m != name}


def test_finetune_has_no_import_circle():
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    graph = {module_name(p): imported_modules(p, modules) for p in paths}
    assert graph["finetune.tasks.glue"] >= {"finetune.config", "finetune.tasks.base"}  # the walk sees imports

    def circle_from(start: str, path: list[str], done: set[str]) -> list[str] | None:
        for nxt in sorted(graph[start]):
            if nxt in path:
                return path[path.index(nxt):] + [nxt]
            if nxt not in done:
                found = circle_from(nxt, path + [nxt], done)
                if found:
                    return found
        done.add(start)
        return None

    done: set[str] = set()
    for module in sorted(graph):
        circle = circle_from(module, [module], done)
        assert circle is None, "import circle: " + " -> ".join(circle)


def test_the_task_registry_and_the_config_start_no_torch():
    probe = ("import sys\nfrom finetune.tasks import TASK_NAMES\nimport finetune.config\n"
             "print(len(TASK_NAMES), 'torch loaded' if 'torch' in sys.modules else 'no torch')")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["13", "no", "torch"], done.stdout[-2000:] + done.stderr[-2000:]


def test_every_task_module_defines_exactly_the_registry_names():
    """WHERE is the one list of names: each kind's dict of tasks has exactly the names the
    registry sends to it."""
    import importlib

    from finetune.tasks import WHERE

    for module, tasks in sorted(set(WHERE.values())):
        defined = getattr(importlib.import_module(f"finetune.tasks.{module}"), tasks)
        assert sorted(defined) == sorted(n for n, where in WHERE.items() if where == (module, tasks)), module
