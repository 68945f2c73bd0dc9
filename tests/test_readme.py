"""The README as a newcomer uses it: the commands it shows run as printed, every flag it names is in that
command's ``--help``, and every Python snippet's imports and names resolve. A README that drifts from the
code fails here.

The main job runs small (the README itself shows ``--max-duration`` for a shorter try), with its daemons,
a worker started before it and the replay and monitor lines afterwards, exactly as the README prints them.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests.support import REPO_ROOT, Process

README = (REPO_ROOT / "README.md").read_text()
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
RUN_NAME = "readme"
# Small sizes for the main job, so the test takes seconds: the README's own way to shorten a run is
# --max-duration; the model and batch options are in `eventbus run --help` (checked below like any flag).
SMALL = ["--max-duration", "4ba", "--batch-size", "4", "--seq-len", "16", "--d-model", "16", "--layers", "1"]


def blocks(language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(README) if lang == language]


def shell_lines() -> list[str]:
    """Each command of the README's shell blocks: continuations joined, comments dropped, `&&` split."""
    lines = []
    for body in blocks("sh"):
        for line in body.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                lines.extend(part.strip() for part in line.split("&&"))
    return lines


def program(command: str) -> list[str] | None:
    """The argv (after the interpreter) of an eventbus or daemon command line, or None for anything else."""
    text = command.removeprefix(".venv/bin/")
    if not re.match(r"(eventbus|python -m eventbus)\b", text):
        return None
    words = shlex.split(text)
    if words[:1] == ["eventbus"]:
        return ["-m", "eventbus", *words[1:]]
    if words[:2] == ["python", "-m"] and words[2:3] and words[2].split(".")[0] == "eventbus":
        return words[1:]
    return None


def prose_paragraphs() -> list[str]:
    return [p for p in FENCE.sub("", README).split("\n\n") if p.strip()]


def shown_commands() -> list[str]:
    """Every eventbus/daemon command the README shows, in shell blocks, tables and text."""
    spans = [s for p in prose_paragraphs() for s in re.findall(r"`([^`\n]+)`", p)]
    return [c for c in dict.fromkeys(shell_lines() + spans) if program(c)]


@functools.cache
def help_text(argv: tuple[str, ...]) -> str:
    result = subprocess.run([sys.executable, *argv, "--help"], capture_output=True, text=True, timeout=60,
                            cwd=REPO_ROOT, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert result.returncode == 0, f"{' '.join(argv)} --help failed:\n{result.stderr[-2000:]}"
    return result.stdout


def help_of(command: str) -> str:
    """The --help of the command (its words before the first option: program, subcommands, positionals)."""
    argv = program(command)
    assert argv is not None
    head = []
    for word in argv:
        if word.startswith("-") and word != "-m":
            break
        head.append(word)
    return help_text(tuple(head))


def has_flag(help: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help) is not None


def flag_checks() -> list[tuple[str, str]]:
    """(command, flag) for every --flag the README names, with the command it belongs to: its own line, its
    table row, or the last command named before it in the same paragraph (else: any command shown)."""
    checks = []
    for command in shown_commands():
        checks += [(command, flag) for flag in FLAG.findall(command)]
    for row in (line for line in README.splitlines() if line.startswith("| `")):
        first, *rest = row.strip("|").split("|")
        command = re.findall(r"`([^`]+)`", first)[0]
        if program(command):
            checks += [(command, flag) for flag in FLAG.findall("|".join(rest))]
    for paragraph in prose_paragraphs():
        if paragraph.startswith("|"):
            continue
        current = None
        for span in re.findall(r"`([^`\n]+)`", paragraph):
            if program(span):
                current = span
            elif span.startswith("--"):
                checks += [(current or "", flag) for flag in FLAG.findall(span)]
    return list(dict.fromkeys(checks))


def test_the_readme_shows_the_two_commands_and_ci_runs_the_test_command_as_printed():
    lines = [line for body in blocks("sh") for line in body.splitlines() if line.startswith("sh scripts/")]
    assert "sh scripts/bootstrap.sh && .venv/bin/eventbus run" in lines
    test_command = next(line for line in lines if line.startswith("sh scripts/bootstrap.sh test"))
    assert test_command in (REPO_ROOT / ".ci" / "run").read_text().replace(
        "sh scripts/bootstrap.sh test\n", "sh scripts/bootstrap.sh test && ")


def test_the_readme_is_short_and_every_page_it_links_to_exists():
    assert len(README.splitlines()) <= 200
    for target in re.findall(r"\]\(([^)\s]+)\)", README):
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        assert (REPO_ROOT / path).exists(), target
        if anchor:  # an anchor the docs set explicitly ({#name}) or a heading's slug
            text = (REPO_ROOT / path).read_text()
            slugs = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-")
                     for h in re.findall(r"^#+ (.*)$", text, re.M)}
            assert f"{{#{anchor}}}" in text or anchor in slugs, target


def test_every_extra_the_readme_installs_is_declared():
    import tomllib

    declared = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = [extra for group in re.findall(r"\.\[([\w,-]+)\]", README) for extra in group.split(",")]
    assert named
    assert not [extra for extra in named if extra not in declared], declared.keys()


def test_nothing_users_read_tells_the_projects_history():
    """Issue numbers, work sessions and commit hashes belong in the repository's history, not in its pages."""
    pages = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]
    history = re.compile(r"\bissues? #?\d+|\bsessions?\b|\bcommit [0-9a-f]{7,40}\b|\b[0-9a-f]{7}\b(?=\))", re.I)
    for page in pages:
        raw = page.read_text()
        text = re.sub(r"`[^`\n]*`", "", FENCE.sub("", raw))  # code may name a module `session`
        found = history.findall(text) + re.findall(r"`[0-9a-f]{7,40}`", raw)
        assert not found, f"{page.relative_to(REPO_ROOT)}: {found}"


@pytest.mark.parametrize("command", shown_commands())
def test_every_command_shown_has_help(command):
    assert "usage:" in help_of(command)


def test_every_flag_the_readme_names_is_in_that_commands_help():
    missing = []
    for command, flag in flag_checks():
        helps = [help_of(command)] if command else [help_of(c) for c in shown_commands()]
        if not any(has_flag(h, flag) for h in helps):
            missing.append(f"{flag} ({command or 'any command shown'})")
    assert not missing, "flags the README names that no --help has: " + ", ".join(missing)


def test_every_flag_in_the_docs_command_blocks_is_in_that_commands_help():
    """The documentation's shell blocks are copied as often as the README's: the same check for their
    eventbus and daemon command lines (environment assignments in front are skipped)."""
    missing = []
    for page in sorted((REPO_ROOT / "docs").rglob("*.md")):
        for lang, body in FENCE.findall(page.read_text()):
            if lang not in ("sh", "bash", ""):
                continue
            for line in body.replace("\\\n", " ").splitlines():
                line = re.sub(r"\s+#.*$", "", line).strip()
                line = re.sub(r"^(export\s+)?([A-Z_]+=\S+\s+)+", "", line)
                if not line or not program(line):
                    continue
                missing += [f"{page.name}: {flag} ({line})" for flag in FLAG.findall(line)
                            if not has_flag(help_of(line), flag)]
    assert not missing, missing


def test_the_security_page_lists_every_environment_variable_the_code_reads():
    read = {name for folder in ("eventbus", "workers") for path in (REPO_ROOT / folder).rglob("*.py")
            for name in re.findall(r"EVENTBUS_[A-Z0-9_]+", path.read_text())}
    listed = set(re.findall(r"`(EVENTBUS_[A-Z0-9_]+)`", (REPO_ROOT / "docs" / "security.md").read_text()))
    assert read and not read - listed, sorted(read - listed)


def _names(tree: ast.AST) -> tuple[list[str], list[tuple[str, int, list[str]]]]:
    """A snippet's import statements, and each dotted name it uses from them (with the call's arity and
    keywords where it is called)."""
    imports, bound = [], set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.append(ast.unparse(node))
            bound |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    uses: list[tuple[str, int, list[str]]] = []
    calls = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Attribute, ast.Name)):
            dotted = ast.unparse(node)
            if dotted.split(".")[0] in bound and re.fullmatch(r"[\w.]+", dotted):
                call = calls.get(id(node))
                uses.append((dotted, len(call.args) if call else -1,
                             [k.arg for k in call.keywords if k.arg] if call else []))
    return imports, uses


CHECK_SNIPPETS = """
import inspect, json, sys, traceback
failures = []
for index, snippet in enumerate(json.loads(sys.argv[1])):
    namespace = {}
    try:
        for statement in snippet["imports"]:
            exec(statement, namespace)
        for dotted, arity, keywords in snippet["uses"]:
            value = eval(dotted, namespace)  # an AttributeError names what the README uses and the code lacks
            if arity < 0:
                continue
            try:
                signature = inspect.signature(value)
            except (TypeError, ValueError):
                continue
            signature.bind_partial(*[None] * arity, **dict.fromkeys(keywords))  # a TypeError names the argument
    except Exception:
        failures.append(f"snippet {index}:\\n{traceback.format_exc(limit=2)}")
print("\\n".join(failures), file=sys.stderr)
sys.exit(1 if failures else 0)
"""


def test_every_python_snippet_imports_and_calls_what_exists():
    """One process for all snippets: the trainers' imports are the slow part."""
    snippets = []
    for index, body in enumerate(blocks("python")):
        imports, uses = _names(ast.parse(body))
        assert imports, f"snippet {index} imports nothing, so checks nothing: show where its names come from"
        snippets.append({"imports": imports, "uses": uses})
    result = subprocess.run([sys.executable, "-c", CHECK_SNIPPETS, json.dumps(snippets)],
                            capture_output=True, text=True, timeout=180,
                            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONWARNINGS="ignore"))
    assert result.returncode == 0, result.stderr[-4000:]


def _shown(prefix: str) -> str:
    line = next((line for line in shell_lines() if line.removeprefix(".venv/bin/").startswith(prefix)), None)
    assert line is not None, f"the README no longer shows a '{prefix} ...' line"
    return line


def _argv(line: str, folder: str) -> list[str]:
    argv = program(line.replace("$PWD", folder).replace("<run_name>", RUN_NAME))
    assert argv is not None
    return argv


def test_the_main_job_a_worker_replay_and_the_monitor_run_as_printed():
    folder = tempfile.mkdtemp(prefix="rd", dir="/tmp")  # short: the run's ipc path must fit a socket name
    try:
        # The callback file the README tells the reader to save, under the name it gives.
        saved_as = README.index("`mycallbacks.py`")
        snippet = FENCE.search(README, saved_as)
        assert snippet is not None and snippet.group(1) == "python"
        with open(os.path.join(folder, "mycallbacks.py"), "w") as out:
            out.write(snippet.group(2))
        env = {"PYTHONPATH": f"{folder}{os.pathsep}{REPO_ROOT}"}

        worker = Process(_argv(_shown("eventbus worker"), folder), cwd=folder, env=env)
        try:
            main_job = _shown("eventbus run")
            assert main_job.startswith(".venv/bin/eventbus run")
            job = Process([*_argv(main_job, folder), "--run-name", RUN_NAME, *SMALL], cwd=folder, env=env)
            assert job.finish(timeout=180) == 0, "\n".join(job.stderr[-40:])
            assert worker.finish(timeout=60) == 0, "\n".join(worker.stderr[-20:])
        finally:
            worker.kill()
        report = f"{RUN_NAME}: 4 batches, last loss"
        assert any(report in line for line in worker.stdout), worker.stdout + worker.stderr

        # What the README says lands in runs/<run_name>/ is there.
        paragraph = next(p for p in prose_paragraphs() if "runs/<run_name>/" in p and "lands in" in p)
        files = [s for s in re.findall(r"`([^`\s/]+\.[a-z]+)`", paragraph)]
        assert files, paragraph
        for name in files:
            assert os.path.exists(os.path.join(folder, "runs", RUN_NAME, name)), name

        replay = subprocess.run([sys.executable, *_argv(_shown("eventbus replay"), folder)], cwd=folder,
                                capture_output=True, text=True, timeout=60, env=dict(os.environ, **env))
        assert replay.returncode == 0, replay.stderr[-2000:]
        assert report in replay.stdout

        finished = next(line for line in shell_lines() if "monitor runs/" in line)
        monitor = subprocess.run([sys.executable, *_argv(finished, folder)], cwd=folder, stdin=subprocess.DEVNULL,
                                 capture_output=True, text=True, timeout=60, env=dict(os.environ, **env))
        assert monitor.returncode == 0, monitor.stderr[-2000:]
        assert RUN_NAME in monitor.stdout + monitor.stderr
    finally:
        shutil.rmtree(folder, ignore_errors=True)
