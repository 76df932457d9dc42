"""WebSearch and WebFetch: SearXNG's JSON API imitated by the local test server, fetches only
of URLs a search returned in the same session, public addresses only (after DNS resolution and
on every redirect), size and time caps, HTML reduced to text, provider errors mapped."""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any

import grpc
import pytest
from system.model.v1 import model_pb2, model_pb2_grpc

from services.model_gateway.failures import failure_for
from services.model_gateway.web.addresses import check_address
from services.model_gateway.web.sessions import SearchSessions
from services.model_gateway.web.text import html_to_text
from services.model_testserver import FakeOpenAIServer
from services.results import AgentFailure
from services.runtime.errors import PermissionDenied
from services.stack.launcher import free_port
from tests.model_gateways import Gateway, gateways

KEY = "test-key"
PLAYER = "steve"
SESSION = "exec-1"


@pytest.fixture
def fake() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer(api_key=KEY) as server:
        yield server


@pytest.fixture
async def gateway(fake: FakeOpenAIServer) -> AsyncIterator[Gateway]:
    async with gateways(
        base_url=fake.base_url,
        api_key=KEY,
        search_url=fake.root_url,
        fetch_allow_loopback=True,  # the test server is on loopback
    ) as start:
        yield start


def _search(query: str = "diamond sword", **fields: Any) -> model_pb2.WebSearchRequest:
    return model_pb2.WebSearchRequest(
        **{"player_id": PLAYER, "search_session": SESSION, "query": query, **fields}
    )


def _fetch(url: str, **fields: Any) -> model_pb2.WebFetchRequest:
    return model_pb2.WebFetchRequest(
        **{"player_id": PLAYER, "search_session": SESSION, "url": url, **fields}
    )


def _hit(url: str) -> dict[str, str]:
    return {"url": url, "title": "T", "content": "C"}


async def _fails(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


async def _searched(
    stub: model_pb2_grpc.ModelGatewayServiceStub, fake: FakeOpenAIServer, *urls: str
) -> None:
    """Makes `urls` fetchable in SESSION by a search that returns them."""
    fake.script_search([_hit(url) for url in urls])
    await stub.WebSearch(_search(), timeout=5)


# -- search --------------------------------------------------------------------------------


async def test_search_returns_hits_from_searxng_json(
    gateway: Gateway, fake: FakeOpenAIServer
) -> None:
    stub = await gateway()
    fake.script_search(
        [
            {"url": "https://minecraft.wiki/w/Sword", "title": " Sword ", "content": "A sword."},
            {"url": "https://minecraft.wiki/w/Sword", "title": "dup", "content": ""},
            {"url": "javascript:alert(1)", "title": "x", "content": ""},
            {"title": "no url"},
            {"url": "https://example.org/b", "title": "B", "content": "b"},
        ]
    )
    response = await stub.WebSearch(_search("钻石剑", language="zh-CN", max_results=5), timeout=5)
    assert [(r.url, r.title, r.snippet) for r in response.results] == [
        ("https://minecraft.wiki/w/Sword", "Sword", "A sword."),
        ("https://example.org/b", "B", "b"),
    ]
    assert len(fake.searches) == 1
    status = await stub.GetModelStatus(model_pb2.GetModelStatusRequest(), timeout=5)
    assert status.search_configured is True


async def test_search_sends_query_format_and_language(
    gateway: Gateway, fake: FakeOpenAIServer
) -> None:
    stub = await gateway(search_default_results=2)
    response = await stub.WebSearch(_search("钻石剑", language="zh"), timeout=5)
    assert len(response.results) == 2  # the configured default
    [sent] = fake.searches
    assert sent.query == {"q": ["钻石剑"], "format": ["json"], "pageno": ["1"], "language": ["zh"]}


@pytest.mark.parametrize(
    ("status", "code", "expected"),
    [
        (500, grpc.StatusCode.UNAVAILABLE, "HTTP 500"),
        (429, grpc.StatusCode.RESOURCE_EXHAUSTED, "rate-limited"),
        (403, grpc.StatusCode.UNAVAILABLE, "formats: [html, json]"),
    ],
)
async def test_search_provider_errors(
    gateway: Gateway, fake: FakeOpenAIServer, status: int, code: grpc.StatusCode, expected: str
) -> None:
    stub = await gateway()
    fake.script_search(status=status)
    error = await _fails(stub.WebSearch(_search(), timeout=5))
    assert error.code() == code
    assert expected in error.details()


async def test_search_timeout(gateway: Gateway, fake: FakeOpenAIServer) -> None:
    stub = await gateway(search_timeout_seconds=0.3)
    fake.script_search(delay=3)
    error = await _fails(stub.WebSearch(_search(), timeout=5))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert failure_for(error.code(), web=True) is AgentFailure.TIMEOUT


async def test_no_search_provider_is_unavailable(gateway: Gateway) -> None:
    stub = await gateway(search_url="")
    error = await _fails(stub.WebSearch(_search(), timeout=5))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "SYSTEM_MODEL_SEARCH_URL" in error.details()
    assert failure_for(error.code(), web=True) is AgentFailure.TOOL_UNAVAILABLE


async def test_unreachable_search_provider(gateway: Gateway) -> None:
    port = free_port()  # free a moment ago: nothing listens there
    stub = await gateway(search_url=f"http://127.0.0.1:{port}")
    error = await _fails(stub.WebSearch(_search(), timeout=5))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "cannot reach the search provider" in error.details()


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"player_id": ""}, "player_id is required"),
        ({"search_session": ""}, "search_session is required"),
        ({"search_session": "s" * 129}, "search_session must be at most 128"),
        ({"query": "  "}, "query is empty"),
        ({"query": "q" * 401}, "the most is 400"),
        ({"max_results": 21}, "max_results must be at most 20"),
        ({"language": "zh cn"}, "language must be a language code"),
    ],
)
async def test_invalid_search(
    gateway: Gateway, fake: FakeOpenAIServer, fields: dict[str, Any], expected: str
) -> None:
    stub = await gateway()
    error = await _fails(stub.WebSearch(_search(**fields), timeout=5))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in error.details()
    assert fake.searches == []


# -- fetch ---------------------------------------------------------------------------------


async def test_fetch_of_a_search_result_returns_its_text(
    gateway: Gateway, fake: FakeOpenAIServer
) -> None:
    stub = await gateway()
    url = fake.add_page(
        "sword",
        "<html><head><title>Diamond Sword</title><style>p{color:red}</style></head><body>"
        "<script>var secret = 1;</script><h1>Diamond sword</h1><p>Two diamonds and&nbsp;a "
        "stick.</p><ul><li>Damage: 7</li></ul></body></html>",
    )
    await _searched(stub, fake, url)
    page = await stub.WebFetch(_fetch(url), timeout=5)
    assert page.title == "Diamond Sword"
    assert page.text == "Diamond sword\n\nTwo diamonds and a stick.\n\nDamage: 7"
    assert (page.url, page.content_type, page.truncated) == (url, "text/html", False)


async def test_default_search_hits_are_fetchable(gateway: Gateway, fake: FakeOpenAIServer) -> None:
    stub = await gateway()
    response = await stub.WebSearch(_search(), timeout=5)
    page = await stub.WebFetch(_fetch(response.results[0].url), timeout=5)
    assert page.text == "Result page 1."


async def test_fetch_of_a_url_not_from_the_search_is_refused(
    gateway: Gateway, fake: FakeOpenAIServer
) -> None:
    stub = await gateway()
    allowed = fake.add_page("allowed", "<p>ok</p>")
    other = fake.add_page("other", "<p>secret</p>")
    await _searched(stub, fake, allowed)
    for request in (
        _fetch(other),  # never returned
        _fetch(allowed, search_session="exec-2"),  # another session
        _fetch(allowed, player_id="alex"),  # another player's session
        _fetch(allowed + "?x=1"),  # not exactly what was returned
    ):
        error = await _fails(stub.WebFetch(request, timeout=5))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "was not returned by a search" in error.details()
    assert not any(r.path == "/pages/other" for r in fake.requests)


async def test_search_sessions_expire(gateway: Gateway, fake: FakeOpenAIServer) -> None:
    stub = await gateway(search_session_ttl_seconds=0.2)
    url = fake.add_page("soon", "<p>ok</p>")
    await _searched(stub, fake, url)
    await asyncio.sleep(0.3)
    error = await _fails(stub.WebFetch(_fetch(url), timeout=5))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "expired after 0.2 s" in error.details()


async def test_loopback_is_refused_by_default(gateway: Gateway, fake: FakeOpenAIServer) -> None:
    """`localhost` passes a check on the name; it is refused on what it resolves to."""
    stub = await gateway(fetch_allow_loopback=False)
    by_name = f"http://localhost:{fake.port}/pages/result-1"
    by_address = fake.page_url("result-1")
    await _searched(stub, fake, by_name, by_address)
    for url, expected in ((by_name, "localhost resolves to"), (by_address, "127.0.0.1")):
        error = await _fails(stub.WebFetch(_fetch(url), timeout=5))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert expected in error.details() and "loopback" in error.details()
    assert not any(r.path.startswith("/pages/") for r in fake.requests)


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("http://10.1.2.3/admin", "a private address"),
        ("http://192.168.1.1/", "a private address"),
        ("http://169.254.169.254/latest/meta-data/", "a link-local address"),
        ("http://[fd00::1]/", "a private address"),
        ("http://[::ffff:10.0.0.1]/", "a private address"),
        ("http://0.0.0.0:8080/", "not a public address"),
    ],
)
async def test_private_addresses_are_refused(
    gateway: Gateway, fake: FakeOpenAIServer, url: str, kind: str
) -> None:
    stub = await gateway()
    await _searched(stub, fake, url)
    error = await _fails(stub.WebFetch(_fetch(url), timeout=5))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert kind in error.details()


async def test_private_address_via_redirect_is_refused(
    gateway: Gateway, fake: FakeOpenAIServer
) -> None:
    stub = await gateway()
    url = fake.add_page("go", status=302, location="http://169.254.169.254/latest/meta-data/")
    await _searched(stub, fake, url)
    error = await _fails(stub.WebFetch(_fetch(url), timeout=5))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "169.254.169.254" in error.details() and "link-local" in error.details()


async def test_redirects_are_followed_and_bounded(gateway: Gateway, fake: FakeOpenAIServer) -> None:
    stub = await gateway(fetch_max_redirects=2)
    hop = fake.add_page("hop", status=301, location="/pages/result-2")
    loop = fake.add_page("loop", status=302, location="/pages/loop")
    await _searched(stub, fake, hop, loop)
    page = await stub.WebFetch(_fetch(hop), timeout=5)
    assert (page.url, page.text) == (fake.page_url("result-2"), "Result page 2.")
    error = await _fails(stub.WebFetch(_fetch(loop), timeout=5))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "more than 2 redirects" in error.details()


@pytest.mark.parametrize("declare_length", [True, False])
async def test_size_cap(gateway: Gateway, fake: FakeOpenAIServer, declare_length: bool) -> None:
    stub = await gateway(fetch_max_bytes=10_000)
    url = fake.add_page("big", "<p>" + "word " * 100_000 + "</p>", declare_length=declare_length)
    await _searched(stub, fake, url)
    page = await stub.WebFetch(_fetch(url), timeout=5)
    assert page.truncated is True
    assert 9_000 < len(page.text) <= 10_000


async def test_max_chars_cuts_the_text(gateway: Gateway, fake: FakeOpenAIServer) -> None:
    stub = await gateway(fetch_max_chars=50)
    url = fake.add_page("text", "abc " * 100, content_type="text/plain")
    await _searched(stub, fake, url)
    page = await stub.WebFetch(_fetch(url, max_chars=20), timeout=5)
    assert (len(page.text), page.truncated, page.content_type) == (20, True, "text/plain")
    page = await stub.WebFetch(_fetch(url, max_chars=10_000), timeout=5)
    assert len(page.text) == 50  # capped by the configured most


async def test_time_cap(gateway: Gateway, fake: FakeOpenAIServer) -> None:
    stub = await gateway(fetch_timeout_seconds=0.4)
    slow = fake.add_page("slow", "<p>late</p>", delay=3)
    trickle = fake.add_page("trickle", "x" * 10_000, content_type="text/plain", chunk_delay=0.2)
    await _searched(stub, fake, slow, trickle)
    for url in (slow, trickle):
        error = await _fails(stub.WebFetch(_fetch(url), timeout=5))
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "did not arrive within 0.4 s" in error.details()


@pytest.mark.parametrize(
    ("fields", "code", "expected"),
    [
        ({"status": 404}, grpc.StatusCode.UNAVAILABLE, "HTTP 404"),
        ({"content_type": "image/png"}, grpc.StatusCode.UNAVAILABLE, "image/png, not text"),
    ],
)
async def test_pages_that_cannot_be_read(
    gateway: Gateway,
    fake: FakeOpenAIServer,
    fields: dict[str, Any],
    code: grpc.StatusCode,
    expected: str,
) -> None:
    stub = await gateway()
    url = fake.add_page("odd", b"\x89PNG", **fields)
    await _searched(stub, fake, url)
    error = await _fails(stub.WebFetch(_fetch(url), timeout=5))
    assert error.code() == code
    assert expected in error.details()


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"url": ""}, "url is required"),
        ({"url": "ftp://example.org/x"}, "absolute http:// or https://"),
        ({"url": "http://user:pw@example.org/"}, "user name or password"),
        ({"url": "/pages/x"}, "absolute http:// or https://"),
        ({"search_session": ""}, "search_session is required"),
    ],
)
async def test_invalid_fetch(gateway: Gateway, fields: dict[str, Any], expected: str) -> None:
    stub = await gateway()
    request = _fetch(**{"url": "https://example.org/", **fields})
    error = await _fails(stub.WebFetch(request, timeout=5))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in error.details()


async def test_charset_is_honoured(gateway: Gateway, fake: FakeOpenAIServer) -> None:
    stub = await gateway()
    url = fake.add_page("gbk", "<p>钻石剑</p>".encode("gbk"), content_type="text/html; charset=gbk")
    await _searched(stub, fake, url)
    assert (await stub.WebFetch(_fetch(url), timeout=5)).text == "钻石剑"


# -- units ---------------------------------------------------------------------------------


def test_html_to_text_drops_markup() -> None:
    title, text = html_to_text(
        "<title> A  page </title><noscript>enable js</noscript><div>one<br>two</div>"
        "<template><p>hidden</p></template><p>three &amp; four</p>"
    )
    assert title == "A page"
    assert text == "one\ntwo\n\nthree & four"


def test_address_rules() -> None:
    public = ipaddress.ip_address("93.184.216.34")
    check_address(public, "example.org", allow_loopback=False)
    check_address(ipaddress.ip_address("127.0.0.1"), "localhost", allow_loopback=True)
    for address in ("127.0.0.1", "::1", "10.0.0.1", "172.16.0.1", "100.64.0.1", "224.0.0.1"):
        with pytest.raises(PermissionDenied):
            check_address(ipaddress.ip_address(address), "h", allow_loopback=False)
    # allow_loopback lets loopback through, never private addresses.
    with pytest.raises(PermissionDenied):
        check_address(ipaddress.ip_address("192.168.0.1"), "h", allow_loopback=True)


def test_search_sessions_are_bounded_and_expire() -> None:
    now = [0.0]
    sessions = SearchSessions(ttl_seconds=10, max_sessions=2, clock=lambda: now[0])
    sessions.remember("p", "a", ["u1"])
    sessions.remember("p", "b", ["u2"])
    assert sessions.allows("p", "a", "u1")  # touches nothing: LRU is by remember
    sessions.remember("p", "c", ["u3"])
    assert not sessions.allows("p", "a", "u1")  # the oldest session was forgotten
    assert sessions.allows("p", "b", "u2") and sessions.allows("p", "c", "u3")
    now[0] = 11
    assert not sessions.allows("p", "c", "u3")
    assert len(sessions) <= 2
