"""Documentation references resolve inside the repository.

Code, configs and Markdown cite the model spec by section (`docs/model_spec.md §5.7`, `… Part A
"Scale"`, and the shorter `spec §7` once a file has named it). These tests fail when a cited section is
not a heading of docs/model_spec.md, when a cited `docs/*.md` file is missing, or when a file still cites
the old out-of-repository spec or the shared docs folder outside the repository. Pure file reading: no
imports of the project.
"""

from __future__ import annotations

import os
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "docs" / "model_spec.md"
SUFFIXES = (".py", ".md", ".yaml")
# Environments, VCS data, caches and run outputs (all git-ignored) are not the repository's text.
SKIP_DIRS = {".venv", ".git", "__pycache__", ".pytest_cache", ".k3rl-cache", ".gl", "runs", "build", "dist"}
# Built from parts so that this file does not cite what it forbids.
OLD_SPEC = "K3" + "_SPEC"
OUT_OF_REPO_DOCS = "shared" + "/docs/"

SECTION = r"§\s?\d+(?:\.\d+)*(?:\s?[–-]\s?§?\d+(?:\.\d+)*)?"
ITEM = rf'(?:{SECTION}|Part [A-Z])(?:\s?"[^"\n]{{1,40}}")?'
ITEMS = rf"{ITEM}(?:[\s#]*(?:,|;|and)?[\s#]*{ITEM})*"
# `docs/model_spec.md §5.6, §6, §11`, `docs/model_spec.md Part A "Scale", §9 "Merging into text"`.
SPEC_REF = re.compile(rf"docs/model_spec\.md[\s#]*(?P<items>{ITEMS})")
# `spec §2.1`, `Spec §3:`, `the spec (§5.1)`, `the spec's tables (§4.2–4.7)`.
SHORT_REF = re.compile(rf"\bspec(?:'s)?(?:\s+[\w-]+){{0,2}}\s*\(?(?P<items>{ITEMS})", re.IGNORECASE)
DOC_FILE = re.compile(r"\bdocs/([\w-]+\.md)\b")
HEADING = re.compile(r"^#{1,6}\s+(?P<text>.+?)\s*$", re.MULTILINE)


def repo_files() -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel = Path(dirpath).relative_to(ROOT)
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and (rel / d) != Path("bench/out")]
        out += [Path(dirpath) / f for f in filenames if f.endswith(SUFFIXES)]
    return sorted(out)


@cache
def texts() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8", errors="replace") for p in repo_files()}


@cache
def spec_headings() -> tuple[frozenset[str], tuple[str, ...]]:
    """Section ids ("5.7", "Part A") and the lower-cased heading texts of docs/model_spec.md."""
    ids, names = set(), []
    for m in HEADING.finditer(SPEC.read_text(encoding="utf-8")):
        text = m["text"].strip()
        names.append(text.lower())
        if num := re.match(r"§?\s?(\d+(?:\.\d+)*)\.?(?:\s|$)", text):
            ids.add(num[1])
        if part := re.match(r"Part ([A-Z])\b", text):
            ids.add(f"Part {part[1]}")
    return frozenset(ids), tuple(names)


def cited(items: str) -> list[tuple[str, str | None]]:
    """(section id, quoted name or None) for every section an items string names; ranges give both ends."""
    out = []
    for m in re.finditer(rf'(?P<sec>{SECTION}|Part [A-Z])(?:\s?"(?P<name>[^"\n]{{1,40}})")?', items):
        sec = m["sec"]
        if sec.startswith("Part"):
            out.append((sec, m["name"]))
            continue
        ends = re.findall(r"\d+(?:\.\d+)*", sec)
        out += [(ends[0], m["name"])] + [(end, None) for end in ends[1:]]
    return out


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def test_model_spec_exists_with_numbered_sections():
    ids, _ = spec_headings()
    for needed in ("Part A", "Part B", "1", "5.5", "5.7", "7", "8.3", "12", "13.2"):
        assert needed in ids, f"docs/model_spec.md has no heading for {needed}"


def test_cited_spec_sections_exist():
    ids, names = spec_headings()
    bad = []
    for rel, text in texts().items():
        for pattern in (SPEC_REF, SHORT_REF):
            for m in pattern.finditer(text):
                for sec, name in cited(m["items"]):
                    where = f"{rel}:{line_of(text, m.start())}: {m[0].strip()!r}"
                    label = sec if sec.startswith("Part") else f"§{sec}"
                    if sec not in ids:
                        bad.append(f"{where} cites {label}, which is not a heading of docs/model_spec.md")
                    elif name and not any(name.lower() in h for h in names):
                        bad.append(f"{where} cites {label} {name!r}, which no heading of docs/model_spec.md names")
    assert not bad, "unresolved spec references:\n" + "\n".join(bad)


def test_cited_docs_files_exist():
    bad = [f"{rel}:{line_of(text, m.start())}: docs/{m[1]} does not exist"
           for rel, text in texts().items() for m in DOC_FILE.finditer(text)
           if not (ROOT / "docs" / m[1]).is_file()]
    assert not bad, "\n".join(bad)


def test_no_out_of_repository_doc_references():
    bad = [f"{rel}:{line_of(text, m.start())}: {text[m.start():m.start() + 60].splitlines()[0]!r}"
           for rel, text in texts().items()
           for m in re.finditer(re.escape(OLD_SPEC) + "|" + re.escape(OUT_OF_REPO_DOCS), text)]
    assert not bad, ("cite docs/model_spec.md (or another in-repository doc) instead:\n" + "\n".join(bad))
