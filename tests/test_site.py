"""The docs site as built: every link and source of every page goes somewhere that exists on
the site (a link that works on GitHub, such as ../tfmcli/engine/ops.py, can 404 there), and the
pages' tables render what they say (the testing page's, a row for each test file). The site is
built once, with mkdocs.yml, into a temporary folder; test_docs.py checks the same pages as GitHub
reads them."""

import os
import posixpath
import re
import subprocess
import sys
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIP = "mkdocs is not installed (the docs extra: python -m pip install \".[docs]\")"


class Page(HTMLParser):
    """One built page: the ids it holds, the links and sources it names (every href and src),
    the text inside its inline <code> (not in <pre>), and its tables' cells as raw HTML."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.ids, self.urls, self.codes, self.tables = set(), [], [], []
        self.code, self.pre, self.cell = None, 0, None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name == "id" or (tag == "a" and name == "name"):
                self.ids.add(value)
            if name in ("href", "src") and value is not None:
                self.urls.append(value)
        if tag == "pre":
            self.pre += 1
        elif tag == "code" and not self.pre:
            self.code = ""
        elif tag == "table":
            self.tables.append([])
        elif tag == "tr" and self.tables:
            self.tables[-1].append([])
        elif tag in ("th", "td") and self.tables:
            self.cell = ""
        if self.cell is not None and tag not in ("th", "td"):
            self.cell += self.get_starttag_text()

    def handle_endtag(self, tag):
        if tag in ("th", "td") and self.cell is not None:
            self.tables[-1][-1].append(self.cell)
            self.cell = None
        elif self.cell is not None:
            self.cell += f"</{tag}>"
        if tag == "pre":
            self.pre -= 1
        elif tag == "code" and self.code is not None:
            self.codes.append(self.code)
            self.code = None

    def handle_data(self, data):
        if self.code is not None:
            self.code += data
        if self.cell is not None:
            self.cell += data


@dataclass
class Site:
    root: Path
    pages: dict[str, Page]   # every HTML page, by its path in the site ("models/index.html")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Site:
    """The site, built once for this module."""
    pytest.importorskip("mkdocs", reason=SKIP)
    pytest.importorskip("material", reason=SKIP)
    out = tmp_path_factory.mktemp("site")
    # not --strict: a warning (CI's build fails on one) would leave no pages to say which link
    # is broken; NO_MKDOCS_2_WARNING quiets Material's notice about MkDocs 2
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--quiet", "--config-file",
         str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
        capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, built.stderr
    return Site(out, {path.relative_to(out).as_posix(): Page(path.read_text(encoding="utf-8"))
                      for path in sorted(out.rglob("*.html"))})


def text(cell: str) -> str:
    """A table cell's text, its tags left out."""
    return re.sub(r"<[^>]+>", "", cell).strip()


def broken(site: Site, name: str, url: str) -> str | None:
    """Why this link of page `name` goes nowhere on the site; None when it goes somewhere."""
    parts = urlsplit(url)
    if parts.scheme in ("http", "https"):   # no network here: well formed is all we can say
        ok = "." in (parts.hostname or "") and not re.search(r"\s", url)
        return None if ok else "not a well-formed URL"
    if parts.scheme or parts.netloc:
        return f"a {parts.scheme or '//'} link"
    path = unquote(parts.path)
    if not path:
        target = name
    else:
        base = "" if path.startswith("/") else posixpath.dirname(name)
        target = posixpath.normpath(posixpath.join(base, path.lstrip("/")))
        if target == ".." or target.startswith("../"):
            return "outside the site"
        if target == ".":
            target = ""
        if path.endswith("/") or (site.root / target).is_dir():
            target = posixpath.join(target, "index.html")
    if not (site.root / target).is_file():
        return f"{target} is not in the site"
    if parts.fragment and target.endswith(".html"):
        if unquote(parts.fragment) not in site.pages[target].ids:
            return f"{target} has no id {unquote(parts.fragment)!r}"
    return None


def test_every_link_and_source_of_every_page_goes_somewhere(site):
    """Each href and src of each built page: a file of the site, and when it names an anchor,
    an id of that page; a link off the site, a well-formed http(s) URL."""
    faults, links = [], 0
    for name, page in site.pages.items():
        for url in page.urls:
            links += 1
            if why := broken(site, name, url):
                faults.append(f"{name}: {url} ({why})")
    assert not faults, f"{len(faults)} broken links:\n" + "\n".join(faults)
    assert len(site.pages) >= 35 and links >= 2000   # the whole site was read


def test_the_link_check_finds_a_missing_page_a_missing_anchor_and_a_link_out_of_the_site(site):
    """The check itself: what each kind of broken link looks like, against the built site."""
    name = "derivations/index.html"
    assert broken(site, name, "../code/") is None
    assert broken(site, name, "../models/#gpt-2") is None
    assert broken(site, "models/index.html", "#gpt-2") is None
    assert broken(site, name, "../../tfmcli/engine/ops.py") == "outside the site"
    assert broken(site, name, "../tfmcli/engine/ops.py") == (
        "tfmcli/engine/ops.py is not in the site")
    assert broken(site, name, "../models/#no-such-heading") == (
        "models/index.html has no id 'no-such-heading'")
    assert broken(site, name, "https://rich.readthedocs.io") is None
    assert broken(site, name, "https:/rich") == "not a well-formed URL"


def test_no_escaped_pipe_shows(site):
    """A `|` escaped for a table (`\\|`) inside a code span stays escaped: Python-Markdown
    does not unescape code, so the page would show the backslash."""
    shown = [(name, code) for name, page in site.pages.items() for code in page.codes
             if "\\|" in code]
    assert not shown
    codes = site.pages["interventions/index.html"].codes
    assert "--ablate-with zero" in codes and "mean" in codes


def test_the_models_table_first_column_never_breaks_a_word(site):
    """Material lets inline code break anywhere (word-break: break-word), and the first column
    of the models table is as narrow as the theme allows: `model_type` showed as model_typ / e,
    and `gpt_bigcode` as gpt_bigcod / e. In plain text, and in links (which Material's tables
    keep whole), a name with no space or hyphen does not break."""
    table = next(table for table in site.pages["models/index.html"].tables
                 if text(table[0][0]) == "model_type")
    first = [row[0] for row in table]
    assert len(first) >= 20 and "gpt_bigcode" in map(text, first)
    for cell in first:
        assert "<code" not in cell and re.fullmatch(r"\w+", text(cell)), cell


def test_the_testing_page_has_a_row_for_every_test_file_and_no_other(site):
    """docs/testing.md's table "What each file proves": each tests/test_*.py is named in the first
    column of one row (a row may name several), each row names one at least, and every file a
    row names is there. A test file added without its row, or one renamed or removed with its
    row left, fails here."""
    table = next(table for table in site.pages["testing/index.html"].tables
                 if [text(cell) for cell in table[0]] == ["file", "what it proves"])
    rows = [re.findall(r"<code>(test_\w+\.py)</code>", row[0]) for row in table[1:]]
    assert len(rows) >= 50
    assert all(rows), [text(row[0]) for row, names in zip(table[1:], rows) if not names]
    named = [name for names in rows for name in names]
    twice = sorted({name for name in named if named.count(name) > 1})
    files = {path.name for path in (ROOT / "tests").glob("test_*.py")}
    without = sorted(files - set(named))
    gone = sorted(set(named) - files)
    assert not without and not gone and not twice, (
        f"docs/testing.md's table: no row for {without}; rows for files that do not exist: "
        f"{gone}; named twice: {twice}")
