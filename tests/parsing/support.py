"""What the parsing tests share: tool definitions, and generation.py's parse loop driven a step at
a time (`Drive`)."""

from __future__ import annotations

from typing import Any

from freetoken.message import DetokenizeMsg
from freetoken.parsing import registry
from freetoken.parsing.family import special_ids
from freetoken.parsing.machine import LogprobRouter, Step
from freetoken.parsing.stage import Label
from freetoken.tokenizer.detokenize import TokenTexts
from freetoken.tokenizer.reply import ReplyBuilder


def tool(name: str, **props: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": name,
                                             "parameters": {"type": "object", "properties": props}}}


TOOLS = [
    tool("get_weather", city={"type": "string"}, days={"type": "integer"}, metric={"type": "boolean"}),
    tool("write_file", path={"type": "string"}, content={"type": "string"}),
    tool("configure", ratio={"type": "number"}, opts={"type": "object"}, tags={"type": "array"},
         limit={"type": ["integer", "null"]}, note={"type": ["string", "null"]}),
]


Parser = str | None


class Drive:
    """generation.py's loop: ReplyBuilder -> OutputParser -> LogprobRouter, a step per call."""

    def __init__(self, tok: Any, reasoning: Parser, tool: Parser, force: bool,
                 stops: list[str] | None = None, tools: list[dict] | None = None) -> None:
        registry.check_logprobs(tok, reasoning, tool)  # what a chat request with logprobs checks
        self.parser = registry.output_parser(reasoning, tool, tools or [], force, special_ids(tok))
        self.router = LogprobRouter()
        keep = registry.keeps_special_tokens(reasoning, tool)
        self.replies = ReplyBuilder(tok, stops or [], skip_special_tokens=not keep,
                                    token_texts=True)

    def step(self, ids: list[int], entries: list[Any], finished: bool = False) -> Step:
        reply = self.replies.build(DetokenizeMsg(1, ids, entries, finished=finished))
        self.router.add(reply.logprobs)
        step = self.parser.feed(reply.token_ids, reply.incremental_output, reply.token_texts)
        self.router.route(step.labels)
        return step

    def finish(self) -> Step:
        step = self.parser.finish()
        self.router.route(step.labels)
        return step


def joined(tok: Any, ids: list[int], labels: list[Label], want: Label) -> str:
    texts = TokenTexts.of(tok)
    return b"".join(texts.bytes(i) for i, lab in zip(ids, labels) if lab is want).decode()
