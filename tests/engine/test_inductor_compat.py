import inspect
import logging

import pytest

from ember.engine import inductor_compat

exc = pytest.importorskip("torch._inductor.exc")
graph = pytest.importorskip("torch._inductor.graph")
log = logging.getLogger(__name__)


class Unprintable:
    def __str__(self):
        raise AssertionError("an argument was formatted")


def eager_call_function(self, target, args, kwargs):  # the shape of torch 2.11's GraphLowering.call_function
    error = exc.OperatorIssue
    log.info("Creating implicit fallback for:\n%s", error.operator_str(target, args, kwargs))


def test_eager_fallback_message_names_only_the_op(monkeypatch):
    monkeypatch.setattr(exc.OperatorIssue, "operator_str", exc.OperatorIssue.__dict__["operator_str"])
    monkeypatch.setattr(graph.GraphLowering, "call_function", eager_call_function)
    assert inductor_compat.cheap_fallback_messages()
    message = exc.OperatorIssue.operator_str("ember::int4_tiled_linear", [Unprintable(), 3], {})
    assert "ember::int4_tiled_linear" in message and "2 args" in message
    assert inductor_compat.cheap_fallback_messages()  # once is enough: already in place


def test_torch_that_formats_lazily_is_left_alone(monkeypatch):
    original = exc.OperatorIssue.__dict__["operator_str"]
    monkeypatch.setattr(exc.OperatorIssue, "operator_str", original)
    source = inspect.getsource(graph.GraphLowering.call_function)
    eager = inductor_compat._EAGER_CALL in source
    assert inductor_compat.cheap_fallback_messages() == eager
    if not eager:  # this torch's own formatting stays
        assert exc.OperatorIssue.__dict__["operator_str"] is original
