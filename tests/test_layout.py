"""The house's layout (docs/code.md): each folder of tfmcli/ says what it holds, and each module
imports only what its folder may."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tfmcli"
# folder -> the modules (prefixes) its modules may import, besides their own folder's, the
# errors and `tfmcli` itself (the lazy-attribute helper); docs/code.md's table
MAY_IMPORT = {
    "engine": (),
    "check": ("tfmcli.engine",),
    "train": ("tfmcli.engine",),
    "explain": ("tfmcli.engine", "tfmcli.check", "tfmcli.train.optim", "tfmcli.render.numbers"),
    "sources": ("tfmcli.engine", "tfmcli.train.tasks", "tfmcli.io"),
    "render": ("tfmcli.explain.summary",),
    "tui": ("tfmcli.engine", "tfmcli.explain", "tfmcli.render", "tfmcli.io"),
}
FOLDERS = ["engine", "check", "train", "explain", "sources", "render", "tui", "cli"]


def imported(path: Path) -> set[str]:
    """Every tfmcli module a file imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tfmcli"):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("tfmcli")}
    return names


@pytest.mark.parametrize("folder", sorted(MAY_IMPORT))
def test_each_folder_imports_only_what_it_may(folder):
    allowed = (f"tfmcli.{folder}", "tfmcli.errors", *MAY_IMPORT[folder])
    for path in sorted((PACKAGE / folder).glob("*.py")):
        for name in imported(path):
            ok = name == "tfmcli" or any(name == a or name.startswith(a + ".") for a in allowed)
            assert ok, f"{path.relative_to(ROOT)} imports {name}"


def test_each_folder_says_what_it_holds_and_the_code_page_names_it():
    page = (ROOT / "docs" / "code.md").read_text()
    assert sorted(p.name for p in PACKAGE.iterdir()
                  if p.is_dir() and (p / "__init__.py").exists()) == sorted(FOLDERS)
    for folder in FOLDERS:
        doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text()))
        assert doc and len(doc.split()) >= 20, folder
        assert f"  {folder}/" in page, folder
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py" and path.parent.name in ("engine", "check", "train"):
            assert path.stem in page, path   # every engine, check and train module listed


def test_how_numbers_are_written_imports_nothing_of_tfms():
    """render/numbers.py is the one notation every room's text uses (the explanations'
    too): it stands on NumPy alone, so importing it pulls in no other room."""
    assert imported(PACKAGE / "render" / "numbers.py") == set()


def test_a_forbidden_import_is_caught(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from tfmcli.render import fmt\n")
    assert imported(module) == {"tfmcli.render"}


def test_each_config_field_is_one_option_documented_once_per_place():
    """The option table (cli/options.py's MODEL_OPTIONS) against the Config: each field one
    option, its flag FLAGS', its bound the field's rule (RULES), named in the Config's
    docstring, and each architecture flag a row of docs/architectures.md's table."""
    import dataclasses
    import re

    from tfmcli.cli import options
    from tfmcli.engine.config import RULES, Config

    fields = [f.name for f in dataclasses.fields(Config)]
    declared = [name for name, _, _ in options.MODEL_OPTIONS if name != "arch"]
    assert sorted(declared) == sorted(fields) and len(set(declared)) == len(declared)
    documented = re.findall(r"^    ([a-z_, ]+) : ", Config.__doc__, flags=re.M)
    assert sorted(n.strip() for line in documented for n in line.split(",")) == sorted(fields)
    page = (ROOT / "docs" / "architectures.md").read_text()
    table = page.split("## The flags")[1].split("\n## ")[0]
    missing = []
    for name, annotation, _ in options.MODEL_OPTIONS:
        option = annotation.__metadata__[0]
        if option.rich_help_panel == options.ARCH:
            flags = [flag for decl in (option.default, *option.param_decls)
                     for flag in str(decl).split("/") if flag.startswith("--")]
            missing.extend([] if any(f"`{flag}" in table for flag in flags) else flags[:1])
        if option.callback is not None and name in RULES and RULES[name].convert is int:
            with pytest.raises(Exception, match="0 is not allowed"):
                option.callback(0)   # a size's least value is the rule's, 1
    assert missing == []
