"""The rule expression language: each expression's CEL text and its Python value agree with CEL.

The CEL strings are golden (the apiserver compiles exactly these); the Python semantics follow CEL:
short-circuit booleans, truncating integer division, has() on optional fields, errors on unguarded
access to an absent field.
"""

from __future__ import annotations

from typing import Any

import pytest
from lockstep.api.cel import RuleBug, field, has, old


def test_cel_text_is_golden() -> None:
    expr = (field("a.mode").eq("fully-async") & field("a.colocate").eq(True)).implies(has("a.b"))
    assert expr.to_cel() == (
        "(!(((self.a.mode == 'fully-async') && (self.a.colocate == true))) || has(self.a.b))"
    )
    assert (field("n") * field("g") % (field("t") // 2)).eq(
        0
    ).to_cel() == "(((self.n * self.g) % (self.t / 2)) == 0)"
    assert field("x").in_(["p2p", "it's"]).to_cel() == "(self.x in ['p2p', 'it\\'s'])"
    assert field("t").map("name").to_cel() == "self.t.map(x, x.name)"
    assert field("b").eq(old("b")).to_cel() == "(self.b == oldSelf.b)"
    assert (field("f") + "-" + field("v")).to_cel() == "((self.f + '-') + self.v)"


def test_python_evaluation_follows_cel() -> None:
    env = {"self": {"a": {"mode": "fully-async", "colocate": True}, "n": 7, "g": 2, "t": [{"name": "x"}]}}
    assert (field("a.mode").eq("fully-async") & field("a.colocate").eq(True)).evaluate(env) is True
    assert (field("n") // field("g")).evaluate(env) == 3
    assert (field("n") % field("g")).evaluate(env) == 1
    assert has("a.colocate").evaluate(env) is True
    assert has("a.missing").evaluate(env) is False
    assert field("t").map("name").evaluate(env) == ["x"]
    assert field("t").size().evaluate(env) == 1
    assert (field("a.mode") + "!").evaluate(env) == "fully-async!"


def test_short_circuit_guards_absent_fields() -> None:
    env: dict[str, Any] = {"self": {"a": {}}}
    guarded = has("a.limit").implies(field("a.limit").gt(0))
    assert guarded.evaluate(env) is True
    with pytest.raises(RuleBug, match=r"self\.a\.limit is absent; guard it with has\(\)"):
        field("a.limit").gt(0).evaluate(env)


def test_integer_division_truncates_toward_zero_like_cel() -> None:
    env = {"self": {"a": -7, "b": 2}}
    assert (field("a") // field("b")).evaluate(env) == -3
    assert (field("a") % field("b")).evaluate(env) == -1
    with pytest.raises(RuleBug, match="division by zero"):
        (field("a") // 0).evaluate(env)


def test_transition_reads_old_self() -> None:
    rule = field("backend").eq(old("backend"))
    assert rule.evaluate({"self": {"backend": "fsdp"}, "oldSelf": {"backend": "fsdp"}}) is True
    assert rule.evaluate({"self": {"backend": "fsdp"}, "oldSelf": {"backend": "megatron"}}) is False


def test_logical_operands_must_be_bools() -> None:
    with pytest.raises(RuleBug, match="expected a bool"):
        (field("n") & field("n")).evaluate({"self": {"n": 1}})
