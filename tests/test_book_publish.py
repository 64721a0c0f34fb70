"""The book as a publication: launch links, repository links, Binder's environment.

Checked without building the book: the configuration Jupyter Book derives from
``book/_config.yml``, the extension that fills in the repository (``book/tools/launch_links.py``),
the Pages workflow that sets it, and the ``environment.yml`` that Binder builds from.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
WORKFLOW = ROOT / ".github" / "workflows" / "book.yml"
# Jupyter Book's default repository.url points here; the book must never link to it.
JB_OWN_REPO = "executablebooks"
REPO_URL_EXPR = "${{ github.server_url }}/${{ github.repository }}"


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def launch_links() -> ModuleType:
    pytest.importorskip("sphinx")
    return _load("launch_links", BOOK / "tools" / "launch_links.py")


@pytest.fixture(scope="module")
def screenshots() -> ModuleType:
    return _load("book_screenshots", BOOK / "tools" / "screenshots.py")


@pytest.fixture(scope="module")
def jb_config() -> dict:
    """The Sphinx configuration Jupyter Book makes of book/_config.yml (its defaults merged in)."""
    jb = pytest.importorskip("jupyter_book.config")
    config, _ = jb.get_final_config(
        user_yaml=BOOK / "_config.yml",
        sourcedir=BOOK,
        cli_config={"latex_individualpages": False},
        validate=True,
        raise_on_invalid=True,
    )
    return config


def _build_step_env(workflow: dict) -> dict[str, str]:
    """The environment of the step that builds the book (job-level env, then the step's)."""
    job = workflow["jobs"]["build"]
    for step in job["steps"]:
        run = step.get("run", "")
        if "make book" in run or "jupyter-book build" in run:
            return {**job.get("env", {}), **step.get("env", {})}
    raise AssertionError("no step in jobs.build runs `make book` or `jupyter-book build`")


def _as_github_would(value: str, context: dict[str, str]) -> str:
    """Substitute ``${{ expr }}`` as Actions does for the plain context lookups used here."""
    return re.sub(r"\$\{\{\s*([\w.]+)\s*\}\}", lambda m: context.get(m.group(1), ""), value)


def test_workflow_sets_the_repository_url_for_the_build():
    workflow = yaml.safe_load(WORKFLOW.read_text())
    env = _build_step_env(workflow)
    assert env.get("LABKIT_REPO_URL") == REPO_URL_EXPR
    assert env.get("LABKIT_BINDERHUB_URL") == "https://mybinder.org"
    assert "vars." in env.get("LABKIT_JUPYTERHUB_URL", ""), (
        "the JupyterHub comes from a repository variable"
    )
    steps = workflow["jobs"]["build"]["steps"]
    upload = [s for s in steps if s.get("uses", "").startswith("actions/upload-pages-artifact@")]
    assert upload and upload[0]["with"]["path"] == "book/_build/html"
    deploy = workflow["jobs"]["deploy"]["steps"]
    assert any(s.get("uses", "").startswith("actions/deploy-pages@") for s in deploy)


def test_workflow_env_gives_launch_links_to_this_repository(launch_links, jb_config):
    env = _build_step_env(yaml.safe_load(WORKFLOW.read_text()))
    github = {
        "github.server_url": "https://github.com",
        "github.repository": "someone/course",
        "github.ref_name": "main",
    }  # vars.* unset: an empty string, as in Actions
    resolved = {k: _as_github_would(str(v), github) for k, v in env.items()}
    options = launch_links.publish_theme_options(jb_config["html_theme_options"], resolved)
    assert options["repository_url"] == "https://github.com/someone/course"
    assert options["launch_buttons"]["binderhub_url"] == "https://mybinder.org"
    assert options["launch_buttons"]["jupyterhub_url"] == ""
    assert options["launch_buttons"]["notebook_interface"] == "jupyterlab"


def test_config_never_points_at_jupyter_books_repository(jb_config):
    assert JB_OWN_REPO not in (BOOK / "_config.yml").read_text()
    theme = jb_config["html_theme_options"]
    # Left out of _config.yml, repository.url would be Jupyter Book's own: it must be set, empty.
    assert theme["repository_url"] == ""
    assert JB_OWN_REPO not in json.dumps(jb_config, default=str)
    assert not any(
        theme["launch_buttons"].get(k) for k in ("binderhub_url", "jupyterhub_url", "colab_url")
    )
    assert not any(
        theme.get(b) for b in ("use_repository_button", "use_issues_button", "use_edit_page_button")
    )
    assert "launch_links" in jb_config["extensions"]


def test_local_build_has_no_repository_links_and_keeps_download(launch_links, jb_config):
    # Even if Jupyter Book's default crept back in, an unset LABKIT_REPO_URL clears it.
    leaked = {
        **jb_config["html_theme_options"],
        "use_issues_button": True,
        "repository_url": "https://github.com/executablebooks/jupyter-book",
    }
    for incoming in (jb_config["html_theme_options"], leaked):
        options = launch_links.publish_theme_options(incoming, {"LABKIT_REPO_URL": ""})
        assert options["repository_url"] == ""
        assert not any(options["launch_buttons"][k] for k in launch_links.LAUNCH_URL_KEYS)
        assert not options["use_repository_button"] and not options["use_issues_button"]
        assert options["use_download_button"] is True
        assert JB_OWN_REPO not in json.dumps(options)


def test_repo_url_turns_on_binder_jupyterhub_and_repository_buttons(launch_links, jb_config):
    env = {
        "LABKIT_REPO_URL": "https://github.com/someone/course.git/",
        "LABKIT_JUPYTERHUB_URL": "https://hub.example.org/",
        "LABKIT_REPO_BRANCH": "spring",
    }
    options = launch_links.publish_theme_options(jb_config["html_theme_options"], env)
    assert options["repository_url"] == "https://github.com/someone/course"
    assert options["repository_branch"] == "spring"
    assert options["repository_provider"] == "github"
    assert options["path_to_docs"] == "book"  # launch paths are book/labs/..., the labs symlink
    assert options["launch_buttons"]["binderhub_url"] == "https://mybinder.org"
    assert options["launch_buttons"]["jupyterhub_url"] == "https://hub.example.org"
    assert options["use_repository_button"] and options["use_issues_button"]
    assert options["use_download_button"] is True


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"LABKIT_REPO_URL": "github.com/someone/course"}, "LABKIT_REPO_URL"),
        ({"LABKIT_REPO_URL": "https://github.com/someone"}, "LABKIT_REPO_URL"),
        ({"LABKIT_REPO_URL": "https://github.com/someone/course/tree/main"}, "LABKIT_REPO_URL"),
        ({"LABKIT_REPO_URL": "https://git.example.org/someone/course"}, "LABKIT_REPO_PROVIDER"),
        (
            {"LABKIT_REPO_URL": "https://git.example.org/a/b", "LABKIT_REPO_PROVIDER": "svn"},
            "LABKIT_REPO_PROVIDER",
        ),
        (
            {
                "LABKIT_REPO_URL": "https://github.com/a/b",
                "LABKIT_JUPYTERHUB_URL": "hub.example.org",
            },
            "LABKIT_JUPYTERHUB_URL",
        ),
    ],
)
def test_malformed_settings_name_the_variable(launch_links, env, named):
    with pytest.raises(ValueError, match=named):
        launch_links.publish_theme_options({}, env)


def test_enterprise_host_with_a_provider_is_accepted(launch_links):
    env = {"LABKIT_REPO_URL": "https://git.example.org/a/b", "LABKIT_REPO_PROVIDER": "GitHub"}
    assert launch_links.publish_theme_options({}, env)["repository_provider"] == "github"


def test_launch_buttons_only_on_lab_pages(launch_links):
    buttons = [{"label": "download-buttons"}, {"label": "launch-buttons"}]
    assert launch_links.keep_launch_buttons_on_labs("labs/01_gpu_memory", buttons) == buttons
    assert launch_links.keep_launch_buttons_on_labs("labs/gpu/sglang", buttons) == buttons
    assert launch_links.keep_launch_buttons_on_labs("chapters/ch01_gpu_selection", buttons) == [
        {"label": "download-buttons"}
    ]
    # Launch paths go through book/labs, which must be the labs folder itself.
    assert (BOOK / "labs").resolve() == (ROOT / "labs").resolve()


def _pip_target(line: str) -> str:
    """What a pip line in environment.yml installs, read the way repo2docker reads it.

    repo2docker (Binder) copies the whole repository before installing the environment only
    when a pip line is local, that is when this target starts with "." (its
    ``is_local_pip_requirement``); it does not strip shell quotes.
    """
    line = line.split("#", 1)[0].strip()
    if line.startswith("--") and "=" in line:
        line = line.split("=", 1)[1]
    elif line.startswith("-"):
        parts = line.split(None, 1)
        line = parts[1] if len(parts) > 1 else ""
    return line


def test_binder_environment_installs_labkit():
    env_file = ROOT / "environment.yml"
    assert env_file.is_file()
    # repo2docker reads binder/ or .binder/ first; either would hide environment.yml.
    assert not (ROOT / "binder").exists() and not (ROOT / ".binder").exists()
    env = yaml.safe_load(env_file.read_text())
    deps = env["dependencies"]
    assert any(isinstance(d, str) and re.fullmatch(r"python\s*=+\s*3\.\d+", d) for d in deps)
    pip_lines = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
    targets = [_pip_target(line) for line in pip_lines]
    local = [t for t in targets if t.startswith(".")]
    assert local, (
        f"no pip line in environment.yml installs the repository as repo2docker sees it "
        f"(targets: {targets}); write it unquoted, e.g. -e .[lab,book,test,ref]"
    )
    match = re.fullmatch(r"\.\[([\w,\s-]+)\]", local[0])
    extras = {e.strip() for e in match.group(1).split(",")} if match else set()
    assert "lab" in extras, "Binder needs the lab extra (JupyterLab and the labs' clients)"
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "labkit"
    assert any(d.startswith("jupyterlab") for d in project["optional-dependencies"]["lab"])


def test_screenshot_pages_skip_asset_folders(screenshots, tmp_path):
    for rel in (
        "index.html",
        "labs/01_gpu_memory.html",
        "labs/gpu/sglang.html",
        "_static/x.html",
        "_sources/labs/a.html",
        "api/_ext.txt",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("<html></html>")
    assert screenshots.find_pages(tmp_path) == [
        "index.html",
        "labs/01_gpu_memory.html",
        "labs/gpu/sglang.html",
    ]


def test_screenshot_redirect_pages_are_recognised(screenshots, tmp_path):
    (tmp_path / "index.html").write_text(
        '<meta http-equiv="Refresh" content="0; url=intro.html" />'
    )
    (tmp_path / "intro.html").write_text("<html><body><p>url=elsewhere.html</p></body></html>")
    assert screenshots.redirect_target(tmp_path / "index.html") == "intro.html"
    assert screenshots.redirect_target(tmp_path / "intro.html") is None


def test_screenshot_report_fails_on_errors_not_on_notes(screenshots):
    ok = screenshots.PageResult(
        "index.html", notes=["external request blocked: https://cdn.example/x.js"]
    )
    bad = screenshots.PageResult("labs/a.html", errors=[("stderr output", "UserWarning: ...")])
    text = screenshots.report([ok, bad])
    assert "FAIL labs/a.html" in text and "FAIL index.html" not in text
    assert text.endswith("2 pages, 1 with errors")


def test_screenshots_refuse_to_run_without_a_built_book(screenshots, tmp_path, capsys):
    assert screenshots.main(["--html", str(tmp_path), "--out", str(tmp_path / "shots")]) == 2
    assert "build the book first" in capsys.readouterr().err


def _screenshots_python() -> str | None:
    """The Python of the screenshots venv (with Playwright), when set up; else None."""
    candidates = [
        os.environ.get("LABKIT_SCREENSHOTS_PYTHON", ""),
        str(ROOT / ".venv-screenshots" / "bin" / "python"),
    ]
    return next((c for c in candidates if c and Path(c).is_file()), None)


def test_screenshots_flag_each_kind_of_error_in_a_real_browser(screenshots, tmp_path):
    python = _screenshots_python()
    if python is None:
        pytest.skip(
            "no screenshots venv (see book/tools/screenshots.py) or LABKIT_SCREENSHOTS_PYTHON"
        )
    if not any(shutil.which(name) for name in screenshots.CHROMIUM_CANDIDATES):
        pytest.skip("no Chromium on PATH (apt-get install chromium)")
    html = tmp_path / "html"
    html.mkdir()
    (html / "index.html").write_text('<meta http-equiv="Refresh" content="0; url=ok.html" />')
    (html / "dot.svg").write_text(
        '<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10">'
        '<rect width="10" height="10"/></svg>'
    )
    (html / "ok.html").write_text(
        '<html><body><p>Fine.</p><img src="dot.svg"><a href="ok.html">'
        '<code class="xref std std-ref">a label</code></a>'
        '<div class="cell_output"><pre>42</pre></div></body></html>'
    )
    (html / "bad.html").write_text(
        '<html><head><link rel="stylesheet" href="_static/missing.css"></head><body>'
        '<div class="cell_output"><div class="output traceback"><pre>Traceback (most recent call'
        ' last): ValueError</pre></div><div class="output stderr"><pre>UserWarning: x</pre></div>'
        '</div><div class="system-message">Unknown directive</div>'
        '<p><code class="xref std std-ref">no-such-label</code></p><img src="nope.png">'
        "</body></html>"
    )
    out = tmp_path / "shots"
    tool = BOOK / "tools" / "screenshots.py"
    done = subprocess.run(
        [python, str(tool), "--html", str(html), "--out", str(out), "--timeout-ms", "30000"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    report = (out / "report.txt").read_text()
    assert "FAIL bad.html" in report and "FAIL ok.html" not in report
    failing = report.split("FAIL bad.html", 1)[1]
    for kind in (
        "traceback",
        "stderr output",
        "sphinx error marker",
        "unresolved reference",
        "missing image",
        "broken asset",
    ):
        assert f"  {kind}:" in failing, kind
    assert "note index.html: redirects to ok.html" in report
    assert (out / "ok.png").stat().st_size > 0 and (out / "bad.png").is_file()
