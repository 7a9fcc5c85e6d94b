"""The rules of the tree that a reading of its source can check: no private name imported
from another module, no runtime patch of a class, no hard process exit, no test hook
read by the product, Textual's private modules reached from one isolation module only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import kvchat

ROOT = Path(kvchat.__file__).parent
TEXTUAL_COMPAT = "kvchat/tui/textual_compat.py"

LINE_RULES = {
    "assigns __class__": re.compile(r"\.__class__\s*=(?!=)"),
    "ends the process with os._exit": re.compile(r"\bos\._exit\("),
    "reads a test hook": re.compile(r"KVCHAT_TEST|_TEST_PAUSE"),
    "walks sys.modules": re.compile(r"sys\.modules\.(?:values|items|keys)\(|list\(sys\.modules"),
}


def sources() -> dict[str, str]:
    return {
        str(path.relative_to(ROOT.parent)): path.read_text(encoding="utf-8")
        for path in sorted(ROOT.rglob("*.py"))
    }


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def imported(text: str) -> list[tuple[int, str, str]]:
    """(line, module, name) for every name imported by ``text`` (name "" for ``import m``)."""
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            out += [(node.lineno, module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name, "") for a in node.names]
    return out


def private_imports(text: str) -> list[str]:
    """Private names (or modules) that ``text`` imports."""
    return [
        f"{line}: {name or module} from {module}"
        for line, module, name in imported(text)
        if private(name) or any(private(part) for part in module.lstrip(".").split("."))
    ]


def broken_line_rules(text: str) -> list[str]:
    return [
        f"{n}: {what}"
        for n, line in enumerate(text.splitlines(), 1)
        for what, rule in LINE_RULES.items()
        if rule.search(line)
    ]


def test_no_private_name_is_imported_from_another_module():
    found = {path: bad for path, text in sources().items() if (bad := private_imports(text))}
    own = {
        path: [b for b in bad if " from kvchat" in b or " from ." in b]
        for path, bad in found.items()
    }
    assert {path: bad for path, bad in own.items() if bad} == {}


def test_private_parts_of_dependencies_are_reached_only_where_there_is_no_public_way():
    """Textual's from its isolation module; mlx.launch's launcher (which kvchat launch
    repeats for a TUI on rank 0) from cli/ring.py. Anywhere else is a new dependency on
    a private part."""
    found = {path: bad for path, text in sources().items() if (bad := private_imports(text))}
    assert any(" from textual._" in b for b in found.pop(TEXTUAL_COMPAT, []))
    ring = found.pop("kvchat/cli/ring.py", [])
    assert all(" from mlx._distributed_utils." in b for b in ring)
    assert found == {}


def test_no_class_swap_hard_exit_test_hook_or_module_scan_in_the_product():
    found = {path: bad for path, text in sources().items() if (bad := broken_line_rules(text))}
    assert found == {}


def test_the_rules_find_what_they_forbid():
    text = (
        "from kvchat.x import _hidden, shown\n"
        "from .common import _fail, app\n"
        "from textual._parser import Parser\n"
        "import textual.widgets\n"
        "layer.__class__ = Fast\n"
        "same = layer.__class__ == Fast\n"
        "os._exit(0)\n"
        "pause = os.environ.get('KVCHAT_STORE_TEST_PAUSE')\n"
        "models = [m for m in list(sys.modules.values())]\n"
        "loaded = 'mlx.core' in sys.modules\n"
    )
    assert private_imports(text) == [
        "1: _hidden from kvchat.x",
        "2: _fail from .common",
        "3: Parser from textual._parser",
    ]
    assert broken_line_rules(text) == [
        "5: assigns __class__",
        "7: ends the process with os._exit",
        "8: reads a test hook",
        "9: walks sys.modules",
    ]


# a module is split along its concerns before it grows past this (as mlx-lm's are)
MAX_LINES = 400


def test_no_module_is_longer_than_the_limit():
    long = {path: text.count("\n") for path, text in sources().items()}
    assert {path: n for path, n in long.items() if n > MAX_LINES} == {}
    assert max(long.values()) > MAX_LINES // 2  # the count reads real files
