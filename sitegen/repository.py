"""Where the site's source repository is, for the link every page's footer carries.

Found, never guessed, in this order: `KERNELBOARD_REPO_URL` (set by whoever builds); the project's own
metadata (a `[project.urls]` entry of pyproject.toml named Repository, Source, Source Code, Code or
Homepage, as the installed distribution reports it); the repository GitHub Actions is building
(`GITHUB_SERVER_URL`/`GITHUB_REPOSITORY`, set on every Actions run, so the published site names the
repository it was built from). None when none of them says: the footer then names no repository rather
than invent one. Light on purpose (os, importlib.metadata, urllib): the fingerprint hashes the answer.
"""

from __future__ import annotations

import os
from importlib import metadata
from urllib.parse import urlsplit

from kernelboard.errors import UsageError

#: The environment variable that names the repository outright.
REPO_URL_ENV = "KERNELBOARD_REPO_URL"

#: `[project.urls]` labels that name the source repository, most specific first.
_LABELS = ("repository", "source", "source code", "code", "homepage")

__all__ = ["REPO_URL_ENV", "repository_url"]


def _http(url: str | None) -> str | None:
    """`url` without a trailing slash when it is an absolute http(s) address with a host, else None."""
    if not url or not url.strip():
        return None
    url = url.strip()
    parts = urlsplit(url)
    return url.rstrip("/") if parts.scheme in ("http", "https") and parts.netloc else None


def _from_metadata() -> str | None:
    try:
        entries = metadata.metadata("kernelboard").get_all("Project-URL") or []
    except metadata.PackageNotFoundError:
        return None
    urls = {}
    for entry in entries:
        label, _, url = entry.partition(",")
        urls.setdefault(label.strip().lower(), url.strip())
    return next((u for label in _LABELS if (u := _http(urls.get(label))) is not None), None)


def repository_url() -> str | None:
    """The source repository's address ('https://github.com/OWNER/NAME'), or None (see the module)."""
    explicit = os.environ.get(REPO_URL_ENV, "").strip()
    if explicit:
        url = _http(explicit)
        if url is None:
            raise UsageError(f"{REPO_URL_ENV} must be an absolute http(s) URL such as "
                             f"https://github.com/OWNER/NAME, got {explicit!r}")
        return url
    found = _from_metadata()
    if found is not None:
        return found
    server, repo = os.environ.get("GITHUB_SERVER_URL", ""), os.environ.get("GITHUB_REPOSITORY", "")
    return _http(f"{server.rstrip('/')}/{repo}") if server and repo.count("/") == 1 else None
