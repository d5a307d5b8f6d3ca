"""The atomic take of ``workers.consumer.channel.Channel``: one Lua script that pops up to a
window's free slots of messages from a channel's priority lists and records each in kombu's unacked
hash and index in the same step, so no message is ever out of Redis without its unacked entry.

Run by ``Channel._take`` (``register_script``); a take Redis refuses before it runs raises
:class:`TakeRefused`.
"""

from __future__ import annotations

from importlib import resources

__all__ = ["TAKE_MANY", "TakeRefused"]

TAKE_MANY = resources.files("workers.consumer").joinpath("take_many.lua").read_text("utf-8")
"""The take script (``take_many.lua``: its KEYS, ARGV, reply and the keys it touches in its
header), read once at import; ``register_script`` names it by its SHA-1."""


class TakeRefused(Exception):
    """Redis refused the take script (nothing was taken).

    Args:
        reason: the refusal (``workers.batching.refusals.REASONS``: the take writes, so Redis
            refusing writes refuses it), or ``None`` for any other error reply.
    """

    def __init__(self, reason: str | None = None) -> None:
        super().__init__(reason or "refused")
        self.reason = reason
