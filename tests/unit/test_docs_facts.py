"""Facts the docs state that the code can check: settings and their defaults, environment
variables, metric names, drop reasons and CLI options. Each test reads the doc and the code, so
a change to either that the other does not follow fails here."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import msgspec
import pytest

from pdflow.cli import build_parser
from pdflow.io.control import SEND_REFUSALS
from pdflow.io.metrics import NodeMetrics
from pdflow.io.settings import _FIELDS, Settings, pdflow_variable

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "operations.md"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "spec" / "README.md"]
CODE = [ROOT / "src", ROOT / "tests", ROOT / "tests_sglang", ROOT / "scripts", ROOT / "benchmarks"]


def _section(text: str, heading: str) -> str:
    """The text of a markdown section, from its heading to the next heading of its level."""
    start = text.index(heading)
    level = heading.split(" ", 1)[0]
    end = text.find(f"\n{level} ", start + len(heading))
    return text[start : len(text) if end < 0 else end]


def _table_rows(section: str) -> list[list[str]]:
    rows = []
    for line in section.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows[1:]  # the header


def _code_names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


# ---- settings --------------------------------------------------------------------------------
_UNITS = {"s": 1, "KiB": 1 << 10, "MiB": 1 << 20}


def _default_of(text: str) -> object:
    """A default as the settings table writes it: `5 s`, `on`, `256 MiB`, `1,048,576`, ..."""
    text = re.sub(r"\s*\(.*?\)", "", text.split(";")[0]).strip()
    words = {"on": True, "off": False, "none": None, "unset": None}
    if text in words:
        return words[text]
    if text.startswith("`") and text.endswith("`"):
        return text.strip("`")
    number = re.fullmatch(r"(\d[\d,]*(?:\.\d+)?)(?: (s|KiB|MiB))?", text)
    if number is None:
        return text
    value = float(number.group(1).replace(",", ""))
    value *= _UNITS.get(number.group(2) or "s", 1)
    return int(value) if value.is_integer() else value


def _settings_table() -> dict[str, str]:
    section = _section(OPERATIONS.read_text(encoding="utf-8"), "## Settings")
    found: dict[str, str] = {}
    for row in _table_rows(section):
        names = _code_names(row[0])
        defaults = [row[1]] if len(names) == 1 else [d.strip() for d in row[1].split(", ")]
        if len(defaults) == 1:
            defaults *= len(names)
        assert len(defaults) == len(names), f"settings row {row[0]}: one default per setting"
        for name, default in zip(names, defaults, strict=True):
            assert name not in found, f"{name} has two rows in docs/operations.md"
            found[name] = default
    return found


def test_the_settings_table_lists_every_setting_and_nothing_else() -> None:
    documented = set(_settings_table())
    fields = set(Settings.__struct_fields__)
    assert documented - fields == set(), "documented settings that do not exist"
    assert fields - documented == set(), "settings docs/operations.md does not list"


# Defaults the table describes rather than states: the value the code means by its default.
_DESCRIBED = {
    # None: a quarter of control_max_early_pages, which the table gives in parentheses.
    "control_max_early_pages_per_decode": "a quarter of `control_max_early_pages` (262,144)",
}


def test_the_settings_table_states_each_default() -> None:
    from pdflow.io.limits import EARLY_SHARES

    defaults = Settings()
    for name, text in _settings_table().items():
        code = getattr(defaults, name)
        if name in _DESCRIBED:
            assert text == _DESCRIBED[name], name
            assert code is None and EARLY_SHARES == 4
            assert defaults.control_max_early_pages // EARLY_SHARES == 262_144
            continue
        if isinstance(code, msgspec.Struct | str) and not isinstance(code, bool):
            code = str(code)
        assert _default_of(text) == code, f"{name}: the doc says {text!r}, the code {code!r}"


def test_the_sglang_backend_default_for_small_room_staging_is_the_documented_one() -> None:
    # Read from the source: importing the backend needs SGLang (its own environment).
    conn = ast.parse((ROOT / "src" / "pdflow" / "sglang" / "conn.py").read_text("utf-8"))
    (value,) = [
        node.value for node in conn.body
        if isinstance(node, ast.Assign) and len(node.targets) == 1
        and getattr(node.targets[0], "id", "") == "SMALL_ROOM_STAGING_BYTES"
    ]  # fmt: skip
    staged = eval(compile(ast.Expression(value), "conn.py", "eval"), {"__builtins__": {}})
    text = _settings_table()["small_room_staging_bytes"]
    assert f"{staged} in the SGLang backend" in text


def test_the_sglang_variables_are_named_with_their_setting_and_floor() -> None:
    text = OPERATIONS.read_text(encoding="utf-8")
    for name, field in _FIELDS.items():
        if field.sglang is None:
            continue
        said = re.search(rf"`{field.sglang}`\s*\(`{name}`(?P<floor>, at least [^)]*)?\)", text)
        assert said is not None, f"docs/operations.md does not name {field.sglang} for {name}"
        if field.sglang_floor is not None:
            assert said["floor"] is not None, f"{field.sglang}: its floor is not stated"
            assert _default_of(said["floor"].removeprefix(", at least ")) == field.sglang_floor


# ---- environment variables -------------------------------------------------------------------
def _code_text() -> str:
    parts = []
    for base in CODE:
        for path in base.rglob("*"):
            if path.suffix in {".py", ".sh", ".toml", ""} and path.is_file():
                parts.append(path.read_text(encoding="utf-8", errors="replace"))
    parts.append((ROOT / "Makefile").read_text(encoding="utf-8"))
    return "\n".join(parts)


def test_every_pdflow_variable_in_the_docs_is_read_somewhere() -> None:
    settings_vars = {pdflow_variable(name) for name in _FIELDS}
    code = _code_text()
    for doc in DOCS:
        for var in set(re.findall(r"\bPDFLOW_[A-Z0-9_]*[A-Z0-9]\b", doc.read_text("utf-8"))):
            if var in settings_vars:
                continue
            # Not a setting: the harnesses' and scripts' own variables, read where they live.
            assert re.search(rf"[\"'$]{{?{var}\b", code), f"{doc.name}: {var} is read nowhere"


# ---- metrics ---------------------------------------------------------------------------------
def _metric_names() -> set[str]:
    registry = NodeMetrics("decode", "test").registry
    names = set()
    for collector in registry._collector_to_names:
        for metric in collector.describe():
            names.add(f"{metric.name}_total" if metric.type == "counter" else metric.name)
    return names


def _metrics_table() -> dict[str, str]:
    section = _section(OPERATIONS.read_text(encoding="utf-8"), "## Metrics")
    found = {}
    for row in _table_rows(section):
        for name in _code_names(row[0]):
            found[name.split("{", 1)[0]] = " | ".join(row)
    return found


def test_the_metrics_table_lists_every_metric_and_nothing_else() -> None:
    documented, real = set(_metrics_table()), _metric_names()
    assert documented - real == set(), "documented metrics the nodes do not export"
    assert real - documented == set(), "metrics docs/operations.md does not list"


def test_every_metric_named_in_the_docs_exists() -> None:
    real = _metric_names()
    for doc in DOCS:
        text = doc.read_text("utf-8")
        for name in set(re.findall(r"\bpdflow_[a-z_]+[a-z]\b", text)):
            if name.endswith(("_total", "_seconds", "_pages", "_bytes", "_queued", "_admitted")):
                assert name in real, f"{doc.name} names a metric {name} that does not exist"


def _string_args(paths: list[Path], callees: set[str]) -> set[str]:
    """The string constants passed first to calls of ``callees`` in these files."""
    found = set()
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        constants = {
            node.targets[0].id: node.value.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign) and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.Constant)
        }  # fmt: skip
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name not in callees:
                continue
            for arg in node.args[:2]:  # a method's first argument may be its output list
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    found.add(arg.value)
                    break
                if isinstance(arg, ast.Name) and isinstance(constants.get(arg.id), str):
                    found.add(constants[arg.id])
                    break
    return found


def _frame_drop_reasons() -> set[str]:
    io = ROOT / "src" / "pdflow" / "io"
    reasons = _string_args(sorted(io.glob("*.py")), {"FrameError", "_drop"})
    limits = ast.parse((io / "limits.py").read_text(encoding="utf-8"))
    for node in ast.walk(limits):  # PrefillRankLimits.refusal and EarlyPages.admit return them
        value = node.value if isinstance(node, ast.Return) else None
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            reasons.add(value.value)
    return reasons


def test_every_frame_drop_reason_is_documented() -> None:
    text = OPERATIONS.read_text(encoding="utf-8")
    where = _metrics_table()["pdflow_dropped_frames_total"]
    where += _section(text, "## Authenticated control plane")
    reasons = _frame_drop_reasons()
    assert {"unannounced_decode", "early_pages_share", "bad_mac", "handler_error"} <= reasons
    missing = {r for r in reasons if not re.search(rf"`?\b{r}\b", where)}
    assert missing == set(), "dropped_frames reasons docs/operations.md does not give"


def test_every_core_drop_kind_is_documented() -> None:
    core = sorted((ROOT / "src" / "pdflow" / "core").rglob("*.py"))
    kinds = _string_args(core, {"_drop", "Dropped"})
    assert {"layout_too_large", "ready_table_full", "bad_generation"} <= kinds
    row = _metrics_table()["pdflow_core_dropped_total"]
    missing = {kind for kind in kinds if not re.search(rf"\b{kind}\b", row)}
    assert missing == set(), "pdflow_core_dropped_total kinds docs/operations.md does not give"


def test_every_send_refusal_is_documented() -> None:
    row = _metrics_table()["pdflow_control_refused_sends_total"]
    assert {r for r in SEND_REFUSALS if not re.search(rf"\b{r}\b", row)} == set()


# ---- the command line ------------------------------------------------------------------------
def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {opt for action in parser._actions for opt in action.option_strings}


_COMMAND = re.compile(r"(?<![\w./-])pdflow ((?:[a-z]+)(?: [a-z]+)?)((?:[^`\n|]*))")


def _text(doc: Path) -> str:
    """The doc, with the set-up's `.venv/bin/pdflow` read as `pdflow`."""
    return doc.read_text("utf-8").replace(".venv/bin/pdflow ", "pdflow ")


def _mentions() -> list[tuple[str, str, str]]:
    """(doc, sub-command words, the rest of the span) for each `pdflow ...` in the docs."""
    found = []
    for doc in DOCS:
        for span in re.findall(r"`([^`\n]*pdflow [^`\n]*)`|^(?:\$ )?(pdflow .*)$",
                               _text(doc), re.MULTILINE):  # fmt: skip
            text = span[0] or span[1]
            for words, rest in _COMMAND.findall(text):
                found.append((doc.name, words, rest))
    return found


def test_every_cli_option_in_the_docs_exists() -> None:
    top = _subcommands(build_parser())
    mentions = _mentions()
    assert len(mentions) > 20
    for doc, words, rest in mentions:
        first, _, second = words.partition(" ")
        if first not in top:
            continue  # prose: "pdflow writes ...", "pdflow as SGLang's ..."
        parser = top[first]
        nested = _subcommands(parser)
        if nested:
            assert second in nested, f"{doc}: pdflow {words}: no such sub-command"
            parser = nested[second]
        else:
            rest = f" {second}{rest}"
        options = _options(parser)
        for option in re.findall(r"(?<![\w-])--[a-z][a-z-]*", rest):
            assert option in options, f"{doc}: `pdflow {words}{rest}`: no option {option}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_the_docs_name_only_commands_that_exist(doc: Path) -> None:
    commands = set(_subcommands(build_parser()))
    for name in re.findall(r"`pdflow ([a-z]+)", doc.read_text("utf-8")):
        assert name in commands, f"{doc.name}: `pdflow {name}` is no command"


# ---- the module map --------------------------------------------------------------------------
def test_the_architecture_module_map_names_the_packages_that_exist() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = _section(text, "## Layers").split("```")[1]
    named = set(re.findall(r"^(pdflow\.[a-z_]+)", block, re.MULTILINE))
    src = ROOT / "src" / "pdflow"
    packages = {f"pdflow.{p.parent.name}" for p in src.glob("*/__init__.py")}
    assert named == packages, "docs/architecture.md's Layers block and src/pdflow differ"
    for folder in re.findall(r"^([a-z_]+)/", block, re.MULTILINE):
        assert (ROOT / folder).is_dir(), folder
    cli = re.search(r"^pdflow\.cli\s+(.*)$", block, re.MULTILINE)
    assert cli is not None
    assert set(cli.group(1).split(" | ")) == set(_subcommands(build_parser()))


# ---- the trace format ------------------------------------------------------------------------
def test_the_trace_doc_lists_every_header_and_step_field() -> None:
    from pdflow.trace.format import TRACE_FORMAT_VERSION, StepRecord, TraceHeader

    text = (ROOT / "docs" / "trace.md").read_text(encoding="utf-8")
    tables = [part for part in text.split("\n\n") if part.startswith("| field |")]
    header, step = ({n for row in _table_rows(t) for n in _code_names(row[0])} for t in tables[:2])
    assert header == set(TraceHeader.__struct_fields__) - {"kind"}
    assert step == set(StepRecord.__struct_fields__) - {"kind"}
    assert f"trace format version ({TRACE_FORMAT_VERSION})" in text


def test_the_spec_readme_counts_the_protocol_rows_and_the_cell_only_ones() -> None:
    from pdflow.sim.coverage import PROTOCOL_MACHINES, cell_only, spec_transitions

    text = " ".join((ROOT / "spec" / "README.md").read_text(encoding="utf-8").split())
    rows = len(spec_transitions(PROTOCOL_MACHINES))
    assert f"({', '.join(PROTOCOL_MACHINES)}: {rows} rows)" in text
    assert f"Only a cell drive reaches these {len(cell_only())}" in text
