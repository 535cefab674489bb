"""AskOptions: one frozen, validated set of ask's options, used by Memory.ask, the HTTP schema and
the CLI (each held to it here)."""

from __future__ import annotations

import dataclasses

import pytest

from kvmemory import config
from kvmemory.errors import InputError
from kvmemory.options import HELP, AskOptions, option_names


def test_defaults_are_the_measured_ones():
    o = AskOptions()
    assert (o.top_k, o.recompute, o.min_relevance, o.rerank, o.rerank_margin, o.max_context_tokens, o.seam,
            o.order) == (config.ASK_TOP_K, config.ASK_RECOMPUTE, config.ASK_MIN_RELEVANCE, config.ASK_RERANK,
                         config.ASK_RERANK_MARGIN, config.ASK_CONTEXT_TOKENS, config.ASK_SEAM, config.ASK_ORDER)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.top_k = 3                                             # type: ignore[misc]


@pytest.mark.parametrize("bad", [{"top_k": 0}, {"top_k": True}, {"max_new_tokens": 0}, {"selector": "x"},
                                 {"recompute": 1.5}, {"recompute": True}, {"expand": "yes"},
                                 {"min_relevance": -0.1}, {"rerank": -1}, {"rerank_margin": float("nan")},
                                 {"max_context_tokens": 0}, {"seam": -2}, {"order": "random"}])
def test_a_bad_option_is_a_typed_error_naming_it(bad):
    (name, _), = bad.items()
    with pytest.raises(InputError, match=name.split("_")[0]):
        AskOptions(**bad)
    with pytest.raises(InputError):
        AskOptions().but(**bad)


def test_but_changes_what_is_given_and_names_what_is_unknown():
    o = AskOptions().but(top_k=3, rerank=None)
    assert o.top_k == 3 and o.rerank == config.ASK_RERANK
    with pytest.raises(InputError, match="topk"):
        AskOptions().but(topk=3)


def test_the_http_schema_and_the_cli_carry_every_option():
    from kvmemory.cli import _parser
    from kvmemory.cli.documents import options_of
    from kvmemory.server.schemas import AskRequest
    assert set(AskRequest.model_fields) - {"question", "stream"} == set(option_names()) == set(HELP)
    req = AskRequest(question="q", top_k=3, order="best_last")
    assert req.options(AskOptions(rerank=0)) == AskOptions(top_k=3, order="best_last", rerank=0)
    args = _parser().parse_args(["ask", "S", "q", "--top-k", "5", "--no-expand", "--order", "best_last",
                                 "--rerank-margin", "0.25"])
    assert options_of(args) == AskOptions(top_k=5, expand=False, order="best_last", rerank_margin=0.25)
    assert options_of(_parser().parse_args(["ask", "S", "q"])) == AskOptions()


def test_memory_ask_refuses_a_bad_option_before_any_work(make_memory):
    mem = make_memory()
    with pytest.raises(InputError, match="top_k"):
        mem.ask("what?", top_k=0)
    with pytest.raises(InputError, match="unknown ask option"):
        mem.ask("what?", topk=2)
