"""The packages' imports as an allow-map: each package of the repo imports only the packages its rule
names, and every package has a rule, so a new one fails here until its rule is written (a
`forbidden` contract that lists every other package lets a new one through unnoticed).

A package is a folder at the repository's root with an `__init__.py`, and for `services` each of
its subpackages (and `bench/probes`, the research probes). Every import counts, inside functions
too. What the rules are for: docs/architecture.md, "Rules". The finer rules inside a package
(the layers of `services`, the rooms of the runtime, what serving takes of the runtime) are
import-linter contracts in pyproject.toml; `make lint` runs both."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL_LIBRARIES = frozenset({"torch", "transformers", "numpy", "onnxruntime"})  # what a process without a model never loads


@dataclass(frozen=True)
class Rule:
    may_import: frozenset[str]  # the packages it may import besides itself
    libraries: frozenset[str] = MODEL_LIBRARIES  # the model libraries it may import
    never: tuple[str, ...] = ()  # modules of those packages it still may not import


STAGES = frozenset({"services.thinker", "services.talker", "services.code2wav"})
PLUMBING = frozenset({"services.base", "services.serving", "omni"})  # what the router and the gateway build on
MODEL_SIDE = PLUMBING | {"services.runtime"}
RULES = {
    "omni": Rule(frozenset(), frozenset()),  # the generated protos (protobuf and grpc only)
    "services.base": Rule(frozenset(), frozenset({"numpy"})),  # numpy: resample.py alone
    "services.runtime": Rule(frozenset({"services.base"})),
    "services.serving": Rule(MODEL_SIDE),
    **{stage: Rule(MODEL_SIDE) for stage in STAGES},
    "services.tools": Rule(MODEL_SIDE | STAGES),
    # Processes that start in well under a second with no GPU image: the base and the plumbing only.
    "router": Rule(PLUMBING, frozenset()),
    "gateway": Rule(PLUMBING, frozenset({"numpy"}), never=("services.serving.wire",)),  # numpy: audio encoding
    # numpy: its audio as arrays; onnxruntime: turn detection's model
    "sessions": Rule(PLUMBING, frozenset({"numpy", "onnxruntime"}), never=("services.serving.wire",)),
    "bench": Rule(MODEL_SIDE | STAGES | {"services.tools"}),
    "bench.probes": Rule(MODEL_SIDE | STAGES | {"services.tools", "bench", "sessions"}),  # sessions: turn detection's cost
}


def package_of(module: str) -> str:
    """The package (a key of RULES) a dotted module name belongs to."""
    parts = module.split(".")
    if parts[0] == "services" and len(parts) > 1 or parts[:2] == ["bench", "probes"]:
        return ".".join(parts[:2])
    return parts[0]


def packages(root: Path = ROOT) -> set[str]:
    """Every package of the repository at `root`, tests aside."""
    tops = {path.parent.name for path in root.glob("*/__init__.py")} - {"tests"}
    subpackages = {f"services.{path.parent.name}" for path in root.glob("services/*/__init__.py")}
    return tops - {"services"} | subpackages | {f"bench.{path.parent.name}" for path in root.glob("bench/probes/__init__.py")}


def imports(module: str, path: Path) -> set[str]:
    """The dotted names `module` (its source at `path`) imports, relative imports resolved."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):  # `from a import b`: a.b, whether b is a module or a name
            base = module.split(".")[:-node.level] if node.level else []
            names |= {".".join([*base, *([node.module] if node.module else []), alias.name]) for alias in node.names}
    return names


def broken(package: str, root: Path = ROOT) -> list[str]:
    """Each import of `package`'s modules its rule does not allow, as 'module imports name'."""
    rule, ours = RULES[package], set(RULES) | {"services"}
    found = []
    for path in sorted(root.joinpath(*package.split(".")).rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        if package_of(module) != package:
            continue  # bench.probes' modules are under bench/ too
        for name in sorted(imports(module, path)):
            target, top = package_of(name), name.split(".")[0]
            allowed = target == package or target in rule.may_import if top in ours else \
                top not in MODEL_LIBRARIES or top in rule.libraries
            if not allowed or any(name == never or name.startswith(never + ".") for never in rule.never):
                found.append(f"{module} imports {name}")
    return found


def test_every_package_has_a_rule():
    missing = packages() - set(RULES)
    assert not missing, f"packages with no rule in tests/test_layers.py's RULES: {sorted(missing)}"


def test_every_package_imports_only_what_its_rule_allows():
    found = [line for package in sorted(packages()) for line in broken(package)]
    assert not found, "imports the allow-map does not allow:\n" + "\n".join(found)


def test_a_package_without_a_rule_and_an_import_outside_its_rule_are_caught(tmp_path):
    """The check itself, on a tree of two packages: `extra`, which has no rule, and a router that
    imports the sessions service."""
    for package, source in (("router", "from sessions import turns\n"), ("extra", "import torch\n")):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(source)
    assert packages(tmp_path) - set(RULES) == {"extra"}
    assert broken("router", tmp_path) == ["router.__init__ imports sessions.turns"]
