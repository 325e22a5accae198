"""The code's shape: the packages point one way (every import in pretrain/ and finetune/ goes to its
own part or to a part below it in LAYERS, and no modules import each other in a circle), and the
trainer stays a wiring of parts (TRAINER_LINES, TRAIN_LINES).

Every import counts: at the top of a module, inside a function, under `if TYPE_CHECKING:`. A part
that needs something from above takes it as an argument (finetune/config.py's `validate` takes the
task registry; pretrain/config/schema.py's `load_config` takes the starting point's inheritance).
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("pretrain", "finetune")

# Bottom to top: a module may import from its own entry and from entries before it. An entry names
# a package or a module (the longest name that contains a module is its entry); modules of one entry
# may import each other (never in a circle: see the second test).
LAYERS = (
    "pretrain.common",  # errors, text files, atomic writes, the library noise list
    "pretrain.config",  # typed, validated settings (torch-free)
    "pretrain.distributed",  # devices, collectives, process groups, the launch environment
    "pretrain.observability",  # console, timers, profiling, device memory
    "pretrain.resilience",  # heartbeats, launch status, hang and failure handling
    "pretrain.cli",  # what every program's command line shares
    "pretrain.data",  # corpora, indexed datasets, samples, loaders
    "pretrain.model",  # BERT and ModernBERT on megatron-core layers
    "pretrain.optim",  # LAMB, StableAdamW, schedules, guards
    "pretrain.checkpoint",  # formats, layouts, Hugging Face exchange, starting points
    "pretrain.plan",  # the memory and step-time planner
    "pretrain.training",  # the trainer and its parts
    "pretrain.main",  # python -m pretrain
    "pretrain.__main__",
    "pretrain",
    "finetune.glue_metrics", "finetune.squad_metrics", "finetune.ner_metrics",  # the official metrics
    "finetune.official_metrics",  # the official dev score of each task (best epoch, sweep selection)
    "finetune.windows",
    "finetune.inputs",
    "finetune.input_cache",
    "finetune.config",
    "finetune.output_dir",  # the output directory every rank agrees on before a run writes
    "finetune.model",
    "finetune.tasks",  # the task registry and the tasks
    "finetune.features",
    "finetune.finetuner",
    "finetune.feature_tagger",
    "finetune.embedding",  # contrastive training of embedding models (issue 53)
    "finetune.sweep",
    "finetune.main",  # python -m finetune
    "finetune.__main__",
    "finetune",
)


def module_names() -> dict[str, Path]:
    """Every module of PACKAGES by dotted name (a package by its own name)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of PACKAGES that `name` imports: `from a.b import c` is a.b.c where c is a module,
    else a.b; relative imports resolved against the module's package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            candidates = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                          for alias in node.names]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in modules:  # `import a.b.c` of a package's attribute
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                targets.add(candidate)
    return targets


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def layer_of(name: str) -> int:
    matches = [i for i, entry in enumerate(LAYERS) if name == entry or name.startswith(entry + ".")]
    assert matches, f"{name} is in no entry of LAYERS (tests/test_structure.py): place it there"
    return max(matches, key=lambda i: len(LAYERS[i]))


def test_every_import_points_down():
    upward = [f"{name} (layer {LAYERS[layer_of(name)]}) imports {target} (layer {LAYERS[layer_of(target)]})"
              for name, targets in sorted(import_graph().items()) for target in sorted(targets)
              if layer_of(target) > layer_of(name)]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_megatron_core_is_imported_through_one_module():
    """pretrain/distributed/megatron_core.py imports megatron-core with its fused kernels' torch.compile
    wrappings made at their first call (2 s of every rank's start-up); a module importing megatron
    itself could be the first to, and every rank would pay for Inductor again."""
    direct = []
    for name, path in sorted(module_names().items()):
        if name == "pretrain.distributed.megatron_core":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            direct += [f"{name}: line {node.lineno} imports {n}" for n in names if n.split(".")[0] == "megatron"]
    assert not direct, "import megatron-core through pretrain.distributed.megatron_core:\n" + "\n".join(direct)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_modules_import_each_other_in_a_circle():
    found = circles(import_graph())
    assert not found, "modules that import each other in a circle:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_walk_sees_every_kind_of_import():
    """The checks above are only as good as the walk: a function-level, a TYPE_CHECKING and a
    relative import are all found, and a circle is found."""
    graph = import_graph()
    assert "pretrain.config.token_clock" in graph["pretrain.config.schema"]  # a relative import in a function
    assert "finetune.tasks.base" in graph["finetune.tasks"]  # under TYPE_CHECKING
    assert "pretrain.checkpoint.starting_point" in graph["pretrain.main"]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# pretrain/training/trainer.py wires the parts and calls them in order: a new concern gets its own
# part beside it (a module of pretrain/training/ or the package it belongs to), not lines here
TRAINER_LINES, TRAIN_LINES = 250, 80


def test_the_trainer_stays_a_wiring_of_parts():
    path = REPO / "pretrain" / "training" / "trainer.py"
    source = path.read_text()
    lines = len(source.splitlines())
    assert lines <= TRAINER_LINES, (f"{path.relative_to(REPO)} has {lines} lines, more than {TRAINER_LINES}: give the "
                                    "new concern its own part")
    train = next(node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)
                 and node.name == "train")
    length = train.end_lineno - train.lineno + 1
    assert length <= TRAIN_LINES, f"Trainer.train has {length} lines, more than {TRAIN_LINES}"
