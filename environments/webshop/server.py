"""The shop as a small HTTP app, for browsers and HTTP agents.

    python -m environments.webshop.server --port 3000 [--num-products 1000 --seed 0]
    # browser:  http://127.0.0.1:3000/                  (pick a goal, then search and click)
    # JSON API: POST /api/reset {"session": "s1", "split": "heldout", "index": 0}  -> {"observation", "goal"}
    #           POST /api/step  {"session": "s1", "action": "search[face moisturizer]"}
    #                           -> {"observation", "reward", "done", "info", "available_actions"}

The same `ShopSession` as the environment serves both: the HTML pages are the text observations with every
bracketed button turned into a link and a search box on the search page. Sessions live in memory
(at most `max_sessions`, the least recently used one is dropped first).
"""

from __future__ import annotations

import argparse
import collections
import html
import re
from typing import Any
from urllib.parse import quote

from aiohttp import web

from environments.webshop.shop import Shop, ShopSession, get_shop

_BUTTON = re.compile(r"\[([^\[\]\n]+)\]")


class SessionStore:
    """Shop sessions by id, least recently used dropped beyond `max_sessions`."""

    def __init__(self, shop: Shop, max_sessions: int = 1000):
        self.shop = shop
        self.max_sessions = max_sessions
        self.sessions: collections.OrderedDict[str, ShopSession] = collections.OrderedDict()

    def goals(self, split: str):
        if split not in ("train", "heldout"):
            raise web.HTTPBadRequest(text=f"split must be 'train' or 'heldout', got {split!r}")
        return self.shop.catalog.train_goals if split == "train" else self.shop.catalog.heldout_goals

    def reset(self, session_id: str, split: str = "heldout", index: int = 0) -> ShopSession:
        goals = self.goals(split)
        if not 0 <= index < len(goals):
            raise web.HTTPBadRequest(
                text=f"goal index {index} is out of range: the {split} split has {len(goals)}"
            )
        session = ShopSession(self.shop, goals[index])
        self.sessions[session_id] = session
        self.sessions.move_to_end(session_id)
        while len(self.sessions) > self.max_sessions:
            self.sessions.popitem(last=False)
        return session

    def get(self, session_id: str) -> ShopSession:
        session = self.sessions.get(session_id)
        if session is None:
            raise web.HTTPNotFound(text=f"no session {session_id!r}; start one with /api/reset or /")
        self.sessions.move_to_end(session_id)
        return session


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
    """The aiohttp application serving `shop`."""
    store = SessionStore(shop, max_sessions)
    routes = web.RouteTableDef()

    @routes.post("/api/reset")
    async def api_reset(request: web.Request) -> web.Response:
        data = await request.json()
        session_id = str(data.get("session", "default"))
        session = store.reset(session_id, data.get("split", "heldout"), int(data.get("index", 0)))
        return web.json_response({**_state(session), "session": session_id, "goal": session.goal.to_dict()})

    @routes.post("/api/step")
    async def api_step(request: web.Request) -> web.Response:
        data = await request.json()
        if "action" not in data:
            raise web.HTTPBadRequest(text='POST /api/step needs {"session": ..., "action": "search[...]"}')
        session = store.get(str(data.get("session", "default")))
        return web.json_response(_state(session, session.act(str(data["action"]))))

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
        store.reset(sid, request.query.get("split", "heldout"), int(request.query.get("index", 0)))
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
        session = store.get(sid)
        outcome = session.act(action)
        return web.Response(
            text=render_html(sid, outcome.observation, session.page), content_type="text/html"
        )

    @routes.get("/session/{sid}/search")
    async def search_page(request: web.Request) -> web.Response:
        return await act(request, f"search[{request.query.get('q', '')}]")

    @routes.get("/session/{sid}/click")
    async def click_page(request: web.Request) -> web.Response:
        return await act(request, f"click[{request.query.get('target', '')}]")

    app = web.Application()
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
    args = parser.parse_args(argv)
    if args.items_path:
        shop = get_shop(source="official", items_path=args.items_path, attributes_path=args.attributes_path)
    else:
        shop = get_shop(source="generated", seed=args.seed, num_products=args.num_products)
    web.run_app(make_app(shop), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
