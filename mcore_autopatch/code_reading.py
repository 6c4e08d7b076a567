"""Read what a module's functions do from their code objects: no file is read, nothing runs.

Shared by the fixes that decide from megatron-core's own code (``numpy_fix``,
``weights_only_fix``): which functions a module defines, which attributes of a global they
load (``np.product``, ``torch.load``), and which names they mention. Only functions whose
names already mention what is looked for are read instruction by instruction, from the raw
bytecode, so reading a module costs little.
"""

from __future__ import annotations

import dis
import sys
from types import CodeType, FunctionType, ModuleType
from typing import Any, Dict, FrozenSet, Iterable, Iterator, Tuple

_LOAD_ATTRIBUTE = frozenset(("LOAD_ATTR", "LOAD_METHOD"))

# Where an instruction's argument indexes co_names, by opcode: the shift that drops the flag
# bits CPython packs below the index (LOAD_GLOBAL's push-NULL bit from 3.11, LOAD_ATTR's
# method bit from 3.12). Read and tested on 3.8 - 3.13 against dis; elsewhere dis is used.
_RAW_BYTECODE_KNOWN = sys.version_info < (3, 14)
_GLOBAL_LOADS = {dis.opmap["LOAD_GLOBAL"]: 1 if sys.version_info >= (3, 11) else 0, dis.opmap["LOAD_NAME"]: 0}
_ATTRIBUTE_LOADS = {dis.opmap["LOAD_ATTR"]: 1 if sys.version_info >= (3, 12) else 0}
if dis.opmap.get("LOAD_METHOD", 256) < 256:  # 3.7 - 3.11 (3.12+ lists it only as a pseudo-op)
    _ATTRIBUTE_LOADS[dis.opmap["LOAD_METHOD"]] = 0
_CACHE = dis.opmap.get("CACHE", -1)  # 3.11+: inline cache entries between instructions


def defined_functions(module: ModuleType) -> "Iterator[Tuple[str, CodeType]]":
    """(qualified name, code) of each function and method the module itself defines, with
    what decorators wrap (staticmethod, classmethod, property, ``functools.wraps`` chains)."""
    home = getattr(module, "__name__", None)
    seen: "set[int]" = set()
    for value in list(vars(module).values()):
        if isinstance(value, ModuleType) or getattr(value, "__module__", None) != home:
            continue  # imported from elsewhere (a module's __getattr__ would run for nothing)
        name = getattr(value, "__name__", None)
        if not isinstance(name, str):
            continue  # an instance (an enum member, a constant): no code of its own
        members = list(vars(value).items()) if isinstance(value, type) else [(None, value)]
        for attr, member in members:
            if not callable(member) and not isinstance(member, _DESCRIPTORS):
                continue  # a class's data (its docstring, fields, __module__): no code
            for code in codes_of(member):
                if id(code) not in seen:
                    seen.add(id(code))
                    yield (name if attr is None else "%s.%s" % (name, attr)), code


# Members that hold code without being callable themselves (staticmethod is callable only
# from 3.10).
_DESCRIPTORS = (property, staticmethod, classmethod)


def codes_of(obj: Any) -> "Iterator[CodeType]":
    if type(obj) is FunctionType and getattr(obj, "__wrapped__", None) is None:
        yield obj.__code__  # the common case: a plain function, nothing wrapped
        return
    parts = [getattr(obj, name, None) for name in ("fget", "fset", "fdel")] if isinstance(obj, property) else [obj]
    for part in parts:
        for _ in range(8):  # a decorator chain longer than this is not code we know
            function = getattr(part, "__func__", part)
            code = getattr(function, "__code__", None)
            if isinstance(code, CodeType):
                yield code
            part = getattr(function, "__wrapped__", None)
            if part is None:
                break


def nested(code: CodeType) -> "Iterator[CodeType]":
    """``code`` and the code of every function, lambda and comprehension inside it."""
    stack = [code]
    while stack:
        current = stack.pop()
        yield current
        for const in current.co_consts:
            if type(const) is CodeType:
                stack.append(const)


def mentions(code: CodeType) -> FrozenSet[str]:
    """Every name ``code`` (and code nested in it) uses: globals, attributes, locals, and the
    identifier constants that keyword arguments are passed by."""
    names: "set[str]" = set()
    for current in nested(code):
        names.update(current.co_names, current.co_varnames)
        names.update(c for c in _flat_constants(current.co_consts) if isinstance(c, str) and c.isidentifier())
    return frozenset(names)


def _flat_constants(consts: Iterable[Any]) -> "Iterator[Any]":
    for const in consts:
        if isinstance(const, (tuple, frozenset)):
            yield from _flat_constants(const)
        else:
            yield const


def attributes_loaded(code: CodeType, owners: FrozenSet[str], wanted: FrozenSet[str]) -> FrozenSet[str]:
    """Which of ``wanted`` ``code`` (or code nested in it) loads as ``<owner>.<name>``, for a
    global named in ``owners`` (``np.product``: owners {"np"}, wanted {"product"})."""
    found: "set[str]" = set()
    for current in nested(code):
        if owners.isdisjoint(current.co_names) or wanted.isdisjoint(current.co_names):
            continue
        if _RAW_BYTECODE_KNOWN:
            found |= _attributes_loaded_raw(current, owners, wanted)
            continue
        previous = None
        for instruction in dis.get_instructions(current):
            if (
                instruction.opname in _LOAD_ATTRIBUTE
                and instruction.argval in wanted
                and previous is not None
                and previous.opname in ("LOAD_GLOBAL", "LOAD_NAME")
                and previous.argval in owners
            ):
                found.add(instruction.argval)
            if instruction.opname != "CACHE":
                previous = instruction
    return frozenset(found)


def _attributes_loaded_raw(code: CodeType, owners: FrozenSet[str], wanted: FrozenSet[str]) -> "set[str]":
    """``attributes_loaded`` of one code object, from its two-byte instructions (EXTENDED_ARG
    widens the next one; CACHE entries are skipped): dis builds an object per instruction,
    most of the time a fix took to read megatron-core 0.8's checkpointing code."""
    raw, names, found = code.co_code, code.co_names, set()
    owner_loaded, extended = False, 0
    for i in range(0, len(raw) - 1, 2):
        op, arg = raw[i], raw[i + 1] | extended
        if op == dis.EXTENDED_ARG:
            extended = arg << 8
            continue
        extended = 0
        if op == _CACHE:
            continue
        if owner_loaded and op in _ATTRIBUTE_LOADS:
            index = arg >> _ATTRIBUTE_LOADS[op]
            if index < len(names) and names[index] in wanted:
                found.add(names[index])
        index = arg >> _GLOBAL_LOADS[op] if op in _GLOBAL_LOADS else -1
        owner_loaded = 0 <= index < len(names) and names[index] in owners
    return found


def globals_bound_to(module: ModuleType, target: Any, unwrap: Any = None) -> FrozenSet[str]:
    """The names under which ``module``'s globals hold ``target`` (``np`` for numpy)."""
    unwrap = unwrap or (lambda obj: obj)
    return frozenset(name for name, value in vars(module).items() if unwrap(value) is target)


def short_name(module_name: str, package: str = "megatron.core.") -> str:
    """``megatron.core.dist_checkpointing.mapping`` -> ``dist_checkpointing.mapping``."""
    return module_name[len(package) :] if module_name.startswith(package) else module_name


def by_function(pairs: "Iterable[Tuple[str, Any]]") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for qualname, value in pairs:
        out.setdefault(qualname, value)
    return out
