"""A YAML syntax error in one line: where, the text of the line, and what is wrong in words.

PyYAML says ``mapping values are not allowed here`` and a mark; a user wants the line number,
the line as they wrote it, and what to change (``config.load`` raises what ``explain`` says).
"""

from __future__ import annotations

import yaml

# PyYAML's problem (its start) -> what is wrong, in words, and what usually fixes it
_WORDS = (
    ("found character '\\t'", "a tab: YAML indents with spaces only; replace the tab with spaces"),
    ("mapping values are not allowed here", "a ':' where no key can start: a value holding ': ' must be quoted "
     "(key: \"a: b\"), or the line above lacks the ':' after its key"),
    ("expected <block end>", "the indentation does not line up: a key must be indented exactly as the keys "
     "beside it in its section"),
    ("could not find expected ':'", "a key without ':' (write key: value)"),
    ("found unexpected end of stream", "a quote opened here is never closed"),
    ("found undefined alias", "'*' starts an alias in YAML: quote a value that begins with '*'"),
    ("found character '@'", "'@' and '`' cannot start a value: quote it"),
    ("found character '`'", "'@' and '`' cannot start a value: quote it"),
    ("expected ',' or ']'", "a list opened with '[' here is never closed with ']'"),
    ("expected ',' or '}'", "a mapping opened with '{' here is never closed with '}'"),
    ("found duplicate anchor", "an anchor ('&name') defined twice: rename one"),
    ("expected a comment or a line break", "text after a closing quote: quote the whole value"),
)


def explain(err: yaml.YAMLError, text: str, path: str) -> str:
    """``PATH: invalid YAML at line N, column M ('TEXT'): WHAT IS WRONG`` for PyYAML's ``err`` on ``text``."""
    problem = str(getattr(err, "problem", None) or str(err).splitlines()[0])
    mark = getattr(err, "problem_mark", None)
    context = getattr(err, "context_mark", None)
    words = next((w for start, w in _WORDS if problem.startswith(start)), None)
    # an error found at the end of the file (an unclosed quote or bracket) is where it was opened
    if context is not None and (mark is None or "end of stream" in problem or "<stream end>" in problem):
        mark = context
    if mark is None:
        return f"{path}: invalid YAML: {words or problem}"
    lines = text.splitlines()
    line = lines[mark.line] if mark.line < len(lines) else ""
    shown = line.rstrip() if len(line.rstrip()) <= 80 else line.rstrip()[:77] + "..."  # indentation kept: it may be the fault
    return (f"{path}: invalid YAML at line {mark.line + 1}, column {mark.column + 1} ({shown!r}): "
            f"{words or problem}" + (f" (YAML: {problem})" if words else ""))
