"""MkDocs hook: kmp's docstrings use Sphinx's roles; show them as plain code in the API pages.

A docstring says ``:func:`kmp.enable```, ``:class:`~kmp.layers.Float32Output``` and ends a
paragraph with ``::`` before a literal block. Rendered as Markdown by mkdocstrings, the
role's name stays in the text (``:func:kmp.enable``). This hook drops the role names, shows
a ``~``-prefixed name by its last part (as Sphinx does) and turns a closing ``::`` into one
colon, on the pages under ``api/``.
"""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj|const|py:\w+):(?=<code>)")
_SHORT = re.compile(r"<code>~(?:[\w.]+\.)?(\w+)</code>")
_LITERAL = re.compile(r"(?<=\w)::</p>")


def on_page_content(html: str, page, config, files) -> str:
    """Rewrite the roles of the rendered docstrings of an API page."""
    if not page.file.src_uri.startswith("api/"):
        return html
    html = _ROLE.sub("", html)
    html = _SHORT.sub(r"<code>\1</code>", html)
    return _LITERAL.sub(":</p>", html)
