"""The documentation site (mkdocs.yml, docs/): `verl-exporter docs` serves it locally, no internet needed; and
the demo's excerpts in docs/demo.md, cut from what a real `verl-exporter demo` (and `demo --hang`) run printed
(tests/tools/test_demo_stack.py and tests/tools/test_demo_hang.py compare them with a fresh run, and rewrite them
with VERL_EXPORTER_UPDATE_DOCS=1)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BEGIN = "<!-- {name}-excerpt:begin (cut from a real demo run by tests/tools/test_{name}.py) -->"
END = "<!-- {name}-excerpt:end -->"
NAN_ALERT = "VerlNonFiniteGradNorm"  # the demo's checkpoint action
STOP_ALERT = "VerlRewardCollapse"  # its stop action
EVENT_RE = re.compile(r"^ {1,3}\d+\.\ds  step +\d+  (\S+) +(.*)$")  # "  38.2s  step 235  trainer      logs ..."
CONTINUED = " " * 26  # the demo wraps an event under its time/step/who columns
DEMO_DIR_RE = re.compile(r"/\S*?verl-exporter-demo-[A-Za-z0-9_]+")

# The entries of an excerpt, in the order the NaN travels: (kind, who, pattern over the whole entry).
DEMO = (
    ("nan", "trainer", r"logs a NaN gradient norm"),
    ("firing", "Prometheus", rf"firing: .*\b{NAN_ALERT} critical"),
    ("notified", "Alertmanager", rf"firing .*\b{NAN_ALERT}\b"),
    ("message", "relay", rf"FIRING · CRITICAL · {NAN_ALERT}\b"),
    ("checkpoint asked", "sidecar", rf"control: checkpoint requested because {NAN_ALERT}\b"),
    ("checkpoint action", "relay", r"action: asked \S+ to checkpoint"),
    ("checkpoint taken", "trainer", rf"checkpoint requested \({NAN_ALERT}\)"),
    ("stop asked", "sidecar", rf"control: stop requested because {STOP_ALERT}\b"),
    ("stop action", "relay", r"action: asked \S+ to stop"),
    ("stop taken", "trainer", rf"stop requested \({STOP_ALERT}\)"),
)
# ... and the hang's (demo --hang): the stall, the stacks, the page.
HANG = (
    ("hang", "trainer", r"the reward function compute_score waits"),
    ("stalled", "Prometheus", r"firing: .*\bVerlTrainingStalledRelative warning"),
    ("stacks", "sidecar", r"forensics: stacks of"),
    ("hung", "Prometheus", r"firing: .*\bVerlTrainingStalled critical"),
    ("page", "relay", r"FIRING · CRITICAL · VerlHangForensics\b"),
)
PATHS = {"demo_stack": DEMO, "demo_hang": HANG}  # the test that runs the demo: what its excerpt follows


def entries(output: str) -> list[tuple[str, list[str]]]:
    """The demo's event entries, each (who, its lines with their continuations)."""
    out: list[tuple[str, list[str]]] = []
    for line in output.splitlines():
        m = EVENT_RE.match(line)
        if m:
            out.append((m.group(1), [line]))
        elif out and line.startswith(CONTINUED):
            out[-1][1].append(line)
        elif out and out[-1][0] != "":
            out.append(("", []))  # anything else ends the entry
    return [e for e in out if e[0]]


def kind_of(who: str, lines: list[str], kinds: tuple[tuple[str, str, str], ...]) -> str | None:
    text = " ".join(" ".join(lines).split())
    return next((kind for kind, by, pattern in kinds if who == by and re.search(pattern, text)), None)


def excerpt(output: str, name: str = "demo_stack") -> str:
    """What the demo printed on its path (the first entry of each kind), abridged at `…`, then its path line
    for the NaN; the demo's temporary folder written as <demo folder>."""
    seen: set[str] = set()
    lines: list[str] = []
    skipped = False
    for who, entry in entries(output):
        kind = kind_of(who, entry, PATHS[name])
        if kind is None or kind in seen:
            skipped = skipped or bool(lines)
            continue
        seen.add(kind)
        if skipped:
            lines.append("  …")
            skipped = False
        lines += entry
    tail = output.splitlines()
    start = next((i for i, line in enumerate(tail) if line.startswith("The path: ")), None)
    if start is not None and name == "demo_stack":
        end = next((i for i in range(start, len(tail)) if not tail[i].strip()), len(tail))
        lines += ["  …", *tail[start:end]]
    return DEMO_DIR_RE.sub("<demo folder>", "\n".join(lines)) + "\n"


def kinds_in(text: str, name: str = "demo_stack") -> list[str]:
    return [k for who, e in entries(text) if (k := kind_of(who, e, PATHS[name]))]


def message_of(text: str, alert: str = NAN_ALERT) -> list[str]:
    """The alert's own section of the robot message it is in, as the chat shows it."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.endswith(f"│ FIRING · CRITICAL · {alert}"))
    end = next(i for i in range(start + 1, len(lines)) if "│ FIRING ·" in lines[i] or "╰─" in lines[i])
    return lines[start:end]


def in_page(page: str, name: str = "demo_stack") -> str:
    """The excerpt held in a page (between the markers, in its code fence)."""
    body = page.split(BEGIN.format(name=name), 1)[1].split(END.format(name=name), 1)[0]
    return body.strip("\n").removeprefix("```text\n").removesuffix("```")


def with_excerpt(page: str, text: str, name: str = "demo_stack") -> str:
    begin, end = BEGIN.format(name=name), END.format(name=name)
    head, rest = page.split(begin, 1)
    return f"{head}{begin}\n```text\n{text}```\n{end}{rest.split(end, 1)[1]}"


def site_config(start: Path | None = None) -> Path | None:
    """The mkdocs.yml of the checkout this package runs from (the docs are not in the wheel)."""
    here = (start or Path(__file__)).resolve()
    return next((p / "mkdocs.yml" for p in here.parents if (p / "mkdocs.yml").is_file() and (p / "docs").is_dir()),
                None)


def serve(listen: str, build: str | None) -> int:
    config = site_config() or site_config(Path.cwd() / "x")
    if config is None:
        print("verl-exporter docs: no mkdocs.yml here; run it in a checkout of verl-exporter (the site is built "
              "from its docs/ folder)", file=sys.stderr)
        return 2
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        print("verl-exporter docs: MkDocs is not installed: pip install 'verl-exporter[docs]'", file=sys.stderr)
        return 2
    args = ["build", "--site-dir", build] if build else ["serve", "--dev-addr", listen, "--no-livereload"]
    return subprocess.call([sys.executable, "-m", "mkdocs", *args, "--config-file", str(config)])
