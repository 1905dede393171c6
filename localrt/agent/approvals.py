"""Which calls run without asking: read-only tools always; anything that writes or runs after the user
allows it (once, or for the rest of the session), or every call when the user chose to approve all
(`--yes`, or the chat app's switch). With no one to ask (no terminal), such a call is denied, and the
model is told why.
"""

from __future__ import annotations

from collections.abc import Awaitable
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from enum import Enum

from localrt.agent.tools import Prepared
from localrt.agent.tools import Tool


class Decision(Enum):
    ONCE = "once"  # this call
    SESSION = "session"  # this tool, until the session (the chat app, the `run`) ends
    DENY = "deny"


@dataclass(frozen=True)
class ApprovalRequest:
    """What the user is asked about: the tool, where it comes from, and the call as it will run."""

    tool: str
    source: str  # "built-in" or the MCP server
    effect: str  # write | run
    summary: str
    detail: str
    detail_kind: str  # diff | command | arguments


Ask = Callable[[ApprovalRequest], Awaitable[Decision]]

DENIED = "The user denied this call: it was not run. Do not retry it; ask the user or answer without it."
NO_ONE_TO_ASK = (
    "Denied: this call needs the user's approval and there is no terminal to ask on (run with --yes to "
    "approve every call). It was not run."
)


@dataclass
class Approvals:
    """The session's approval state. `ask` is None where no one can answer (a script without a tty)."""

    ask: Ask | None = None
    approve_all: bool = False
    allowed: set[str] = field(default_factory=set)  # tools allowed for this session

    def needs_asking(self, tool: Tool) -> bool:
        return tool.effect != "read" and not self.approve_all and tool.name not in self.allowed

    async def decide(self, tool: Tool, call: Prepared) -> tuple[bool, str]:
        """(run it?, the message the model gets instead when not)."""
        if not self.needs_asking(tool):
            return True, ""
        if self.ask is None:
            return False, NO_ONE_TO_ASK
        decision = await self.ask(
            ApprovalRequest(tool.name, tool.source, tool.effect, call.summary, call.detail, call.detail_kind)
        )
        if decision is Decision.SESSION:
            self.allowed.add(tool.name)
        return decision is not Decision.DENY, DENIED
