"""The fenced bash block of a docs section, as the guide tests run it (unchanged)."""
from distributed import REPO


def documented_block(doc: str, heading: str) -> str:
    """The first ```bash block under `heading` (a "## ..." line) of docs/`doc`."""
    text = (REPO / "docs" / doc).read_text(encoding="utf-8")
    section = text.split(heading + "\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```bash\n", 1)[1].split("```", 1)[0]
