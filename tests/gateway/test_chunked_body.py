"""The engine-side chunked body decoder (gateway.chunked_body) against h11's reading of the same bytes: any
valid framing split at any points gives the same body; broken framing, overlong lines and bytes past the
end are caught."""

from __future__ import annotations

import h11
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.chunked_body import MAX_LINE, ChunkedBody, ChunkedBodyError

HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


def _h11_body(raw: bytes) -> bytes:
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="POST", target="/", headers=[("host", "e"), ("content-length", "0")]))
    client.send(h11.EndOfMessage())
    client.receive_data(HEAD + raw)
    body = b""
    while not isinstance(event := client.next_event(), h11.EndOfMessage):
        assert event is not h11.NEED_DATA
        body += getattr(event, "data", b"")
    return body


def _feed(raw: bytes, cuts: list[int]) -> tuple[bytes, ChunkedBody]:
    decoder, body, start = ChunkedBody(), b"", 0
    for cut in [*sorted(set(cuts)), len(raw)]:
        body += decoder.feed(raw[start:cut])
        start = cut
    return body, decoder


_SIZE_FORMS = st.sampled_from(["%x", "%X", "%04x"])
_EXTENSIONS = st.sampled_from([b"", b";name=value", b";a;b=\"q\"", b"  ", b" \t", b";x"])
_TRAILERS = st.lists(st.sampled_from([b"x-usage: 12", b"checksum:abc", b"empty:"]), max_size=2)


@given(chunks=st.lists(st.binary(min_size=1, max_size=300), max_size=8), form=_SIZE_FORMS, ext=_EXTENSIONS,
       trailers=_TRAILERS, cuts=st.lists(st.integers(0, 3000), max_size=12))
def test_any_valid_framing_split_anywhere_reads_as_h11_reads_it(chunks, form, ext, trailers, cuts):
    raw = b"".join((form % len(c)).encode() + ext + b"\r\n" + c + b"\r\n" for c in chunks)
    raw += b"0" + ext + b"\r\n" + b"".join(t + b"\r\n" for t in trailers) + b"\r\n"
    body, decoder = _feed(raw, [c for c in cuts if c <= len(raw)])
    assert body == _h11_body(raw) == b"".join(chunks)
    assert decoder.done and not decoder.extra


def test_nothing_is_done_before_the_last_chunk_and_its_blank_line():
    body, decoder = _feed(b"3\r\nabc\r\n0\r\n", [])
    assert body == b"abc" and not decoder.done
    assert decoder.feed(b"\r\n") == b"" and decoder.done


@pytest.mark.parametrize("raw", [
    b"g\r\n", b"-1\r\n", b"\r\n", b" 3\r\nabc\r\n", b"3\r\nabcX\r\n", b"3\r\nabc\rX", b"1" * 21 + b"\r\n",
    b"0\r\nnot a header\r\n\r\n", b"0\r\n: no name\r\n\r\n",
])
def test_broken_framing_is_an_error(raw):
    with pytest.raises(ChunkedBodyError):
        _feed(raw, list(range(len(raw))))


def test_a_size_line_or_trailer_without_end_is_bounded():
    with pytest.raises(ChunkedBodyError, match="too long"):
        ChunkedBody().feed(b"1" + b" " * (MAX_LINE + 1))
    decoder = ChunkedBody()
    decoder.feed(b"0\r\n")
    with pytest.raises(ChunkedBodyError, match="too long"):
        for _ in range(MAX_LINE // 4):
            decoder.feed(b"x: 12\r\n")


def test_bytes_after_the_body_are_flagged_and_dropped():
    body, decoder = _feed(b"2\r\nok\r\n0\r\n\r\nHTTP/1.1 200", [])
    assert body == b"ok" and decoder.done and decoder.extra
    late = ChunkedBody()
    late.feed(b"0\r\n\r\n")
    assert late.feed(b"junk") == b"" and late.extra
