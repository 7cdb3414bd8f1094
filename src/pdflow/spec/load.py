"""Load spec/protocol.toml into typed structures."""

from __future__ import annotations

import hashlib
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

import msgspec


class SpecTransition(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename={"source": "from"}
):
    source: str
    on: str
    to: str
    emits: tuple[str, ...] = ()
    guard: str | None = None


class SpecTable(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    transitions: tuple[SpecTransition, ...]


class SpecMachine(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: str
    description: str
    initial: str
    inputs: tuple[str, ...]
    remote_inputs: tuple[str, ...]
    states: dict[str, str]
    guards: dict[str, str]
    outputs: dict[str, str]
    table: SpecTable


class SpecTimer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    machine: str
    default_s: float
    env: tuple[str, ...]
    runs_in: tuple[str, ...]
    starts: str
    expires: str
    same_budget_as: str | None = None


class SpecInvariant(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    id: str
    text: str


class RegistryAnswer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    status: int
    when: str


class SpecRegistry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    ready_when: str
    answers: tuple[RegistryAnswer, ...]


class Spec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    spec_version: str
    kvpoll: dict[str, int]
    policies: dict[str, str]
    timers: dict[str, SpecTimer]
    invariants: tuple[SpecInvariant, ...]
    registry: SpecRegistry
    machines: dict[str, SpecMachine]


def spec_path() -> Path:
    """The spec of this checkout when run from source, else the copy shipped in the wheel."""
    source_tree = Path(__file__).resolve().parents[3] / "spec" / "protocol.toml"
    if source_tree.is_file():
        return source_tree
    shipped = resources.files("pdflow") / "_spec" / "protocol.toml"
    return Path(str(shipped))


def spec_files(path: Path | None = None) -> list[Path]:
    """protocol.toml first, then every machine file under machines/, in name order."""
    main = path or spec_path()
    machine_dir = main.parent / "machines"
    extra = sorted(machine_dir.glob("*.toml")) if machine_dir.is_dir() else []
    return [main, *extra]


def spec_sha256(path: Path | None = None) -> str:
    digest = hashlib.sha256()
    for file in spec_files(path):
        digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def machine_files(path: Path | None = None) -> dict[str, Path]:
    """Which spec file defines each machine, for messages that send the reader to it."""
    files: dict[str, Path] = {}
    for file in spec_files(path):
        for name in _read_toml(file).get("machines", {}):
            files.setdefault(name, file)
    return files


def load_spec(path: Path | None = None) -> Spec:
    """The spec, refusing (ValueError, naming the file and the machine) a malformed one: an
    unknown key too, since a misspelt ``guard`` or ``emits`` would otherwise be read as absent
    and could agree with the code by accident."""
    files = spec_files(path)
    raw = _read_toml(files[0])
    machines = raw.setdefault("machines", {})
    defined_in = dict.fromkeys(machines, files[0])
    for extra in files[1:]:
        for name, machine in _read_toml(extra).get("machines", {}).items():
            if name in machines:
                raise ValueError(f"{extra}: machine {name} is defined twice (also in "
                                 f"{defined_in[name]})")  # fmt: skip
            machines[name], defined_in[name] = machine, extra
    for name, machine in machines.items():
        try:
            msgspec.convert(machine, type=SpecMachine)
        except msgspec.ValidationError as exc:
            raise ValueError(f"{defined_in[name]}: machine {name}: malformed: {exc}") from exc
    try:
        return msgspec.convert(raw, type=Spec)
    except msgspec.ValidationError as exc:
        raise ValueError(f"{files[0]}: malformed spec: {exc}") from exc


def _read_toml(file: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"no protocol spec at {file}") from exc
    except IsADirectoryError as exc:
        raise IsADirectoryError(f"{file} is a folder, not a spec file") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{file}: malformed TOML: {exc}") from exc
