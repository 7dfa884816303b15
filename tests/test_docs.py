"""The README and the docs site stay true: every code block runs, the configuration reference is the code's, and
every page is in the site's navigation (``mkdocs build --strict`` in CI checks the links)."""

from __future__ import annotations

import json
import re

import pytest

from docs_blocks import ROOT, all_blocks, blocks_of, doc_files, run_block
from multirank import run_ranks

BLOCKS = all_blocks()


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "python"], ids=lambda b: b.id)
def test_python_block_runs(block, tmp_path):
    if block.skip:
        pytest.skip(block.skip)
    run_ranks(run_block, block.ranks, block.code, block.id, block.setup, str(tmp_path / "work"), timeout=240)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "json"], ids=lambda b: b.id)
def test_json_block_is_valid(block):
    value = json.loads(block.code)
    from llmpar.runtime.config import _VALID, Blocks

    if isinstance(value, dict) and any(k in _VALID for k in value):
        Blocks.parse(value)  # a DeepSpeed config the engine accepts


def test_configuration_reference_is_generated_from_the_code():
    from llmpar.runtime.reference import render

    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == render(), (
        "docs/configuration.md is stale: run `python -m llmpar.runtime.reference > docs/configuration.md` (make docs)"
    )


def test_every_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    listed = set(re.findall(r"([\w-]+\.md)\s*$", nav, re.M))
    assert pages == listed, (
        f"pages not in mkdocs.yml's nav: {sorted(pages - listed)}; nav entries without a page: {sorted(listed - pages)}"
    )


def test_skips_say_why_and_marks_are_known(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("<!-- docs-test: skip -->\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="needs a reason"):
        blocks_of(md)
    md.write_text("<!-- docs-test: rank=2 -->\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="not known"):
        blocks_of(md)


def test_a_failing_block_fails(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("text\n```python\nassert 1 + 1 == 3, 'the docs lie'\n```\n")
    (block,) = blocks_of(md)
    with pytest.raises(AssertionError, match="the docs lie"):
        run_block(block.code, "x.md:2", None, str(tmp_path / "w"))


def test_the_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250 and len(text.encode()) <= 20_000
    for page in re.findall(r"\]\((docs/[\w-]+\.md)", text):
        assert (ROOT / page).exists(), page
    assert len(doc_files()) > 15
