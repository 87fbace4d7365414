"""torch.export archives (``.pt2``) loaded without running code from the file.

``torch.export.load`` trusts its file. In the pinned torch it unpickles without restriction (weights and constants
marked ``use_pickle``, custom and opaque objects, the sample inputs when their restricted load fails, the legacy
weight files), loads an AOTInductor shared library found in the archive, evaluates the symbolic shape expressions
with ``sympy.sympify`` (Python's ``eval``) and turns the program's guards, argument names and input spec into Python
source that ``ExportedProgram.module()`` executes.

So the archive is read here as a zip first (:func:`vetted_archive`), and only what is known to be data goes on:

- **entries**: the program (``models/model.json``), the weights' and constants' configs and their raw tensor
  records. An AOTInductor folder or any native library, a legacy pickled weight file or the pre-2.7 layout is
  refused; the sample inputs, extra files and anything else are never read (rasterscale makes its own dummy tile).
- **payloads**: every weight and constant is a raw tensor record (``use_pickle: false`` with its tensor meta);
  a pickled one, a custom (TorchBind) object or an opaque Python object is refused.
- **the program** (its JSON, walked whole): every operator an ATen operator, one of torch's symbolic-integer
  operators or a higher-order operator that runs a subgraph of the program (autocast, grad mode, cond, loops);
  every symbolic expression made of symbols, numbers, operators and sympy's and torch's expression classes; every
  guard a comparison of input sizes and numbers; every argument name, input-spec key and subgraph name a Python
  identifier, every parameter's, buffer's and constant's path identifiers joined by dots; no custom objects. Node
  metadata (stack traces, module paths) is dropped: nothing runs it, but FX writes some of it into generated
  source.

The program is then loaded by torch from a new in-memory archive holding only the vetted records (no sample inputs,
no native code, no pickles), through the archive loader itself, so torch's fallbacks to older formats (which
unpickle) are never reached. A torch without that loader (another version's private API) cannot load a .pt2 safely
here: the form is refused, with ONNX or TorchScript named instead. A problem is one
:class:`~rasterscale.errors.InputError` line naming the file and what was found.
"""

from __future__ import annotations

import functools
import io
import json
import keyword
import re
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from rasterscale.errors import InputError

MODEL = "model"
PROGRAM = f"models/{MODEL}.json"
WEIGHTS_CONFIG = f"data/weights/{MODEL}_weights_config.json"
CONSTANTS_CONFIG = f"data/constants/{MODEL}_constants_config.json"
SAMPLE_INPUTS = f"data/sample_inputs/{MODEL}.pt"
ARCHIVE_FORMAT = "archive_format"
KEPT_AS_THEY_ARE = (ARCHIVE_FORMAT, "archive_version", "byteorder")
NATIVE_SUFFIXES = (".so", ".dll", ".dylib", ".pyd", ".cubin", ".hsaco", ".o", ".a", ".spv")
RAW_WEIGHT = re.compile(r"weight_\d+")
RAW_CONSTANT = re.compile(r"tensor_\d+")
ATEN_OPERATOR = re.compile(r"torch\.ops\.aten\.[A-Za-z_]\w*\.[A-Za-z_]\w*")
# higher-order operators that run a subgraph of the same program (its autocast or grad mode, a branch, a loop):
# never one that calls a kernel, a delegate or an object from outside the graph
SUBGRAPH_OPERATORS = frozenset(
    f"torch.ops.higher_order.{name}"
    for name in ("wrap_with_autocast", "wrap_with_set_grad_enabled", "cond", "while_loop", "scan", "invoke_subgraph")
)

# symbolic shape expressions as torch writes them (sympy's srepr: ``Mul(Integer(2), Symbol('s39', positive=True,
# integer=True))``): sympy's expression classes, torch's own sympy functions, symbols' names quoted, numbers,
# operators and assumptions as keywords. No attribute, item or other string can be written, so ``sympify`` (an
# ``eval``) can only build an expression.
EXPRESSION_TOKEN = re.compile(
    r"\s*(?:(?P<number>\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)|(?P<symbol>'[a-z]+\d+')|(?P<name>[A-Za-z_]\w*)"
    r"|(?P<op>\*\*|//|==|!=|<=|>=|[-+*/%(),<>&|~=]))"
)
SYMBOL = re.compile(r"[a-z]+\d+")
ASSUMPTIONS = frozenset(
    {
        "positive", "negative", "nonnegative", "nonpositive", "nonzero", "zero", "integer", "rational", "real",
        "finite", "infinite", "even", "odd", "commutative", "evaluate",
    }
)  # fmt: skip
CONSTANTS = frozenset({"True", "False", "oo", "zoo", "nan", "true", "false"})
# a guard: sizes and strides of the inputs (L['x'].size()[0]), numbers, comparisons and arithmetic
GUARD_TOKEN = re.compile(
    r"\s*(?:L\['[A-Za-z_]\w*'\]\.(?:size|stride)\(\)\[\d+\]|\d+|and\b|or\b|not\b|==|!=|<=|>=|//|[-+*%()<>])"
)
# names FX writes into the generated source of ExportedProgram.module() (attribute paths: ``getattr(self, "{part}")``
# for a part that is not an identifier, unescaped): parameters', buffers', constants' and submodules' paths
FQN = re.compile(r"(?:[A-Za-z_]\w*|\d+)(?:\.(?:[A-Za-z_]\w*|\d+))*")
FQN_KEYS = frozenset(
    {"parameter_name", "buffer_name", "tensor_constant_name", "custom_obj_name", "user_input_name", "fqn"}
)
TREESPEC_TYPES = frozenset({None, "builtins.tuple", "builtins.list", "builtins.dict", "collections.OrderedDict"})


class UnsafeArchive(Exception):
    """What in a ``.pt2`` would run code or is not part of a plain program; worded for the one line."""


@dataclass(frozen=True)
class VettedArchive:
    """The records of a ``.pt2`` that torch may read: names relative to the archive's folder, bytes vetted."""

    records: Mapping[str, bytes]

    def as_buffer(self, api: ArchiveApi) -> io.BytesIO:
        """A new archive holding only these records (torch's own writer: its layout and alignment)."""
        buffer = io.BytesIO()
        with api.writer(buffer) as writer:
            for name, data in self.records.items():
                writer.write_bytes(name, data)
        buffer.seek(0)
        return buffer


@dataclass(frozen=True)
class ArchiveApi:
    """The parts of torch that read and write a .pt2's records and know its symbolic operators."""

    load: Any  # torch.export.pt2_archive._package.load_pt2
    writer: Any  # PT2ArchiveWriter
    symbolic_operators: Any  # torch._export.serde.serialize._SYM_OPS


def archive_api(path: str = "") -> ArchiveApi:
    """This torch's archive reader and writer, on which the vetted loading stands; a torch without them cannot load
    a .pt2 safely here, and the form is refused (an :class:`InputError` naming ``path``)."""
    import torch

    try:
        from torch._export.serde.serialize import _SYM_OPS
        from torch.export.pt2_archive._package import PT2ArchiveWriter, load_pt2
    except ImportError:
        raise InputError(
            f"{path}: this torch ({torch.__version__}) cannot load a .pt2 safely here (its archive reader is not the "
            "one rasterscale vets for); export the model to ONNX or TorchScript instead"
        ) from None
    return ArchiveApi(load_pt2, PT2ArchiveWriter, _SYM_OPS)


def load_program(path: str) -> Any:
    """The torch.export program of the ``.pt2`` at ``path``, loaded from its vetted records only (an
    :class:`InputError` naming the file and what was found otherwise)."""
    api = archive_api(path)
    vetted = vetted_archive(path)
    try:
        contents = api.load(vetted.as_buffer(api))
    except Exception as err:  # torch raises many kinds on a program it cannot rebuild
        raise InputError(f"{path}: torch.export cannot load it ({first_line(err)})") from None
    if MODEL not in contents.exported_programs:
        raise InputError(f"{path}: torch.export cannot load it (no program named '{MODEL}')")
    return contents.exported_programs[MODEL]


def vetted_archive(path: str) -> VettedArchive:
    """The records of the archive at ``path`` that make a plain program, each vetted (see the module's text)."""
    try:
        records = archive_entries(path)
        program = json.loads(records[PROGRAM]) if PROGRAM in records else {}
        if program:  # before the rules: a newer torch may write what they do not know
            check_schema_version(path, program)
        check_layout(set(records))
        program = vetted_program(program)
        kept = {name: records[name] for name in KEPT_AS_THEY_ARE if name in records}
        kept[PROGRAM] = json.dumps(program).encode()
        for config_name, pattern in ((WEIGHTS_CONFIG, RAW_WEIGHT), (CONSTANTS_CONFIG, RAW_CONSTANT)):
            kept[config_name] = records[config_name]
            folder = config_name.rsplit("/", 1)[0]
            for record in raw_entries(json.loads(records[config_name]), pattern, config_name):
                name = f"{folder}/{record}"
                if name not in records:
                    raise UnsafeArchive(f"{config_name} names {record}, which the archive does not hold")
                kept[name] = records[name]
        kept[SAMPLE_INPUTS] = b""  # never read: rasterscale makes its own dummy tile
    except UnsafeArchive as err:
        raise InputError(f"{path}: {err}; export it to ONNX or TorchScript, or again with torch.export") from None
    except InputError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as err:  # JSON of another shape than torch writes
        raise InputError(f"{path}: not a torch.export program torch.export.save writes ({first_line(err)})") from None
    return VettedArchive(kept)


def archive_entries(path: str) -> dict[str, bytes]:
    """The archive's records by name below its one top folder, after refusing what holds native code or pickles
    (a pre-2.7 layout, a legacy weight file, an AOTInductor folder, a native library)."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            tops = {name.split("/", 1)[0] for name in names}
            if len(tops) != 1 or any("/" not in name for name in names):
                raise UnsafeArchive("not a torch.export archive (one folder at its root)")
            top = tops.pop() + "/"
            relative = [name[len(top) :] for name in names]
            refuse_unsafe_entries(relative)
            return {name: archive.read(top + name) for name in relative if wanted(name)}
    except (zipfile.BadZipFile, OSError) as err:
        raise UnsafeArchive(f"not a readable zip archive ({first_line(err)})") from None


def wanted(name: str) -> bool:
    """Records the program is rebuilt from: the program, the payload configs and raw tensors, the format marks."""
    return name in KEPT_AS_THEY_ARE or name == PROGRAM or name.startswith(("data/weights/", "data/constants/"))


def refuse_unsafe_entries(names: list[str]) -> None:
    found = set(names)
    if "serialized_exported_program.json" in found or any(n.endswith("serialized_state_dict.pt") for n in names):
        raise UnsafeArchive("a torch.export archive of torch 2.6 or older (its weights are pickled)")
    for name in names:
        if name.startswith("data/aotinductor/"):
            raise UnsafeArchive(f"holds an AOTInductor package ({name}): compiled native code")
        if name.lower().endswith(NATIVE_SUFFIXES):
            raise UnsafeArchive(f"holds a native library ({name})")
    for legacy in (f"data/weights/{MODEL}.pt", f"data/constants/{MODEL}.pt"):
        if legacy in found:
            raise UnsafeArchive(f"holds pickled weights in torch's legacy layout ({legacy})")
    others = [n for n in names if n.startswith("models/") and n != PROGRAM]
    if others:
        raise UnsafeArchive(f"holds {len(others) + 1} programs ({', '.join([PROGRAM, *others])}); one, '{MODEL}'")


def check_schema_version(path: str, program: Mapping[str, Any]) -> None:
    """A program of another major serialization schema than this torch's, or of a newer minor one: one line with
    both torch versions and schemas."""
    import torch
    from torch._export.serde.schema import SCHEMA_VERSION

    schema = program.get("schema_version") or {}
    major, minor = int(schema.get("major", -1)), int(schema.get("minor", -1))
    if major != SCHEMA_VERSION[0] or minor > SCHEMA_VERSION[1]:
        newer = "a newer" if (major, minor) > tuple(SCHEMA_VERSION) else "another"
        raise InputError(
            f"{path}: a torch.export program from {newer} torch ({program.get('torch_version', '?')}, schema "
            f"{major}.{minor}) than this one ({torch.__version__}, schema {SCHEMA_VERSION[0]}.{SCHEMA_VERSION[1]}): "
            f"export it again with torch {torch.__version__.split('+')[0]}, or to ONNX"
        )


def check_layout(found: set[str]) -> None:
    """The records a program of one model is rebuilt from: the format mark, the program, its payload configs."""
    if ARCHIVE_FORMAT not in found or PROGRAM not in found:
        raise UnsafeArchive(f"not a torch.export program (no {ARCHIVE_FORMAT} or {PROGRAM})")
    for config in (WEIGHTS_CONFIG, CONSTANTS_CONFIG):
        if config not in found:
            raise UnsafeArchive(f"no {config}")


def raw_entries(config: Mapping[str, Any], pattern: re.Pattern[str], config_name: str) -> set[str]:
    """The raw tensor records a weights or constants config names, after refusing every pickled payload: a
    ``use_pickle`` tensor, a custom (TorchBind) object, an opaque Python object."""
    records = set()
    for fqn, payload in config["config"].items():
        require_path(fqn, config_name)
        record = str(payload["path_name"])
        if record.startswith("custom_obj_"):
            raise UnsafeArchive(f"constant '{fqn}' is a custom (TorchBind) object, which torch unpickles")
        if record.startswith("opaque_obj_"):
            raise UnsafeArchive(f"constant '{fqn}' is an opaque Python object, which torch unpickles")
        if payload.get("use_pickle"):
            raise UnsafeArchive(f"'{fqn}' is stored pickled (use_pickle in {config_name})")
        if not pattern.fullmatch(record) or not isinstance(payload.get("tensor_meta"), dict):
            raise UnsafeArchive(f"'{fqn}' is not a raw tensor record ({record} in {config_name})")
        records.add(record)
    return records


def vetted_program(program: dict[str, Any]) -> dict[str, Any]:
    """The program's JSON with everything that torch turns into code checked, and node metadata dropped."""
    guards = program.get("guards_code") or []
    for guard in guards:
        if not is_plain_guard(guard):
            raise UnsafeArchive(f"guard {short(guard)} is not a comparison of input sizes")
    module = program["graph_module"]
    module["metadata"] = {}
    for names in (module.get("treespec_namedtuple_fields") or {}).values():
        require_identifiers(names.get("field_names", []), "a named tuple's field")
    for entry in module.get("module_call_graph") or []:
        signature = entry.get("signature")
        if signature:
            require_identifiers(signature.get("forward_arg_names") or [], "argument name")
            for spec in (signature.get("in_spec"), signature.get("out_spec")):
                if spec:
                    check_treespec(json.loads(spec))
    for key, value in walk(program):
        check_field(key, value)
    for node in nodes(module["graph"]):
        node["metadata"] = {}
    return program


def walk(value: Any) -> Iterator[tuple[str, Any]]:
    """Every (key, value) pair of a JSON document, depth first."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield key, item
            yield from walk(item)
    elif isinstance(value, list):
        for item in value:
            yield from walk(item)


def nodes(graph: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The nodes of a graph and of the graphs its nodes take (higher-order operators' subgraphs)."""
    for node in graph.get("nodes", []):
        yield node
        for key, value in walk(node.get("inputs", [])):
            if key == "as_graph" and isinstance(value, dict) and isinstance(value.get("graph"), dict):
                yield from nodes(value["graph"])


def check_field(key: str, value: Any) -> None:
    if key in ("target", "as_operator") and isinstance(value, str):
        if not is_allowed_operator(value):
            raise UnsafeArchive(
                f"calls {short(value)}: a .pt2 runs ATen operators, symbolic-size operators and its own subgraphs only"
            )
    elif key == "expr_str":
        if not isinstance(value, str) or not is_plain_expression(value):
            raise UnsafeArchive(f"symbolic expression {short(value)} is not a plain arithmetic expression")
    elif key in ("as_custom_obj", "custom_obj") and value:
        raise UnsafeArchive("takes a custom (TorchBind) object, which torch unpickles")
    elif key in FQN_KEYS:
        require_path(value, "the program's signature")
    elif key == "as_graph" and isinstance(value, dict):
        require_identifiers([value.get("name")], "a subgraph's name")


def is_allowed_operator(target: str) -> bool:
    return bool(ATEN_OPERATOR.fullmatch(target)) or target in SUBGRAPH_OPERATORS or target in symbolic_operators()


@functools.cache
def symbolic_operators() -> frozenset[str]:
    """The serialized names of torch's symbolic-integer operators (``_operator.add``, ``torch.sym_max``, ...)."""
    return frozenset(f"{op.__module__}.{op.__name__}" for op in archive_api().symbolic_operators)


def is_plain_expression(text: str) -> bool:
    """Symbols, numbers, operators and the known functions: what ``sympy.sympify`` may evaluate."""
    split = tokens(EXPRESSION_TOKEN, text)
    if split is None:
        return False
    allowed = expression_names()
    return all(kind != "name" or SYMBOL.fullmatch(token) or token in allowed for kind, token in split)


@functools.cache
def expression_names() -> frozenset[str]:
    """Names an expression may hold: sympy's expression classes, the functions torch's own deserializer hands
    ``sympy.sympify`` (``FloorDiv``, ``CeilToInt``, ...), assumptions and constants."""
    import sympy
    import torch.utils._sympy.functions as functions

    classes = {
        name
        for module in (sympy, functions)
        for name in dir(module)
        if isinstance(getattr(module, name), type) and issubclass(getattr(module, name), sympy.Basic)
    }
    return frozenset(classes) | ASSUMPTIONS | CONSTANTS


def is_plain_guard(text: Any) -> bool:
    return isinstance(text, str) and tokens(GUARD_TOKEN, text) is not None


def tokens(pattern: re.Pattern[str], text: str) -> list[tuple[str | None, str]] | None:
    """``text`` split into ``pattern``'s tokens, (group name, text) each; None where it does not split so."""
    found: list[tuple[str | None, str]] = []
    position, end = 0, len(text.rstrip())
    while position < end:
        match = pattern.match(text, position)
        if match is None or match.end() == position:
            return None
        position = match.end()
        kind = match.lastgroup
        found.append((kind, match.group(kind) if kind else match.group(0).strip()))
    return found


def require_path(name: Any, where: str) -> None:
    """A parameter's, buffer's or submodule's path: identifiers and indices joined by dots ('' is the root)."""
    if not isinstance(name, str) or (name and not FQN.fullmatch(name)):
        raise UnsafeArchive(f"names an attribute {short(name)} in {where} that is not a path of identifiers")


def require_identifiers(names: list[Any], what: str) -> None:
    for name in names:
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
            raise UnsafeArchive(f"{what} {short(name)} is not a Python identifier")


def check_treespec(spec: Any) -> None:
    """A pytree spec (``[protocol, node]``): plain containers only, dict keys identifiers."""
    node = spec[1] if isinstance(spec, list) and len(spec) == 2 else spec
    stack = [node]
    while stack:
        node = stack.pop()
        kind = node.get("type")
        if kind not in TREESPEC_TYPES:
            raise UnsafeArchive(f"input or output of type {short(kind)}: plain tuples, lists and dicts only")
        context = node.get("context")
        if kind in ("builtins.dict", "collections.OrderedDict") and context:
            require_identifiers(json.loads(context), "keyword")
        stack.extend(node.get("children_spec", []))


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return (lines[0] if lines else type(err).__name__)[:200]
