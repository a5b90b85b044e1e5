"""Chat output parsing: reasoning, content and tool calls, read once from the released tokens.

Each family's rules live in one module (``qwen3``, ``harmony``, ``hermes``, ``qwen3_coder``),
written as stages over text; ``machine.OutputParser`` feeds them the tokens with their text
and labels every token from what the stages made of its characters, so the streamed deltas
and chat logprob routing are the same reading. ``registry`` is where family names live.
See docs/parsers.md and docs/logprobs.md.
"""

from freetoken.parsing.calls import ToolCallItem
from freetoken.parsing.family import LogprobsUnavailable
from freetoken.parsing.machine import LogprobRouter, OutputParser, Step
from freetoken.parsing.stage import Label
from freetoken.parsing.tools import validate_tools

__all__ = ["Label", "LogprobRouter", "LogprobsUnavailable", "OutputParser", "Step",
           "ToolCallItem", "validate_tools"]
