"""The documentation stays short at the top and true underneath.

README.md is the entry point (under 15 KB); the details live in docs/*.md, one topic per file.
These tests read the Markdown only (no subprocess, no import of the project) and fail when:
- README.md grows past 15,000 bytes, or a docs/*.md file is not linked from it;
- a relative link of README.md or docs/*.md points at a file that does not exist, or its
  #anchor at no heading of the target (GitHub's heading slugs);
- a repository path written in code (`tools/...`, `pretrain/...`, `configs/...`, ...), a
  `python -m X` module or a `tools/X.py` command no longer exists (renamed or moved code);
- the README's test command is not the one .ci/run runs.
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS_DIR = ROOT / "docs"
README_MAX_BYTES = 15_000

# Prefixes of repository paths that docs mention in code; anything else in code (data/..., ckpt/...,
# outputs/...) is an example path of the user's, not ours. Under docs/ only `docs/NAME.md` counts:
# program output shows rates such as "7,803 docs/s".
# A brace list (`configs/bert-{base,large}.yaml`) is part of the path and expanded.
REPO_PATH = re.compile(
    r"(?<![\w./-])(?:\./)?((?:tools|pretrain|finetune|configs|tests|\.ci)/(?:[^\s`'\",;:()\[\]|{]|\{[^}\s]*\})*"
    r"|docs/(?:[\w-]+\.md)?(?![\w/])|launcher\.sh)")
# `python -m X` modules that are not ours: the test runner and launchers the docs name.
THIRD_PARTY_MODULES = {"pytest", "torch.distributed.run", "deepspeed", "pip", "venv"}


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS_DIR.glob("*.md"))]


def split_markdown(text: str) -> tuple[str, list[str]]:
    """(prose with fenced code blocks blanked out, the fenced code blocks' contents)."""
    prose, blocks, block = [], [], None
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if block is None:
                block = []
            else:
                blocks.append("\n".join(block))
                block = None
            prose.append("")
        elif block is not None:
            block.append(line)
            prose.append("")
        else:
            prose.append(line)
    assert block is None, "unterminated ``` block"
    return "\n".join(prose), blocks


# a code span may wrap onto the next line, never across a blank line
INLINE_CODE = re.compile(r"(`+)((?:(?!\n\s*\n).)+?)\1", re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def inline_code(prose: str) -> list[str]:
    return [m.group(2) for m in INLINE_CODE.finditer(prose)]


def links(path: Path) -> list[str]:
    prose, _ = split_markdown(path.read_text(encoding="utf-8"))
    # code spans may hold brackets and parentheses ("[k=v ...]") that are not links
    return LINK.findall(INLINE_CODE.sub("code", prose))


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lowercased, every character that is not a
    letter, digit, '_', '-' or space dropped, spaces turned into '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts by its text
    text = text.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose, _ = split_markdown(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    result = set()
    for line in prose.splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = github_slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        result.add(slug if n == 0 else f"{slug}-{n}")  # GitHub numbers repeated headings
    return result


def code_texts(path: Path) -> list[str]:
    """Every inline code span and fenced code block of a Markdown file."""
    prose, blocks = split_markdown(path.read_text(encoding="utf-8"))
    return inline_code(prose) + blocks


def is_placeholder(path: str) -> bool:
    """Paths written as a pattern or with a part to fill in, not as files: a glob
    (`configs/bert-base*.yaml`, `tools/*.py`), an elision or `<name>`, or a path component written
    in capitals (`tools/SCRIPT.py`, `configs/finetune/TASK.yaml`). No real path under the
    checked prefixes has an all-capital component. Everything else is checked."""
    if any(mark in path for mark in ("*", "<", "...")):
        return True
    return re.search(r"(?:^|/)[A-Z][A-Z0-9_]*(?:[./]|$)", path) is not None


def expand_braces(path: str) -> list[str]:
    """`a-{x,y}.yaml` -> [`a-x.yaml`, `a-y.yaml`], every brace list in turn."""
    m = re.search(r"\{([^{}]*)\}", path)
    if m is None:
        return [path]
    return [expanded for choice in m.group(1).split(",")
            for expanded in expand_braces(path[:m.start()] + choice + path[m.end():])]


def repo_paths(text: str) -> list[str]:
    return [path for m in REPO_PATH.finditer(text) for path in expand_braces(m.group(1).rstrip("."))]


# ------------------------------------------------------------------------------------------------


def test_readme_is_short():
    size = README.stat().st_size
    assert size < README_MAX_BYTES, (
        f"README.md has {size} bytes, the limit is {README_MAX_BYTES}: move details into docs/")


def test_every_docs_file_is_linked_from_readme():
    docs = sorted(DOCS_DIR.glob("*.md"))
    assert docs, "docs/*.md is empty"
    linked = {(README.parent / target.split("#")[0]).resolve()
              for target in links(README) if not target.startswith("#")}
    missing = [str(d.relative_to(ROOT)) for d in docs if d.resolve() not in linked]
    assert not missing, f"not linked from README.md: {missing}"


def test_relative_links_and_anchors_resolve():
    problems, checked = [], 0
    for md in markdown_files():
        for target in links(md):
            if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            checked += 1
            file_part, _, anchor = target.partition("#")
            dest = (md.parent / file_part).resolve() if file_part else md
            where = f"{md.relative_to(ROOT)}: ({target})"
            if ROOT not in dest.parents and dest != ROOT:
                problems.append(f"{where} leaves the repository")
            elif not dest.exists():
                problems.append(f"{where}: {file_part} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where}: no heading of {dest.relative_to(ROOT)} has the anchor #{anchor}")
    assert checked > 50, f"only {checked} links found: is the link parser broken?"
    assert not problems, "\n".join(problems)


def test_repository_paths_in_code_exist():
    problems, checked = [], 0
    for md in markdown_files():
        for code in code_texts(md):
            for path in repo_paths(code):
                if is_placeholder(path):
                    continue
                checked += 1
                if not (ROOT / path).exists():
                    problems.append(f"{md.relative_to(ROOT)}: `{path}` does not exist")
            # test files are named without their directory in docs/testing.md
            for name in re.findall(r"(?<![\w/])(test_\w+\.py)\b", code):
                checked += 1
                if not (ROOT / "tests" / name).exists():
                    problems.append(f"{md.relative_to(ROOT)}: `{name}` is not in tests/")
    assert checked > 50, f"only {checked} paths found: is the code parser broken?"
    assert not problems, "\n".join(problems)


def test_python_modules_and_tool_commands_exist():
    problems, modules, commands = [], 0, 0
    for md in markdown_files():
        for code in code_texts(md):
            for module in re.findall(r"\bpython3?\s+-m\s+([\w.]+)", code):
                modules += 1
                as_path = ROOT / module.replace(".", "/")
                ours = (as_path / "__init__.py").exists() or as_path.with_suffix(".py").exists()
                if not ours and module not in THIRD_PARTY_MODULES:
                    problems.append(f"{md.relative_to(ROOT)}: `python -m {module}`: no such module here")
            for script in re.findall(r"\b(?:python3?|bash|tool)\s+(?:\./)?(tools/[\w./-]+)", code):
                commands += 1
                if not is_placeholder(script) and not (ROOT / script).is_file():
                    problems.append(f"{md.relative_to(ROOT)}: runs {script}, which does not exist")
    assert modules >= 5 and commands >= 10, f"found {modules} modules, {commands} tool commands"
    assert not problems, "\n".join(problems)


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    lines = [line for line in ci.splitlines() if "pytest" in line and not line.lstrip().startswith("#")]
    assert len(lines) == 1, f".ci/run should run pytest once: {lines}"
    # CI-only environment (REQUIRE_NETNS=1: fail rather than skip) is not part of the command
    command = " ".join(re.sub(r"(?<!\S)[A-Z_][A-Z0-9_]*=\S*\s+", "", lines[0]).split())
    assert "python -m pytest -q tests" in command
    _, blocks = split_markdown(README.read_text(encoding="utf-8"))
    readme_commands = {" ".join(line.split("#")[0].split()) for block in blocks for line in block.splitlines()}
    assert command in readme_commands, f"README.md does not show .ci/run's test command: {command}"


def test_github_slug():
    assert github_slug("Fine-tuning: GLUE, SQuAD 1.1/2.0, SWAG, features") == "fine-tuning-glue-squad-1120-swag-features"
    assert github_slug("1. Vocabulary: `tools/build_vocab.py`") == "1-vocabulary-toolsbuild_vocabpy"
    assert github_slug("Looking at a model: `[MASK]` predictions and loss curves") == \
        "looking-at-a-model-mask-predictions-and-loss-curves"
    assert github_slug("Checkpoints: resume and conversion") == "checkpoints-resume-and-conversion"
