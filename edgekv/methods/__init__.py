"""Compression methods: one file per method, and a plain registry.

Add a method by writing a ``Method`` dataclass in its own file and listing it
in ``METHODS``; the parametrised test matrix (tests/test_methods.py) picks it up.
"""

from __future__ import annotations

import dataclasses
import re

from ..errors import EdgekvError
from .base import Method, ScorerMethod
from .chelsea import Chelsea
from .chelsea_nobias import ChelseaNoBias
from .chunk import ChunkSelection
from .chunkkv import ChunkKV
from .compresskv import CompressKV
from .context_shift import ContextShift
from .expected_attention import ExpectedAttention
from .full import Full
from .h2o import H2O
from .knorm import Knorm
from .kvzip import KVzip
from .lagkv import LagKV
from .protokv import ProtoKV
from .random import Random
from .rerotate import KeyRerotation
from .snapkv import SnapKV
from .streaming_llm import StreamingLLM
from .wrapper import MethodWrapper

METHODS: dict[str, type[Method]] = {
    cls.name: cls
    for cls in (Full, StreamingLLM, Knorm, Random, ContextShift, LagKV, SnapKV, ChunkKV, H2O, CompressKV,
                ProtoKV, Chelsea, ChelseaNoBias, KVzip, ExpectedAttention)
}


# NAME+SUFFIX wraps method NAME: position changes wrap a method rather than being driver flags
WRAPPERS: dict[str, type[MethodWrapper]] = {w.suffix: w for w in (KeyRerotation, ChunkSelection)}


def parse_value(text: str) -> object:
    """A parameter value as written on a command line: true/false, an int, a float, else the text."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_params(items: list[str], what: str = "a parameter") -> dict[str, object]:
    """``NAME=VALUE`` strings to a dict (values through ``parse_value``)."""
    out: dict[str, object] = {}
    for item in items:
        k, eq, v = item.partition("=")
        if not eq or not k.strip():
            raise EdgekvError(f"{what} takes NAME=VALUE, got {item!r}")
        out[k.strip()] = parse_value(v)
    return out


def get_method(name: str, **params: object) -> Method:
    """A configured instance; unknown names and parameters are one-line errors.
    ``knorm+rerotate`` is knorm wrapped in ``KeyRerotation`` (parameters go to knorm);
    ``knorm+rerotate@6144`` sets the wrapper's one argument (``limit``).
    ``chunkkv:per_layer=true:chunk=20`` sets parameters in the name itself, so that one
    string names a configuration wherever a method name goes (a sweep's ``--methods``,
    a request); ``params`` given beside it win."""
    base, plus, suffix = name.rpartition("+")
    if not plus or not re.fullmatch(r"[A-Za-z_]\w*(@.*)?", suffix):  # no wrapper: a '+' in a value (1e+3)
        base, plus, suffix = name, "", ""
    base, colon, spec = base.partition(":")
    if colon:
        params = {**parse_params(spec.split(":"), f"{name!r}: a parameter after ':'"), **params}
    if plus:
        suffix, at, arg = suffix.partition("@")
        if suffix not in WRAPPERS:
            raise EdgekvError(f"unknown method suffix {suffix!r} in {name!r}; available: +{', +'.join(WRAPPERS)}")
        if not at:
            return WRAPPERS[suffix](method=get_method(base, **params))
        if not (arg.isascii() and arg.isdigit()):
            raise EdgekvError(f"{name!r}: the number after '@' must be a whole number, got {arg!r}")
        wrapper = WRAPPERS[suffix]
        if not wrapper.arg:
            raise EdgekvError(f"{name!r}: +{suffix} takes no '@' argument")
        return wrapper(method=get_method(base, **params), **{wrapper.arg: int(arg)})
    cls = METHODS.get(base)
    if cls is None:
        raise EdgekvError(f"unknown method {base!r}; available: {', '.join(METHODS)}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    for k in params:
        if k not in known:
            raise EdgekvError(
                f"method {base!r} has no parameter {k!r}; it takes: {', '.join(known) or 'none'}"
            )
    for k, v in params.items():
        _check_type(base, k, known[k].default, v)
    try:
        return cls(**params)  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        raise EdgekvError(f"bad parameters for {base}: {e}") from e


def _check_type(method: str, name: str, default: object, value: object) -> None:
    """A parameter's value must have its default's type (an int is a fine float), so that a
    string from a config or a request fails here, with its name, not deep in a compression."""
    kind = type(default)
    if kind not in (bool, int, float, str):
        return  # no default to go by (None: optional paths and the like)
    ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise EdgekvError(f"parameter {name!r} of {method} takes {kind.__name__} values, got {value!r}")


__all__ = ["METHODS", "WRAPPERS", "ChunkSelection", "KeyRerotation", "Method", "MethodWrapper", "ScorerMethod",
           "get_method", "parse_params", "parse_value"]
