"""The type stubs (`byzcoll/__init__.pyi`) checked against the module, as the C header is checked
against the library: every public name, attribute and method on one side is on the other, and
functions and methods take the same parameters (names, kinds and defaults)."""

import ast
import inspect
import pathlib

import byzcoll

STUB = pathlib.Path(byzcoll.__file__).with_name("__init__.pyi")


def stub():
    return ast.parse(STUB.read_text())


def public(names):
    return {n for n in names if not n.startswith("_")}


def stub_params(fn: ast.FunctionDef):
    """(name, kind, default source) of each parameter but `self`."""
    a = fn.args
    out = []
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for arg, d in zip(positional, defaults):
        out.append((arg.arg, "positional", None if d is None else ast.literal_eval(d)))
    if a.vararg:
        out.append((a.vararg.arg, "var_positional", None))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append((arg.arg, "keyword_only", None if d is None else ast.literal_eval(d)))
    if a.kwarg:
        out.append((a.kwarg.arg, "var_keyword", None))
    return [p for p in out if p[0] != "self"]


def runtime_params(fn):
    kinds = {
        inspect.Parameter.POSITIONAL_ONLY: "positional",
        inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
        inspect.Parameter.VAR_POSITIONAL: "var_positional",
        inspect.Parameter.KEYWORD_ONLY: "keyword_only",
        inspect.Parameter.VAR_KEYWORD: "var_keyword",
    }
    out = []
    for p in inspect.signature(fn).parameters.values():
        default = None if p.default is inspect.Parameter.empty else p.default
        out.append((p.name, kinds[p.kind], default))
    return [p for p in out if p[0] != "self"]


def test_the_module_and_its_stub_name_the_same_things():
    declared = set()
    for node in stub().body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            declared.add(node.name)
        elif isinstance(node, ast.AnnAssign):
            declared.add(node.target.id)
    exported = set(byzcoll.__all__)
    assert declared == exported, (
        f"in the stub only: {sorted(declared - exported)}; "
        f"in the module only: {sorted(exported - declared)}"
    )


def test_functions_take_what_their_stubs_say():
    for node in stub().body:
        if isinstance(node, ast.FunctionDef):
            fn = getattr(byzcoll, node.name)
            if inspect.isbuiltin(fn):
                continue  # a native function: its signature is not introspectable
            assert stub_params(node) == runtime_params(fn), node.name


def test_classes_have_what_their_stubs_say():
    for node in stub().body:
        if not isinstance(node, ast.ClassDef):
            continue
        cls = getattr(byzcoll, node.name)
        declared = {}
        for item in node.body:
            if isinstance(item, ast.FunctionDef):
                declared[item.name] = item
            elif isinstance(item, ast.AnnAssign):
                declared[item.target.id] = None
        if issubclass(cls, BaseException):
            # Exceptions: the declared attributes are set on instances; the rest is Python's.
            assert public(declared) <= public(dir(cls)) | set(declared), node.name
            continue
        have = public(dir(cls))
        assert public(declared) == have, (
            f"{node.name}: in the stub only: {sorted(public(declared) - have)}; "
            f"in the module only: {sorted(have - public(declared))}"
        )
        for name, fn in declared.items():
            member = inspect.getattr_static(cls, name, None)
            if fn is None or isinstance(member, property) or not inspect.isfunction(member):
                continue
            assert stub_params(fn) == runtime_params(member), f"{node.name}.{name}"
