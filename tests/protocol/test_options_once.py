"""SUBMIT options other than `stop=` may be given once (issue 45): a repeated one is a
BAD_REQUEST naming it, not a silent choice of the last."""

from __future__ import annotations

import pytest
from colibri_protocol.codec import Frame
from colibri_protocol.errors import ProtocolError
from colibri_protocol.messages import Submit, parse_request


def submit(*options: str) -> Submit:
    request = parse_request(Frame("SUBMIT", ("r", "1", *options), b"a"))
    assert isinstance(request, Submit)
    return request


@pytest.mark.parametrize(
    "options",
    [
        ("temperature=0.1", "temperature=0.9"),
        ("max_tokens=4", "top_k=2", "max_tokens=4"),
        ("chat=0", "chat=0"),
        ("draft_max=2", "draft_max=3"),
    ],
)
def test_a_repeated_option_is_refused(options: tuple[str, ...]) -> None:
    key = options[-1].partition("=")[0]
    with pytest.raises(ProtocolError, match=f"option {key} given twice") as err:
        submit(*options)
    assert err.value.code == "BAD_REQUEST"


def test_stop_may_repeat() -> None:
    assert submit("stop=a", "stop=b", "temperature=0.5").stop == ("a", "b")
