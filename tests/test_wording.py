"""Every page a learner reads speaks to the learner: no notes about how the course was developed.

Lessons, exercises, solutions (cell sources and the text outputs committed with them) and the book's
prose pages, of every chapter there is, are searched for phrases that belong to the course's development
(its issues, targets and scores against them, maintainers, work notes) rather than to the learner.
"""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([*ROOT.glob("notebooks/*.ipynb"), *ROOT.glob("exercises/*.ipynb"), *ROOT.glob("solutions/*.ipynb"),
                *ROOT.glob("book/*.md")])

# (pattern, what it is); case-insensitive. "issue" alone is a verb here ("each thread issues a load").
DEVELOPMENT_PHRASES = [
    (r"\b(the|this|an|our|chapter'?s|course'?s)\s+issue'?s?\b(?!\s+(a|an|one|two|the|its|loads?|stores?|instructions?)\b)",
     "a development issue"),
    (r"\bissue\s*#\s*\d+", "an issue number"),
    (r"\btargets?\s*:\s*(within|at least|≥|>=|\d)", "a development target"),
    (r"\btargets?\s+(met|reached)\b", "a development target"),
    (r"\btarget\s*(is|was)?\s*within\s+\d", "a development target"),
    (r"\b\d+\s+of\s+\d+\s+(targets|comparisons|checks)\s+(met|reached)\b", "a score against targets"),
    (r"\bcomparisons\s+met\b", "a score against targets"),
    (r"\bTARGETS\b", "a table of development targets"),
    (r"\bmaintainers?\b", "a maintainer note"),
    (r"\b(TODO|FIXME|XXX)\b", "a work note"),
    (r"\bintegrator\b", "a development role"),
    (r"\bacceptance\s+criteri", "development criteria"),
    (r"\bpull\s+request\b", "development history"),
    (r"\b(CHAPTER|STYLE)\.md\b", "a development document"),
    (r"\b(Claude|ChatGPT|Anthropic)\b|\bas an AI\b|\bAI[- ](assistant|generated|written)\b", "how the course was built"),
]
CASE_SENSITIVE = {r"\bTARGETS\b", r"\b(TODO|FIXME|XXX)\b"}


def _texts(path: Path):
    """(where, text) for each cell source and text output of a notebook, or each line of a page."""
    if path.suffix == ".md":
        for i, line in enumerate(path.read_text().splitlines(), 1):
            yield f"line {i}", line
        return
    nb = json.loads(path.read_text())
    for i, cell in enumerate(nb["cells"]):
        yield f"cell {i}", "".join(cell.get("source", ""))
        for out in cell.get("outputs", []):
            text = out.get("text") or out.get("data", {}).get("text/plain") or ""
            yield f"cell {i} output", "".join(text) if isinstance(text, list) else text


def test_there_are_pages_to_check():
    assert len(PAGES) >= 4 and any(p.suffix == ".md" for p in PAGES)


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_learner_pages_have_no_development_notes(path):
    found = []
    for where, text in _texts(path):
        for pattern, what in DEVELOPMENT_PHRASES:
            flags = 0 if pattern in CASE_SENSITIVE else re.IGNORECASE
            for m in re.finditer(pattern, text, flags):
                found.append(f"{where}: {what}: {text[max(0, m.start() - 40):m.end() + 40]!r}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("text, flagged", [
    ("peak memory at N = 65,536  # the issue's check", True),
    ("(target: within 1.1x)", True),
    ("15 of 18 targets met", True),
    ("each thread issues one load per element", False),
    ("an in-place op reads and writes its target", False),
    ("lambda logits, target: F.cross_entropy(logits, target)", False),
    ("the chapter issues two loads", False),
])
def test_the_phrases_catch_notes_and_spare_ordinary_words(text, flagged):
    hits = [p for p, _ in DEVELOPMENT_PHRASES
            if re.search(p, text, 0 if p in CASE_SENSITIVE else re.IGNORECASE)]
    assert bool(hits) == flagged, hits
