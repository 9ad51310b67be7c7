"""Light (stdlib-only) vs math (numpy/sympy) sandboxes: which calls go where, and that the choice never
changes what a call sees."""
from __future__ import annotations

import ast
import os
import time

import pytest

from sandbox.route import LIGHT, MATH, route

HEAVY = ("numpy", "sympy")
LOADED = frozenset({"math", "os", "sys", "json", "re", "itertools", "fractions", "collections"})   # a light one's


@pytest.mark.parametrize("code, kind", [
    ("print(1 + 1)", LIGHT),
    ("import math, itertools\nfrom fractions import Fraction\nprint(Fraction(1, 3))", LIGHT),
    ("import os.path\nimport collections.abc", LIGHT),
    ("def f(:", LIGHT),                                   # fails the same way in both
    ("import numpy as np\nnp.zeros(3)", MATH),
    ("from sympy import symbols", MATH),
    ("import scipy.optimize", MATH),                      # imports numpy itself
    ("import random", MATH),                              # not loaded in light sandboxes: loaded in math ones
    ("from datetime import date", MATH),
    ("def f():\n    import networkx\n    return 1", MATH),
    ("m = __import__('nu' 'mpy')", LIGHT),               # not detectable; still correct, just slower
    ("import importlib\nimportlib.import_module('sympy')", MATH),   # the name appears in the text
    ("x = 1; import scipy", MATH),
    ("from . import x", LIGHT),                           # relative: fails the same way in both
    ("import os, json as j, \\\n    re", LIGHT),
    ("import os, networkx as nx", MATH),
    ("from os import (path,\n    sep)", LIGHT),
    ('s = "import torch"', LIGHT),                      # not at a line start: text, not an import
    ('s = """\nimport torch\n"""', MATH),              # a false positive only costs speed
])
def test_route(code, kind):
    assert route(code, HEAVY, LOADED) == kind


def test_routing_is_linear_on_hostile_input():
    for code in ("import os\n" + "not " * 4000 + "1", "import os\n" + "[" * 5000, "import " + "a." * 200000):
        t = time.perf_counter()
        route(code, HEAVY, LOADED)
        assert time.perf_counter() - t < 0.5   # linear: ~ms; a quadratic scan of these inputs takes seconds


def test_calls_land_in_the_right_kind_of_sandbox(healthy):
    light = healthy.run("print(sum(range(10)))")
    math = healthy.run("import sympy\nprint(sympy.factor(sympy.Symbol('x')**2 - 1))")
    assert light["sandbox"] == "light" and light["stdout"] == "45\n", light
    assert math["sandbox"] == "math" and math["stdout"] == "(x - 1)*(x + 1)\n", math
    s = healthy.run("x = 1", session="routing-s")
    assert s["sandbox"] == "math", s   # sessions always: a later cell may import numpy


def test_each_sandbox_is_pinned_to_one_of_the_services_cpus(healthy):
    cpus = set(os.sched_getaffinity(0))
    code = "import os\nprint(sorted(os.sched_getaffinity(0)))"
    light = healthy.run_many([{"code": code} for _ in range(16)])
    math = healthy.run_many([{"code": code + "  # numpy"} for _ in range(16)])
    seen = {}
    for r in light + math:
        assert r["status"] == "ok", r
        got = ast.literal_eval(r["stdout"])
        assert len(got) == 1 and got[0] in cpus, r   # one CPU, and one the service may use
        seen.setdefault(r["sandbox"], set()).add(got[0])
    # round-robin within each kind: its two sandboxes sit on two CPUs where there are two
    assert seen["light"] and seen["math"]
    if len(cpus) >= 2 and len(healthy.pool.light_slots) >= 2:
        assert len(seen["light"]) == 2 and len(seen["math"]) == 2, seen


def test_a_light_cell_that_imports_numpy_dynamically_still_gets_it(healthy):
    r = healthy.run("m = __import__('nu' + 'mpy')\nprint(m.arange(4).sum())", timeout_s=10)
    assert r["sandbox"] == "light" and r["status"] == "ok" and r["stdout"] == "6\n", r


def test_light_sandboxes_have_no_random_loaded_and_both_kinds_draw_fresh_numbers(healthy):
    light = healthy.pool.light_modules
    assert {"math", "fractions", "itertools"} <= light and "random" not in light and "numpy" not in light
    code = "import random\nprint(random.random())"
    rs = [healthy.run(code), healthy.run(code), healthy.run("x = __import__('ran' + 'dom').random()\nprint(x)"),
          healthy.run("x = __import__('ran' + 'dom').random()\nprint(x)")]
    assert [r["sandbox"] for r in rs] == ["math", "math", "light", "light"], rs
    assert all(r["status"] == "ok" for r in rs) and len({r["stdout"] for r in rs}) == 4, rs


def test_light_and_math_cells_see_the_same_fresh_globals(healthy):
    code = "print(sorted(k for k in globals() if not k.startswith('__')))"
    light = healthy.run(code)
    math = healthy.run(code + "  # numpy")
    assert light["sandbox"] == "light" and math["sandbox"] == "math"
    assert light["stdout"] == math["stdout"] == "[]\n", (light, math)


def test_light_cells_have_the_builtins_site_adds(healthy):
    # light interpreters start without site (-S); exit(), quit(), help ... must still be there
    code = "import builtins\nprint(sorted(vars(builtins)))"
    light = healthy.run(code)
    math = healthy.run(code + "  # numpy")
    assert light["sandbox"] == "light" and math["sandbox"] == "math"
    assert light["stdout"] == math["stdout"] and "'exit'" in light["stdout"], (light, math)
    assert healthy.run("exit()")["status"] == "ok"


@pytest.mark.parametrize("threads", [0, 2])
def test_cpu_time_is_measured_for_the_cell_and_its_threads(healthy, threads):
    """pid 1 reads the cell's CPU time from /proc (one thread: its schedstat; more: every live thread's)."""
    code = f"""
import threading, time
def spin(done=None):
    t = time.thread_time()
    while time.thread_time() - t < 0.15:
        pass
    if done is not None:
        done.release()
        time.sleep(30)   # still alive when the cell reports
sems = [threading.Semaphore(0) for _ in range({threads})]
for s in sems:
    threading.Thread(target=spin, args=(s,), daemon=True).start()
spin()
for s in sems:
    s.acquire()
"""
    r = healthy.run(code, timeout_s=10)
    assert r["status"] == "ok", r
    assert 0.15 * (threads + 1) - 0.02 <= r["cpu_s"] <= 0.15 * (threads + 1) + 1.0, r
