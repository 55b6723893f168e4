"""Every relative link in the repository's Markdown resolves: the file exists,
and a `#anchor` names a heading of the target (GitHub's heading slugs)."""

import pathlib
import re

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def markdown_files() -> list[pathlib.Path]:
  files = [REPO_ROOT / "README.md"]
  for folder in ("docs", "experiments"):
    files += sorted((REPO_ROOT / folder).rglob("*.md"))
  return [f for f in files if f.is_file()]


def github_slug(heading: str) -> str:
  """The anchor GitHub gives a heading: lower case, punctuation dropped,
  spaces turned into hyphens."""
  text = heading.strip().lower()
  text = re.sub(r"[^\w\- ]", "", text)
  return text.replace(" ", "-")


def anchors(markdown: pathlib.Path) -> set[str]:
  found, seen = set(), {}
  text = FENCE.sub("", markdown.read_text())
  for line in text.splitlines():
    match = re.match(r"#{1,6}\s+(.*)", line)
    if not match:
      continue
    slug = github_slug(match.group(1))
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    found.add(slug if count == 0 else f"{slug}-{count}")
  return found


def broken_links(markdown: pathlib.Path) -> list[str]:
  broken = []
  text = FENCE.sub("", markdown.read_text())
  for target in LINK.findall(text):
    if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
      continue
    path_part, _, anchor = target.partition("#")
    destination = (markdown.parent / path_part).resolve() if path_part else markdown
    if not destination.exists():
      broken.append(f"{target}: no such file")
    elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
      broken.append(f"{target}: no heading with anchor #{anchor}")
  return broken


def test_slugs_follow_github():
  assert github_slug("Run 9: TMA loads (git dd25c73, 2026-11-22)") == (
      "run-9-tma-loads-git-dd25c73-2026-11-22")
  assert github_slug("`ffi/…` kernels") == "ffi-kernels"


@pytest.mark.parametrize(
    "markdown", markdown_files(),
    ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_relative_links_resolve(markdown):
  assert broken_links(markdown) == []
