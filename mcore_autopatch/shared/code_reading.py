"""Read what a module's functions do from their code objects: no file is read, nothing runs.

Shared by the fixes that decide from megatron-core's own code (``numpy_removed_names``,
``torch_load_weights_only``): which functions a module defines, which attributes of a global they
load (``np.product``, ``torch.load``), and which names they mention. Only code objects whose
names already mention what is looked for are read instruction by instruction (with ``dis``),
so reading a module costs little.
"""

from __future__ import annotations

import dis
from types import CodeType, FunctionType, ModuleType
from typing import Any, Dict, FrozenSet, Iterable, Iterator, Tuple

_LOAD_ATTRIBUTE = frozenset(("LOAD_ATTR", "LOAD_METHOD"))
_LOAD_GLOBAL = frozenset(("LOAD_GLOBAL", "LOAD_NAME"))
# Widens the next instruction's argument (a name index past 255), or an inline cache entry
# between instructions (3.11+): neither stands between a global's load and its attribute's.
_NOT_AN_OPERATION = frozenset(("EXTENDED_ARG", "CACHE"))


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
    global named in ``owners`` (``np.product``: owners {"np"}, wanted {"product"}).

    Read with ``dis``, and only in code objects whose names hold both an owner and a wanted
    name: most of a module is passed over by a set intersection."""
    found: "set[str]" = set()
    for current in nested(code):
        if owners.isdisjoint(current.co_names) or wanted.isdisjoint(current.co_names):
            continue
        owner_loaded = False
        for instruction in dis.get_instructions(current):
            if instruction.opname in _NOT_AN_OPERATION:
                continue
            if owner_loaded and instruction.opname in _LOAD_ATTRIBUTE and instruction.argval in wanted:
                found.add(instruction.argval)
            owner_loaded = instruction.opname in _LOAD_GLOBAL and instruction.argval in owners
    return frozenset(found)


def stored_names(code: CodeType, opname: str) -> "set[str]":
    """The names ``code``'s ``opname`` instructions store (``STORE_ATTR``: ``obj.name = ...``,
    ``STORE_GLOBAL``: ``global name; name = ...``), in this code object only."""
    return {i.argval for i in dis.get_instructions(code) if i.opname == opname}


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
