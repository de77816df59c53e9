"""Misbehaving tools shared by the tool-execution and chain tests: arguments or results with no text (huge
integers, cycles, lone surrogates), tools that raise SystemExit / KeyboardInterrupt, and one that swallows its
cancellation (`stubborn_tool`)."""

import asyncio
import sys
import threading
import time

from agentfly_jax.tools import tool

DIGITS = "1" * 5000  # more digits than Python converts (sys.get_int_max_str_digits() is 4300)


@tool
def echo(text: str) -> str:
    """Returns its argument.

    Args:
        text: What to return.
    """
    return text


@tool
def number(x: int) -> str:
    """Shows a number.

    Args:
        x: The number.
    """
    return f"got {x}"


@tool
def huge_int() -> int:
    """Returns an integer too long to convert to text."""
    return 10**5000


@tool
def circular_list() -> list:
    """Returns a list that contains itself."""
    items: list = [1]
    items.append(items)
    return items


@tool
def circular_observation() -> dict:
    """Returns a dict whose observation is the dict itself."""
    result: dict = {}
    result["observation"] = result
    return result


@tool
def lone_surrogate() -> str:
    """Returns text with a lone surrogate."""
    return "before \ud800 after"


@tool
def exits_sync() -> str:
    """Calls sys.exit in a worker thread."""
    sys.exit(2)


@tool
async def exits_async() -> str:
    """Raises SystemExit on the event loop."""
    raise SystemExit(3)


@tool
def interrupts_sync() -> str:
    """Raises KeyboardInterrupt."""
    raise KeyboardInterrupt


class Counter:
    """A pooled environment for the resource manager: a counter that tools and rewards change."""

    def __init__(self):
        self.value = 0

    async def reset(self):
        self.value = 0

    async def health_check(self):
        return True

    async def close(self):
        pass


def stubborn_tool(release: threading.Event, timeout: float, ended: threading.Event | None = None):
    """A tool named "stubborn" that ignores cancellation until `release` is set (or 10 s: a runtime that waits for
    it fails, not hangs); sets `ended` when it returns."""
    @tool(name="stubborn", timeout=timeout)
    async def stubborn() -> str:
        """Ignores cancellation until released (or 10 s)."""
        give_up = time.monotonic() + 10
        try:
            while not release.is_set() and time.monotonic() < give_up:
                try:
                    await asyncio.sleep(0.01)
                except asyncio.CancelledError:
                    pass
            return "finished anyway"
        finally:
            if ended is not None:
                ended.set()

    return stubborn
