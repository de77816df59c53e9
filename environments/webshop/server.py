"""The shop as a small HTTP app, for browsers and HTTP agents.

    python -m environments.webshop.server --port 3000 [--num-products 1000 --seed 0 --max-sessions 1000]
    # browser:  http://127.0.0.1:3000/                  (pick a goal, then search and click)
    # JSON API: POST /api/reset {"session": "s1", "split": "heldout", "index": 0}  -> {"observation", "goal"}
    #           POST /api/step  {"session": "s1", "action": "search[face moisturizer]"}
    #                           -> {"observation", "reward", "done", "info", "available_actions"}

The same `ShopSession` as the environment serves both: the HTML pages are the text observations with every
bracketed button turned into a link and a search box on the search page.

Limits, because the app may face any client: a request body is at most `MAX_BODY_BYTES` (413 beyond), a session
id 1 to `MAX_SESSION_ID_CHARS` characters, an action at most `MAX_ACTION_CHARS`. Sessions live in memory, at most
`max_sessions` of them: a new session beyond that drops the least recently used one (its id then answers 404),
so a flood of new ids costs memory for `max_sessions` sessions only. Every malformed request gets a 4xx whose
body names what was wrong (JSON `{"error": ...}` on /api/, plain text on the HTML pages). Actions (a search
scores the whole catalog) run in worker threads, so one slow request does not hold up the others; the steps of
one session run one at a time, in arrival order.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import html
import json
import logging
import math
import re
from typing import Any
from urllib.parse import quote

from aiohttp import web

from environments.webshop.shop import Shop, ShopSession, get_shop

log = logging.getLogger(__name__)

_BUTTON = re.compile(r"\[([^\[\]\n]+)\]")
_INTEGER = re.compile(r"[+-]?[0-9]+")

MAX_BODY_BYTES = 64 * 1024
MAX_SESSION_ID_CHARS = 128
MAX_ACTION_CHARS = 1000
SPLITS = ("train", "heldout")


def _bad(what: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=what)


def _session_id(value: Any) -> str:
    if not isinstance(value, str):
        raise _bad(f"'session' must be a string, got {type(value).__name__}")
    if not 1 <= len(value) <= MAX_SESSION_ID_CHARS:
        raise _bad(f"'session' must be 1 to {MAX_SESSION_ID_CHARS} characters, got {len(value)}")
    return value


def _action(value: Any) -> str:
    if not isinstance(value, str):
        raise _bad(f"'action' must be a string such as \"search[...]\", got {type(value).__name__}")
    if len(value) > MAX_ACTION_CHARS:
        raise _bad(f"an action (with its search query) is at most {MAX_ACTION_CHARS} characters, got {len(value)}")
    return value


def _split(value: Any) -> str:
    if not isinstance(value, str):
        raise _bad(f"'split' must be a string ('train' or 'heldout'), got {type(value).__name__}")
    if value not in SPLITS:
        raise _bad(f"split must be 'train' or 'heldout', got {value[:50]!r}")
    return value


def _index(value: Any) -> int:
    """A goal index from JSON (an int, not a bool or float) or a query string (decimal digits only)."""
    if isinstance(value, str):
        if not _INTEGER.fullmatch(value):
            raise _bad(f"'index' must be an integer, got {value[:50]!r}")
        if len(value) > 18:
            raise _bad(f"goal index {value[:30]}... is out of range")
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        shown = repr(value) if isinstance(value, float) and not math.isfinite(value) else type(value).__name__
        raise _bad(f"'index' must be an integer, got {shown}")
    return value


async def _json_object(request: web.Request, fields: tuple[str, ...]) -> dict[str, Any]:
    """The request body as a JSON object whose keys are all among `fields`."""
    body = await request.read()  # beyond MAX_BODY_BYTES aiohttp answers 413
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # ValueError covers JSONDecodeError and UnicodeDecodeError
        raise _bad(f"the request body is not valid JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(data, dict):
        raise _bad(f"the request body must be a JSON object with {', '.join(fields)}; got {type(data).__name__}")
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise _bad(f"unknown field {unknown[0][:50]!r} in {request.path}; expected {', '.join(fields)}")
    return data


@dataclasses.dataclass
class _Entry:
    session: ShopSession
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)


class SessionStore:
    """Shop sessions by id; beyond `max_sessions` the least recently used is dropped (counted in `evicted`)."""

    def __init__(self, shop: Shop, max_sessions: int = 1000):
        if max_sessions < 1:
            raise ValueError(f"max_sessions={max_sessions}; need at least 1")
        self.shop = shop
        self.max_sessions = max_sessions
        self.entries: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self.entries)

    def goals(self, split: Any):
        split = _split(split)
        return self.shop.catalog.train_goals if split == "train" else self.shop.catalog.heldout_goals

    def reset(self, session_id: Any, split: Any = "heldout", index: Any = 0) -> ShopSession:
        session_id = _session_id(session_id)
        goals = self.goals(split)
        index = _index(index)
        if not 0 <= index < len(goals):
            raise _bad(f"goal index {index} is out of range: the {split} split has {len(goals)}")
        session = ShopSession(self.shop, goals[index])
        self.entries[session_id] = _Entry(session)
        self.entries.move_to_end(session_id)
        while len(self.entries) > self.max_sessions:
            dropped, _ = self.entries.popitem(last=False)
            self.evicted += 1
            log.info("WebShop app: %d sessions live; dropped the least recently used, %r (%d dropped so far)",
                     self.max_sessions, dropped, self.evicted)
        return session

    def entry(self, session_id: Any) -> _Entry:
        session_id = _session_id(session_id)
        entry = self.entries.get(session_id)
        if entry is None:
            raise web.HTTPNotFound(
                text=f"no session {session_id!r} (never started, or dropped as the least recently used of "
                f"{self.max_sessions}); start one with /api/reset or /"
            )
        self.entries.move_to_end(session_id)
        return entry

    def get(self, session_id: Any) -> ShopSession:
        return self.entry(session_id).session

    async def act(self, session_id: Any, action: str):
        """Runs `action` in a worker thread (searches are CPU work), one action of a session at a time."""
        entry = self.entry(session_id)
        async with entry.lock:
            return entry.session, await asyncio.to_thread(entry.session.act, action)


STORE = web.AppKey("webshop_sessions", SessionStore)


@web.middleware
async def _json_errors(request: web.Request, handler):
    """4xx replies of the JSON API carry {"error": what was wrong, "status": code}."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if not request.path.startswith("/api/") or exc.status < 400:
            raise
        return web.json_response({"error": exc.text, "status": exc.status}, status=exc.status)


def _state(session: ShopSession, outcome=None) -> dict[str, Any]:
    return {
        "observation": outcome.observation if outcome else session.observation(),
        "reward": outcome.reward if outcome else None,
        "done": session.page == "done",
        "info": outcome.info if outcome else {},
        "available_actions": session.available_actions(),
        "page": session.page,
    }


def render_html(session_id: str, text: str, page: str) -> str:
    """An observation as an HTML page: buttons become links, the search page gets a search box."""
    base = f"/session/{quote(session_id)}"

    def link(match: re.Match) -> str:
        target = match.group(1)
        if target == "Search page":
            return html.escape(match.group(0))
        return f'<a href="{base}/click?target={quote(target)}">[{html.escape(target)}]</a>'

    parts = []
    for line in text.split("\n"):
        pieces, last = [], 0
        for match in _BUTTON.finditer(line):
            pieces.append(html.escape(line[last : match.start()]))
            pieces.append(link(match))
            last = match.end()
        pieces.append(html.escape(line[last:]))
        parts.append("".join(pieces))
    body = "<br>\n".join(parts)
    if page == "search":
        body += (
            f'<form action="{base}/search"><input name="q" size="60" autofocus> '
            '<button type="submit">Search</button></form>'
        )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>WebShop</title></head>"
        f"<body style='font-family: sans-serif; max-width: 60em'>{body}"
        f"<p><a href='/'>other goals</a></p></body></html>"
    )


def make_app(shop: Shop, max_sessions: int = 1000) -> web.Application:
    """The aiohttp application serving `shop`; its session store is `app[STORE]`."""
    store = SessionStore(shop, max_sessions)
    routes = web.RouteTableDef()

    @routes.post("/api/reset")
    async def api_reset(request: web.Request) -> web.Response:
        data = await _json_object(request, ("session", "split", "index"))
        session_id = data.get("session", "default")
        session = store.reset(session_id, data.get("split", "heldout"), data.get("index", 0))
        return web.json_response({**_state(session), "session": session_id, "goal": session.goal.to_dict()})

    @routes.post("/api/step")
    async def api_step(request: web.Request) -> web.Response:
        data = await _json_object(request, ("session", "action"))
        if "action" not in data:
            raise _bad('POST /api/step needs {"session": ..., "action": "search[...]"}; the action is missing')
        action = _action(data["action"])
        session, outcome = await store.act(data.get("session", "default"), action)
        return web.json_response(_state(session, outcome))

    @routes.get("/")
    async def index(request: web.Request) -> web.Response:
        goals = store.goals(request.query.get("split", "heldout"))
        items = "".join(
            f'<li><a href="/session/g{i}/reset?index={i}">{html.escape(g.instruction)}</a></li>'
            for i, g in enumerate(goals[:100])
        )
        return web.Response(
            text=f"<!doctype html><html><head><meta charset='utf-8'><title>WebShop</title>"
            f"</head><body><h3>WebShop goals (held-out)</h3><ol start=0>{items}</ol>"
            f"</body></html>",
            content_type="text/html",
        )

    @routes.get("/session/{sid}/reset")
    async def reset_page(request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        store.reset(sid, request.query.get("split", "heldout"), request.query.get("index", "0"))
        raise web.HTTPFound(f"/session/{quote(sid)}")

    @routes.get("/session/{sid}")
    async def show(request: web.Request) -> web.Response:
        sid = request.match_info["sid"]
        session = store.get(sid)
        return web.Response(
            text=render_html(sid, session.observation(), session.page), content_type="text/html"
        )

    async def act(request: web.Request, action: str) -> web.Response:
        sid = request.match_info["sid"]
        session, outcome = await store.act(sid, _action(action))
        return web.Response(
            text=render_html(sid, outcome.observation, session.page), content_type="text/html"
        )

    @routes.get("/session/{sid}/search")
    async def search_page(request: web.Request) -> web.Response:
        return await act(request, f"search[{request.query.get('q', '')}]")

    @routes.get("/session/{sid}/click")
    async def click_page(request: web.Request) -> web.Response:
        return await act(request, f"click[{request.query.get('target', '')}]")

    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_json_errors])
    app[STORE] = store
    app.add_routes(routes)
    return app


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Serve the WebShop-compatible shop over HTTP.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-products", type=int, default=1000)
    parser.add_argument(
        "--items-path", default="", help="official items_shuffle*.json (with --attributes-path)"
    )
    parser.add_argument("--attributes-path", default="")
    parser.add_argument(
        "--max-sessions", type=int, default=1000, help="live sessions kept; the least recently used goes first"
    )
    args = parser.parse_args(argv)
    if args.items_path:
        shop = get_shop(source="official", items_path=args.items_path, attributes_path=args.attributes_path)
    else:
        shop = get_shop(source="generated", seed=args.seed, num_products=args.num_products)
    web.run_app(make_app(shop, args.max_sessions), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
