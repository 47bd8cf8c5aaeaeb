"""The documentation a newcomer navigates: the home page (docs/index.md) links every page of
docs/, the site's navigation (mkdocs.yml) holds every page, the README links the home page and
the brokers page, and the API reference (docs/api.md, mkdocstrings ``:::`` directives) renders
every public name of ``celery_zklock``. ``make docs`` builds the site with ``--strict``, which
fails on a link to a page or anchor that does not exist."""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import celery_zklock

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(p.name for p in DOCS.glob("*.md"))
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")


def _links(text: str) -> set[str]:
    """The targets of the markdown links in ``text``, without their anchors."""
    return set(LINK.findall(text))


def test_the_home_page_links_every_page() -> None:
    linked = _links((DOCS / "index.md").read_text(encoding="utf-8"))
    missing = [page for page in PAGES if page != "index.md" and page not in linked]
    assert not missing, f"docs/index.md links no {missing}: add each where a newcomer looks"
    local = {target for target in linked if "://" not in target}
    assert local <= set(PAGES), f"docs/index.md links pages that do not exist: {local - set(PAGES)}"


def test_the_site_navigation_holds_every_page() -> None:
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = text.split("\nnav:\n", 1)[1]
    listed = re.findall(r"^\s*- (?:[^:\n]+: )?([\w.-]+\.md)\s*$", nav, re.M)
    assert len(listed) == len(set(listed)), "a page is in mkdocs.yml's nav twice"
    assert sorted(listed) == PAGES, (
        f"not in the nav: {sorted(set(PAGES) - set(listed))}; "
        f"no such page: {sorted(set(listed) - set(PAGES))}"
    )


def test_the_readme_links_the_home_page_and_the_brokers_page() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    linked = _links(readme)
    assert {"docs/index.md", "docs/brokers.md", "docs/getting-started.md"} <= linked
    missing = [t for t in linked if t.startswith("docs/") and not (ROOT / t).exists()]
    assert not missing, f"README.md links pages that do not exist: {missing}"


@dataclass
class Directive:
    """One ``::: path`` of docs/api.md and the members its options name (None: all)."""

    path: str
    members: list[str] | None

    def resolve(self) -> object:
        parts = self.path.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                found: object = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError:
                continue
            for name in parts[cut:]:
                found = getattr(found, name)
            return found
        raise AssertionError(f"docs/api.md: ::: {self.path} names nothing importable")

    def covered(self) -> list[object]:
        """The objects this directive renders: itself, and a module's members."""
        found = self.resolve()
        if not isinstance(found, ModuleType) or self.members == []:
            return [found]
        names = self.members
        if names is None:
            names = list(getattr(found, "__all__", None) or _public_names(found))
        return [found, *(getattr(found, name) for name in names)]


def _public_names(module: ModuleType) -> list[str]:
    return [
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__
    ]


def _directives() -> list[Directive]:
    lines = (DOCS / "api.md").read_text(encoding="utf-8").splitlines()
    found = []
    for number, line in enumerate(lines):
        if not line.startswith("::: "):
            continue
        options = []
        for following in lines[number + 1 :]:
            if following and not following.startswith(" "):
                break
            options.append(following.strip())
        members: list[str] | None = None
        if "members: false" in options:
            members = []
        elif "members:" in options:
            start = options.index("members:") + 1
            members = []
            for option in options[start:]:
                if not option.startswith("- "):
                    break
                members.append(option[2:].strip())
        found.append(Directive(line[4:].strip(), members))
    return found


def test_the_api_reference_renders_every_public_name() -> None:
    covered = {id(obj) for directive in _directives() for obj in directive.covered()}
    public = [*celery_zklock.__all__, "RedisFence"]  # RedisFence: imported on first use
    missing = [name for name in public if id(getattr(celery_zklock, name)) not in covered]
    assert not missing, f"docs/api.md renders no {missing}: add a ::: directive for each"


def test_the_api_reference_check_sees_a_missing_name() -> None:
    """The check above would fail without MultiLock's directive."""
    without = [d for d in _directives() if "multi" not in d.path.lower()]
    covered = {id(obj) for directive in without for obj in directive.covered()}
    assert id(celery_zklock.MultiLock) not in covered
    assert id(celery_zklock.Mutex) in covered
