"""Launch and repository links of the published book, taken from the environment.

Why an extension and not a line in ``_config.yml``: the repository has no fixed public address
(forks, mirrors, a classroom copy), and Jupyter Book's own default for ``repository.url`` is
Jupyter Book's repository, so a hard-coded or forgotten URL sends students to the wrong place.
``_config.yml`` therefore sets the URL to "" and every launch service off; this extension turns
them on from environment variables when the book is built:

``LABKIT_REPO_URL``
    The repository the book is built from, ``https://<host>/<owner>/<repo>``. Unset or empty:
    no launch, repository or issue buttons at all (a plain local ``make book``). The book
    workflow (``.github/workflows/book.yml``) sets it to the repository that runs the workflow.
``LABKIT_REPO_BRANCH``
    The branch the launch links open (default ``main``).
``LABKIT_REPO_PROVIDER``
    ``github``, ``gitlab`` or ``bitbucket``; needed only when the host is not github.com,
    gitlab.com or bitbucket.org (a GitHub Enterprise server, say).
``LABKIT_BINDERHUB_URL``
    The BinderHub the Binder button opens (default ``https://mybinder.org``). Binder builds
    the image from ``environment.yml`` at the repository root.
``LABKIT_JUPYTERHUB_URL``
    A JupyterHub with nbgitpuller (a classroom hub); unset or empty: no JupyterHub button.

Launch buttons go on lab pages only (``labs/...``): the chapters are MyST Markdown, which a
plain JupyterLab opens as text, not as a notebook. Every page keeps the theme's download
button, which on a lab page offers the ``.ipynb``.

To preview locally: ``LABKIT_REPO_URL=https://github.com/<owner>/<repo> make book``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from sphinx.application import Sphinx
from sphinx.config import Config

# The launch services sphinx-book-theme knows; a URL for any of them makes it add launch buttons.
LAUNCH_URL_KEYS = ("binderhub_url", "jupyterhub_url", "colab_url", "deepnote_url")
KNOWN_HOSTS = {"github.com": "github", "gitlab.com": "gitlab", "bitbucket.org": "bitbucket"}
PROVIDERS = ("github", "gitlab", "bitbucket")
DEFAULT_BINDERHUB_URL = "https://mybinder.org"
DEFAULT_BRANCH = "main"
# Pages (Sphinx docnames) that get launch buttons: the lab notebooks, seen through book/labs.
LAB_PREFIX = "labs/"


def _http_url(name: str, value: str) -> str:
    """Return ``value`` without a trailing slash, or raise ValueError naming ``name``."""
    parts = urlsplit(value)
    if parts.scheme not in ("https", "http") or not parts.netloc:
        raise ValueError(
            f"{name} must be an http(s) URL such as https://example.org, got {value!r}"
        )
    return value.rstrip("/")


def repository_from_env(env: Mapping[str, str]) -> dict[str, str] | None:
    """Read the repository the book links to from ``env`` (LABKIT_REPO_* variables).

    Returns None when ``LABKIT_REPO_URL`` is unset or empty, else a dict with ``url`` (no
    trailing slash or ``.git``), ``branch`` and ``provider``. Raises ValueError naming the
    variable when a value is malformed: the theme splits the URL into host, owner and repo, so
    anything else would produce links that look right and lead nowhere.
    """
    raw = env.get("LABKIT_REPO_URL", "").strip()
    if not raw:
        return None
    url = _http_url("LABKIT_REPO_URL", raw).removesuffix(".git")
    parts = urlsplit(url)
    segments = [s for s in parts.path.split("/") if s]
    if len(segments) != 2:
        raise ValueError(f"LABKIT_REPO_URL must be https://<host>/<owner>/<repo>, got {raw!r}")
    provider = env.get("LABKIT_REPO_PROVIDER", "").strip().lower()
    if not provider:
        provider = KNOWN_HOSTS.get(parts.netloc.lower(), "")
    if provider not in PROVIDERS:
        raise ValueError(
            f"LABKIT_REPO_PROVIDER must be one of {', '.join(PROVIDERS)} for host "
            f"{parts.netloc!r}, got {provider!r}"
        )
    branch = env.get("LABKIT_REPO_BRANCH", "").strip() or DEFAULT_BRANCH
    return {"url": url, "branch": branch, "provider": provider}


def publish_theme_options(
    theme_options: Mapping[str, Any], env: Mapping[str, str]
) -> dict[str, Any]:
    """Return sphinx-book-theme options with repository and launch links set from ``env``.

    ``theme_options`` is what Jupyter Book made of ``_config.yml``; it is not modified. Without
    a repository URL every link to a repository is switched off and the URL cleared, whatever
    came in, so no default (Jupyter Book's own repository) can leak into the pages. The
    download button is on in both cases.
    """
    options = dict(theme_options)
    launch = dict(options.get("launch_buttons") or {})
    options["use_download_button"] = True
    repo = repository_from_env(env)
    if repo is None:
        options.update(
            repository_url="",
            use_repository_button=False,
            use_issues_button=False,
            use_edit_page_button=False,
        )
        for key in LAUNCH_URL_KEYS:
            launch[key] = ""
        launch["thebe"] = False
    else:
        options.update(
            repository_url=repo["url"],
            repository_branch=repo["branch"],
            repository_provider=repo["provider"],
            use_repository_button=True,
            use_issues_button=True,
        )
        binder = env.get("LABKIT_BINDERHUB_URL", "").strip() or DEFAULT_BINDERHUB_URL
        launch["binderhub_url"] = _http_url("LABKIT_BINDERHUB_URL", binder)
        hub = env.get("LABKIT_JUPYTERHUB_URL", "").strip()
        launch["jupyterhub_url"] = _http_url("LABKIT_JUPYTERHUB_URL", hub) if hub else ""
    options["launch_buttons"] = launch
    return options


def _apply(app: Sphinx, config: Config) -> None:
    """``config-inited``: rewrite the theme options before the theme reads them."""
    config.html_theme_options = publish_theme_options(config.html_theme_options, os.environ)


def keep_launch_buttons_on_labs(
    pagename: str, header_buttons: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Return the page's header buttons without the launch group unless it is a lab page."""
    if pagename.startswith(LAB_PREFIX):
        return header_buttons
    return [b for b in header_buttons if b.get("label") != "launch-buttons"]


def _filter_page(
    app: Sphinx, pagename: str, templatename: str, context: dict, doctree: Any
) -> None:
    """``html-page-context``, after the theme (priority 501) has added its buttons."""
    if "header_buttons" in context:
        context["header_buttons"] = keep_launch_buttons_on_labs(pagename, context["header_buttons"])


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("config-inited", _apply)
    app.connect("html-page-context", _filter_page, priority=502)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
