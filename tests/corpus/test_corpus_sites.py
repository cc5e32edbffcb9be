"""Site offsets on a hand-made source with awkward line ends, headers and docstrings."""

import ast

from corpus.sites import find_sites, line_starts

SRC = (
    "# caf\u00e9 \u65e5\u672c\r\n"  # 1: non-ASCII, CRLF
    "import os\r"  # 2: lone CR
    "\x0c\n"  # 3: form feed is not a line break for Python
    "@decorator(x[1:2])\n"  # 4
    "def first(a: int = {1: 2}[1],\n"  # 5
    "          b=lambda: 0,\n"  # 6
    "          ) -> dict[str, int]:  # note: colon\n"  # 7
    "    # comment in body\n"  # 8
    "    x = 'caf\u00e9'\n"  # 9
    "    return {'k': x}\n"  # 10
    "\n"
    "def one(): return 1\n"
    "class K:\n"
    '    """Doc\n'
    '    more."""\n'
    "    async def m(self):\n"
    "        '''m doc'''\n"
    "        def inner():\n"
    "            pass\n"
    "        return inner\n"
)


def test_line_starts_agree_with_ast_line_numbers():
    starts = line_starts(SRC)
    for node in ast.walk(ast.parse(SRC)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            line = SRC[starts[node.lineno - 1] : starts[node.lineno]]
            assert line.lstrip().startswith(("def", "async def", "class")), line
    # Broken variant: str.splitlines also breaks at form feed, shifting later line numbers.
    naive = [0]
    for part in SRC.splitlines(keepends=True):
        naive.append(naive[-1] + len(part))
    assert SRC[starts[4] :].startswith("def first")  # ast: `def first` is line 5
    assert SRC[naive[4] :].startswith("@decorator")  # splitlines: line 5 is one line early


def test_sites_and_offsets():
    sites = {s.qualname: s for s in find_sites(SRC)}
    assert sorted(sites) == ["K", "K.m", "K.m.inner", "first"]  # `one` has no body line
    f = sites["first"]
    assert (f.kind, f.line, f.indent, f.doc_end) == ("def", 5, "", None)
    assert f.start == SRC.index("@decorator")
    assert f.header_end == SRC.index("    # comment in body")  # after the `:` line, not line 6
    assert f.end == SRC.index("\n\ndef one") + 1 and f.end_line == 10 and f.body_lines == 2
    k = sites["K"]
    assert (k.kind, k.start) == ("class", SRC.index("class K"))
    assert k.header_end == SRC.index('    """Doc')
    assert k.doc_end == SRC.index("    async def") and k.end == len(SRC)
    m = sites["K.m"]
    assert (m.kind, m.indent, m.start) == ("def", "    ", SRC.index("    async def"))
    assert m.header_end == SRC.index("        '''m doc")
    assert m.doc_end == SRC.index("        def inner")
    assert sites["K.m.inner"].body_lines == 1 and sites["K.m.inner"].doc_end is None


def test_docstring_followed_on_its_line_has_no_doc_end():
    src = 'def f():\n    "doc"; x = 1\n    return x\n'
    (s,) = find_sites(src)
    assert s.doc_end is None and s.header_end == src.index('    "doc"')
