"""Typed dataclass configs: strict dict/YAML loading, dotted command-line overrides, validation.

Every component's config subclasses :class:`Config`. A whole run is one tree of configs; it is
loaded from YAML or built by a preset function, then edited with overrides such as
``--model.n_layers=4``. Anything wrong (an unknown key, a wrong type, a value out of range) raises
:class:`ConfigError` naming the dotted key and, for unknown keys, the closest valid ones.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import fractions
import os
import re
import types
import typing
from typing import Any, Iterable, Union

__all__ = ["Config", "ConfigError", "StrEnum", "SIZE_UNITS", "parse_overrides", "parse_size"]


class ConfigError(ValueError):
    """The one exception type for bad configuration: the message says what to change."""


class StrEnum(str, enum.Enum):
    """A string-valued choice; ``str(member)`` is its value (so YAML and logs show plain text)."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def _bool_member(cls, value: Any, true: "StrEnum", false: "StrEnum") -> "StrEnum | None":
        """For a choice that extends a switch (its ``_missing_``): ``true`` / ``false`` (the bools, or
        text as a bool option reads it) as the members that mean on and off; None for anything else."""
        text = str(value).lower()
        if value is True or text in ("true", "1", "yes", "on"):
            return true
        if value is False or text in ("false", "0", "no", "off"):
            return false
        return None


def _close(name: str, options: Iterable[str]) -> str:
    options = list(options)
    matches = difflib.get_close_matches(name, options, n=3, cutoff=0.5)
    if matches:
        return f"did you mean {', '.join(repr(m) for m in matches)}?"
    return f"valid keys: {', '.join(sorted(options))}"


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Return ``value`` converted to the annotated type ``tp``, or raise ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: {value!r} is not a valid {_type_name(tp)}")
    if origin in (list, tuple):
        if isinstance(value, str):
            value = [v for v in value.split(",") if v != ""]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        item_tp = args[0] if args else Any
        items = [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if isinstance(tp, type) and issubclass(tp, Config):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return tp.from_dict(value, prefix=key)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        try:
            return tp(value)
        except ValueError:
            choices = ", ".join(repr(m.value) for m in tp)
            raise ConfigError(f"{key}: {value!r} is not one of {choices}") from None
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, os.PathLike)):
            return os.fspath(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value


def _parse_scalar(text: str) -> Any:
    """Parse an override's right-hand side the way YAML would (``4``, ``1e-3``, ``true``, ``[1,2]``)."""
    try:
        import yaml
    except ImportError:  # pragma: no cover - yaml is a declared dependency
        return text
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


@dataclasses.dataclass
class Config:
    """Base of every config: strict construction from dicts, YAML, overrides and validation."""

    AUTO_NONE: typing.ClassVar[frozenset[str]] = frozenset()
    """Fields whose None means "chosen by the run" and which therefore take ``auto`` as its name (in YAML and on
    the command line). Only these: elsewhere None may mean off (a sliding window, a capacity), and ``auto``
    stays the error or the string it was."""

    @classmethod
    def _auto(cls, name: str, value: Any) -> Any:
        return None if name in cls.AUTO_NONE and isinstance(value, str) and value.lower() == "auto" else value

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def _hints(cls) -> dict[str, Any]:
        return typing.get_type_hints(cls)

    @classmethod
    def from_dict(cls, data: dict[str, Any], prefix: str = "") -> "Config":
        """Build from a (nested) mapping; unknown keys and wrong types raise ConfigError."""
        if not isinstance(data, dict):
            raise ConfigError(f"{prefix or cls.__name__}: expected a mapping, got {data!r}")
        hints = cls._hints()
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        kwargs = {}
        for key, value in data.items():
            dotted = f"{prefix}.{key}" if prefix else key
            if key not in names:
                raise ConfigError(f"unknown config key {dotted!r}: {_close(key, names)}")
            kwargs[key] = _coerce(cls._auto(key, value), hints[key], dotted)
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise ConfigError(f"{prefix or cls.__name__}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict of builtin types (enums as their values), safe for YAML and JSON."""

        def plain(v: Any) -> Any:
            if isinstance(v, Config):
                return v.to_dict()
            if isinstance(v, enum.Enum):
                return v.value
            if isinstance(v, (list, tuple)):
                return [plain(x) for x in v]
            if isinstance(v, dict):
                return {k: plain(x) for k, x in v.items()}
            return v

        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.init}

    # ---- YAML -------------------------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "Config":
        import yaml

        path = os.fspath(path)
        if not os.path.exists(path):
            raise ConfigError(f"config file {path!r} does not exist")
        if os.path.isdir(path):
            raise ConfigError(f"config file {path!r} is a directory: pass a YAML file (e.g. <run_dir>/config.yaml)")
        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path!r} is not UTF-8 text ({e.reason} at byte {e.start}): "
                              "pass a YAML file") from None
        except OSError as e:
            raise ConfigError(f"config file {path!r} cannot be read: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path!r} is not valid YAML: {e}") from None
        return cls.from_dict(data)

    def to_yaml(self, path: str | os.PathLike | None = None) -> str:
        import yaml

        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return text

    # ---- overrides --------------------------------------------------------------------------
    def apply_overrides(self, overrides: Iterable[str]) -> "Config":
        """Apply ``--a.b.c=value`` (or ``a.b.c=value``) strings in place; returns self."""
        for item in overrides:
            text = item[2:] if item.startswith("--") else item
            if "=" not in text:
                raise ConfigError(f"override {item!r} must look like --key.sub=value")
            key, raw = text.split("=", 1)
            self.set_dotted(key.strip(), _parse_scalar(raw))
        return self

    def set_dotted(self, key: str, value: Any) -> None:
        """Set the field at dotted path ``key`` (type-checked, nested configs created as needed)."""
        target: Config = self
        parts = key.split(".")
        for i, part in enumerate(parts):
            names = [f.name for f in dataclasses.fields(target) if f.init]
            dotted = ".".join(parts[: i + 1])
            if part not in names:
                raise ConfigError(f"unknown config key {dotted!r}: {_close(part, names)}")
            tp = type(target)._hints()[part]
            if i == len(parts) - 1:
                setattr(target, part, _coerce(type(target)._auto(part, value), tp, dotted))
                return
            child = getattr(target, part)
            if child is None:
                sub = [a for a in typing.get_args(tp) if isinstance(a, type) and issubclass(a, Config)]
                if not sub:
                    raise ConfigError(f"{dotted!r} is not a nested config")
                child = sub[0]()
                setattr(target, part, child)
            if not isinstance(child, Config):
                raise ConfigError(f"{dotted!r} is a value, not a nested config: use --{dotted}=...")
            target = child

    # ---- validation -------------------------------------------------------------------------
    def validate(self) -> None:
        """Check cross-field rules of this config and every nested config; raise ConfigError."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Config):
                v.validate()

    def build(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has nothing to build")

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)


def parse_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split argv into dotted overrides (``--x.y=v`` or ``--x=v``) and the remaining arguments."""
    overrides, rest = [], []
    for a in argv:
        (overrides if a.startswith("--") and "=" in a else rest).append(a)
    return overrides, rest


# The project's one size convention: GB means 10^9 and GiB 2^30, never mixed.
SIZE_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
              "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([KMGT])(i)?)?B?\s*", re.IGNORECASE)


def parse_size(text: str | int, what: str) -> int:
    """Bytes in ``text``: a number with an optional unit, K/M/G/T (powers of 1000) or Ki/Mi/Gi/Ti
    (powers of 1024), with or without B, any case: "5GB" = 5 * 10^9, "500MiB" = 500 * 2^20,
    "1.5K" = 1500, "4096" = 4096. An int is a count of bytes; a fraction of a byte is dropped.
    Raises ConfigError naming ``what`` (e.g. "--sizes") unless the result is a positive number.
    """
    size = 0
    if isinstance(text, int):
        size = text
    elif (m := _SIZE.fullmatch(str(text))) is not None:
        unit = (m[2] or "").upper() + ("i" if m[3] else "")
        size = int(fractions.Fraction(m[1]) * SIZE_UNITS[unit])
    if size <= 0:
        raise ConfigError(f"{what} {text!r} is not a positive size: write bytes with an optional unit, "
                          "K/M/G/T (powers of 1000) or Ki/Mi/Gi/Ti (powers of 1024), B optional, "
                          "e.g. 4096, 500MB, 64KiB, 1Gi")
    return size
