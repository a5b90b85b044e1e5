"""The one place parser family names live: name -> family, ``auto`` detection from the
vocabulary and chat template, and what the server asks of the configured families."""

from __future__ import annotations

from typing import Any

from freetoken.parsing import tool_grammar
from freetoken.parsing.call_list import GraniteDetector, Phi4MiniDetector
from freetoken.parsing.calls import CallStream
from freetoken.parsing.family import Family, check_logprobs as _check_logprobs, openai_call_id
from freetoken.parsing.glm45 import Glm45Detector, Glm45Splitter
from freetoken.parsing.harmony import HARMONY_MARKERS, HarmonyDetector, HarmonySplitter
from freetoken.parsing.hermes import HermesDetector
from freetoken.parsing.machine import OutputParser, Step, join_steps
from freetoken.parsing.mistral import MistralDetector, mistral_call_id
from freetoken.parsing.qwen3 import ThinkSplitter
from freetoken.parsing.qwen3_coder import Qwen3CoderDetector

# In `auto`'s order of preference.
FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("gpt_oss", splitter=HarmonySplitter, detector=HarmonyDetector, markers=HARMONY_MARKERS,
           detect=("<|channel|>", "<|message|>"), keeps_special_tokens=True,
           calls_need_reasoning=True),
    # Before qwen3 and the <tool_call> formats: GLM-4.5's vocabulary holds their markers too.
    Family("glm45", splitter=Glm45Splitter, detector=Glm45Detector, markers=ThinkSplitter.MARKERS,
           detect=("</think>", "<tool_call>"), template_hint="<arg_key>"),
    Family("qwen3", splitter=ThinkSplitter, markers=ThinkSplitter.MARKERS, detect=("</think>",),
           thinks_by_default=True),
    Family("qwen3_coder", detector=Qwen3CoderDetector, detect=("<tool_call>",),
           template_hint="<function="),
    Family("hermes", detector=HermesDetector, detect=("<tool_call>",)),
    # [TOOL_CALLS] and [ARGS] are control tokens, which a skipping decode would drop.
    Family("mistral", detector=MistralDetector, detect=("[TOOL_CALLS]",),
           keeps_special_tokens=True, call_id=mistral_call_id),
    # Granite's <|tool_call|> is a special token; Phi-4-mini's functools is plain text. Phi-4-mini's
    # vocabulary holds <|tool_call|> too: Granite's template hint tells them apart.
    Family("granite", detector=GraniteDetector, detect=("<|tool_call|>",),
           template_hint="<|start_of_role|>", keeps_special_tokens=True),
    Family("phi4_mini_json", detector=Phi4MiniDetector, detect=("<|tool|>", "<|/tool|>")),
)}  # fmt: skip
ALIASES = {"qwen25": "hermes", "qwen": "hermes"}  # more names of tool-call parsers
REASONING_PARSERS = tuple(n for n, f in FAMILIES.items() if f.splitter is not None)
TOOL_CALL_PARSERS = (*(n for n, f in FAMILIES.items() if f.detector is not None), *ALIASES)


def reasoning_family(name: str | None) -> Family | None:
    """The family of a resolved ``--reasoning-parser`` value; None when it is off."""
    if name is None or name == "off":
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; "
                         f"choose one of {sorted(REASONING_PARSERS)}")
    return FAMILIES[name]


def tool_family(name: str | None) -> Family | None:
    """The family of a resolved ``--tool-call-parser`` value; None when it is off."""
    if name is None or name == "off":
        return None
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; "
                         f"choose one of {sorted(TOOL_CALL_PARSERS)}")
    return FAMILIES[ALIASES.get(name, name)]


def resolve(reasoning: str, tool: str, tokenizer: Any) -> tuple[str | None, str | None]:
    """``auto`` picks a family from the vocabulary and the chat template; ``off`` is none."""
    template = getattr(tokenizer, "chat_template", None) or ""

    def pick(names: tuple[str, ...]) -> str | None:
        return next((n for n in names if FAMILIES[n].detected(tokenizer, template)), None)

    r = pick(REASONING_PARSERS) if reasoning == "auto" else reasoning
    t = pick(tuple(n for n in TOOL_CALL_PARSERS if n not in ALIASES)) if tool == "auto" else tool
    return (None if r == "off" else r), (None if t == "off" else t)


def output_parser(
    reasoning: str | None = None,
    tool: str | None = None,
    tools: list[dict] | None = None,
    force_reasoning: bool = False,
    special_ids: frozenset[int] = frozenset(),
) -> OutputParser:
    """One request's parser: the reasoning family's splitter, then the tool family's calls."""
    r, t = reasoning_family(reasoning), tool_family(tool)
    stages = [r.splitter(force_reasoning)] if r is not None and r.splitter else []
    if t is not None and t.detector is not None:
        stages.append(CallStream(t.detector(tools)))
    return OutputParser(stages, special_ids)


def parse_text(text: str, reasoning: str | None = None, tool: str | None = None,
               tools: list[dict] | None = None, force_reasoning: bool = False) -> Step:
    """A whole output at once: one call item per call with its full arguments."""
    parser = output_parser(reasoning, tool, tools, force_reasoning)
    return join_steps([parser.feed_text(text), parser.finish()])


def starts_in_reasoning(reasoning: str | None, chat_template_kwargs: dict) -> bool:
    """Whether the output starts inside a think block the chat template opened."""
    family = reasoning_family(reasoning)
    return family is not None and family.starts_in_reasoning(chat_template_kwargs)


def check_logprobs(tokenizer: Any, reasoning: str | None, tool: str | None) -> None:
    """Raise ``LogprobsUnavailable`` when chat logprobs cannot be labelled for these parsers."""
    _check_logprobs(tokenizer, reasoning_family(reasoning), tool_family(tool))


def keeps_special_tokens(reasoning: str | None, tool: str | None) -> bool:
    """Whether chat output must be detokenized with special tokens kept (Harmony's markers)."""
    return any(f is not None and f.keeps_special_tokens
               for f in (reasoning_family(reasoning), tool_family(tool)))


def call_id(tool: str | None) -> str:
    """A new tool call's id: Mistral's templates take only 9 alphanumeric characters."""
    family = tool_family(tool)
    return family.call_id() if family is not None else openai_call_id()


# Structured outputs. The text after which a reasoning family's answer starts: a grammar on the
# answer applies from there, and the reasoning before it stays free.
ANSWER_MARKERS = {"qwen3": "</think>", "gpt_oss": "<|channel|>final<|message|>"}
_ALWAYS_HEADED = {"gpt_oss"}  # Harmony output opens with a channel header, thinking or not

# Grammars of tool calls in each tool format (tool_choice required / named), and whether the
# grammar spans the family's own reasoning too (Harmony's analysis comes before its call).
TOOL_GRAMMARS = {"hermes": (tool_grammar.hermes, False),
                 "qwen3_coder": (tool_grammar.qwen3_coder, False),
                 "glm45": (tool_grammar.glm45, False),
                 "mistral": (tool_grammar.mistral, False),
                 "granite": (tool_grammar.granite, False),
                 "phi4_mini_json": (tool_grammar.phi4_mini, False),
                 "gpt_oss": (tool_grammar.harmony, True)}


def answer_marker(reasoning: str | None, chat_template_kwargs: dict) -> str | None:
    """The marker after which the answer starts, when the output starts before it (in
    reasoning, or in Harmony's headers); None when the output is the answer from its start."""
    family = reasoning_family(reasoning)
    if family is None or family.name not in ANSWER_MARKERS:
        return None
    if family.name in _ALWAYS_HEADED or family.starts_in_reasoning(chat_template_kwargs):
        return ANSWER_MARKERS[family.name]
    return None


def tool_call_grammar(tool: str | None, tools: list[dict], name: str | None, parallel: bool,
                      literal: tool_grammar.Literal) -> tuple[str, bool] | None:
    """The Lark grammar that forces tool calls in `tool`'s format (one of `name`, or one or more
    of any tool), and whether it spans the reasoning; None when the format has none."""
    family = tool_family(tool)
    if family is None or family.name not in TOOL_GRAMMARS:
        return None
    build, spans_reasoning = TOOL_GRAMMARS[family.name]
    return build(tools, name, parallel, literal), spans_reasoning
