"""Which interpreter a stateless call runs in: "light" (stdlib only) or "math" (numpy, sympy pre-imported).

Forking an interpreter that holds numpy and sympy costs several ms of CPU (page tables of a big heap, then
the child's teardown); a stdlib-only one forks in well under one. Most tool calls that import nothing heavy
therefore run in light sandboxes. The choice only changes speed, never semantics: a cell starts with
fresh globals either way (nothing pre-imported is visible without an import), and a light cell that
imports numpy after all (e.g. through `exec` of a built string) gets it, just slower, within its own limits.

A call is "math" when its code
- mentions a pre-imported module's name anywhere (catches `__import__("sympy")`, `importlib`, strings), or
- has an import statement (at the start of a line or after `;`) of a module the light interpreter has not
  loaded (numpy, scipy, networkx, but also random or datetime): a light cell seldom pays for an import, and
  the math interpreter has much of the standard library loaded already (sympy and numpy pull it in).
Imports are found with regular expressions, not the parser: ast.parse can spend 100+ ms on 16 KB of
hostile nesting, on the service's event loop; these scans are linear. A false "import" inside a string
only sends the call to a math sandbox, which runs anything.
"""
from __future__ import annotations

import re

LIGHT, MATH = "light", "math"
_IMPORT = re.compile(r"(?:^|;)[ \t]*import[ \t]+([^\n#;]*)", re.MULTILINE)
_FROM = re.compile(r"(?:^|;)[ \t]*from[ \t]+([\w.]*)[ \t]+import\b", re.MULTILINE)
_NAME = re.compile(r"[ \t(\\]*([\w.]+)")


def _top(name: str) -> str:
    return name.partition(".")[0]


def route(code: str, heavy: tuple[str, ...], light_modules: frozenset[str]) -> str:
    """LIGHT or MATH for `code`; `heavy`: the math sandboxes' preload, `light_modules`: top-level names
    of the modules a light sandbox's interpreter has loaded."""
    if any(name in code for name in heavy):
        return MATH
    if "import" not in code:
        return LIGHT
    for m in _FROM.finditer(code):
        mod = m.group(1)
        if mod and not mod.startswith(".") and _top(mod) not in light_modules:
            return MATH
    for m in _IMPORT.finditer(code):
        for part in m.group(1).split(","):
            n = _NAME.match(part)
            if n and _top(n.group(1)) not in light_modules:
                return MATH
    return LIGHT
