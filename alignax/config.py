"""Typed configs from YAML: dataclasses in, dataclasses out, every key checked.

``from_dict(TrainConfig, yaml_dict)`` builds nested frozen dataclasses, checking each
value against its annotation (``int``, ``float``, ``bool``, ``str``, ``Literal``,
``Optional``, ``list``/``tuple``/``dict`` of those, nested dataclasses). An unknown key
names itself, its path and the valid keys; an ill-typed value names its path, the type
wanted and the value given. ``apply_overrides`` takes ``dotted.key=value`` strings from
the command line, values parsed as YAML scalars.

Numbers. PyYAML reads YAML 1.1, where ``1e-3`` is a *string* (a 1.1 float needs a dot
and a signed exponent). :class:`YamlLoader`, used by :func:`load_yaml` and
:func:`apply_overrides`, reads floats as YAML 1.2 does, so every form a person types is a
float: ``1e-3``, ``1E-3``, ``5e-7``, ``1.0e+3``, ``1.5``, ``1.``, ``.5``, ``-.5``,
``-2e-4``, ``+1e3``, ``1_000.5`` (underscores between digits, as YAML 1.1 and Python
allow), ``.inf``, ``-.inf``, ``.nan``. Bare ``inf`` / ``nan`` are strings to YAML, and
YAML 1.1's base-60 floats (``1:30.5``) are strings, as in YAML 1.2. Booleans are YAML
1.2's too: only ``true``/``false`` (any case YAML allows); YAML 1.1's ``on``/``off``/``yes``/
``no`` are text, so a choice such as ``rollout.pack_groups=off`` reads as written instead of
as ``false``. Ints, nulls and dates read as before. The typed conversion then decides by the field's annotation:

- ``float`` fields take any int or float, and also numeric text (a quoted ``'1e-3'``,
  a dict built in Python): the forms above plus ``inf``/``-inf``/``infinity``.
  ``inf`` is allowed (a bound meaning "no limit"); NaN is refused, it is never a usable
  hyper-parameter (every comparison with it is false).
- ``int`` fields take integers, and a float or numeric text only when it is a whole
  number: ``max_steps: 1e5`` is ``100000``; ``2.5`` is "expected an integer". Floats
  beyond 2**53 are refused (not exact); write the digits.
- ``str`` fields keep text as text; an unquoted number (``1e-3``, ``7``, ``0.5``) in a
  ``str`` field is an error that says to quote it (the typed text would be lost).
- ``bool`` fields take only ``true``/``false``.

``load_callable("package.module:function")`` imports the object a config names.

The last part of the file is generic machinery for cross-field checks of any config tree:
a condition language (:class:`Is`, :class:`Above`, :class:`Given`, :class:`All`, ...; each
says itself in recipe terms and names the values that make it fail), the key table's rows
(:class:`Rule`: keys read when a condition holds) and the schema walk (:func:`schema_keys`,
:func:`set_keys`, :func:`unusable_keys`). The run config's table is
:mod:`alignax.trainers.validation`.
"""

from __future__ import annotations

import abc
import dataclasses
import decimal
import difflib
import functools
import importlib
import keyword
import math
import re
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config key or value is wrong; the message names the dotted path.

    The base of every refusal of user input (a run directory, a data record, a checkpoint,
    a model folder, a reward function's spec...): ``alignax`` prints any of them as one
    line and exits 2 (``alignax.cli``)."""

    def __init__(self, message: str, *, reason: str | None = None):
        super().__init__(message)
        self.reason = reason  # what a union's "expected A | B" message should pass on


_SHOWN_CHARS = 200  # a bad value longer than this is cut in the message, its length said


def cut(text: str) -> str:
    """``text`` for an error message: its first :data:`_SHOWN_CHARS` characters and its length
    when longer (a pasted 100,000-character value would bury the message)."""
    if len(text) <= _SHOWN_CHARS:
        return text
    return f"{text[:_SHOWN_CHARS]}... ({len(text):,} characters)"


def shown(value: Any) -> str:
    """``repr(value)`` for an error message, :func:`cut` when long."""
    return cut(repr(value))


def key_name(field_name: str) -> str:
    """The config key of a dataclass field: a key that is a Python keyword (``rollout.async``)
    is the field of that name with a trailing underscore (``async_``)."""
    base = field_name[:-1]
    return base if field_name.endswith("_") and keyword.iskeyword(base) else field_name


def field_name(key: str) -> str:
    """The dataclass field that holds config ``key`` (the inverse of :func:`key_name`)."""
    return f"{key}_" if keyword.iskeyword(key) else key


# --- YAML with YAML 1.2 floats -----------------------------------------------------------

_FLOAT_TAG = "tag:yaml.org,2002:float"
_DIGITS = r"[0-9][0-9_]*"
# YAML 1.2 core-schema floats, plus the underscores YAML 1.1 allowed. YAML 1.1's
# sexagesimal floats (``1:30.5`` == 90.5) are gone, as in YAML 1.2: such text is a string.
_FLOAT_RE = re.compile(
    rf"""^(?:[-+]?(?:{_DIGITS}\.[0-9_]*(?:[eE][-+]?{_DIGITS})?    # 1.  1.5  1.5e3  1_000.5
                 |\.{_DIGITS}(?:[eE][-+]?{_DIGITS})?             # .5  -.5e-3
                 |{_DIGITS}[eE][-+]?{_DIGITS}                     # 1e-3  5E7  +1e3
                 |\.(?:inf|Inf|INF))                              # .inf  -.inf
          |\.(?:nan|NaN|NAN))$""",
    re.X,
)
_INT_TEXT_RE = re.compile(rf"^[-+]?{_DIGITS}$")
_INF_NAN_TEXT_RE = re.compile(r"^[-+]?(?:\.?inf|infinity|\.?nan)$", re.I)
_EXACT_FLOAT_INT = 2**53


class YamlLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` reading floats and booleans as YAML 1.2 does (``1e-3`` is a float,
    not text; ``on``/``off``/``yes``/``no`` are text, not booleans).

    Only the float and bool resolvers differ from SafeLoader; ints, nulls, dates are as
    before.
    """


_BOOL_TAG = "tag:yaml.org,2002:bool"
_BOOL_RE = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_REPLACED = {_FLOAT_TAG: _FLOAT_RE, _BOOL_TAG: _BOOL_RE}
YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, _REPLACED.get(tag, regexp)) for tag, regexp in resolvers]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def yaml_load(stream: Any) -> Any:
    """``yaml.safe_load`` with YAML 1.2 floats and booleans (:class:`YamlLoader`)."""
    return yaml.load(stream, Loader=YamlLoader)  # noqa: S506 - a SafeLoader subclass


def _number_from_text(text: str) -> decimal.Decimal | None:
    """The number a string spells (the float forms above, decimal ints, inf/nan), else None."""
    s = text.strip()
    if not (_FLOAT_RE.match(s) or _INT_TEXT_RE.match(s) or _INF_NAN_TEXT_RE.match(s)):
        return None
    s = s.replace("_", "").lower().replace(".inf", "inf").replace(".nan", "nan")
    try:
        return decimal.Decimal(s)
    except decimal.InvalidOperation:
        return None


def _to_int(value: Any, path: str) -> int:
    number: Any = value
    if isinstance(value, str):
        number = _number_from_text(value)
    if isinstance(number, int) and not isinstance(number, bool):
        return number
    if isinstance(number, float):
        if number.is_integer() and abs(number) <= _EXACT_FLOAT_INT:
            return int(number)
        if number.is_integer() and math.isfinite(number):
            raise ConfigError(f"{path}: expected an integer, got {shown(value)}, too large to read exactly "
                              "from a float; write its digits")
    if isinstance(number, decimal.Decimal) and number.is_finite() and number == number.to_integral_value():
        return int(number)
    raise ConfigError(f"{path}: expected an integer, got {shown(value)}")


def _to_float(value: Any, path: str) -> float:
    number: Any = value
    if isinstance(value, str):
        number = _number_from_text(value)
        number = None if number is None else float(number)
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise ConfigError(f"{path}: expected a number, got {shown(value)}")
    number = float(number)
    if math.isnan(number):
        reason = "NaN is not a usable value; give a number (inf is allowed)"
        raise ConfigError(f"{path}: {reason}", reason=reason)
    return number


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin in (dict, Mapping) and typing.get_args(tp):
        key, value = typing.get_args(tp)
        return f"{{{_type_name(key)}: {_type_name(value)}}}"
    if origin is tuple and typing.get_args(tp) and typing.get_args(tp)[-1] is not Ellipsis:
        return f"[{', '.join(_type_name(a) for a in typing.get_args(tp))}]"
    return getattr(tp, "__name__", str(tp))


def _takes_mappings(tp: Any) -> bool:
    """Whether ``tp`` is read from a YAML mapping (a section or a ``dict[...]``)."""
    return dataclasses.is_dataclass(tp) or typing.get_origin(tp) in (dict, Mapping) or tp is dict


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{path}: {shown(value)} is not a valid choice; valid: "
                              f"{', '.join(map(repr, args))}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        mapped = [a for a in args if _takes_mappings(a)]
        if len(mapped) == 1 and isinstance(value, Mapping):
            # a mapping can only be the one option read from a mapping: its own error names the
            # field and the rule (``lora.rank: ...``, ``rollout.rejection.token: expected 2
            # items``), not "expected LoraConfig | null"
            return _convert(mapped[0], value, path)
        reasons = []
        for option in args:
            if option is type(None):
                continue
            try:
                return _convert(option, value, path)
            except ConfigError as err:
                reasons += [err.reason] if err.reason else []
        detail = "".join(f"; {r}" for r in reasons)
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {shown(value)}{detail}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping of {tp.__name__} fields, got {shown(value)}")
        return from_dict(tp, value, path=path)
    if origin in (list, Sequence, tuple) or tp in (list, tuple):
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise ConfigError(f"{path}: expected a list, got {shown(value)}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{path}: expected {len(args)} items, got {len(value)}")
            return tuple(_convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        items = [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or tp is tuple) else items
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {shown(value)}")
        key_tp, val_tp = args if args else (Any, Any)
        return {_convert(key_tp, k, path): _convert(val_tp, v, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {shown(value)}")
        return value
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected an integer, got {shown(value)}")
        return _to_int(value, path)
    if tp is float:
        return _to_float(value, path)
    if tp is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            key = path.rpartition(".")[2] or path
            reason = (f"quote the value to keep it as text (YAML: {key}: '...', command line: "
                      f"{path}=\"'...'\")")
            raise ConfigError(f"{path}: expected a string, got the number {shown(value)}; {reason}", reason=reason)
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {shown(value)}")
        return value
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{path}: cannot read a {_type_name(tp)} from {shown(value)}")


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints(cls)``, resolved once per class: the config modules use
    postponed annotations, and resolving them compiles each annotation string anew, which
    a validation sweep over every key would otherwise pay thousands of times."""
    return typing.get_type_hints(cls)


def from_dict(cls: type[T], data: Mapping[str, Any], *, path: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, checking every key and value."""
    if data is None:
        data = {}
    hints = type_hints(cls)
    fields = {key_name(f.name): f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = unknown[0]
        where = f"{path}.{key}" if path else key
        close = difflib.get_close_matches(str(key), list(fields), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown config key {shown(where)}{hint}; valid keys here: {', '.join(fields)}")
    kwargs = {}
    for name, value in data.items():
        where = f"{path}.{name}" if path else name
        kwargs[field_name(name)] = _convert(hints[field_name(name)], value, where)
    missing = [
        n for n, f in fields.items()
        if field_name(n) not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        where = ", ".join(f"{path}.{m}" if path else m for m in missing)
        raise ConfigError(f"missing required config key(s): {where}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        said = str(err)  # a section's own check may name its dotted key already (lora.rank must be >= 1)
        raise ConfigError(said if path and said.startswith(f"{path}.") else f"{path or cls.__name__}: {said}") from err


def dotted(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as ``{dotted.key: leaf}`` (an empty mapping is a leaf ``{}``)."""
    if isinstance(tree, Mapping):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(dotted(v, f"{prefix}{k}."))
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: tree}


def to_dict(config: Any) -> Any:
    """Plain, YAML/JSON-able form of a config dataclass (tuples become lists)."""
    if dataclasses.is_dataclass(config):
        return {key_name(f.name): to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, (list, tuple)):
        return [to_dict(v) for v in config]
    if isinstance(config, Mapping):
        return {k: to_dict(v) for k, v in config.items()}
    return config


_OVERRIDE_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")


def _override_key(item: str, key: str) -> list[str]:
    """The parts of an override's dotted ``key``; a malformed key is a :class:`ConfigError`
    naming the override ``item`` and what is wrong with it."""
    key = key.strip()
    if not key:
        raise ConfigError(f"override {shown(item)}: the key before '=' is empty; expected dotted.key=value, "
                          "e.g. optim.learning_rate=1e-4")
    parts = key.split(".")
    if "" in parts:
        where = ("starts with a dot" if parts[0] == "" else "ends with a dot" if parts[-1] == ""
                 else "has two dots in a row")
        raise ConfigError(f"override {shown(item)}: the key {shown(key)} {where} (an empty part); expected "
                          "dotted.key=value "
                          "with a name between every two dots")
    for part in parts:
        if not _OVERRIDE_PART.match(part):
            odd = sorted({ch for ch in part if not (ch.isascii() and (ch.isalnum() or ch in "_-"))})
            what = (f"holds {', '.join('a space' if c == ' ' else repr(c) for c in odd)}" if odd
                    else "starts with '-'")
            raise ConfigError(f"override {shown(item)}: the key part {shown(part)} {what}; config keys are names of "
                              "letters, "
                              "digits and '_' (no spaces; put any space in the value, after '=')")
    return parts


def _yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error in one line: its problem and the column of the value it is at."""
    problem, mark = getattr(err, "problem", None), getattr(err, "problem_mark", None)
    if not problem:
        return " ".join(str(err).split())
    return f"{problem} at column {mark.column + 1}" if mark is not None else problem


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` strings to a nested dict (values parsed as YAML, 1.2 floats:
    ``optim.learning_rate=1e-3`` is a float).

    A malformed override is a :class:`ConfigError` naming it: no ``=``, an empty key
    (``=5``), an empty part (``dpo..beta=1``, ``.x=1``, ``a.b.=1``), a key part that is not a
    name (spaces, odd characters), a part that is a value rather than a section, a value
    that is not valid YAML.
    """
    data = _deep_copy(data)
    for item in overrides:
        if not isinstance(item, str) or "=" not in item:
            raise ConfigError(f"override {shown(item)} must look like dotted.key=value")
        key, raw = item.split("=", 1)
        parts = _override_key(item, key)
        node = data
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {shown(item)}: {shown(part)} is a value, not a section")
            node = child
        try:
            value = yaml_load(raw) if raw.strip() else ""
        except yaml.YAMLError as err:
            raise ConfigError(f"override {shown(item)}: the value is not valid YAML ({_yaml_problem(err)})") from err
        node[parts[-1]] = value
    return data


def _deep_copy(data: Any) -> Any:
    if isinstance(data, Mapping):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


def load_yaml(path: str) -> dict[str, Any]:
    """The mapping in a YAML file (read with :class:`YamlLoader`: ``1e-3`` is a float)."""
    with open(path, encoding="utf-8") as f:
        try:
            data = yaml_load(f)
        except yaml.YAMLError as err:  # a syntax error: where it is, not a parser traceback
            mark = getattr(err, "problem_mark", None)
            where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark else str(path)
            raise ConfigError(f"{where}: not valid YAML ({getattr(err, 'problem', None) or err})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of config sections")
    return data


_SPEC_EXAMPLE = "'my_package.rewards:score'"
_IDENTIFIER_PATH = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")


def load_callable(spec: str) -> Callable[..., Any]:
    """``"package.module:function"`` -> that function (or any callable the module holds).

    After the colon a dotted path reaches into the module (``"pkg.mod:Class.method"``).
    Every failure is a :class:`ConfigError` naming ``spec`` and what would be right: a
    malformed spec, a module that cannot be found, an attribute the module lacks (with
    the closest names), an object that is not callable. An error raised while the module
    itself imports (a missing dependency) is reported as such, chained to the original.
    """
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ConfigError(f"callable spec {spec!r} is malformed: expected 'package.module:function' "
                          f"with exactly one colon, e.g. {_SPEC_EXAMPLE}")
    module_name, _, attr_path = (part.strip() for part in spec.partition(":"))
    for part, what in ((module_name, "module path before the colon"), (attr_path, "name after the colon")):
        if not _IDENTIFIER_PATH.match(part):
            raise ConfigError(f"callable spec {spec!r} is malformed: the {what} {part!r} is not a dotted "
                              f"Python name; expected 'package.module:function', e.g. {_SPEC_EXAMPLE}")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and (module_name == err.name or module_name.startswith(err.name + ".")):
            raise ConfigError(f"callable spec {spec!r}: no module named {err.name!r}; the part before the "
                              "colon must be an importable module (installed, or on sys.path)") from err
        raise ConfigError(f"callable spec {spec!r}: module {module_name!r} was found but importing it "
                          f"failed: {err}") from err
    except ImportError as err:
        raise ConfigError(f"callable spec {spec!r}: importing module {module_name!r} failed: {err}") from err
    reached: list[str] = []
    for name in attr_path.split("."):
        if not hasattr(obj, name):
            owner = ".".join([module_name, *reached])
            close = difflib.get_close_matches(name, [n for n in dir(obj) if not n.startswith("_")], n=3)
            hint = "; did you mean " + " or ".join(
                repr(f"{module_name}:{'.'.join([*reached, c])}") for c in close) + "?" if close else ""
            raise ConfigError(f"callable spec {spec!r}: {owner!r} has no attribute {name!r}{hint}")
        obj = getattr(obj, name)
        reached.append(name)
    if not callable(obj):
        raise ConfigError(f"callable spec {spec!r} names a {type(obj).__name__}, not a function or other "
                          "callable")
    return obj


# =========================================================================================
# The condition language, the key table's rows and the schema walk: generic over any config
# dataclass tree. ``alignax.trainers.validation`` writes the run config's table in them;
# each algorithm's entry (``alignax.trainers.algorithms``) writes its own rows.
# =========================================================================================

MISSING = object()  # what :func:`get` returns through a null section


def get(config: Any, path: str) -> Any:
    """The value at a dotted ``path`` of ``config`` (``MISSING`` through a null section)."""
    value = config
    for part in path.split("."):
        if value is None:
            return MISSING
        value = getattr(value, field_name(part))
    return value


def show(value: Any) -> str:
    """A value as a recipe writes it."""
    if value is None or value is MISSING:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return "[" + ", ".join(show(v) for v in value) + "]"
    if dataclasses.is_dataclass(value):
        return "{...}"
    return cut(str(value))


# ---------------------------------------------------------------------------- conditions
class Cond(abc.ABC):
    """A condition on a config: ``cond(config) -> bool``; ``text`` says it in recipe terms,
    ``got(config)`` the values that make it fail."""

    text: str

    @abc.abstractmethod
    def __call__(self, config: Any) -> bool:
        """Whether the condition holds for ``config``."""

    @abc.abstractmethod
    def got(self, config: Any) -> str:
        """The values of ``config`` that the condition reads, in recipe terms."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.text}>"


class Is(Cond):
    """``path`` holds one of ``values``."""

    def __init__(self, path: str, *values: Any):
        self.path, self.values = path, values
        self.text = f"{path}={'|'.join(show(v) for v in values)}"

    def __call__(self, config):
        return get(config, self.path) in self.values

    def got(self, config):
        return f"{self.path}={show(get(config, self.path))}"


class IsNot(Is):
    """``path`` holds none of ``values``."""

    def __init__(self, path: str, *values: Any):
        super().__init__(path, *values)
        self.text = f"{path} other than {'/'.join(show(v) for v in values)}"

    def __call__(self, config):
        return get(config, self.path) not in self.values


class Above(Is):
    """``path`` > ``bound``."""

    def __init__(self, path: str, bound: float = 0):
        super().__init__(path)
        self.bound = bound
        self.text = f"{path} > {show(bound)}"

    def __call__(self, config):
        value = get(config, self.path)
        return value is not None and value is not MISSING and value > self.bound


class NonZero(Is):
    """``path`` != 0."""

    def __init__(self, path: str):
        super().__init__(path)
        self.text = f"{path} != 0"

    def __call__(self, config):
        return get(config, self.path) != 0


class Given(Is):
    """``path`` is set: not null, not empty."""

    def __init__(self, path: str):
        super().__init__(path)
        self.text = f"{path} set"

    def __call__(self, config):
        value = get(config, self.path)
        return value is not MISSING and value is not None and value != () and value != {}

    def got(self, config):
        value = get(config, self.path)
        return f"{self.path}={'[]' if value == () else '{}' if value == {} else show(value)}"


class All(Cond):
    def __init__(self, *conds: Cond):
        self.conds = conds
        self.text = " and ".join(c.text for c in conds)

    def __call__(self, config):
        return all(c(config) for c in self.conds)

    def got(self, config):
        return next(c.got(config) for c in self.conds if not c(config))


class AnyOf(Cond):
    def __init__(self, *conds: Cond):
        self.conds = conds
        self.text = " or ".join(f"({c.text})" if isinstance(c, (All, AnyOf)) else c.text for c in conds)

    def __call__(self, config):
        return any(c(config) for c in self.conds)

    def got(self, config):
        seen = []
        for c in self.conds:
            for part in c.got(config).split(", "):
                if part and part not in seen:
                    seen.append(part)
        return ", ".join(seen)


class Named(Cond):
    """``cond`` said in words (``text``)."""

    def __init__(self, text: str, cond: Cond):
        self.text, self.cond = text, cond

    def __call__(self, config):
        return self.cond(config)

    def got(self, config):
        return self.cond.got(config)


class Check(Cond):
    """A condition computed by ``fn``; ``got_fn`` says the values it read."""

    def __init__(self, text: str, fn: Callable[[Any], bool], got_fn: Callable[[Any], str]):
        self.text, self.fn, self.got_fn = text, fn, got_fn

    def __call__(self, config):
        return self.fn(config)

    def got(self, config):
        return self.got_fn(config)


ALWAYS = Check("any run", lambda c: True, lambda c: "")
NEVER = Check("no run", lambda c: False, lambda c: "")


# --- the key table's rows
@dataclasses.dataclass(frozen=True)
class Rule:
    """``keys`` (dotted leaves, or a section: all keys under it) are read when ``when``
    holds; ``why``: the reason in words, for the error message."""

    keys: tuple[str, ...]
    when: Cond
    why: str = ""

    def covers(self, key: str) -> bool:
        return any(key == k or key.startswith(k + ".") for k in self.keys)


def rule(keys: str | Sequence[str], when: Cond, why: str = "") -> Rule:
    return Rule((keys,) if isinstance(keys, str) else tuple(keys), when, why)


def keys_of(cls: type, prefix: str, *, but: Sequence[str] = ()) -> list[str]:
    """The keys of section ``cls`` at ``prefix`` except ``but``."""
    return [f"{prefix}.{key_name(f.name)}" for f in dataclasses.fields(cls) if key_name(f.name) not in but]


# --- the schema walk
def schema_keys(cls: type, prefix: str = "") -> Iterator[str]:
    """Every dotted key of the schema: leaves, and optional sections (``ppo.ptx_data``)
    with their leaves after them."""
    hints = type_hints(cls)
    for field in dataclasses.fields(cls):
        tp, key = hints[field.name], prefix + key_name(field.name)
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        if dataclasses.is_dataclass(tp):
            yield from schema_keys(tp, key + ".")
        elif inner:
            yield key
            yield from schema_keys(inner[0], key + ".")
        else:
            yield key


def field_default(cls: type, field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return MISSING


def set_keys(config: Any, prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
    """``(key, value, default)`` of every key whose value differs from its dataclass default;
    a set optional section (``ppo.ptx_data``) comes before its own set keys."""
    for field in dataclasses.fields(config):
        value, key = getattr(config, field.name), prefix + key_name(field.name)
        if dataclasses.is_dataclass(value):
            default = field_default(type(config), field)
            if default is None:  # an optional section, set
                yield key, value, None
            yield from set_keys(value, key + ".")
            continue
        default = field_default(type(config), field)
        if default is MISSING or value != default:
            yield key, value, default


@dataclasses.dataclass(frozen=True)
class Unusable:
    """A set key that the run would ignore: the first of its rules that fails."""

    key: str
    value: Any
    default: Any
    rule: Rule


def unusable_keys(config: Any, rules_covering: Callable[[str], Sequence[Rule]]) -> list[Unusable]:
    """The set keys whose rules (``rules_covering(key)``, in table order) do not all hold,
    in schema order; the keys under an optional section reported for a rule are not
    repeated for it."""
    out: list[Unusable] = []
    for key, value, default in set_keys(config):
        for r in rules_covering(key):
            if not r.when(config):
                if not any(u.rule is r and key.startswith(u.key + ".") for u in out):
                    out.append(Unusable(key, value, default, r))
                break
    return out
