"""A tiny expression language that compiles to CEL and evaluates in Python with the same meaning.

Why it exists: a cross-field rule must reject the same manifests at `kubectl apply` (CEL in the CRD's
x-kubernetes-validations) and in `lockstep validate` (Python, offline). Writing each rule twice invites
drift; here a rule is written once as an expression tree and both forms come from it.

Semantics follow CEL: `&&` and `||` short-circuit, `/` is integer division, field access on an absent
field is an error (guard with `has`), `in` tests list membership. Values are the wire form (camelCase
keys, enum values as strings), which is what the apiserver hands CEL after defaulting.

Who uses it: lockstep.api.rules (declares the rules), lockstep.api.crdgen (emits `to_cel()`),
lockstep.api.manifest (calls `evaluate`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Scalar = str | int | float | bool


class RuleBug(Exception):
    """A rule read a field that is absent without guarding it with has(); a bug in the rule."""


class Expr:
    """Base of expression nodes; the operator methods build bigger expressions."""

    def to_cel(self) -> str:
        raise NotImplementedError

    def evaluate(self, env: Mapping[str, Any]) -> Any:
        """Value of the expression; env maps `self` (and `oldSelf`) to wire-form dicts."""
        raise NotImplementedError

    # comparisons are methods, not __eq__, so expressions stay hashable and unambiguous
    def eq(self, other: Expr | Scalar) -> Expr:
        return Bin("==", self, lit(other))

    def lt(self, other: Expr | Scalar) -> Expr:
        return Bin("<", self, lit(other))

    def le(self, other: Expr | Scalar) -> Expr:
        return Bin("<=", self, lit(other))

    def gt(self, other: Expr | Scalar) -> Expr:
        return Bin(">", self, lit(other))

    def ge(self, other: Expr | Scalar) -> Expr:
        return Bin(">=", self, lit(other))

    def in_(self, values: Expr | Sequence[Scalar]) -> Expr:
        return Bin("in", self, values if isinstance(values, Expr) else Lit(list(values)))

    def implies(self, other: Expr) -> Expr:
        return Bin("||", Not(self), other)

    def __and__(self, other: Expr) -> Expr:
        return Bin("&&", self, other)

    def __or__(self, other: Expr) -> Expr:
        return Bin("||", self, other)

    def __invert__(self) -> Expr:
        return Not(self)

    def __mul__(self, other: Expr | int) -> Expr:
        return Bin("*", self, lit(other))

    def __floordiv__(self, other: Expr | int) -> Expr:
        return Bin("/", self, lit(other))

    def __mod__(self, other: Expr | int) -> Expr:
        return Bin("%", self, lit(other))

    def __add__(self, other: Expr | Scalar) -> Expr:
        return Bin("+", self, lit(other))


def lit(value: Expr | Scalar | list[Any]) -> Expr:
    """Wrap a Python value as a literal (expressions pass through)."""
    return value if isinstance(value, Expr) else Lit(value)


@dataclass(frozen=True, slots=True, eq=False)
class Lit(Expr):
    """A literal: string, number, bool or a list of them."""

    value: Any

    def to_cel(self) -> str:
        return _cel_literal(self.value)

    def evaluate(self, env: Mapping[str, Any]) -> Any:
        return self.value


def _cel_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, int | float):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_cel_literal(v) for v in value) + "]"
    raise TypeError(f"no CEL literal for {value!r}")


@dataclass(frozen=True, slots=True, eq=False)
class Ref(Expr):
    """A field path from `self` or `oldSelf`, e.g. Ref('self', ('schedule', 'mode'))."""

    root: str
    path: tuple[str, ...]

    def to_cel(self) -> str:
        return ".".join((self.root, *self.path))

    def evaluate(self, env: Mapping[str, Any]) -> Any:
        value = env[self.root]
        for i, key in enumerate(self.path):
            if not isinstance(value, Mapping) or key not in value:
                raise RuleBug(f"{'.'.join((self.root, *self.path[: i + 1]))} is absent; guard it with has()")
            value = value[key]
        return value

    def matches(self, pattern: str) -> Expr:
        """The string matches the RE2 regular expression (CEL `matches`; unanchored unless ^...$)."""
        return Matches(self, pattern)

    def map(self, field: str) -> Expr:
        """The list of `field` of each element: CEL `list.map(x, x.field)`."""
        return Pluck(self, field)

    def size(self) -> Expr:
        return Size(self)

    def all(self, var: str, body: Expr) -> Expr:
        """True when `body` holds for every element bound to `var` (CEL `list.all(var, body)`);
        `body` reads the element as field(path, root=var)."""
        return Macro("all", self, var, body)

    def exists(self, var: str, body: Expr) -> Expr:
        """True when `body` holds for some element (CEL `list.exists(var, body)`)."""
        return Macro("exists", self, var, body)

    def exists_one(self, var: str, body: Expr) -> Expr:
        """True when `body` holds for exactly one element (CEL `list.exists_one(var, body)`)."""
        return Macro("exists_one", self, var, body)


@dataclass(frozen=True, slots=True, eq=False)
class Macro(Expr):
    """CEL's list macros all / exists / exists_one over the elements of `ref`, bound to `var`."""

    kind: str
    ref: Ref
    var: str
    body: Expr

    def to_cel(self) -> str:
        return f"{self.ref.to_cel()}.{self.kind}({self.var}, {self.body.to_cel()})"

    def evaluate(self, env: Mapping[str, Any]) -> Any:
        hits = [_bool(self.body.evaluate({**env, self.var: item})) for item in self.ref.evaluate(env)]
        if self.kind == "all":
            return all(hits)
        if self.kind == "exists":
            return any(hits)
        return sum(hits) == 1


@dataclass(frozen=True, slots=True, eq=False)
class Has(Expr):
    """True when the last field of the path is present (CEL `has(a.b.c)`; parents must exist)."""

    ref: Ref

    def to_cel(self) -> str:
        return f"has({self.ref.to_cel()})"

    def evaluate(self, env: Mapping[str, Any]) -> Any:
        parent = Ref(self.ref.root, self.ref.path[:-1]).evaluate(env)
        return isinstance(parent, Mapping) and self.ref.path[-1] in parent


@dataclass(frozen=True, slots=True, eq=False)
class Pluck(Expr):
    ref: Ref
    field: str

    def to_cel(self) -> str:
        return f"{self.ref.to_cel()}.map(x, x.{self.field})"

    def evaluate(self, env: Mapping[str, Any]) -> Any:
        return [item[self.field] for item in self.ref.evaluate(env)]


@dataclass(frozen=True, slots=True, eq=False)
class Matches(Expr):
    ref: Ref
    pattern: str

    def to_cel(self) -> str:
        return f"{self.ref.to_cel()}.matches({_cel_literal(self.pattern)})"

    def evaluate(self, env: Mapping[str, Any]) -> Any:
        # Python's re and RE2 agree on the simple patterns we use (classes, groups, anchors)
        return re.search(self.pattern, self.ref.evaluate(env)) is not None


@dataclass(frozen=True, slots=True, eq=False)
class Size(Expr):
    ref: Ref

    def to_cel(self) -> str:
        return f"size({self.ref.to_cel()})"

    def evaluate(self, env: Mapping[str, Any]) -> Any:
        return len(self.ref.evaluate(env))


@dataclass(frozen=True, slots=True, eq=False)
class Not(Expr):
    inner: Expr

    def to_cel(self) -> str:
        return f"!({self.inner.to_cel()})"

    def evaluate(self, env: Mapping[str, Any]) -> Any:
        return not _bool(self.inner.evaluate(env))


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise RuleBug(f"expected a bool, got {value!r}")
    return value


@dataclass(frozen=True, slots=True, eq=False)
class Bin(Expr):
    op: str
    left: Expr
    right: Expr

    def to_cel(self) -> str:
        return f"({self.left.to_cel()} {self.op} {self.right.to_cel()})"

    def evaluate(self, env: Mapping[str, Any]) -> Any:
        if self.op == "&&":
            return _bool(self.left.evaluate(env)) and _bool(self.right.evaluate(env))
        if self.op == "||":
            return _bool(self.left.evaluate(env)) or _bool(self.right.evaluate(env))
        a, b = self.left.evaluate(env), self.right.evaluate(env)
        match self.op:
            case "==":
                return bool(a == b)
            case "<":
                return bool(a < b)
            case "<=":
                return bool(a <= b)
            case ">":
                return bool(a > b)
            case ">=":
                return bool(a >= b)
            case "in":
                return a in b
            case "*":
                return a * b
            case "/":
                return _int_div(a, b)
            case "%":
                return _int_mod(a, b)
            case "+":
                return a + b
        raise RuleBug(f"unknown operator {self.op}")


def _int_div(a: int, b: int) -> int:
    # CEL truncates toward zero; all our operands are positive, but keep the meaning exact
    if b == 0:
        raise RuleBug("division by zero")
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def _int_mod(a: int, b: int) -> int:
    if b == 0:
        raise RuleBug("modulus by zero")
    return a - b * _int_div(a, b)


def field(path: str, root: str = "self") -> Ref:
    """A field reference from a dotted camelCase path relative to the rule's scope."""
    return Ref(root, tuple(path.split(".")))


def var(name: str) -> Ref:
    """The element a list macro binds (`all(var, ...)`) when it is a scalar, e.g. a label string."""
    return Ref(name, ())


def has_var(name: str, path: str) -> Expr:
    """has() of a field of the element a list macro binds, e.g. has_var("t", "labels") is has(t.labels)
    (an optional list the apiserver leaves out when the manifest does)."""
    return Has(field(path, root=name))


def old(path: str) -> Ref:
    """The same field before the update (transition rules)."""
    return field(path, root="oldSelf")


def has(path: str) -> Expr:
    """True when the optional field at the dotted path is set."""
    return Has(field(path))
