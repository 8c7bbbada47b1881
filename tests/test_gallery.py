"""The docs' pictures (scripts/gallery.py) are what their commands print today: each is drawn
again and compared, and each command page shows its own."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gallery", ROOT / "scripts" / "gallery.py")
gallery = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gallery)


@pytest.mark.parametrize("name", list(gallery.GALLERY))
def test_each_picture_is_what_its_command_draws_today(name, tmp_path):
    for package in gallery.NEEDS.get(name, ()):
        pytest.importorskip(package)
    drawn = tmp_path / f"{name}.svg"
    gallery.draw(name, drawn)
    kept = (gallery.PICTURES / f"{name}.svg").read_text()
    assert gallery.comparable(drawn.read_text()) == gallery.comparable(kept), (
        f"docs/pictures/{name}.svg is stale: python scripts/gallery.py {name}")


def test_pictures_keep_their_spaces_in_every_renderer():
    """Without xml:space="preserve", librsvg collapses spaces and right-aligned columns
    shift; every --svg tfm writes carries it."""
    for picture in gallery.PICTURES.glob("*.svg"):
        assert picture.read_text().startswith(
            '<svg class="rich-terminal" xml:space="preserve"'), picture.name


def test_every_command_page_shows_its_picture_and_every_picture_is_shown():
    pages = {page: page.read_text() for page in [ROOT / "README.md",
                                                 *(ROOT / "docs").rglob("*.md")]}
    for command in (ROOT / "docs" / "commands").glob("*.md"):
        if command.stem != "index":
            assert f"![tfm {command.stem}](../pictures/{command.stem}.svg)" in pages[command]
    shown = {m for text in pages.values() for m in re.findall(r"pictures/([\w-]+)\.svg", text)}
    assert shown == set(gallery.GALLERY) == {p.stem for p in gallery.PICTURES.glob("*.svg")}


def test_a_changed_time_is_all_that_comparable_forgives():
    a = 'class="terminal-123-r1">600&#160;steps&#160;in&#160;2.5&#160;s</text>'
    b = 'class="terminal-456-r1">600&#160;steps&#160;in&#160;13.0&#160;s</text>'
    assert gallery.comparable(a) == gallery.comparable(b)
    assert gallery.comparable(a) != gallery.comparable(a.replace("600", "601"))


def test_rounding_is_all_that_comparable_forgives_besides_the_time():
    """A check's residual (1.1e-16 here, 2.2e-16 or exactly 0 on another CPU), central
    differences' error below 1e-7, and a mean that is 0.0000 here and ≈0 there compare equal;
    any other number, and a residual of 1e-6, do not."""
    def cell(text):
        return f'class="terminal-1-r1">{text}</text>'

    same = [("by&#160;1.1e-16", "by&#160;0.0e+00"), ("by&#160;4.2e-11", "by&#160;5.5e-11"),
            ("&#160;1.72e-16", "&#160;0.00e+00"), ("&#160;0.0000", "&#160;&#160;&#160;&#160;≈0"),
            ("worst&#160;relative&#160;error&#160;3.08e-08&#160;(blocks.0.attn.b_K)",
             "worst&#160;relative&#160;error&#160;4.16e-09&#160;(blocks.0.attn.W_Q)")]
    for a, b in same:
        assert gallery.comparable(cell(a)) == gallery.comparable(cell(b)), (a, b)
    for a, b in [("+0.5108", "+0.5109"), ("by&#160;1.2e-06", "by&#160;1.3e-06"),
                 ("&#160;0.0000", "&#160;0.0001"), ("10.00", "1.00"), ("1e-05", "1e-06")]:
        assert gallery.comparable(cell(a)) != gallery.comparable(cell(b)), (a, b)
