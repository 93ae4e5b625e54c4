"""MkDocs hook: links from a docs page to files outside ``docs/`` (examples, benchmarks).

On GitHub these relative links open the file. The built site holds only ``docs/``, so there they
become the file's path in the repository, or a link into ``repo_url`` when mkdocs.yml sets one.
"""

from __future__ import annotations

import re
from typing import Any

_OUTSIDE = re.compile(r"\[(?P<text>[^\]]+)\]\((?:\.\./)+(?P<path>(?:examples|benchmarks|tests|minifabric)/[^)\s]*)\)")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Rewrite each link to a repository file outside the docs folder."""
    repo_url = (config.get("repo_url") or "").rstrip("/")

    def rewrite(match: re.Match[str]) -> str:
        text, path = match["text"], match["path"]
        if repo_url:
            return f"[{text}]({repo_url}/blob/main/{path})"
        return text if path.rstrip("/") in text else f"{text} (`{path}` in the repository)"

    return _OUTSIDE.sub(rewrite, markdown)
