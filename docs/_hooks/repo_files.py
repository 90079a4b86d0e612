"""MkDocs hook: a guide may link a file of the repository outside docs/.

The guides link files such as ``../bench/results/numerics.md`` or
``../examples/horovod_tf1_session.py`` relatively, as GitHub shows them. MkDocs knows only
docs/, so this hook adds every such file that exists to the site under ``repo/<its path>``
(a Markdown file becomes a page, anything else is copied as it is), following the links of
the added pages too, and rewrites each link to the added copy. A link to a file that does
not exist is left as written, so MkDocs reports it and ``mkdocs build --strict`` fails.
Links inside fenced code blocks are left alone.
"""

from __future__ import annotations

import os
import posixpath
import re
from urllib.parse import urlsplit

from mkdocs.structure.files import File, Files, InclusionLevel

PREFIX = "repo"
# [text](target) and ![alt](target), with an optional "title"; the target has no spaces.
_LINK = re.compile(r"(\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")


def _relative_target(url: str) -> tuple[str, str] | None:
    """``(path, '#anchor')`` of a relative link to a file; None for anything else."""
    parts = urlsplit(url)
    if parts.scheme or parts.netloc or not parts.path or parts.path.startswith("/"):
        return None
    return parts.path, f"#{parts.fragment}" if parts.fragment else ""


def _outside_fences(markdown: str) -> list[tuple[bool, str]]:
    """The lines of ``markdown`` (ends kept), each with whether it lies outside a fence."""
    lines, fence = [], None
    for line in markdown.splitlines(keepends=True):
        match = _FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
            lines.append((False, line))
        elif fence is not None:
            if match and match.group(1).startswith(fence[0]) and len(match.group(1)) >= len(fence):
                fence = None
            lines.append((False, line))
        else:
            lines.append((True, line))
    return lines


def _site_uri(abs_target: str, docs_dir: str, root: str) -> str | None:
    """Where the file at ``abs_target`` is in the site; None when it is not a repository file."""
    if not os.path.isfile(abs_target):
        return None
    if abs_target.startswith(docs_dir + os.sep):
        return os.path.relpath(abs_target, docs_dir).replace(os.sep, "/")
    if abs_target.startswith(root + os.sep):
        return f"{PREFIX}/" + os.path.relpath(abs_target, root).replace(os.sep, "/")
    return None


def _links(file: File, docs_dir: str, root: str):
    """Each relative link of a page that reaches a repository file: (site uri, its path)."""
    source = file.content_string
    base = os.path.dirname(file.abs_src_path)
    for outside, line in _outside_fences(source):
        if not outside:
            continue
        for match in _LINK.finditer(line):
            target = _relative_target(match.group(2))
            if target is None:
                continue
            abs_target = os.path.normpath(os.path.join(base, target[0]))
            uri = _site_uri(abs_target, docs_dir, root)
            if uri is not None:
                yield uri, abs_target


def _paths(config) -> tuple[str, str]:
    docs_dir = os.path.realpath(config.docs_dir)
    root = os.path.realpath(os.path.dirname(config.config_file_path))
    return docs_dir, root


def on_files(files: Files, config) -> Files:
    """Add the repository files that the pages link, and those their own pages link."""
    docs_dir, root = _paths(config)
    pending = list(files.documentation_pages())
    while pending:
        page = pending.pop()
        for uri, abs_target in _links(page, docs_dir, root):
            if not uri.startswith(f"{PREFIX}/") or files.get_file_from_path(uri) is not None:
                continue
            added = File.generated(
                config, uri, abs_src_path=abs_target, inclusion=InclusionLevel.NOT_IN_NAV
            )
            files.append(added)
            if added.is_documentation_page():
                pending.append(added)
    return files


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    """Point each link to a repository file at its place in the site."""
    docs_dir, root = _paths(config)
    here = posixpath.dirname(page.file.src_uri)
    base = os.path.dirname(page.file.abs_src_path)

    def rewrite(match: re.Match) -> str:
        target = _relative_target(match.group(2))
        if target is None:
            return match.group(0)
        uri = _site_uri(os.path.normpath(os.path.join(base, target[0])), docs_dir, root)
        if uri is None or files.get_file_from_path(uri) is None:
            return match.group(0)  # MkDocs reports it (strict: an error)
        return match.group(1) + posixpath.relpath(uri, here or ".") + target[1] + match.group(3)

    return "".join(
        _LINK.sub(rewrite, line) if outside else line for outside, line in _outside_fences(markdown)
    )
