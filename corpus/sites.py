"""Function and class sites in a Python source text, as character offsets on line boundaries.

Offsets are indices into the decoded `str`. They are derived from `ast` line numbers only
(never from `col_offset`, which counts UTF-8 bytes); a line ends at `\\r\\n`, `\\r` or `\\n`,
the same line breaks the Python tokenizer counts (not `str.splitlines`, which also breaks at
form feed and other separators). Every offset except `len(text)` is the start of a line.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
import warnings
from bisect import bisect_left
from dataclasses import dataclass

_LINE_END = re.compile(r"\r\n|\r|\n")


def line_starts(text: str) -> list[int]:
    """starts[i] = offset of line i + 1 (1-based lines); one extra entry len(text) at the end."""
    starts = [0] + [m.end() for m in _LINE_END.finditer(text)]
    if starts[-1] != len(text):
        starts.append(len(text))
    return starts


def next_line_start(starts: list[int], offset: int) -> int:
    """The first line start >= offset."""
    return starts[min(bisect_left(starts, offset), len(starts) - 1)]


@dataclass(frozen=True)
class Site:
    qualname: str  # dotted: Class.method, outer.inner
    kind: str  # "def" (also async def) or "class"
    line: int  # 1-based line of the `def` / `class` keyword
    start: int  # start of the first decorator line, else of the def/class line
    header_end: int  # start of the line after the header's `:` (comments after it excluded)
    doc_end: int | None  # end of the docstring's last line (newline included); None: no docstring
    end: int  # end of the node's last line, newline included
    end_line: int  # 1-based last line of the node
    indent: str  # whitespace before the keyword
    body_lines: int  # lines from the first body statement through the node's last line


def _prefix_is_blank(line: str, col_bytes: int) -> bool:
    return line.encode("utf-8")[:col_bytes].strip() == b""


def _rest_is_blank(line: str, col_bytes: int) -> bool:
    rest = line.encode("utf-8")[col_bytes:].strip()
    return rest == b"" or rest.startswith(b"#")


def _colons(text: str) -> list[tuple[int, int]]:
    """(row, col) of every `:` outside brackets, in order: a def/class header ends at the first
    one after its keyword (annotations and defaults sit inside the parentheses)."""
    depth, out = 0, []
    # newline=None reads \r and \r\n as line ends, keeping rows equal to `ast` line numbers.
    try:
        for t in tokenize.generate_tokens(io.StringIO(text, newline=None).readline):
            if t.type != tokenize.OP:
                continue
            if t.string in ("(", "[", "{"):
                depth += 1
            elif t.string in (")", "]", "}"):
                depth -= 1
            elif t.string == ":" and depth == 0:
                out.append(t.start)
    except tokenize.TokenError as e:
        raise ValueError(f"tokenize: {e}") from None
    return out


def _site(node, qualname: str, lines: list[str], starts: list[int], colons) -> Site | None:
    body = node.body
    first = body[0]
    def_line = lines[node.lineno - 1]
    i = bisect_left(colons, (node.lineno, 0))
    if i == len(colons):
        return None
    colon_row = colons[i][0]
    # Single-line bodies (`def f(): pass`) and bodies sharing the header's line have no
    # line boundary where a prompt could end.
    if first.lineno <= colon_row or not _prefix_is_blank(lines[first.lineno - 1], first.col_offset):
        return None
    if not _prefix_is_blank(def_line, node.col_offset):
        return None
    indent = def_line[: len(def_line) - len(def_line.lstrip())]
    doc_end = None
    is_doc = (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    )
    if is_doc and _rest_is_blank(lines[first.end_lineno - 1], first.end_col_offset):
        if len(body) == 1 or body[1].lineno > first.end_lineno:
            doc_end = starts[first.end_lineno]
    first_line = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return Site(
        qualname=qualname,
        kind="class" if isinstance(node, ast.ClassDef) else "def",
        line=node.lineno,
        start=starts[first_line - 1],
        header_end=starts[colon_row],
        doc_end=doc_end,
        end=starts[node.end_lineno],
        end_line=node.end_lineno,
        indent=indent,
        body_lines=node.end_lineno - first.lineno + 1,
    )


def find_sites(text: str) -> list[Site]:
    """All def/class sites in source order. Raises SyntaxError / ValueError for bad source."""
    with warnings.catch_warnings():  # invalid escapes etc. in old test fixtures
        warnings.simplefilter("ignore", SyntaxWarning)
        tree = ast.parse(text)
    starts = line_starts(text)
    lines = [text[starts[i] : starts[i + 1]] for i in range(len(starts) - 1)]
    colons = _colons(text)
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    out: list[Site] = []

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, kinds):
                q = f"{prefix}{child.name}"
                s = _site(child, q, lines, starts, colons)
                if s is not None:
                    out.append(s)
                visit(child, q + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    out.sort(key=lambda s: (s.start, s.line))
    return out
