"""PROTOTYPE, not product code: what a server and an agent would hold at start if their
config were validated by msgspec instead of pydantic (issue 25, docs/performance.md,
"Memory at 1,000 idle connections").

Throwaway: nothing in nodeagent imports it, and it does not convert the product's models.
It needs `msgspec` (`.venv/bin/pip install 'msgspec==0.22.*'`; not a dependency).

1. Generate, from the product's pydantic models (introspected here, with pydantic),
   `msgspec.Struct` equivalents of every model a role's config reaches (AgentConfig and
   NodeConfig for the agent, ServerConfig and RoutesConfig for the server): the same
   fields, types, defaults, aliases and numeric/length/pattern constraints (msgspec.Meta);
   a model with a string form (`HostPort`, `AllowRule`, `PortRange`: a "before" model
   validator) becomes `str | Struct` and its string is turned into the struct by the
   product's own function, after msgspec's decode. Types msgspec has no form for (an IP
   network, a Path) are decoded as `str`; the other Python validators (field and "after"
   validators) are counted, not run: they are the same functions either way, so they cost
   the same memory.
2. In a fresh interpreter per role and variant, import what the role imports at start
   (`nodeagent.cli`, `nodeagent.<role>.main`) and validate the role's real config (the
   benchmark's file, as `memory_after_load` writes it) and a config-stream line, then read
   RSS:
   - `pydantic`: as today (`parse_config`, `parse_config_line`);
   - `msgspec`: `pydantic` replaced in sys.modules by an inert stand-in (its names, doing
     nothing: the tree's modules import, their model classes become plain classes, about
     what a `Struct` class is), msgspec and the generated structs loaded, the same
     documents validated with `msgspec.convert` / `msgspec.json.decode`.
   The difference is what pydantic, pydantic-core and the pydantic models cost a role
   holding a validated config.

    .venv/bin/python -m scripts.bench.config_without_pydantic [--rounds 2] [--show-structs]

About 15 seconds. Figures and what converting for real would take: docs/performance.md.
"""

from __future__ import annotations

import argparse
import enum
import ipaddress
import json
import os
import subprocess
import sys
import tempfile
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from nodeagent.config import AgentConfig, NodeConfig, RoutesConfig, ServerConfig
from nodeagent.config.base import Model
from nodeagent.configstream.protocol import config_line
from nodeagent.testing.standalone import Upstream, agent_config, make_certs, server_config
from scripts.bench.lib.procmem import compile_bytecode

ROOTS: dict[str, tuple[type[Model], type[Model]]] = {
    "agent": (AgentConfig, NodeConfig),  # the file, the config stream's line
    "server": (ServerConfig, RoutesConfig),
}

_CONSTRAINTS = ("gt", "ge", "lt", "le", "min_length", "max_length", "pattern")
_AS_TEXT = (Path, ipaddress.IPv4Network, ipaddress.IPv6Network, ipaddress.IPv4Address,
            ipaddress.IPv6Address)


class Generator:
    """msgspec.Struct source for a set of pydantic models, and what it could not carry."""

    def __init__(self) -> None:
        self.order: list[type[Model]] = []
        self.seen: set[type[Model]] = set()
        self.any_fields: list[str] = []
        self.string_forms: dict[str, dict[str, str]] = {}  # struct → field → model
        self.before: dict[str, str] = {}  # model → its before validator's name
        self.validators = 0  # Python validators the structs do not run

    def visit(self, model: type[Model]) -> None:
        if model in self.seen:
            return
        self.seen.add(model)
        decorators = model.__pydantic_decorators__
        for info in decorators.model_validators.values():
            if info.info.mode == "before":
                self.before[model.__name__] = info.cls_var_name
            else:
                self.validators += 1
        self.validators += len(decorators.field_validators)
        for field in model.model_fields.values():
            for inner in self._models_in(field.annotation):
                self.visit(inner)
            self.validators += sum(1 for m in field.metadata
                                   if type(m).__name__ in ("AfterValidator", "BeforeValidator"))
        self.order.append(model)

    def _models_in(self, annotation: Any) -> list[type[Model]]:
        if isinstance(annotation, type) and issubclass(annotation, Model):
            return [annotation]
        return [m for arg in typing.get_args(annotation) for m in self._models_in(arg)]

    def type_source(self, annotation: Any, where: str, forms: list[str]) -> str:
        origin = typing.get_origin(annotation)
        args = typing.get_args(annotation)
        if annotation is type(None) or annotation is None:
            return "None"
        if annotation in (int, float, str, bool, bytes):
            return str(annotation.__name__)
        if annotation is Path:
            return "Path"
        if annotation in (ipaddress.IPv4Network, ipaddress.IPv6Network):
            return "IPNetwork"
        if annotation in (ipaddress.IPv4Address, ipaddress.IPv6Address):
            return "IPAddress"
        if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
            return "str" if issubclass(annotation, str) else "int"
        if isinstance(annotation, type) and issubclass(annotation, Model):
            name = annotation.__name__
            if name in self.before:
                forms.append(name)
                scalar = "int | str" if name == "PortRange" else "str"
                return f"{scalar} | {name}"
            return name
        if origin is typing.Annotated:
            base = self.type_source(args[0], where, forms)
            meta = self.meta_source(annotation.__metadata__)
            if any(type(m).__name__ in ("AfterValidator", "BeforeValidator")
                   for m in annotation.__metadata__):
                self.validators += 1
            return f"Annotated[{base}, {meta}]" if meta else base
        if origin is typing.Literal:
            return f"Literal[{', '.join(repr(a) for a in args)}]"
        if origin in (typing.Union, types.UnionType):
            parts = [self.type_source(a, where, forms) for a in args]
            if "Any" in parts:
                return "Any"
            flat = list(dict.fromkeys(p for part in parts for p in part.split(" | ")))
            structs = [p for p in flat if p[:1].isupper()
                       and p not in ("None", "Path", "IPNetwork", "IPAddress")
                       and not p.startswith(("Annotated", "Literal", "Any"))]
            texts = [p for p in flat if p in ("str", "Path") or p.startswith("Literal")]
            if len(structs) > 1 or len(texts) > 1:  # msgspec: one object, one string type
                self.any_fields.append(where)
                return "Any"
            return " | ".join(flat)
        if origin is tuple:
            if len(args) == 2 and args[1] is Ellipsis:
                return f"tuple[{self.type_source(args[0], where, forms)}, ...]"
            return f"tuple[{', '.join(self.type_source(a, where, forms) for a in args)}]"
        if origin in (list, frozenset, set):
            return f"{origin.__name__}[{self.type_source(args[0], where, forms)}]"
        if origin is dict:
            return (f"dict[{self.type_source(args[0], where, forms)}, "
                    f"{self.type_source(args[1], where, forms)}]")
        if annotation is Any:
            return "Any"
        self.any_fields.append(f"{where} ({annotation!r})")
        return "Any"

    @staticmethod
    def meta_source(metadata: Any) -> str:
        kwargs = {}
        for m in metadata:
            for name in _CONSTRAINTS:
                value = getattr(m, name, None)
                if value is not None:
                    kwargs[name] = value
        if not kwargs:
            return ""
        return "Meta(" + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")"

    def source(self) -> str:
        lines = ["from __future__ import annotations",
                 "import ipaddress",
                 "from pathlib import Path",
                 "from typing import Annotated, Any, Literal",
                 "import msgspec", "from msgspec import Meta, field",
                 "IPNetwork = ipaddress._BaseNetwork",
                 "IPAddress = ipaddress._BaseAddress",
                 "def dec_hook(kind, value):",
                 "    if kind is IPNetwork and isinstance(value, str):",
                 "        return ipaddress.ip_network(value)",
                 "    if kind is Path and isinstance(value, str):",
                 "        return Path(value)",
                 "    if kind is IPAddress and isinstance(value, str):",
                 "        return ipaddress.ip_address(value)",
                 "    raise NotImplementedError(kind)", ""]
        for model in self.order:
            name = model.__name__
            lines.append(f"class {name}(msgspec.Struct, kw_only=True, frozen=True, "
                         f"forbid_unknown_fields=True):")
            fields = model.model_fields
            if not fields:
                lines.append("    pass")
            for fname, info in fields.items():
                forms: list[str] = []
                where = f"{name}.{fname}"
                typ = self.type_source(info.annotation, where, forms)
                meta = self.meta_source(info.metadata)
                if meta and typ != "Any":
                    base, optional = typ.removesuffix(" | None"), typ.endswith(" | None")
                    typ = f"Annotated[{base}, {meta}]" + (" | None" if optional else "")
                if forms:
                    self.string_forms.setdefault(name, {})[fname] = forms[0]
                rename = f", name={info.alias!r}" if info.alias and info.alias != fname else ""
                default = self.default_source(info, where)
                if default is None:
                    lines.append(f"    {fname}: {typ}"
                                 + (f" = field({rename[2:]})" if rename else ""))
                else:
                    lines.append(f"    {fname}: {typ} = field({default}{rename})")
            lines.append("")
        return "\n".join(lines)

    def default_source(self, info: Any, where: str) -> str | None:
        if info.is_required():
            return None
        if info.default_factory is not None:
            factory = info.default_factory
            if factory in (dict, list, tuple, frozenset, set):
                return f"default_factory={factory.__name__}"
            self.any_fields.append(f"{where} (default factory {factory!r})")
            return "default=None"
        value = info.default
        if isinstance(value, Model):
            if value == type(value)():
                return f"default_factory={type(value).__name__}"
            self.any_fields.append(f"{where} (default {value!r})")
            return "default=None"
        if isinstance(value, enum.Enum):
            return f"default={value.value!r}"
        if isinstance(value, Path):
            return f"default_factory=lambda: Path({str(value)!r})"
        if isinstance(value, _AS_TEXT):
            self.any_fields.append(f"{where} (default {value!r})")
            return "default=None"
        if isinstance(value, dict | list) and not value:
            return f"default_factory={type(value).__name__}"
        if isinstance(value, frozenset | set):
            return f"default_factory=lambda: {value!r}"
        if isinstance(value, int | float | str | bool | bytes | tuple) or value is None:
            return f"default={value!r}"
        self.any_fields.append(f"{where} (default {value!r})")
        return "default=None"


# The inert stand-in for pydantic in the msgspec variant: the names the tree's modules
# import, doing nothing, so they import without pydantic and pydantic-core.
_STUB = r'''
import sys, types
pyd = types.ModuleType("pydantic")
class _Meta(type):
    def __new__(mcs, name, bases, ns, **kw):
        cls = super().__new__(mcs, name, bases, ns)
        fields = {}
        for base in reversed(cls.__mro__):
            fields.update({k: None for k in base.__dict__.get("__annotations__", {})
                           if not k.startswith("_") and k != "model_config"})
        cls.model_fields = fields
        return cls
class BaseModel(metaclass=_Meta):
    def __init__(self, **kw):
        self.__dict__.update(kw)
    @classmethod
    def model_validate(cls, *a, **kw):
        raise NotImplementedError("prototype: pydantic is not loaded")
class ValidationError(ValueError):
    pass
class ValidationInfo:
    pass
class _Marker:
    def __init__(self, *a, **kw):
        self.args, self.kw = a, kw
def Field(default=None, **kw):
    return default
def PrivateAttr(default=None, **kw):
    return default
def ConfigDict(**kw):
    return kw
def _decorator(*a, **kw):
    return lambda f: f
def create_model(*a, **kw):
    raise NotImplementedError("prototype: pydantic is not loaded")
for name, value in dict(BaseModel=BaseModel, ValidationError=ValidationError,
        ValidationInfo=ValidationInfo, Field=Field, PrivateAttr=PrivateAttr,
        ConfigDict=ConfigDict, field_validator=_decorator, model_validator=_decorator,
        AfterValidator=_Marker, BeforeValidator=_Marker, WithJsonSchema=_Marker,
        create_model=create_model).items():
    setattr(pyd, name, value)
alias = types.ModuleType("pydantic.alias_generators")
alias.to_camel = lambda s: s
pyd.alias_generators = alias
sys.modules["pydantic"] = pyd
sys.modules["pydantic.alias_generators"] = alias
'''

_CHILD = r'''
import importlib, json, sys, types
from pathlib import Path
args = json.loads(sys.argv[1])
def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
if args["variant"] == "msgspec":
    exec(args["stub"])
importlib.import_module("nodeagent.cli")
main = importlib.import_module(f"nodeagent.{args['role']}.main")
import yaml
file_doc = yaml.safe_load(Path(args["file"]).read_text())
line = Path(args["line"]).read_bytes()
if args["variant"] == "pydantic":
    import nodeagent.config as c
    from nodeagent.configstream.protocol import parse_config_line
    file_model, line_model = getattr(c, args["file_model"]), getattr(c, args["line_model"])
    config = c.parse_config(file_model, file_doc, "file", base_dir=Path(args["file"]).parent)
    version, streamed = parse_config_line(line, line_model)
    checks = [len(config.model_fields_set), version]
else:
    import msgspec
    import nodeagent.config as c
    structs = types.ModuleType("config_structs")
    sys.modules["config_structs"] = structs
    exec(args["structs"], structs.__dict__)
    forms, before = args["string_forms"], args["before"]
    def settle(obj):
        # A string form (`127.0.0.1:80`) into its struct, by the product's own function.
        if not isinstance(obj, msgspec.Struct):
            return obj
        changes = {}
        for name, model in forms.get(type(obj).__name__, {}).items():
            value = getattr(obj, name)
            new = (tuple(one(model, v) for v in value) if isinstance(value, tuple)
                   else one(model, value))
            if new is not value:
                changes[name] = new
        for f in msgspec.structs.fields(obj):
            value = getattr(obj, f.name)
            if f.name not in changes and isinstance(value, msgspec.Struct):
                changes[f.name] = settle(value)
            elif f.name not in changes and isinstance(value, tuple) and value \
                    and isinstance(value[0], msgspec.Struct):
                changes[f.name] = tuple(settle(v) for v in value)
        return msgspec.structs.replace(obj, **changes) if changes else obj
    def one(model, value):
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            doc = getattr(getattr(c, model, None) or _find(model), before[model])(value)
            return settle(msgspec.convert(doc, getattr(structs, model),
                                          dec_hook=structs.dec_hook))
        return settle(value)
    def _find(model):
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("nodeagent.config") \
                    and hasattr(mod, model):
                return getattr(mod, model)
        raise LookupError(model)
    config = settle(msgspec.convert(file_doc, getattr(structs, args["file_model"]),
                                    dec_hook=structs.dec_hook))
    Line = msgspec.defstruct("Line", [("version", int),
                                      ("config", getattr(structs, args["line_model"]))])
    parsed = msgspec.json.decode(line, type=Line, dec_hook=structs.dec_hook)
    streamed = settle(parsed.config)
    version = parsed.version
    assert "pydantic_core" not in sys.modules, "pydantic-core was loaded"
    checks = [len(msgspec.structs.fields(config)), version]
if args.get("verbose"):
    print(repr(config)[:1500], repr(streamed)[:800], sep="\n", file=sys.stderr)
    print(sorted(sys.modules), file=sys.stderr)
print(json.dumps({"rss": rss(), "modules": len(sys.modules), "checks": checks,
                  "pydantic": "pydantic_core" in sys.modules}))
'''


# --running: no pydantic in a copy of the tree. `pydantic/__init__.py` at the copy's root
# (first on the processes' path): in an agent or a server, an inert pydantic whose
# `model_validate` decodes with the generated structs (config_structs.py beside it) and
# turns them into the product's own classes (plain classes there, with their methods); in
# any other process, the real pydantic.
_SWITCH = r"""
import os, sys
_role = next((a for a in sys.argv[1:6] if a in ("agent", "server", "controller")), None)
if _role not in ("agent", "server"):
    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    del sys.modules[__name__]
    _saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != _root]
    try:
        import pydantic as _real
    finally:
        sys.path[:] = _saved
    sys.modules[__name__] = _real
else:
    import msgspec
    import config_structs as _S
    class _Meta(type):
        def __new__(mcs, name, bases, ns, **kw):
            cls = super().__new__(mcs, name, bases, ns)
            fields = {}
            for base in reversed(cls.__mro__):
                fields.update({k: None for k in base.__dict__.get("__annotations__", {})
                               if not k.startswith("_") and k != "model_config"})
            cls.model_fields = fields
            return cls
    _products = {}
    def _product_class(name):
        if not _products:
            for mod in list(sys.modules.values()):
                if getattr(mod, "__name__", "").startswith("nodeagent.config"):
                    _products.update({k: v for k, v in vars(mod).items()
                                      if isinstance(v, _Meta)})
        return _products[name]
    def _one(model, value):
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            doc = getattr(_product_class(model), _S.BEFORE[model])(value)
            return _settle(msgspec.convert(doc, getattr(_S, model), dec_hook=_S.dec_hook))
        return _settle(value)
    def _settle(obj):
        if not isinstance(obj, msgspec.Struct):
            return obj
        changes = {}
        for name, model in _S.STRING_FORMS.get(type(obj).__name__, {}).items():
            value = getattr(obj, name)
            new = (tuple(_one(model, v) for v in value) if isinstance(value, tuple)
                   else _one(model, value))
            if new is not value:
                changes[name] = new
        for f in msgspec.structs.fields(obj):
            value = getattr(obj, f.name)
            if f.name in changes:
                continue
            if isinstance(value, msgspec.Struct):
                changes[f.name] = _settle(value)
            elif isinstance(value, tuple) and value and isinstance(value[0], msgspec.Struct):
                changes[f.name] = tuple(_settle(v) for v in value)
        return msgspec.structs.replace(obj, **changes) if changes else obj
    class _Private:
        def __init__(self, default=None, default_factory=None):
            self.default, self.default_factory = default, default_factory
    def _finish(inst):
        # What pydantic does after validating: private attributes, model_post_init.
        for klass in reversed(type(inst).__mro__):
            for k, v in vars(klass).items():
                if isinstance(v, _Private):
                    inst.__dict__[k] = (v.default_factory() if v.default_factory
                                        else v.default)
        inst.model_post_init(None)
        return inst
    def _product(value):
        if isinstance(value, msgspec.Struct):
            inst = object.__new__(_product_class(type(value).__name__))
            for f in msgspec.structs.fields(value):
                inst.__dict__[f.name] = _product(getattr(value, f.name))
            return _finish(inst)
        if isinstance(value, tuple):
            return tuple(_product(v) for v in value)
        if isinstance(value, dict):
            return {k: _product(v) for k, v in value.items()}
        return value
    def _builtins(value, **kw):
        if isinstance(type(value), _Meta):
            return {k: _builtins(v) for k, v in value.__dict__.items() if k[:1] != "_"}
        if isinstance(value, (tuple, list)):
            return [_builtins(v) for v in value]
        if isinstance(value, dict):
            return {k: _builtins(v) for k, v in value.items()}
        return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)
    class ValidationError(ValueError):
        def errors(self, **kw):
            return [{"loc": (), "msg": str(self), "type": "value_error"}]
    class BaseModel(metaclass=_Meta):
        def __init__(self, **kw):
            self.__dict__.update(kw)
            _finish(self)
        def model_post_init(self, context):
            pass
        @classmethod
        def model_validate(cls, doc, *, context=None, **kw):
            try:
                value = msgspec.convert(doc, getattr(_S, cls.__name__),
                                        dec_hook=_S.dec_hook)
            except msgspec.ValidationError as exc:
                raise ValidationError(str(exc)) from None
            return _product(_settle(value))
        def model_dump(self, mode=None, exclude=None, **kw):
            return {k: v for k, v in _builtins(self).items() if k not in (exclude or ())}
        def model_copy(self, update=None, **kw):
            new = object.__new__(type(self))
            new.__dict__.update(self.__dict__)
            new.__dict__.update(update or {})
            return new
        def model_dump_json(self, **kw):
            return msgspec.json.encode(_builtins(self)).decode()
        @classmethod
        def model_validate_json(cls, data, **kw):
            return cls.model_validate(msgspec.json.decode(data))
    class ValidationInfo:
        pass
    class _Marker:
        def __init__(self, *a, **kw):
            self.args, self.kw = a, kw
    def Field(default=None, **kw):
        return default
    PrivateAttr = _Private
    def ConfigDict(**kw):
        return kw
    def field_validator(*a, **kw):
        return lambda f: f
    model_validator = field_validator
    AfterValidator = BeforeValidator = WithJsonSchema = _Marker
    def create_model(*a, **kw):
        raise NotImplementedError("prototype: no pydantic in this agent")
"""


def running_tree(root: Path, gen: Generator, structs: str) -> None:
    """A copy of this tree in `root` whose roles validate their config with msgspec."""
    import shutil

    for package in ("nodeagent", "tunnel", "netfilter"):
        shutil.copytree(Path.cwd() / package, root / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    (root / "pydantic").mkdir()
    (root / "pydantic" / "__init__.py").write_text(_SWITCH)
    (root / "config_structs.py").write_text(
        structs + f"\nSTRING_FORMS = {gen.string_forms!r}\nBEFORE = {gen.before!r}\n")


def documents(work: Path) -> dict[str, dict[str, Path]]:
    """The benchmark's config files (`memory_after_load`'s pair) and a config line each."""
    certs = make_certs(work)
    upstream = Upstream(http_port=18080, echo_port=18081)
    scfg = server_config(work, certs, upstream)
    acfg = agent_config(work, certs, upstream, scfg["tunnel"])
    out: dict[str, dict[str, Path]] = {}
    for role, doc in (("server", scfg), ("agent", acfg)):
        line_model = ROOTS[role][1]
        path = work / f"{role}.yaml"
        path.write_text(yaml.safe_dump(doc))
        known = {k: v for k, v in doc.items() if k in line_model.model_fields}
        config = line_model.model_validate(known, context={"base_dir": work})
        line = config_line(7, typing.cast(NodeConfig | RoutesConfig, config))
        (work / f"{role}.line").write_bytes(line)
        out[role] = {"file": path, "line": work / f"{role}.line"}
    return out


def measure(role: str, variant: str, docs: dict[str, Path], gen: Generator,
            structs: str) -> dict[str, Any]:
    file_model, line_model = ROOTS[role]
    args = {"role": role, "variant": variant, "file": str(docs["file"]),
            "line": str(docs["line"]), "file_model": file_model.__name__,
            "line_model": line_model.__name__, "stub": _STUB, "structs": structs,
            "string_forms": gen.string_forms, "before": gen.before}
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(args)],
                          capture_output=True, text=True, cwd=Path.cwd(),
                          env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    if done.returncode != 0:
        raise SystemExit(f"{role} / {variant} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.config_without_pydantic",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--running", action="store_true",
                        help="run memory_after_load on a copy of this tree whose server "
                             "and agent validate their config with msgspec (~3 minutes)")
    parser.add_argument("--show-structs", action="store_true",
                        help="print the generated msgspec structs")
    args = parser.parse_args()
    try:
        import msgspec  # noqa: F401
    except ImportError:
        print("needs msgspec: .venv/bin/pip install 'msgspec==0.22.*' (a prototype's "
              "dependency, not nodeagent's)", file=sys.stderr)
        return 2
    compile_bytecode(Path.cwd())
    gen = Generator()
    for file_model, line_model in ROOTS.values():
        gen.visit(file_model)
        gen.visit(line_model)
    structs = gen.source()
    if args.show_structs:
        print(structs)
    fields = sum(len(m.model_fields) for m in gen.order)
    print(f"{len(gen.order)} models, {fields} fields; string forms: "
          f"{', '.join(sorted(gen.before))}; Python validators not run by the structs: "
          f"{gen.validators}; fields msgspec cannot type (decoded as Any): "
          f"{len(gen.any_fields)} {gen.any_fields}")
    if args.running:
        with tempfile.TemporaryDirectory() as tmp:
            running_tree(Path(tmp), gen, structs)
            print(f"memory_after_load on a copy of this tree ({tmp}) whose server and "
                  f"agent validate their config with msgspec, without pydantic", flush=True)
            return subprocess.run([sys.executable, "-m", "scripts.bench.memory_after_load",
                                   "--tree", tmp, "--rounds", str(max(args.rounds, 1) + 1)],
                                  check=False).returncode
    with tempfile.TemporaryDirectory() as tmp:
        docs = documents(Path(tmp))
        rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for _ in range(args.rounds):
            for role in ("server", "agent"):
                for variant in ("pydantic", "msgspec"):
                    rows.setdefault((role, variant), []).append(
                        measure(role, variant, docs[role], gen, structs))
    print("\nRSS of a fresh interpreter that imported the role and validated its config "
          "file and a config line, MiB (each round)")
    for role in ("server", "agent"):
        p = [r["rss"] for r in rows[(role, "pydantic")]]
        m = [r["rss"] for r in rows[(role, "msgspec")]]
        print(f"  {role:6s} pydantic {' '.join(f'{x:5.1f}' for x in p)}   "
              f"msgspec {' '.join(f'{x:5.1f}' for x in m)}   "
              f"difference {' '.join(f'{a - b:4.1f}' for a, b in zip(p, m, strict=True))}"
              f"   modules {rows[(role, 'pydantic')][0]['modules']} -> "
              f"{rows[(role, 'msgspec')][0]['modules']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
