"""The documentation: the site (mkdocs.yml, docs/) builds with `mkdocs build --strict`, so no link,
anchor or page is broken and the API reference is generated; every relative link in README.md and
docs/ points to a file of the repository (and, into a page, to one of its headings); no page cites a
file outside the repository; every page is in the site's navigation; the README stays short; the
example of docs/adding-a-schedule.md is the file tests/test_extension.py runs."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = [README, *sorted(DOCS.glob("*.md"))]

INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
LINK_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?\s*$", re.M)
SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")


def outside_fences(text: str) -> list[str]:
    kept, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            kept.append(line)
    return kept


def prose(text: str) -> str:
    """The text without code blocks and inline code, where brackets are not links."""
    return re.sub(r"(`+)(?!`).*?(?<!`)\1(?!`)", "", "\n".join(outside_fences(text)), flags=re.S)


def relative_links(page: Path) -> list[str]:
    text = prose(page.read_text())
    targets = INLINE_LINK.findall(text) + LINK_DEFINITION.findall(text)
    return [t for t in targets if not SCHEME.match(t) and not t.startswith("#")]


def anchors(page: Path) -> set[str]:
    """The ids of a page's headings (GitHub's rule; mkdocs' gives the same on these pages) and its explicit ids."""
    text = page.read_text()
    ids = set(re.findall(r'\bid="([^"]+)"', text))
    for line in outside_fences(text):
        heading = re.match(r"#{1,6}\s+(.*?)\s*$", line)
        if heading:
            title = re.sub(r"\[([^\]]*)\](\([^)]*\))?", r"\1", heading.group(1)).replace("`", "")  # a link: its text
            ids.add(re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-"))
    return ids


def test_the_site_builds_in_strict_mode_with_its_api_reference(tmp_path):
    missing = [
        name
        for name in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python")
        if importlib.util.find_spec(name.split(".")[0]) is None
    ]
    assert not missing, f"{missing} not installed: pip install -e '.[dev]' (make test does)"
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    reference = (site / "reference" / "index.html").read_text()
    for name in ("CommSchedStrategy", "FusionOptions", "DeFTOptions", "Preserver", "StopAndSave", "register_schedule"):
        assert name in reference, f"the API reference lost {name}"
    for page in DOCS.glob("*.md"):
        built = site / "index.html" if page.stem == "index" else site / page.stem / "index.html"
        assert built.is_file(), f"{page.name} was not built"


def test_every_relative_link_points_to_a_file_of_the_repository():
    checked, broken = 0, []
    for page in PAGES:
        for target in relative_links(page):
            path, _, anchor = target.partition("#")
            resolved = (page.parent / unquote(path)).resolve() if path else page
            checked += 1
            if not resolved.is_relative_to(ROOT) or not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file in the repository)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no heading or id '{anchor}' there)")
    assert broken == []
    assert checked > 50, f"only {checked} relative links found: the link pattern no longer matches the pages"


def test_the_readme_links_every_page_of_the_docs():
    linked = {Path(t.partition("#")[0]).name for t in relative_links(README) if t.startswith("docs/")}
    assert {p.name for p in DOCS.glob("*.md")} <= linked


def test_no_page_cites_a_file_outside_the_repository():
    outside = ("DESIGN" + ".md", "../" + "shared", "papers" + "/")  # spelt apart so that this file does not cite them
    files = [*PAGES, ROOT / "mkdocs.yml"]
    citing = [f"{p.relative_to(ROOT)}: {name}" for p in files for name in outside if name in p.read_text()]
    assert citing == []


def test_every_page_is_in_the_navigation_and_every_entry_is_a_page():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def entries(nav):
        for item in nav:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            yield from (entries(value) if isinstance(value, list) else [value])

    assert sorted(entries(config["nav"])) == sorted(p.name for p in DOCS.glob("*.md"))


def test_the_readme_stays_short():
    lines = README.read_text().splitlines()
    assert len(lines) < 300, f"README.md has {len(lines)} lines: move the detail into docs/"


def test_the_adding_a_schedule_page_shows_the_file_the_tests_run(tmp_path):
    """docs/adding-a-schedule.md includes examples/custom_schedule.py (tests/test_extension.py runs that
    file), so the page cannot drift from what is tested."""
    assert '--8<-- "examples/custom_schedule.py"' in (DOCS / "adding-a-schedule.md").read_text()


# --------------------------------------------------------------------------- the code blocks
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
COMMAND = re.compile(r"^(?:\.venv/bin/)?(commsched-train|commsched-bench|commsched-cluster|commsched-probe)\s")
PLACEHOLDER = re.compile(r"\[--|\.\.\.|\(the same\)|ARGS")


def code_blocks(language: str) -> list[tuple[str, str]]:
    """(page, block) for every fenced block of README.md and docs/ in `language` ("": unlabelled)."""
    return [(page.name, body) for page in PAGES for lang, body in FENCE.findall(page.read_text()) if lang == language]


def command_lines() -> list[tuple[str, str]]:
    """Every commsched command shown in a shell block (continuations joined, comments kept off)."""
    found = []
    for page, body in code_blocks("") + code_blocks("bash"):
        for line in body.replace("\\\n", " ").splitlines():
            line = line.strip()
            if COMMAND.match(line):
                found.append((page, line))
    return found


def test_every_python_block_of_the_docs_runs(tmp_path):
    """Each Python block is a whole program: run in a fresh namespace, in a fresh interpreter."""
    blocks = [(page, body) for page, body in code_blocks("python") if not body.startswith("--8<--")]
    assert len(blocks) >= 5, blocks
    program = (
        "import sys, traceback\nfailed = []\n"
        f"for page, body in {blocks!r}:\n"
        "    try:\n        exec(compile(body, page, 'exec'), {'__name__': 'docs_block'})\n"
        "    except BaseException:\n        failed.append(page + ':\\n' + body + traceback.format_exc())\n"
        "print('\\n\\n'.join(failed)); sys.exit(1 if failed else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


def test_every_command_line_of_the_docs_is_accepted():
    """The commands the docs show parse and validate as their own command would (Hydra's composition and
    the project's checks, without starting anything); a recipe they name exists."""
    lines = command_lines()
    assert len(lines) >= 20, lines
    trains, benches, flags = [], [], []
    for page, line in lines:
        if PLACEHOLDER.search(line):
            continue
        words = shlex.split(line, comments=True)
        while words:
            command, rest = Path(words[0]).name, words[1:]
            cut = rest.index("--") if "--" in rest else len(rest)
            args, words = rest[:cut], rest[cut + 1 :]
            if command == "commsched-train":
                trains.append(
                    (page, [a for a in args if a != "-m" and not a.startswith(("hydra.", "resume=", "data.dir="))])
                )
            elif command == "commsched-bench":
                benches.append((page, [a for a in args if not a.startswith("hydra.")]))
            elif command in ("commsched-cluster", "commsched-probe"):
                flags.append((page, command, args))
            else:
                break
    program = f"""
import sys, commsched_cli  # as the console scripts import the package: without torch
from hydra import compose, initialize_config_module
from commsched.cli.config import register_configs, train_config, validate
from commsched.bench.config import register_bench_config, validate_bench
from commsched.cluster.cli import parser as cluster_parser
from commsched.profile.cli import probe_parser

def first_of_each_sweep(overrides):  # a -m sweep's first run
    return [
        o.split("=", 1)[0] + "=" + o.split("=", 1)[1].split(",")[0] if "=" in o and "[" not in o else o
        for o in overrides
    ]

failed = []
register_configs()
with initialize_config_module(config_module="commsched.conf", version_base=None):
    for page, overrides in {trains!r}:
        try:
            validate(train_config(compose(config_name="train", overrides=first_of_each_sweep(overrides))))
        except Exception as error:
            failed.append(f"{{page}}: commsched-train {{' '.join(overrides)}}: {{error}}")
register_bench_config()
with initialize_config_module(config_module="commsched.bench.conf", version_base=None):
    for page, overrides in {benches!r}:
        try:
            validate_bench(compose(config_name="bench", overrides=overrides))
        except Exception as error:
            failed.append(f"{{page}}: commsched-bench {{' '.join(overrides)}}: {{error}}")
for page, command, args in {flags!r}:
    try:
        (cluster_parser if command == "commsched-cluster" else probe_parser)().parse_args(args)
    except SystemExit:
        failed.append(f"{{page}}: {{command}} {{' '.join(args)}}: refused")
assert "torch" not in sys.modules, "checking a command line imported torch"
print("\\n".join(failed)); sys.exit(1 if failed else 0)
"""
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert len(trains) >= 8 and len(benches) >= 10, (trains, benches)


def test_every_recipe_the_docs_name_exists():
    named = {m for _, body in code_blocks("") + code_blocks("bash") for m in re.findall(r"\brecipes/[\w./-]+", body)}
    assert named, "no recipe named"
    missing = sorted(n for n in named if not (ROOT / n).exists())
    assert not missing, missing
