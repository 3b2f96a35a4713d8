"""The simulated engine writes a streamed answer's chunks the way uvicorn does: into the socket without a pass of
the event loop, so chunks an engine produces back to back (vLLM's role chunk and first token) leave back to back."""

from __future__ import annotations

import h11
import trio

from sim.http_server import HttpRequest, HttpResponse, serve_http


async def test_chunks_produced_back_to_back_leave_without_a_scheduler_pass_between_them(nursery):
    """A task that runs at every scheduler pass counts none while the second chunk is written (trio's
    ``send_all`` would yield there), and the client still gets every chunk."""
    passes: list[int] = []
    between: list[int] = []

    async def spin() -> None:
        for _ in range(100_000):  # bounded: stops by itself if the test fails to cancel it
            passes.append(1)
            await trio.sleep(0)

    async def chunks():
        yield b"data: role\n\n"
        before = len(passes)
        yield b"data: token\n\n"
        between.append(len(passes) - before)

    async def handle(req: HttpRequest) -> HttpResponse:
        return HttpResponse(200, content_type="text/event-stream", stream=chunks())

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    nursery.start_soon(serve_http, listeners, handle, 5.0, 0.0)
    nursery.start_soon(spin)
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    conn = h11.Connection(h11.CLIENT)
    await stream.send_all(conn.send(h11.Request(method="POST", target="/v1/chat/completions",
                                                headers=[("host", "sim"), ("content-length", "0")]))
                          + conn.send(h11.EndOfMessage()))
    body = b""
    with trio.fail_after(5):
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Data):
                body += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                break
    assert body == b"data: role\n\ndata: token\n\n"
    assert between == [0]
    await stream.aclose()
    nursery.cancel_scope.cancel()
